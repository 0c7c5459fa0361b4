"""torchtitan's fused QKV weights on a dmuon model: the state-dict hooks :func:`dedicate` removes, and
torchtitan's own split / merge, which the checkpoint wrapper applies around DCP instead."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn


# [Note: fused QKV]
# torchtitan's FusedQKVLinear (every Llama 3 flavour) registers a state_dict post-hook that splits the
# live ``wqkv`` weight into new ``wq``/``wk``/``wv`` tensors, and a load pre-hook that merges them back.
# The split reads the weight's data, which a non-owner of a dedicated ``wqkv`` does not have, and the
# tensors it produces are copies, which dmuon's state-dict functions cannot load into. ``dedicate`` removes
# both hooks, so ``model.state_dict()`` (and dmuon.get_model_state_dict) report the live ``wqkv``;
# DMuonModelWrapper applies torchtitan's own split / merge around DCP, so checkpoints keep torchtitan's
# stock ``wq``/``wk``/``wv`` layout (a model without dmuon loads them).
def _fused_qkv_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(state-dict prefix, module)`` of every FusedQKVLinear in ``model``."""
    try:
        from torchtitan.models.common.attention import FusedQKVLinear
    except ImportError:  # no triton: no torchtitan model with attention could have been built
        return []
    return [
        (f"{canonical_fqn(name)}." if name else "", m)
        for name, m in model.named_modules()
        if isinstance(m, FusedQKVLinear)
    ]


def _unhook_fused_qkv(model: nn.Module) -> None:
    """Remove FusedQKVLinear's split-on-save / merge-on-load hooks. See [Note: fused QKV]."""
    for _, module in _fused_qkv_modules(model):
        fused = {type(module)._split_qkv_on_save, type(module)._merge_qkv_on_load}
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "hook", h) in fused]:
                del hooks[key]


def _split_fused_qkv(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """torchtitan's checkpoint layout: ``wqkv`` keys (present ones only) split into ``wq``/``wk``/``wv``."""
    for prefix, module in _fused_qkv_modules(model):
        type(module)._split_qkv_on_save(module, state_dict, prefix, {})


def _merge_fused_qkv(model: nn.Module, state_dict: dict[str, Any], *, like: dict[str, Any]) -> None:
    """torchtitan's merge of ``wq``/``wk``/``wv`` into ``wqkv``, each result placed as its entry in ``like``
    (the live sharded dict): torchtitan merges tensor-parallel shards as a Replicate DTensor over "tp",
    and dmuon loads a TP matrix from its own shard (Replicate to Shard is a local slice)."""
    for prefix, module in _fused_qkv_modules(model):
        type(module)._merge_qkv_on_load(module, state_dict, prefix)
        for param in ("weight", "bias"):
            key, want = f"{prefix}wqkv.{param}", like.get(f"{prefix}wqkv.{param}")
            got = state_dict.get(key)
            if isinstance(got, DTensor) and isinstance(want, DTensor) and got.placements != want.placements:
                state_dict[key] = got.redistribute(want.device_mesh, want.placements)
