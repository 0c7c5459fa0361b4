"""The owner route: a dedicated matrix (or batch of them) whole on its owner rank, which runs Newton-Schulz
alone ([Note: route strategies] in ``base.py``).

The owner holds the param, its averaged gradient after the reduce, and its state; its update is the group's
rule on every same-layout batch of the matrices it owns (one Newton-Schulz call per run of blocks, [Note:
matrix blocks]), in the master's dtype where there is one ([Note: master weights]), rounded into the param
the next forward broadcasts. Nothing here is collective. Its checkpoint view: the state on the owner, whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...runtime.blocks import Blocks
from ...runtime.hooks import DMuonState
from ...runtime.param import DedicatedParam, local
from ...runtime.precision import is_wider
from ...runtime.route import Route
from ..rules import UpdateRule
from ..update import MuonHParams
from .base import Member, StepContext

__all__ = ["Owner", "master_dtype_of", "update_dtype", "update_target"]


def master_dtype_of(dp: DedicatedParam, master_dtype: torch.dtype | None) -> torch.dtype | None:
    """Dtype of the optimizer-state ``"master"`` of ``dp`` under ``dmuon.Muon(master_dtype=...)`` (``None``: it
    has none). Same on every rank. AdamW params (``adamw_owner`` ones too) have none: ``master_dtype`` is Muon's."""
    # param_dtype: its own value is the master (a tensor-parallel shard's master is its local shard's)
    if master_dtype is None or dp.compute_dtype != dp.dtype or dp.route is not Route.MUON:
        return None
    return master_dtype if is_wider(master_dtype, dp.dtype) else None


def update_dtype(dp: DedicatedParam, master_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype Muon updates ``dp`` in, and keeps its momentum in. Same on every rank."""
    master = master_dtype_of(dp, master_dtype)
    return master if master is not None else dp.dtype


def update_target(ctx: StepContext, dp: DedicatedParam) -> Tensor:
    """Owner: the tensor Muon updates for ``dp``: its master (created or refreshed here) or the param (a
    tensor-parallel param's local shard)."""
    p = dp.bound()
    value = local(p)  # a tensor-parallel param's shard
    if dp.master is not None:
        dp.refresh_master()
        return dp.master
    dtype = master_dtype_of(dp, ctx.master_dtype)
    if dtype is None:
        return value  # type: ignore[return-value]
    st = ctx.state[p]
    if "master" not in st:
        st["master"] = value.detach().to(dtype, memory_format=torch.preserve_format, copy=True)
        dp.master_made_from_param()
    else:
        dp.refresh_master(st["master"])
    return st["master"]


class Owner:
    """Whole matrices on their owner ([Note: route strategies])."""

    name = "muon"
    on_owner = True

    def full_rows(self, dp: DedicatedParam) -> int | None:
        """The row count of a per-row state (``None``: the param's own, as here)."""
        return None

    def update_(self, ctx: StepContext, members: Sequence[Member], hp: MuonHParams, rule: UpdateRule) -> None:
        """Same-layout matrices this rank owns go through Newton-Schulz as one batch."""
        by_shape: dict[tuple, list[tuple[Tensor, Tensor, Tensor]]] = {}  # (param, update target, grad)
        dps = {id(m.param): m.dedicated for m in members}
        for m in members:
            dp = m.dedicated
            grad = dp.reduced_grad()
            if grad is None:
                continue
            target = update_target(ctx, dp)  # p itself unless it has a master
            grad = grad.to(target.dtype)  # a no-op without mixed precision
            rule.init_state_(ctx.state[m.param], grad, target.dtype, full_rows=self.full_rows(dp))
            # same layout: one Newton-Schulz call per run of blocks ([Note: matrix blocks])
            key = (tuple(target.shape), target.dtype, grad.dtype, dp.tp_dim, dp.full_shape, dp.blocks)
            by_shape.setdefault(key, []).append((m.param, target, grad))
        for (_, _, _, tp_dim, full_shape, blocks), items in by_shape.items():
            self._update_batch(ctx, ([t for _, t, _ in items], [g for _, _, g in items],
                                     [ctx.state[p] for p, _, _ in items], hp), rule, blocks, tp_dim, full_shape)
            for p, target, _ in items:
                if target is not local(p):  # a master (a tensor-parallel shard is updated in place)
                    dps[id(p)].write_back(target)  # round into the compute copy the next forward broadcasts

    def _update_batch(self, ctx: StepContext, args: tuple[list[Tensor], list[Tensor], list[Any], MuonHParams],
                      rule: UpdateRule, blocks: Blocks, tp_dim: int | None, full_shape: Any) -> None:
        """The rule's update of one same-layout batch, on this rank."""
        rule.update_(*args, blocks)

    def materialise_(self, ctx: StepContext, member: Member, rule: UpdateRule) -> None:
        dp = member.dedicated
        p = dp.bound()
        if "momentum_buffer" not in ctx.state[p]:
            update_target(ctx, dp)  # creates a master_dtype master from the param, as a first step does
        rule.init_state_(ctx.state[p], local(p), update_dtype(dp, ctx.master_dtype), full_rows=self.full_rows(dp))

    def state_dtypes(self, member: Member, rule: UpdateRule, *, master_dtype: torch.dtype | None
                     ) -> dict[str, torch.dtype]:
        dp = member.dedicated
        out = rule.state_dtypes(update_dtype(dp, master_dtype))
        master = master_dtype_of(dp, master_dtype)
        if master is not None:
            out["master"] = master
        return out

    def laid_out_like(self, member: Member, key: str) -> Tensor | None:
        return None  # whole on the owner

    def ns_batch(self, runtime: DMuonState, member: Member) -> tuple[Blocks, Any] | None:
        return member.dedicated.blocks, None

    def ns_work(self, runtime: DMuonState, n: int, split: Any) -> tuple[int, int]:
        return n, 0
