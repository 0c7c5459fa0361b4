"""A refused DCP checkpoint changes nothing ([Note: staged loads] in dmuon/checkpoint/_common.py).

Each layout saves two DCP checkpoints two steps apart (A, then B) and builds three bad ones from them: a
torn one (A with rank 0's data file of B), A with one flipped byte in a model tensor, and A with one flipped
byte in an optimizer tensor. Loading each the documented way (``dcp.load`` into the ``staged=True`` dict,
then ``dmuon.set_state_dict``) must be refused on every rank and leave the model and the optimizer
bit-identical to before the call; training then goes on bit-identical to an uninterrupted twin, and A itself
loads back exactly. Layouts: a 1-D mesh (2 ranks), HSDP 2 x 2 and dp=2 x tp=2 (4 ranks), with the builders
and steps of tests/test_checkpoint.py, tests/test_hsdp.py and tests/test_tp_checkpoint.py.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests._asserts import differences
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dmuon
from tests._dist import run_distributed
from tests._training import full_weights

#: (model key, optimizer key) whose bytes the flipped checkpoints change: dedicated matrices, one of them
#: tensor-parallel (its first shard) in the TP layout
FLIPPED = {
    "1d": ("model.layers.1.mlp.down_proj.weight", "optim.state.layers.0.attention.q_proj.weight.momentum_buffer"),
    "hsdp": ("model.layers.0.mlp.up_proj.weight", "optim.state.layers.1.attention.o_proj.weight.momentum_buffer"),
    "tp": ("model.layers.0.w2.weight", "optim.state.layers.1.w1.weight.momentum_buffer"),
}
BAD = ("torn", "model_byte", "optim_byte")
Step = Callable[[int], float]


# --------------------------------------------------------------------------------------------------- #
# Checkpoint surgery (rank 0)                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _payload(item: bytes) -> tuple[int, int]:
    """``(offset, length)`` of a tensor's raw bytes inside its DCP item: the data record of the item's
    ``torch.save`` zip, or the whole item where it is stored raw."""
    if item[:2] != b"PK":
        return 0, len(item)
    with zipfile.ZipFile(io.BytesIO(item)) as zf:
        record = next(i for i in zf.infolist() if re.search(r"/data/\d+$", i.filename))
    name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
    return record.header_offset + 30 + name_len + extra_len, record.file_size


def flip_byte(ckpt: str, key: str) -> None:
    """Flip one bit in the middle of the first chunk of ``key``'s data in the DCP directory ``ckpt``."""
    meta = dcp.FileSystemReader(ckpt).read_metadata()
    index, info = min(((i, s) for i, s in meta.storage_data.items() if i.fqn == key), key=lambda x: str(x[0]))
    path = os.path.join(ckpt, info.relative_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start, length = _payload(bytes(data[info.offset:info.offset + info.length]))
    assert length > 0, index
    data[info.offset + start + length // 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(data)


def bad_copies(a: str, b: str, dest: Callable[[str], str], flips: dict[str, str]) -> None:
    """Bad copies of the DCP checkpoint ``a``: ``dest("torn")`` with rank 0's data file of the later ``b``,
    and ``dest(name)`` with one bit flipped in key ``flips[name]``."""
    shutil.copytree(a, dest("torn"))
    shutil.copy(os.path.join(b, "__0_0.distcp"), dest("torn"))
    for name, key in flips.items():
        shutil.copytree(a, dest(name))
        flip_byte(dest(name), key)


# --------------------------------------------------------------------------------------------------- #
# Worker side                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _snapshot(model: Any, opt: Any) -> dict:
    """Everything a load could change: the parameters as they live (read with torch.distributed alone), the
    model's full dict (buffers and masters too) and the optimizer's (state and param groups)."""
    return {"params": full_weights(model), "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


def outcome(load: Callable[[], object]) -> str:
    """``"loaded"``, or the message of the ValueError that ``load`` raised."""
    try:
        load()
    except ValueError as e:
        return str(e)
    return "loaded"


def _load(model: Any, opt: Any, path: str, *, staged: bool = True, cpu_offload: bool = True) -> str:
    """The documented DCP load; ``"loaded"`` or the ValueError's message."""

    def load() -> None:
        sd = dmuon.get_state_dict(model, opt, sharded=True, staged=staged, cpu_offload=cpu_offload)
        dcp.load(sd, checkpoint_id=path)
        dmuon.set_state_dict(model, opt, sd)

    return outcome(load)


def _scenario(layout: str, root: str, build: Callable[[], tuple[Any, Any, Step]]) -> dict:
    model, opt, step = build()
    twin, twin_opt, twin_step = build()
    losses = [(step(s), twin_step(s)) for s in range(1)]
    dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(root, "A"))
    at_a = _snapshot(model, opt)
    losses += [(step(s), twin_step(s)) for s in range(1, 3)]
    dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(root, "B"))
    if dist.get_rank() == 0:
        bad_copies(os.path.join(root, "A"), os.path.join(root, "B"), lambda name: os.path.join(root, name),
                   dict(zip(("model_byte", "optim_byte"), FLIPPED[layout])))
    dist.barrier()
    before = _snapshot(model, opt)
    out: dict[str, Any] = {"a_differs": bool(differences(at_a, before))}
    for name in BAD:
        out[name] = _load(model, opt, os.path.join(root, name))
        out[f"{name} changed"] = differences(before, _snapshot(model, opt))
    losses += [(step(3), twin_step(3))]
    out["losses"] = losses
    out["twin differs"] = differences(_snapshot(twin, twin_opt), _snapshot(model, opt))
    out["intact"] = _load(model, opt, os.path.join(root, "A"), cpu_offload=False)
    out["not restored"] = differences(at_a, _snapshot(model, opt))
    return out


def _one_d() -> tuple[Any, Any, Step]:
    from tests.test_checkpoint import _setup, _step

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = _setup(world)
    return model, opt, lambda s: _step(model, opt, sched, rank, world, s)


def _hsdp() -> tuple[Any, Any, Step]:
    from tests.test_hsdp import Run, _build, _step

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build(world, Run())
    return model, opt, lambda s: _step(model, opt, rank, world, s)


def _tp() -> tuple[Any, Any, Step]:
    from tests.test_tp_checkpoint import _build, _step

    model, opt, dp_mesh = _build("tp")
    return model, opt, lambda s: _step(model, opt, dp_mesh, s)


def one_d_job(rank: int, world: int, root: str) -> dict:
    out = {"1d": _scenario("1d", os.path.join(root, "1d"), _one_d)}
    # the dict of live tensors (no staged=True): dcp.load itself overwrites them, and the error says so
    model, opt, _ = _one_d()
    out["unstaged"] = _load(model, opt, os.path.join(root, "1d", "torn"), staged=False)
    return out


def four_rank_job(rank: int, world: int, root: str) -> dict:
    return {layout: _scenario(layout, os.path.join(root, layout), build)
            for layout, build in (("hsdp", _hsdp), ("tp", _tp))}


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("refusal"))
    one_d = run_distributed(one_d_job, 2, root)
    four = run_distributed(four_rank_job, 4, root)
    out = {"1d": [r["1d"] for r in one_d], "unstaged": [r["unstaged"] for r in one_d]}
    out.update({layout: [r[layout] for r in four] for layout in ("hsdp", "tp")})
    return out


@pytest.mark.parametrize("layout", ["1d", "hsdp", "tp"])
@pytest.mark.parametrize("bad", BAD)
def test_refused_checkpoint_changes_nothing(results: dict, layout: str, bad: str) -> None:
    for rank, r in enumerate(results[layout]):
        assert r["a_differs"], "A must differ from the state at the time of the load, or the test proves nothing"
        message = r[bad]
        assert "checksums do not match" in message, (rank, message)
        assert not r[f"{bad} changed"], f"rank {rank}: the refused {bad} load changed {r[f'{bad} changed'][:4]}"
        half = "optim" if bad == "optim_byte" else "model"
        assert f"dmuon.set_state_dict ('{half}')" in message and "nothing was changed" in message, (rank, message)


@pytest.mark.parametrize("layout", ["1d", "hsdp", "tp"])
def test_training_goes_on_like_an_uninterrupted_twin_and_the_intact_checkpoint_loads(results: dict,
                                                                                     layout: str) -> None:
    for rank, r in enumerate(results[layout]):
        assert all(mine == twins for mine, twins in r["losses"]), (rank, r["losses"])
        assert not r["twin differs"], (rank, r["twin differs"][:5])
        assert r["intact"] == "loaded", (rank, r["intact"])
        assert not r["not restored"], (rank, r["not restored"][:5])


def test_unstaged_target_error_says_what_happened(results: dict) -> None:
    """Without ``staged=True`` ``dcp.load`` writes into the live tensors; the refusal says so (and what to do)."""
    for rank, message in enumerate(results["unstaged"]):
        assert "checksums do not match" in message, (rank, message)
        assert "dcp.load already wrote" in message and "staged=True" in message, (rank, message)
