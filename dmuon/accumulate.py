"""Gradient accumulation: ``dmuon.no_sync(model)`` keeps gradients local until a backward outside it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch.nn as nn

from ._fsdp import fsdp_modules
from .runtime.hooks import get_state, unwrap_ddp

__all__ = ["no_sync"]


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Inside: no dedicated gradient reduce, no FSDP2 reduce-scatter, no replicated all-reduce (and for a
    ``DistributedDataParallel`` model, DDP's own ``no_sync``); every rank accumulates its local gradients. The first backward outside reduces the accumulated sum.

    Weights still travel (forward broadcast, and under Z3 the backward re-broadcast): only gradient
    traffic is deferred. Non-owner ranks hold full-size local gradients of dedicated params meanwhile
    (summed in ``dedicate_params(reduce_dtype=...)`` when that is wider than the params, as FSDP2 does).

    Example::

        for i, batch in enumerate(loader):
            ctx = dmuon.no_sync(model) if (i + 1) % accum_steps else contextlib.nullcontext()
            with ctx:
                (model(batch).loss / accum_steps).backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """
    state = get_state(model)
    fsdp = fsdp_modules(model)
    previous = state.sync_grads
    state.sync_grads = False
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    ddp_sync = model.no_sync() if unwrap_ddp(model) is not model else nullcontext()  # DDP's own params
    try:
        with ddp_sync:
            yield
    finally:
        state.sync_grads = previous
        for m in fsdp:
            m.set_requires_gradient_sync(previous, recurse=False)
