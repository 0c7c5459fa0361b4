"""The engine's-shards route: the update of ``Route.MUON_SHARDED`` params (experts ``[E, m, n]``) where they live
([Note: route strategies] in ``base.py``; its checkpoint view: state on every rank, laid out like the param).

[Note: Muon on the engine's shards]
A batch of matrices needs no owner: ``fully_shard`` chunks dim 0 (``Shard(0)``, like ``torch.chunk``),
and expert parallelism places experts ``Shard(0)`` over its mesh, so each rank's local tensor of such a
param is whole matrices, ``[E_local, m, n]``. Newton–Schulz runs right there, batched over the rank's
matrices, with no gather and no broadcast of dmuon's: the engine's own all-gather before the module and
reduce-scatter after backward are the "broadcast" and "reduce" of an owner design, and they carry the
experts whatever the optimizer is. Each expert then has one owner per replicate row (the rank holding its
chunk); under HSDP the rows split it ([Note: expert NS across replicas]).

Momentum (and a ``master_dtype`` master, and any state of the group's update rule: NorMuon's per-row second
moment ``[E, m, 1]``) is optimizer state laid out like the param, a DTensor, so
state dicts treat it as they treat AdamW's moments. A rank whose chunk is empty (more ranks than
experts) skips the param. The rest is the update of an owned param, per matrix (the group's rule,
``dmuon/optim/rules.py``, on the local tensors, the lr read from each block).

[Note: expert NS across replicas]
Under HSDP the ranks of one shard column (same shard index, every replicate row) hold the same chunk with the
same averaged gradient and the same state, so each would compute the same update. Instead the chunk's experts
are split like ``torch.chunk`` over the column's replicate indices: each updates its share (momentum, any
per-row statistic, Newton-Schulz, the step, on dim-0 slices of the local tensors), and one all-gather over
the replicate group brings every rank the others' shares, the updated values (the master where there is
one) and every state tensor, as raw bytes: one launch per step whatever the dtypes (``comm.gather_shares``,
``CommKind.SHARDED_UPDATE``). Each matrix's arithmetic is the one of the unsplit batch (bit for bit on
the CPU), so the split changes which rank computes, not the bits. The gather carries the state too
(momentum as large as the param): gathering only Newton-Schulz's outputs would halve the bytes but needs
every rule split at its Newton-Schulz, and an unsplit state would differ between rows after a restart from a
checkpoint of one of them. Split only where the param's replicate mesh dim is dmuon's replicate column (the
mesh given to ``dedicate_params`` and ``fully_shard`` alike; expert parallelism's own meshes keep every row
computing its copy) and that column sits in one node (torchrun's ``LOCAL_WORLD_SIZE``, read by every rank
in ``dedicate_params``' grid gather and used only where all read the same: ``CommContext.ranks_per_node``,
so every row decides alike): the gather moves
twice the chunk, which NVLink carries in less time than the Newton-Schulz it saves, a network link in more
(``python -m dmuon.plan --simulate``, Qwen3-30B-A3B on 8 x 8 HSDP, 4 x 2048 tokens: splitting across nodes
would take the busiest rank's NS from 99 to 20 ms and add 254 ms of exposed gather).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ...runtime import comm as C
from ...runtime.blocks import Blocks
from ...runtime.hooks import DMuonState
from ...runtime.param import splits_dim0_only
from ...runtime.precision import is_wider, refresh_master_
from ..groups import canonical_name
from ..rules import PER_ROW_KEYS, RULES, Algorithm, UpdateRule
from ..update import MuonHParams
from .base import Member, StepContext

__all__ = ["Sharded", "layouts", "check_sharded_params", "master_dtype_of", "update_target", "step_params", "materialise"]


def layouts(state: DMuonState) -> dict[str, Blocks]:
    """The matrices of each ``Route.MUON_SHARDED`` param of the model, by canonical FQN (its name in param groups)."""
    return {canonical_name(fqn): blocks for fqn, blocks in state.sharded_muon.items()}


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


def _one_node(ranks: tuple[int, ...], ctx: C.CommContext) -> bool:
    """Whether ``ranks`` share a node by torchrun's numbering (``ctx.ranks_per_node``, the same on every rank:
    ranks that read different values would split differently and hang in the gather); unknown: no."""
    per_node = ctx.ranks_per_node
    return per_node is not None and len({r // per_node for r in ranks}) == 1


def _column_split(p: DTensor, ctx: C.CommContext | None) -> bool:
    """Whether the rows split ``p``'s update: its replicate mesh dim is dmuon's replicate column, inside one
    node (metadata and the launcher's environment only; the same answer on every rank of the column)."""
    if ctx is None or ctx.replicate_size == 1 or p.device_mesh.ndim != 2 or not isinstance(p.placements[0], Replicate):
        return False
    coord = p.device_mesh.get_coordinate()
    if coord is None:
        return False
    column = tuple(int(r) for r in p.device_mesh.mesh[:, coord[1]].tolist())
    return column == tuple(ctx.global_rank(C.Dim.REPLICATE, r) for r in range(ctx.replicate_size)) and _one_node(column, ctx)


def _shares(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s ranges of ``n`` experts over ``parts`` ranks (the last ones short or empty)."""
    step = -(-n // parts)
    return [(min(n, k * step), min(n, (k + 1) * step)) for k in range(parts)]


def _byte_views(t: Tensor, a: int, b: int) -> Tensor:
    return t[a:b].reshape(-1).view(torch.uint8)


def step_params(named: list[tuple[str, DTensor]], hp: MuonHParams, state: Mapping[Tensor, dict[str, Any]],
                layouts: Mapping[str, Blocks], master_dtype: torch.dtype | None, seen: dict[int, int],
                rule: UpdateRule = RULES[Algorithm.MUON], *, ctx: C.CommContext | None = None) -> None:
    """Muon on every rank's whole matrices of the ``(fqn, param)`` of one param group: same local shape, dtypes
    and blocks batched into one Newton-Schulz call per run of blocks. ``ctx``: dmuon's groups; under HSDP the
    replicate rows split each chunk's experts and gather the results ([Note: expert NS across replicas])."""
    batches: dict[tuple, list[tuple[DTensor, Tensor, Tensor, slice]]] = {}
    stepped: list[DTensor] = []
    split: list[tuple[Tensor, ...]] = []  # per split param: its value and state tensors, whole (what the rows gather)
    for fqn, p in named:
        if p.grad is None or p._local_tensor.shape[0] == 0:  # no gradient, or an empty chunk on this rank
            continue
        st = state[p]
        target = update_target(p, st, master_dtype, seen)
        grad = p.grad._local_tensor.to(target.dtype)
        rule.init_state_(st, p, target.dtype)
        stepped.append(p)
        share = slice(None)
        if _column_split(p, ctx):
            R, me = ctx.replicate_size, ctx.replicate_index  # type: ignore[union-attr]
            share = slice(*_shares(target.shape[0], R)[me])
            split.append((target, *(st[k]._local_tensor for k in sorted(st) if k != "master")))
            if share.start == share.stop:
                continue
            target, grad = target[share], grad[share]
        blocks = Blocks.of(target.shape, layouts[fqn].spec)  # this rank's experts, the param's row blocks
        batches.setdefault((tuple(target.shape), target.dtype, grad.dtype, blocks), []).append((p, target, grad, share))
    for (*_, blocks), items in batches.items():
        rule.update_([t for _, t, _, _ in items], [g for _, _, g, _ in items],
                     [{k: v._local_tensor[share] for k, v in state[p].items()} for p, _, _, share in items], hp, blocks)
    if split:
        _gather_shares(split, ctx)  # type: ignore[arg-type]
    for p in stepped:
        if master_dtype_of(p, master_dtype) is not None:  # round the master's result into the param
            with torch.no_grad():
                p._local_tensor.copy_(state[p]["master"]._local_tensor)
            seen[id(p)] = p._local_tensor._version


def _gather_shares(split: list[tuple[Tensor, ...]], ctx: C.CommContext) -> None:
    """One all-gather over the replicate group: each row's share of every split tensor, as bytes."""
    R, me = ctx.replicate_size, ctx.replicate_index
    ranges = [_shares(tensors[0].shape[0], R) for tensors in split]

    def views(r: int) -> list[Tensor]:
        return [_byte_views(t, *rng[r]) for tensors, rng in zip(split, ranges) for t in tensors]

    parts = []
    for r in range(R):
        chunks = views(r)
        n = sum(c.numel() for c in chunks)
        parts.append(torch.cat(chunks) if r == me and n else torch.empty(n, dtype=torch.uint8,
                                                                         device=split[0][0].device))
    C.gather_shares(ctx, parts)
    for r in range(R):
        if r == me:
            continue
        off = 0
        for view in views(r):
            view.copy_(parts[r][off:off + view.numel()])
            off += view.numel()


class Sharded:
    """Batches of matrices on the engine's dim-0 shards, stepped where they live ([Note: route strategies],
    [Note: Muon on the engine's shards])."""

    name = "muon_sharded"
    on_owner = False

    def update_(self, ctx: StepContext, members: Sequence[Member], hp: MuonHParams, rule: UpdateRule) -> None:
        step_params([(m.name, m.param) for m in members], hp, ctx.state, layouts(ctx.runtime),  # type: ignore[misc]
                    ctx.master_dtype, ctx.seen, rule, ctx=ctx.runtime.ctx)

    def materialise_(self, ctx: StepContext, member: Member, rule: UpdateRule) -> None:
        materialise(member.param, ctx.state[member.param], ctx.master_dtype, ctx.seen, rule)  # type: ignore[arg-type]

    def state_dtypes(self, member: Member, rule: UpdateRule, *, master_dtype: torch.dtype | None
                     ) -> dict[str, torch.dtype]:
        master = master_dtype_of(member.param, master_dtype)
        return {**rule.state_dtypes(master or member.param.dtype), **({"master": master} if master is not None else {})}

    def laid_out_like(self, member: Member, key: str) -> Tensor | None:
        """The param, or for a per-row state (NorMuon's ``[E, m, 1]``) ``param[..., :1]``'s layout."""
        return member.param.detach()[..., :1] if key in PER_ROW_KEYS else member.param

    def ns_batch(self, runtime: DMuonState, member: Member) -> tuple[Blocks, Any] | None:
        """This rank's whole matrices of the batch (none in an empty chunk)."""
        shape = tuple(member.param.to_local().shape)  # type: ignore[attr-defined]
        return (Blocks.of(shape, layouts(runtime)[member.name].spec), None) if shape[0] else None

    def ns_work(self, runtime: DMuonState, n: int, split: Any) -> tuple[int, int]:
        return n, 0
