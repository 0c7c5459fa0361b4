"""Newton–Schulz times measured on one H200, per matrix shape and batch, for the planner (``--simulate``).

Every number here is a cell of ``docs/benchmarks.md``, with the section it comes from (:data:`SOURCES`: the
date, the section's title and its command). A *backend* is one NS implementation as it was on the day it was
measured; dmuon's own NS got faster over the sessions, so a past run is predicted with the NS of its day
(:data:`BACKENDS` says which is which), and a prediction for today uses ``"auto"``.

How a time is read (:func:`ns_ms`), for ``batch`` matrices of one shape in one call (orientation ignored
unless both orientations were measured):

1. The shape was measured: the time *per matrix* is interpolated linearly in ``log2(batch)`` between the
   measured batches, and held at the nearest measured batch outside them (a smaller call is never predicted
   faster per matrix than the smallest measured one, a larger call never faster than the largest).
2. It was not: the backend's measured rates (nominal flops per ms, flops of torch's direct form,
   :func:`ns_flops`) over the calls of the same aspect class (square: ``max/min < 1.5``; wide otherwise)
   are interpolated in ``log(flops of the call)`` and held at the ends; the time is the flops over that rate.
   Such a time is *interpolated by flops*, and :func:`ns_source` says so.

Pure Python: the planner imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["SOURCES", "BACKENDS", "NSPoint", "ns_flops", "ns_ms", "ns_source"]

#: NS steps of every measurement (Keller Jordan's 5, or Polar Express's 5: same products, same time).
STEPS = 5


class NSPoint(NamedTuple):
    """One measured call: ``batch`` matrices of ``rows x cols`` in ``ms``, from ``source`` (a key of
    :data:`SOURCES`)."""

    rows: int
    cols: int
    batch: int
    ms: float
    source: str


#: Where each number comes from: the section of docs/benchmarks.md and its command.
SOURCES: Mapping[str, str] = MappingProxyType({
    "2026-11-29-forms": "2026-11-29, 'Newton–Schulz forms per shape (second session)': "
                        "python scripts/gpu_profile.py --parts ns (median of 5 calls)",
    "2026-11-29-kernel": "2026-11-29, 'third session', the half-tile kernel table, first run: "
                         "python scripts/gpu_symmetric_kernel.py --ns (auto + Polar Express, one call per shape group)",
    "2026-12-01-evening": "2026-12-01 (evening), 'Newton–Schulz side by side': "
                          "python scripts/gpu_ns_side_by_side.py --out DIR --reps 7 (one rank's share at 8 ranks)",
    "2026-12-01-closing": "2026-12-01 (late night), issue 14's closing round, process 3 per group: "
                          "python scripts/gpu_ns_side_by_side.py --out DIR --reps 11 --no-chart",
    "2026-12-02-single": "2026-12-02, 'Single matrices' (auto via update: replayed from a CUDA graph): "
                         "python scripts/gpu_moe_ns.py --out DIR --reps 5",
    "2026-12-02-experts": "2026-12-02, issue 25 expert Newton–Schulz (one MoE layer's experts, chunks of 2^28): "
                          "python scripts/gpu_moe_ns.py --out DIR --reps 5; dmuon's NS from the later run",
})

_F, _K, _E, _C, _S, _X = ("2026-11-29-forms", "2026-11-29-kernel", "2026-12-01-evening", "2026-12-01-closing",
                          "2026-12-02-single", "2026-12-02-experts")


def _pts(source: str, rows: list[tuple[int, int, int, float]]) -> tuple[NSPoint, ...]:
    return tuple(NSPoint(m, n, b, ms, source) for m, n, b, ms in rows)


# The 8 projection shapes of Llama-3.2-1B and Llama-3.1-8B at batches 1 / 4 / all of one model.
_FORMS_SHAPES = ((2048, 2048, 32), (512, 2048, 32), (8192, 2048, 32), (2048, 8192, 16),
                 (4096, 4096, 64), (1024, 4096, 64), (14336, 4096, 64), (4096, 14336, 32))


def _forms(column: list[tuple[float, float, float]]) -> tuple[NSPoint, ...]:
    """One column of the 2026-11-29 forms table: (batch 1, batch 4, all) per shape of ``_FORMS_SHAPES``."""
    out = []
    for (m, n, big), times in zip(_FORMS_SHAPES, column):
        out += [(m, n, 1, times[0]), (m, n, 4, times[1]), (m, n, big, times[2])]
    return _pts(_F, out)


#: backend -> (what it is, its measured calls)
BACKENDS: Mapping[str, tuple[str, tuple[NSPoint, ...]]] = MappingProxyType({
    "torch": ("torch.optim.Muon's NS, one call per matrix (bf16 direct form); the all-to-all designs' "
              "DistMuon runs it", _forms([
                  (0.67, 1.92, 15.60), (0.48, 1.83, 14.85), (1.38, 5.43, 45.20), (1.43, 5.45, 22.32),
                  (3.48, 13.62, 215.67), (0.41, 1.44, 22.21), (8.69, 38.57, 580.16), (8.67, 36.06, 282.67)])
              + _pts(_S, [(768, 2048, 1, 0.326), (2048, 7168, 1, 1.300)])),
    "direct-2026-11-29": ("dmuon's batched bf16 direct form (torch's arithmetic, one call per shape group), "
                          "the default of 2026-11-29; also torchtitan's batched NS of local experts", _forms([
                              (0.54, 1.74, 12.85), (0.48, 0.48, 1.11), (1.38, 5.24, 45.34), (1.55, 5.24, 22.27),
                              (3.45, 13.88, 217.18), (0.42, 0.93, 11.48), (8.81, 36.41, 589.19),
                              (9.24, 36.14, 284.82)])),
    "gram-2026-11-29": ("dmuon's bf16 Gram form with Polar Express, 2026-11-29 (before the symmetric kernels)",
                        _forms([(0.67, 2.30, 17.28), (0.61, 0.64, 0.89), (0.99, 3.73, 30.00), (1.09, 4.05, 15.50),
                                (3.99, 16.58, 260.61), (0.48, 0.74, 9.37), (6.28, 26.11, 414.28),
                                (6.43, 26.13, 207.65)])),
    "auto-2026-11-29": ("dmuon's ns_backend='auto' of 2026-11-29 (second session): the Gram form where "
                        "aspect >= 1.5 and batch*m^2*n >= 2^33, else the direct form", ()),
    "auto-2026-11-29-kernel": ("dmuon's 'auto' + Polar Express of the third session (2026-11-29), with the "
                               "half-tile Triton kernel for the symmetric products", _pts(_K, [
                                   (2048, 2048, 32, 10.29), (512, 2048, 32, 0.90), (8192, 2048, 32, 25.93),
                                   (2048, 8192, 16, 14.62), (4096, 4096, 64, 158.29), (1024, 4096, 64, 8.24),
                                   (14336, 4096, 64, 353.68), (4096, 14336, 32, 173.76)])),
    "auto": ("dmuon's ns_backend='auto' today (float16 forms, quack's symmetric GEMM, CUDA graphs for small "
             "groups, chunks of 2^28 elements)", _pts(_S, [
                 (2048, 8192, 1, 0.919), (8192, 2048, 1, 0.857), (2048, 2048, 1, 0.459), (512, 2048, 1, 0.140),
                 (4096, 4096, 1, 2.915), (1024, 4096, 1, 0.305), (14336, 4096, 1, 4.932), (4096, 14336, 1, 5.161),
                 (768, 2048, 1, 0.185), (2048, 7168, 1, 0.833)])
             + _pts(_C, [(4096, 4096, 8, 19.30), (1024, 4096, 8, 1.10), (14336, 4096, 8, 34.09),
                         (4096, 14336, 4, 18.11)])
             + _pts(_E, [(2048, 2048, 4, 1.56), (512, 2048, 4, 0.34), (8192, 2048, 4, 2.97), (2048, 8192, 2, 1.89)])
             + _pts(_X, [(768, 2048, 384, 16.39), (2048, 7168, 96, 59.91)])),
    "gns": ("gram-newton-schulz 0.1.6, eager (the stand-in for dion's own NS: Polar Express with symmetric "
            "Triton kernels, or gram-newton-schulz itself)", _pts(_C, [
                (4096, 4096, 8, 19.69), (1024, 4096, 8, 2.35), (14336, 4096, 8, 37.01), (4096, 14336, 4, 18.65)])
            + _pts(_E, [(2048, 2048, 4, 2.47), (512, 2048, 4, 2.06), (8192, 2048, 4, 3.08), (2048, 8192, 2, 2.10)])
            + _pts(_X, [(768, 2048, 384, 18.28), (2048, 7168, 96, 64.78)])),
})


def _check(backend: str, rows: int, cols: int, batch: int) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"dmuon.plan: unknown NS backend {backend!r}; one of {', '.join(BACKENDS)}")
    for what, v in (("rows", rows), ("cols", cols), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"dmuon.plan: NS {what} must be a positive int, got {v!r}")


def ns_flops(rows: int, cols: int, batch: int = 1) -> float:
    """Nominal flops of ``batch`` NS calls of :data:`STEPS` steps in torch's direct form (``4 m^2 n + 2 m^3`` a
    step, ``m`` the short side), the unit every rate here is counted in."""
    m, n = min(rows, cols), max(rows, cols)
    return float(batch * STEPS * (4 * m * m * n + 2 * m ** 3))


def _resolve(backend: str, rows: int, cols: int, batch: int) -> str:
    """The measured backend a composite backend runs for this call (its own name otherwise)."""
    if backend != "auto-2026-11-29":
        return backend
    m, n = min(rows, cols), max(rows, cols)
    return "gram-2026-11-29" if n / m >= 1.5 and batch * m * m * n >= 2 ** 33 else "direct-2026-11-29"


def _same_shape(points: tuple[NSPoint, ...], rows: int, cols: int) -> list[NSPoint]:
    exact = [p for p in points if (p.rows, p.cols) == (rows, cols)]
    return exact or [p for p in points if (p.rows, p.cols) == (cols, rows)]


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear ``y(x)`` through sorted ``xs``, held at the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _per_matrix(points: list[NSPoint], batch: int) -> float:
    by_batch: dict[int, list[float]] = {}
    for p in points:
        by_batch.setdefault(p.batch, []).append(p.ms / p.batch)
    batches = sorted(by_batch)
    return _interp(math.log2(batch), [math.log2(b) for b in batches],
                   [sum(by_batch[b]) / len(by_batch[b]) for b in batches])


def _square(rows: int, cols: int) -> bool:
    return max(rows, cols) / min(rows, cols) < 1.5


def _by_rate(points: tuple[NSPoint, ...], rows: int, cols: int, batch: int) -> float:
    same = [p for p in points if _square(p.rows, p.cols) == _square(rows, cols)] or list(points)
    calls = sorted((math.log(ns_flops(p.rows, p.cols, p.batch)), ns_flops(p.rows, p.cols, p.batch) / p.ms)
                   for p in same)
    flops = ns_flops(rows, cols, batch)
    return flops / _interp(math.log(flops), [c[0] for c in calls], [c[1] for c in calls])


def ns_ms(backend: str, rows: int, cols: int, batch: int = 1) -> float:
    """Predicted ms of one NS call on ``batch`` matrices of ``rows x cols`` by ``backend`` (module docstring).

    Example::

        ns_ms("auto", 4096, 4096, 8)      # 19.30: measured
        ns_ms("auto", 3072, 8192, 4)      # no 3072 x 8192 measured: interpolated by flops
    """
    _check(backend, rows, cols, batch)
    resolved = _resolve(backend, rows, cols, batch)
    points = BACKENDS[resolved][1]
    same = _same_shape(points, rows, cols)
    if same:
        return batch * _per_matrix(same, batch)
    return _by_rate(points, rows, cols, batch)


def ns_source(backend: str, rows: int, cols: int, batch: int = 1) -> str:
    """How :func:`ns_ms` got its time: ``"measured"`` (this shape and batch), ``"batch-interpolated"`` (this
    shape at other batches) or ``"flops-interpolated"`` (other shapes)."""
    _check(backend, rows, cols, batch)
    same = _same_shape(BACKENDS[_resolve(backend, rows, cols, batch)][1], rows, cols)
    if not same:
        return "flops-interpolated"
    return "measured" if any(p.batch == batch for p in same) else "batch-interpolated"
