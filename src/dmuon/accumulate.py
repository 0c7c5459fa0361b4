"""Gradient accumulation: ``dmuon.no_sync(model)`` keeps gradients local until a backward outside it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

from . import engines

__all__ = ["no_sync"]


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Inside: no dedicated gradient reduce, no replicated all-reduce, and the engine's own sync off too (FSDP2's
    reduce-scatter; for a ``DistributedDataParallel`` model, DDP's own ``no_sync``); every rank accumulates its
    local gradients. The first backward outside reduces the accumulated sum.

    On an FSDP2 model dmuon also follows FSDP2's own switch, however it is set (``set_requires_gradient_sync``,
    which torch's pipelining schedules turn off for every microbatch): the dedicated gradients then accumulate
    too, and are reduced by the next synchronised backward, clip or ``step()``.

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
    state = engines.state_of(model)
    engine = engines.of(model)
    previous = state.sync_grads
    state.sync_grads = False
    try:
        with engine.no_sync(resume=previous):
            yield
    finally:
        state.sync_grads = previous
