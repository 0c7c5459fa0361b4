"""torchtitan's fused QKV weights on a dmuon model: the matrices Muon orthogonalises in them
(:class:`QKVBlocks`), the state-dict hooks :func:`dedicate` removes, and torchtitan's own split / merge,
which the checkpoint wrapper applies around DCP instead."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn

from ...runtime.blocks import Interleaved, RowBlocks


# [Note: fused QKV blocks]
# ``FusedQKVLinear.wqkv`` is three projections in one weight, and Muon's update of the fused weight as one
# matrix is not Muon's update of its parts (one polar factor for q, k and v together; the lr rule reads the
# fused shape). So by default each of q, k and v is orthogonalised alone, as Megatron's ``split_qkv`` does
# (what a model with separate ``wq`` / ``wk`` / ``wv`` gets from ``torch.optim.Muon``); ``"heads"`` splits
# further into one matrix per head (torchtitan DistMuon's ``BlockShard(block_size=head_dim)``), ``"whole"``
# keeps the fused matrix. torchtitan lays the rows out by KV group, not as ``[q; k; v]``: ``n_kv`` groups of
# ``[heads_per_kv q heads, 1 k head, 1 v head]`` of ``head_dim`` rows each (its forward views the output as
# ``(n_kv, heads_per_kv + 2, head_dim)``, its checkpoint split reads it the same way). A contiguous
# ``[q_rows, k_rows, v_rows]`` split would cut through the groups and mix q, k and v rows of different
# heads; the q, k and v blocks are ``Interleaved((heads_per_kv * head_dim, head_dim, head_dim), n_kv)``
# (``dmuon/runtime/blocks.py``), which gathers each from every group. The blocks describe the whole
# matrix, so under tensor parallelism (``wqkv`` split by rows: whole KV groups per tp rank) the TP update
# applies them after gathering it ([Note: TP update] in ``dmuon/optim/tp_update.py``).
class QKVBlocks(str, enum.Enum):
    """How Muon splits torchtitan's fused ``wqkv`` weight. See [Note: fused QKV blocks]."""

    #: q, k and v, each orthogonalised alone (the default)
    QKV = "qkv"
    #: one matrix per head of q, k and v (``head_dim`` rows each)
    HEADS = "heads"
    #: the fused weight as one matrix
    WHOLE = "whole"

    @classmethod
    def parse(cls, value: QKVBlocks | str) -> QKVBlocks:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"dmuon torchtitan: qkv_blocks must be one of {[m.value for m in cls]}, got "
                             f"{value!r}") from None


def qkv_row_blocks(module: nn.Module, mode: QKVBlocks, rows: int) -> RowBlocks:
    """The row blocks of a FusedQKVLinear's ``wqkv`` of ``rows`` rows (all of them, also under TP)."""
    hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
    if mode is QKVBlocks.WHOLE:
        return None
    if rows % (r * hd):
        raise ValueError(f"dmuon torchtitan: a fused wqkv of {rows} rows is not a whole number of KV groups of "
                         f"{r} x {hd} rows (heads_per_kv + 2 heads of head_dim)")
    if mode is QKVBlocks.HEADS:
        return rows // hd
    return Interleaved((hpk * hd, hd, hd), rows // (r * hd))


def fused_qkv_blocks(model: nn.Module, mode: QKVBlocks | str) -> Callable[[str, nn.Parameter], RowBlocks] | None:
    """``dedicate_params(blocks=...)`` for every FusedQKVLinear ``wqkv`` weight of ``model`` (by identity, so
    any name reaches it); ``None`` when there is nothing to split."""
    mode = QKVBlocks.parse(mode)
    weights = {id(m.wqkv.weight): m for _, m in _fused_qkv_modules(model)}
    if mode is QKVBlocks.WHOLE or not weights:
        return None

    def blocks(fqn: str, param: nn.Parameter) -> RowBlocks:
        module = weights.get(id(param))
        return None if module is None else qkv_row_blocks(module, mode, int(param.shape[0]))

    return blocks


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
