"""Muon on the engine's shards: the update of ``Route.MUON_SHARDED`` params (experts ``[E, m, n]``).

[Note: Muon on the engine's shards]
A batch of matrices needs no owner: ``fully_shard`` chunks dim 0 (``Shard(0)``, like ``torch.chunk``),
and expert parallelism places experts ``Shard(0)`` over its mesh, so each rank's local tensor of such a
param is whole matrices, ``[E_local, m, n]``. Newton–Schulz runs right there, batched over the rank's
matrices, with no gather and no broadcast of dmuon's: the engine's own all-gather before the module and
reduce-scatter after backward are the "broadcast" and "reduce" of an owner design, and they carry the
experts whatever the optimizer is. Each expert then has one owner per replicate row (the rank holding its
chunk); under HSDP every replicate row computes the same update on its copy.

Momentum (and a ``master_dtype`` master, and any state of the group's update rule: NorMuon's per-row second
moment ``[E, m, 1]``) is optimizer state laid out like the param, a DTensor, so
state dicts treat it as they treat AdamW's moments. A rank whose chunk is empty (more ranks than
experts) skips the param. The rest is the update of an owned param, per matrix (the group's rule,
``dmuon/optim/rules.py``, on the local tensors, the lr read from each block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..runtime.blocks import Blocks
from ..runtime.param import splits_dim0_only
from ..runtime.precision import is_wider, refresh_master_
from .rules import RULES, Algorithm, UpdateRule
from .update import MuonHParams

__all__ = ["check_sharded_params", "master_dtype_of", "update_target", "step_params", "materialise"]


def check_sharded_params(named: Mapping[str, nn.Parameter], layouts: Mapping[str, Blocks]) -> None:
    """Refuse a ``MUON_SHARDED`` param that the engine did not shard along dim 0 (DDP, or no ``fully_shard``;
    another ``shard_placement_fn``): its local tensor would not be whole matrices. Local and the same on
    every rank (placements are global)."""
    for fqn, p in named.items():
        if not (isinstance(p, DTensor) and splits_dim0_only(p)):
            how = (f"a DTensor placed {tuple(p.placements)}" if isinstance(p, DTensor) else
                   "not sharded (no fully_shard around it, or DistributedDataParallel)")
            raise ValueError(
                f"dmuon.Muon: {fqn!r} ({layouts[fqn].describe()}) is routed 'muon_sharded', Muon on the engine's shards "
                f"of dim 0, but it is {how}. Wrap it with fully_shard (default placement Shard(0)), or give it one "
                "owner: dmuon.dedicate_params(..., route=lambda n, p: 'muon' if n == " + repr(fqn) + " else None)."
            )


def master_dtype_of(p: torch.Tensor, master_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype of ``p``'s optimizer-state ``"master"``, or ``None`` (same rule as for owned params)."""
    return master_dtype if master_dtype is not None and is_wider(master_dtype, p.dtype) else None


def update_target(p: DTensor, st: dict[str, Any], master_dtype: torch.dtype | None,
                  seen: dict[int, int]) -> Tensor:
    """The local tensor Muon updates for ``p``: its master's (created from the param, or restarted from it if
    something wrote the param since; see [Note: master weights] in ``dmuon/runtime/precision.py``), or the
    param's own shard. ``seen``: the param version each master last agreed with, by ``id(p)``."""
    dtype = master_dtype_of(p, master_dtype)
    if dtype is None:
        return p._local_tensor
    value = p._local_tensor
    if "master" not in st:
        st["master"] = p.detach().to(dtype)
        seen[id(p)] = value._version
    else:
        seen[id(p)] = refresh_master_(st["master"]._local_tensor, value, seen.get(id(p)))
    return st["master"]._local_tensor


def materialise(p: DTensor, st: dict[str, Any], master_dtype: torch.dtype | None, seen: dict[int, int],
                rule: UpdateRule = RULES[Algorithm.MUON]) -> None:
    """The zero state a first step would create (sharded state dicts need the keys before training)."""
    if "momentum_buffer" not in st:
        update_target(p, st, master_dtype, seen)
    rule.init_state_(st, p, master_dtype_of(p, master_dtype) or p.dtype)


def step_params(named: list[tuple[str, DTensor]], hp: MuonHParams, state: Mapping[Tensor, dict[str, Any]],
                layouts: Mapping[str, Blocks], master_dtype: torch.dtype | None, seen: dict[int, int],
                rule: UpdateRule = RULES[Algorithm.MUON]) -> None:
    """Muon on every rank's whole matrices of the ``(fqn, param)`` of one param group: same local shape, dtypes
    and blocks batched into one Newton-Schulz call per run of blocks."""
    batches: dict[tuple, list[tuple[DTensor, Tensor, Tensor]]] = {}
    for fqn, p in named:
        if p.grad is None or p._local_tensor.shape[0] == 0:  # no gradient, or an empty chunk on this rank
            continue
        st = state[p]
        target = update_target(p, st, master_dtype, seen)
        grad = p.grad._local_tensor.to(target.dtype)
        rule.init_state_(st, p, target.dtype)
        blocks = Blocks.of(target.shape, layouts[fqn].spec)  # this rank's experts, the param's row blocks
        batches.setdefault((tuple(target.shape), target.dtype, grad.dtype, blocks), []).append((p, target, grad))
    for (*_, blocks), items in batches.items():
        rule.update_([t for _, t, _ in items], [g for _, _, g in items],
                     [{k: v._local_tensor for k, v in state[p].items()} for p, _, _ in items], hp, blocks)
        for p, target, _ in items:
            if target is not p._local_tensor:  # a master: round the result into the param
                with torch.no_grad():
                    p._local_tensor.copy_(target)
                seen[id(p)] = p._local_tensor._version
