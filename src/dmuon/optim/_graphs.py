"""CUDA-graph replay of the batched Newton–Schulz call, one graph per shape group.

[Note: NS graphs]
NS on an owner's shape group is ~6 kernels per step and a few around them: for the small groups of small
models or large worlds, the host's launches, not the GPU, set its time. The first call with a given key
(shape, dtype, device, steps, coefficients, eps, backend) warms the call up on a side stream (Triton and
quack compile, cuBLAS picks its kernels), captures it into a graph whose input is a static copy, and
every call then copies its input in and replays: the same kernels on the same data, so bit-identical to
the eager call (``tests/test_ns_graphs.py`` on CUDA). A new shape, dtype or owned set is a new key; all
graphs share one memory pool (they never run at once), and each keeps its static input and output between
steps, so the cache is sized by those bytes, not by a count: past :data:`MAX_GRAPH_BYTES` the least recently
used graphs go. Groups of more than :data:`MAX_ELEMENTS` elements stay eager: they are GPU-bound, and a
graph would keep their intermediates reserved between steps. The result is the graph's static output: the caller consumes it
before the next call with the same key. Set ``DMUON_NS_CUDA_GRAPHS=0`` to keep every call eager.
Pure tensor math, no ``torch.distributed``; nothing here runs off CUDA.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_ELEMENTS", "MAX_GRAPH_BYTES", "switched_on", "enabled", "run", "clear"]

#: largest group (batch x rows x cols) replayed from a graph. Measured on an H200 (2026-12-01, two processes):
#: 4 x 8192 x 2048 (2^26) took 2.91 / 2.93 ms replayed against 4.24 / 3.26 eager; the 8B share's groups of 2^27
#: and more gain nothing (8 x 14336 x 4096: 35.05 / 35.56 against 34.18 / 34.09)
MAX_ELEMENTS = 2**26
#: static inputs and outputs the kept graphs may hold between steps (least recently used dropped first); a
#: graph larger than this alone is still kept, as the only one
MAX_GRAPH_BYTES = 2**29

_graphs: OrderedDict[tuple, tuple[Any, Tensor, Tensor]] = OrderedDict()
_pool: Any = None


def switched_on() -> bool:
    """Not switched off by ``DMUON_NS_CUDA_GRAPHS=0``."""
    return os.environ.get("DMUON_NS_CUDA_GRAPHS", "1") != "0"


def enabled(X: Tensor) -> bool:
    """Whether a call on ``X`` replays a graph: CUDA, at most :data:`MAX_ELEMENTS`, not already inside a
    capture, and :func:`switched_on`."""
    return X.is_cuda and X.numel() <= MAX_ELEMENTS and switched_on() and not torch.cuda.is_current_stream_capturing()


def run(fn: Callable[[Tensor], Tensor], X: Tensor, key: tuple) -> Tensor:
    """``fn(X)``, from the graph of ``key`` (captured at the first call). See [Note: NS graphs]."""
    global _pool
    full_key = (tuple(X.shape), X.dtype, X.device, *key)
    entry = _graphs.get(full_key)
    if entry is None:
        from ._symmetric import replayed

        static_in = X.clone()
        side = torch.cuda.Stream(X.device)
        side.wait_stream(torch.cuda.current_stream(X.device))
        with torch.cuda.stream(side), replayed():  # warm-up and capture choose the same kernels
            for _ in range(2):
                fn(static_in)
        torch.cuda.current_stream(X.device).wait_stream(side)
        if _pool is None:
            _pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_pool), replayed():
            static_out = fn(static_in)
        entry = (graph, static_in, static_out)
        _graphs[full_key] = entry
        while len(_graphs) > 1 and sum(i.nbytes + o.nbytes for _, i, o in _graphs.values()) > MAX_GRAPH_BYTES:
            _graphs.popitem(last=False)
    else:
        _graphs.move_to_end(full_key)
    graph, static_in, static_out = entry
    static_in.copy_(X)
    graph.replay()
    return static_out


def clear() -> None:
    """Drop every captured graph (and with the last one, their pool)."""
    global _pool
    _graphs.clear()
    _pool = None
