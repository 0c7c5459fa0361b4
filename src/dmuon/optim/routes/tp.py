"""The tensor-parallel route: a dedicated matrix split over the "tp" ranks of its owner's data-parallel slot,
each keeping its shard and that shard's state ([Note: route strategies] in ``base.py``).

Everything but where Newton-Schulz runs is the owner route's (``owner.py``, which this strategy extends): the
momentum, the decay and the step stay on the shards; Newton-Schulz needs the full matrix, so each same-shape
batch goes through the rule's tensor-parallel update with ``comm.tp_exchange`` as its all-to-all ([Note: TP
update] in ``dmuon/optim/tp_update.py``, the math, which never sees a process group). Per-row state (NorMuon's)
is the full matrix's rows, whole on every tp rank. Checkpoint view: on the owner slot, each state tensor laid
out like the param (a DTensor over "tp": full dicts gather it, loads slice it), per-row ones whole.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ...runtime import comm as C
from ...runtime.blocks import Blocks
from ...runtime.hooks import DMuonState
from ...runtime.param import DedicatedParam
from ..rules import PER_ROW_KEYS, UpdateRule
from ..tp_update import exchange_cost
from ..update import MuonHParams
from .base import Member, StepContext
from .owner import Owner

__all__ = ["TensorParallel"]


class TensorParallel(Owner):
    """Tensor-parallel shards of an owner slot's matrices ([Note: route strategies], [Note: TP update])."""

    name = "muon (tensor parallel)"

    def full_rows(self, dp: DedicatedParam) -> int | None:
        """The full matrix's row count: its per-row state is whole on every tp rank."""
        return dp.full_shape[0]  # type: ignore[index]

    def _update_batch(self, ctx: StepContext, args: tuple[list[Tensor], list[Tensor], list[Any], MuonHParams],
                      rule: UpdateRule, blocks: Blocks, tp_dim: int | None, full_shape: Any) -> None:
        """The full matrix's update, Newton-Schulz on one tp rank per matrix (collective over "tp")."""
        state = ctx.runtime
        tp_group = state.tp_mesh.get_group()
        rule.update_tp_(*args, full_shape=full_shape, tp_dim=tp_dim, tp_rank=state.tp_mesh.get_local_rank(),
                        tp_size=state.tp_mesh.size(), blocks=blocks,
                        exchange=lambda *a: C.tp_exchange(state.ctx, *a, group=tp_group))

    def laid_out_like(self, member: Member, key: str) -> Tensor | None:
        return None if key in PER_ROW_KEYS else member.dedicated.bound()

    def ns_batch(self, runtime: DMuonState, member: Member) -> tuple[Blocks, Any] | None:
        dp = member.dedicated
        return dp.blocks, (dp.tp_dim, math.prod(dp.shape))

    def ns_work(self, runtime: DMuonState, n: int, split: Any) -> tuple[int, int]:
        """The full matrices dealt to this tp rank, and its shards of the others' sent over "tp" and back."""
        return exchange_cost(n, split[1], tp_rank=runtime.tp_mesh.get_local_rank(), tp_size=runtime.tp_mesh.size())
