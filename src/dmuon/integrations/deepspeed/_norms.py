"""The dedicated gradients' share of DeepSpeed's norm and overflow verdict, at every stage.

Each engine hook that asks "how large are the gradients" or "is one of them inf / NaN" (ZeRO-1/2's scaled norm,
``BF16_Optimizer``'s norm groups, ZeRO-3's norm groups and overflow check, stage 0's clip) adds the same thing:
the owners' averaged gradients, each counted once on its owner, summed over dmuon's shard group. One place, so
the sum's order (and so its bits) is the same wherever it is taken.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...runtime import comm as C
from ...runtime.hooks import DMuonState

__all__ = ["owned_grads", "squared_norm", "owned_squared_norm", "owned_overflow"]


def owned_grads(state: DMuonState) -> list[Tensor]:
    """The averaged gradients of the dedicated params this rank owns (none for a param without one)."""
    return [g for dp in state.owned() if (g := dp.reduced_grad()) is not None]


def squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """Sum of the squared 2-norms of ``grads``, in fp32 on ``device``, added in list order."""
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        acc = acc + torch.linalg.vector_norm(g.float(), 2).to(device) ** 2
    return acc


def owned_squared_norm(state: DMuonState) -> Tensor:
    """The dedicated gradients' squared norm over the job (each on its owner). Collective: every rank calls it."""
    ctx = state.ctx
    return C.all_reduce_sum(ctx, squared_norm(owned_grads(state), ctx.device))


def owned_overflow(state: DMuonState) -> bool:
    """Whether any rank owns an inf / NaN dedicated gradient: one all-reduce and one host read, whatever the
    number of gradients. Collective: every rank calls it."""
    ctx = state.ctx
    bad = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for g in owned_grads(state):
        bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(device=ctx.device, dtype=torch.float32))
    return bool(C.all_reduce_max(ctx, bad).item() > 0)
