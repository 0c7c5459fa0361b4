"""Device timing for the GPU scripts: the median of a few synchronised runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_ms"]


def median_ms(fn: Callable[[], object], *, reps: int = 5, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds, each run closed by a device synchronisation (CUDA
    kernels are asynchronous: without it the host would time only the launches)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)
