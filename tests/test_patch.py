"""The FSDP2 skip patch: fully_shard leaves dedicated params plain whatever the import order; install is
idempotent and reversible; a torch without the hook point fails loudly with its version."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import dmuon
from dmuon.engines import fsdp2 as _patch

# Runs in a fresh interpreter so `fully_shard` really is imported before dmuon.
_IMPORT_ORDER_SCRIPT = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard          # bound before dmuon exists
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import dmuon
    dmuon.install_patch(); dmuon.install_patch()           # idempotent
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[0].weight._dedicated_owner_rank = 0
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    kinds = {{n: type(p).__name__ for n, p in m.named_parameters()}}
    print(kinds)
    assert not isinstance(m[0].weight, DTensor), kinds
    assert isinstance(m[1].weight, DTensor) and isinstance(m[0].bias, DTensor), kinds
    dist.destroy_process_group()
    print("IMPORT-ORDER-OK")
    """
)


def test_fully_shard_imported_before_dmuon_skips_dedicated():
    from dmuon.tools.launch import free_port

    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDER_SCRIPT.format(port=free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "IMPORT-ORDER-OK" in out.stdout


def test_install_is_idempotent_and_reversible():
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    assert dmuon.is_patch_installed()
    wrapped = _fsdp_init._get_managed_states
    dmuon.install_patch()
    assert _fsdp_init._get_managed_states is wrapped, "a second install must not wrap twice"
    dmuon.uninstall_patch()
    try:
        assert not dmuon.is_patch_installed()
        assert _fsdp_init._get_managed_states is wrapped.__wrapped__
    finally:
        dmuon.install_patch()
    assert dmuon.is_patch_installed()


def test_patched_helper_ignores_only_dedicated_params():
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    m = torch.nn.Linear(3, 3)
    m.weight._dedicated_owner_rank = 1
    try:
        params, _ = _fsdp_init._get_managed_states([m], None)
        assert [p is m.bias for p in params] == [True]
        params, _ = _fsdp_init._get_managed_states([m], {m.bias})
        assert params == []
    finally:
        del m.weight._dedicated_owner_rank
    params, _ = _fsdp_init._get_managed_states([m], None)
    assert len(params) == 2


def test_missing_hook_point_fails_loudly_with_torch_version(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    monkeypatch.delattr(_fsdp_init, "_get_managed_states")
    with pytest.raises(RuntimeError, match=torch.__version__.replace("+", r"\+")):
        _patch.install_patch()


def test_changed_signature_fails_loudly(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    monkeypatch.setattr(_fsdp_init, "_get_managed_states", lambda mods, ignored, extra: None)
    with pytest.raises(RuntimeError, match="expected"):
        _patch.install_patch()
