"""Plain parameters: trainable params that neither dmuon nor FSDP2 manages, averaged like DDP would."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import comm as C
from .comm import CommKind

__all__ = ["all_reduce_replicated_grads"]


def all_reduce_replicated_grads(ctx: C.CommContext, params: list[nn.Parameter]) -> None:
    """Average gradients of trainable params that neither dmuon nor FSDP2 manages (a model, or part of
    one, without ``fully_shard``), like DDP would. One coalesced all-reduce per dtype; a trailing flag
    per param records whether any rank had a gradient, so params nobody touched keep ``grad=None``.

    Host-sync free when every such param has a local gradient (the usual case): the averages are
    copied into the existing ``.grad`` tensors on the device. Only a rank that lacks some gradient
    reads the flags on the host, since whether ``.grad`` becomes a tensor or stays ``None`` is a host
    decision (a zero gradient would still move AdamW's state and apply weight decay).

    The list comes from the optimizer rather than from scanning the model here: while FSDP2 holds a
    module unsharded, its parameters are plain tensors too and must not be mistaken for these.
    """
    if not params or ctx.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    dev = ctx.device
    for dtype, ps in by_dtype.items():
        had_local = [p.grad is not None for p in ps]
        parts = [
            (p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device))
            for p in ps
        ]
        # all present (the usual case): flags made on the device, no host->device copy; otherwise this
        # rank reads the result on the host below anyway
        flags = (torch.ones(len(ps), dtype=dtype, device=dev) if all(had_local)
                 else torch.tensor(had_local, dtype=dtype).to(dev))
        flat = torch.cat([t.to(dev) for t in parts] + [flags])
        C.wait(C.all_reduce_avg(ctx, flat, CommKind.REPLICATED_GRAD_ALL_REDUCE, "replicated grads"))
        total = sum(p.numel() for p in ps)
        # host read only on a rank that lacks a gradient: did any other rank have one?
        others_had = (flat[total:] > 0).tolist() if not all(had_local) else had_local
        off = 0
        for p, has, any_grad in zip(ps, had_local, others_had):
            n = p.numel()
            g = flat[off : off + n].view_as(p)
            off += n
            if has:
                p.grad.copy_(g)  # type: ignore[union-attr]
            elif any_grad:
                p.grad = g.to(p.device, copy=True)
