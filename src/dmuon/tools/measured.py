"""Every step time ``docs/benchmarks.md`` has measured, as data, and the planner's prediction of each.

:data:`RUNS` names each section (date, title, command); :data:`POINTS` holds one row per variant and run with
what was measured (whole step, forward + backward, optimizer step, end to end; ms). Each row names the
Newton–Schulz its day ran (a backend of :mod:`dmuon.tools.ns_table`), so a past run is predicted with the
NS of its day. :func:`validate` predicts every row with :func:`dmuon.tools.schedules.simulate_design` and
returns the errors; ``python -m dmuon.plan --validate`` prints them, and ``tests/test_plan_simulate.py`` holds
the planner to them.

Left out, with the reason: runs with fp32 masters (the planner does not model masters), the issue-15 runs
(quack was not installed that day: an NS build measured per shape nowhere) and the issue-23 morning runs of
2026-12-02 (an NS regression of that morning, fixed the same day, measured per shape nowhere).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from .ns_table import ns_ms
from .presets import PRESETS
from .schedules import owner_plan, simulate_design
from .step_model import Scenario, muon_update_ms, sizes_of

__all__ = ["RUNS", "Point", "POINTS", "ERROR_BOUNDS", "KNOWN_MISSES", "category", "bound", "predict", "validate"]

RUNS: Mapping[str, str] = MappingProxyType({
    "1129-baseline": "2026-11-29 first baseline, 1 x H200: python -m dmuon.bench --preset 1b --steps 5 --warmup 3",
    "1129-batched": "2026-11-29 batched Newton–Schulz per shape group, 1 x H200: python -m dmuon.bench --preset 1b",
    "1129-second": "2026-11-29 issue 6 second session, 1 x H200: bash scripts/bench_one_gpu.sh OUT",
    "1129-third": "2026-11-29 third session (half-tile kernel), 1 x H200: python -m dmuon.bench --preset 1b "
                  "--dmuon-wrap root --ns-backend auto --ns-coefficients polar_express",
    "1129-2gpu-first": "2026-11-29 first two-GPU run, 2 x H200 NVLink: torchrun --nproc_per_node 2 -m dmuon.bench "
                       "(4 x 2048 tokens per rank)",
    "1129-2gpu-third": "2026-11-29 third session, two GPUs again, 2 x H200 NV18: bash scripts/bench_multi_gpu.sh "
                       "OUT checks, then the bench (4 x 2048 tokens per rank)",
    "1201-issue13": "2026-12-01 (later) issue 13, 1 x H200: python -m dmuon.bench --preset 1b --steps 12 --warmup 3 "
                    "--variants torch_muon,dmuon_z3 --dmuon-wrap root --ns-backend auto --ns-coefficients "
                    "polar_express",
    "1201-evening": "2026-12-01 (evening), whole step, defaults, 1 x H200: python -m dmuon.bench --preset 1b",
    "1201-closing": "2026-12-01 (late night), after the MAX_ELEMENTS change, 1 x H200: python -m dmuon.bench "
                    "--preset 1b --rounds 3 --variants torch_muon,dmuon_z3 [--dmuon-wrap root]",
    "1202-issue26": "2026-12-02 (later) issue 26, 1 x H200: python -m dmuon.bench --preset 1b --variants "
                    "torch_muon,dmuon_z3 --dmuon-wrap root --steps 10 --warmup 3 --rounds 2",
})


class Point(NamedTuple):
    """One measured variant of one run. ``design``: a design of :mod:`dmuon.tools.schedules`, or
    ``"owner_step"`` (``--simulate-world-size``: the busiest owner's momentum + NS + update, ``opt_ms``; and
    ``share_ms``, torch's NS of all matrices / W)."""

    id: str
    run: str
    design: str
    preset: str
    world: int = 1
    replicas: int = 1
    batch: int = 4
    seq: int = 512
    wrap: str = "root"
    reshard: str = "z3"
    ns: str = "auto"
    publish_async: bool = True
    step_ms: float | None = None
    fwdbwd_ms: float | None = None
    opt_ms: float | None = None
    e2e_ms: float | None = None
    share_ms: float | None = None
    #: ``opt_ms / share_ms`` where only the ratio was printed
    ratio: float | None = None
    #: a point the model's constants were fitted to (COMPUTE_ANCHORS), not a prediction
    calibration: bool = False


def _pt(id: str, run: str, design: str, preset: str, **kw: Any) -> Point:
    return Point(id, run, design, preset, **kw)


_B, _S, _T = "1129-baseline", "1129-second", "1129-third"
_D, _K, _A, _G = "direct-2026-11-29", "auto-2026-11-29", "auto-2026-11-29-kernel", "auto"
_1B, _8B = "llama3.2-1b", "llama3-8b"

POINTS: tuple[Point, ...] = (
    # ------------------------------------------------------------------ 1 GPU, 4 x 512 (host-bound)
    _pt("baseline/fsdp_adamw", _B, "fsdp_adamw", _1B, step_ms=116.77, fwdbwd_ms=94.17, opt_ms=22.60),
    _pt("baseline/naive", _B, "naive", _1B, ns="torch", step_ms=240.49, fwdbwd_ms=99.10, opt_ms=141.39),
    _pt("baseline/torch_muon", _B, "torch_muon", _1B, step_ms=148.71, fwdbwd_ms=48.25, opt_ms=100.46),
    _pt("baseline/dmuon_z3", _B, "dmuon", _1B, wrap="layers", ns="torch", step_ms=177.68, fwdbwd_ms=77.02,
        opt_ms=100.66),
    _pt("baseline/dmuon_z2", _B, "dmuon", _1B, wrap="layers", reshard="z2", ns="torch", step_ms=200.11,
        fwdbwd_ms=98.64, opt_ms=101.47),
    _pt("batched/fsdp_adamw", "1129-batched", "fsdp_adamw", _1B, step_ms=137.03, fwdbwd_ms=114.08, opt_ms=22.95),
    _pt("batched/torch_muon", "1129-batched", "torch_muon", _1B, step_ms=165.38, fwdbwd_ms=63.99, opt_ms=101.39),
    _pt("batched/dmuon_z3", "1129-batched", "dmuon", _1B, wrap="layers", ns=_D, step_ms=210.57, fwdbwd_ms=114.19,
        opt_ms=96.38),
    _pt("batched/dmuon_z2", "1129-batched", "dmuon", _1B, wrap="layers", reshard="z2", ns=_D, step_ms=200.85,
        fwdbwd_ms=107.19, opt_ms=93.67),
    _pt("second/recipe/fsdp_adamw", _S, "fsdp_adamw", _1B, step_ms=105.74, fwdbwd_ms=93.10, opt_ms=12.64),
    _pt("second/recipe/naive", _S, "naive", _1B, ns=_D, step_ms=188.35, fwdbwd_ms=86.44, opt_ms=101.92),
    _pt("second/recipe/torch_muon", _S, "torch_muon", _1B, step_ms=151.86, fwdbwd_ms=54.03, opt_ms=97.82),
    _pt("second/recipe/dmuon_z3", _S, "dmuon", _1B, wrap="layers", ns=_D, step_ms=176.48, fwdbwd_ms=86.08,
        opt_ms=90.40),
    _pt("second/recipe/dmuon_z2", _S, "dmuon", _1B, wrap="layers", reshard="z2", ns=_D, step_ms=183.02,
        fwdbwd_ms=92.82, opt_ms=90.20),
    _pt("second/root/torch_muon", _S, "torch_muon", _1B, step_ms=142.57, fwdbwd_ms=44.44, opt_ms=98.14),
    _pt("second/root/dmuon_z3", _S, "dmuon", _1B, ns=_D, step_ms=137.39, fwdbwd_ms=50.36, opt_ms=87.02),
    _pt("second/root/dmuon_z2", _S, "dmuon", _1B, reshard="z2", ns=_D, step_ms=135.47, fwdbwd_ms=48.73,
        opt_ms=86.75),
    _pt("second/fast/torch_muon", _S, "torch_muon", _1B, step_ms=143.79, fwdbwd_ms=46.41, opt_ms=97.38),
    _pt("second/fast/dmuon_z3", _S, "dmuon", _1B, ns=_K, step_ms=114.44, fwdbwd_ms=48.88, opt_ms=65.56),
    _pt("second/fast/dmuon_z2", _S, "dmuon", _1B, reshard="z2", ns=_K, step_ms=113.76, fwdbwd_ms=48.28,
        opt_ms=65.48),
    _pt("third/dmuon_z3 opt (run 1)", _T, "dmuon", _1B, ns=_A, opt_ms=56.75),
    _pt("third/dmuon_z3 opt (run 2)", _T, "dmuon", _1B, ns=_A, opt_ms=55.69),
    _pt("issue13/dmuon_z3 opt (run 1)", "1201-issue13", "dmuon", _1B, ns=_A, opt_ms=55.3),
    _pt("issue13/dmuon_z3 opt (run 2)", "1201-issue13", "dmuon", _1B, ns=_A, opt_ms=55.1),
    _pt("evening/recipe/dmuon_z3", "1201-evening", "dmuon", _1B, wrap="layers", ns=_G, step_ms=137.0, opt_ms=54.2),
    _pt("evening/recipe/torch_muon", "1201-evening", "torch_muon", _1B, step_ms=140.5, opt_ms=96.5),
    _pt("closing/recipe/dmuon_z3", "1201-closing", "dmuon", _1B, wrap="layers", ns=_G, step_ms=150.33,
        opt_ms=51.48),
    _pt("closing/recipe/torch_muon", "1201-closing", "torch_muon", _1B, step_ms=152.52, opt_ms=96.52),
    _pt("closing/root/dmuon_z3", "1201-closing", "dmuon", _1B, ns=_G, step_ms=106.87, opt_ms=47.68),
    _pt("closing/root/torch_muon", "1201-closing", "torch_muon", _1B, step_ms=156.15, opt_ms=97.08),
    _pt("issue26/dmuon_z3 opt", "1202-issue26", "dmuon", _1B, ns=_G, opt_ms=48.3),
    # ------------------------------------------------------------------ 1 GPU, 4 x 4096
    _pt("second/4x4096/torch_muon", _S, "torch_muon", _1B, seq=4096, step_ms=396.37, fwdbwd_ms=294.66,
        opt_ms=101.70),
    _pt("second/4x4096/dmuon_z3", _S, "dmuon", _1B, seq=4096, ns=_K, step_ms=368.69, fwdbwd_ms=300.94,
        opt_ms=67.75),
    # ------------------------------------------------------------------ --simulate-world-size 8
    _pt("baseline/W=8 owner 8B", _B, "owner_step", _8B, world=8, ns="torch", opt_ms=140.3, share_ms=138.0),
    _pt("baseline/W=8 owner 1B", _B, "owner_step", _1B, world=8, ns="torch", opt_ms=11.6, share_ms=10.8),
    _pt("batched/W=8 owner 8B", "1129-batched", "owner_step", _8B, world=8, ns=_D, opt_ms=139.6, share_ms=135.8),
    _pt("batched/W=8 owner 1B", "1129-batched", "owner_step", _1B, world=8, ns=_D, opt_ms=10.8, share_ms=10.6),
    _pt("second/W=8 owner 8B", _S, "owner_step", _8B, world=8, ns=_D, opt_ms=141.0, share_ms=137.5),
    _pt("second/W=8 owner 8B fast", _S, "owner_step", _8B, world=8, ns=_K, opt_ms=110.1, share_ms=137.5),
    _pt("second/W=8 owner 1B", _S, "owner_step", _1B, world=8, ns=_D, opt_ms=10.6, share_ms=10.7),
    _pt("second/W=8 owner 1B fast", _S, "owner_step", _1B, world=8, ns=_K, opt_ms=8.2, share_ms=10.8),
    _pt("third/W=8 owner 8B (ratio)", _T, "owner_step", _8B, world=8, ns=_A, ratio=0.66),
    _pt("third/W=8 owner 1B (ratio)", _T, "owner_step", _1B, world=8, ns=_A, ratio=0.68),
    # ------------------------------------------------------------------ 2 GPUs, 4 x 2048 per rank
    _pt("2gpu-first/1B recipe/fsdp_adamw", "1129-2gpu-first", "fsdp_adamw", _1B, world=2, seq=2048, step_ms=176.70,
        fwdbwd_ms=168.10, opt_ms=8.60),
    _pt("2gpu-first/1B recipe/naive", "1129-2gpu-first", "naive", _1B, world=2, seq=2048, ns=_D, step_ms=410.63,
        fwdbwd_ms=172.10, opt_ms=238.53),
    _pt("2gpu-first/1B recipe/dmuon_z3", "1129-2gpu-first", "dmuon", _1B, world=2, seq=2048, wrap="layers", ns=_D,
        step_ms=217.11, fwdbwd_ms=168.80, opt_ms=48.32),
    _pt("2gpu-first/1B recipe/dmuon_z2", "1129-2gpu-first", "dmuon", _1B, world=2, seq=2048, wrap="layers",
        reshard="z2", ns=_D, step_ms=219.35, fwdbwd_ms=171.74, opt_ms=47.62),
    _pt("2gpu-first/1B root/fsdp_adamw", "1129-2gpu-first", "fsdp_adamw", _1B, world=2, seq=2048, step_ms=173.33,
        fwdbwd_ms=162.67, opt_ms=10.65),
    _pt("2gpu-first/1B root/dmuon_z3", "1129-2gpu-first", "dmuon", _1B, world=2, seq=2048, ns=_K, step_ms=190.19,
        fwdbwd_ms=153.46, opt_ms=36.73),
    _pt("2gpu-first/1B root/dmuon_z2", "1129-2gpu-first", "dmuon", _1B, world=2, seq=2048, reshard="z2", ns=_K,
        step_ms=186.62, fwdbwd_ms=150.22, opt_ms=36.40),
    _pt("2gpu-first/8B/fsdp_adamw", "1129-2gpu-first", "fsdp_adamw", _8B, world=2, seq=2048, step_ms=781.69,
        fwdbwd_ms=749.24, opt_ms=32.45, calibration=True),
    _pt("2gpu-first/8B/dmuon_z3", "1129-2gpu-first", "dmuon", _8B, world=2, seq=2048, ns=_K, step_ms=1192.08,
        fwdbwd_ms=743.97, opt_ms=448.11),
    _pt("2gpu-first/8B/dmuon_z2", "1129-2gpu-first", "dmuon", _8B, world=2, seq=2048, reshard="z2", ns=_K,
        step_ms=1181.35, fwdbwd_ms=733.06, opt_ms=448.29),
    _pt("2gpu-third/8B/fsdp_adamw", "1129-2gpu-third", "fsdp_adamw", _8B, world=2, seq=2048, step_ms=803.24,
        fwdbwd_ms=773.44, opt_ms=29.80, e2e_ms=783.95),
    _pt("2gpu-third/8B/naive", "1129-2gpu-third", "naive", _8B, world=2, seq=2048, ns=_D, step_ms=2042.60,
        fwdbwd_ms=782.22, opt_ms=1260.38, e2e_ms=2040.09),
    _pt("2gpu-third/8B/dmuon_z3", "1129-2gpu-third", "dmuon", _8B, world=2, seq=2048, ns=_A, step_ms=1144.59,
        fwdbwd_ms=759.50, opt_ms=385.09, e2e_ms=1140.31),
    _pt("2gpu-third/8B/dmuon_z2", "1129-2gpu-third", "dmuon", _8B, world=2, seq=2048, reshard="z2", ns=_A,
        step_ms=1138.49, fwdbwd_ms=749.86, opt_ms=388.63, e2e_ms=1128.28),
    _pt("2gpu-third/HSDP 2x1 1B/fsdp_adamw", "1129-2gpu-third", "fsdp_adamw", _1B, world=2, replicas=2, seq=2048,
        e2e_ms=162.72),
    _pt("2gpu-third/HSDP 2x1 1B/dmuon_z3", "1129-2gpu-third", "dmuon", _1B, world=2, replicas=2, seq=2048, ns=_A,
        e2e_ms=183.86),
    _pt("2gpu-third/HSDP 2x1 1B/dmuon_z3 sync publish", "1129-2gpu-third", "dmuon", _1B, world=2, replicas=2,
        seq=2048, ns=_A, publish_async=False, e2e_ms=185.82),
    _pt("2gpu-third/HSDP 2x1 8B/fsdp_adamw", "1129-2gpu-third", "fsdp_adamw", _8B, world=2, replicas=2, seq=2048,
        e2e_ms=783.10),
    _pt("2gpu-third/HSDP 2x1 8B/dmuon_z3", "1129-2gpu-third", "dmuon", _8B, world=2, replicas=2, seq=2048, ns=_A,
        e2e_ms=1145.66),
    _pt("2gpu-third/HSDP 2x1 8B/dmuon_z3 sync publish", "1129-2gpu-third", "dmuon", _8B, world=2, replicas=2,
        seq=2048, ns=_A, publish_async=False, e2e_ms=1157.78),
)


#: How far off the planner is, at worst, by kind of run and quantity (``|predicted / measured - 1|``, over
#: every point but :data:`KNOWN_MISSES`). ``step``: whole step or end to end; ``parts``: forward + backward and
#: the optimizer step. Why the 1-GPU bounds are wide: at 4 x 512 tokens the step is host-bound and the same
#: configuration measured 93-114 ms forward + backward across sessions; today's ``auto`` NS was timed per shape
#: at batches up to 8 only, and an owner of every 1B matrix batches 32 (held at the batch-8 time per matrix:
#: the 1-GPU optimizer step is over-predicted by up to 48%).
ERROR_BOUNDS: Mapping[tuple[str, str], float] = MappingProxyType({
    ("2 GPUs", "step"): 0.10, ("2 GPUs", "parts"): 0.13,
    ("1 GPU", "step"): 0.21, ("1 GPU", "parts"): 0.48,
    ("simulated W=8", "step"): 0.16,
})
#: Points beyond their kind's bound, with the reason and their own bound.
KNOWN_MISSES: Mapping[str, tuple[float, str]] = MappingProxyType({
    "2gpu-first/1B recipe/naive": (0.48, "naive FSDP2 + Muon issues two synchronous DTensor gathers per matrix from "
                                         "Python (224 at 1B); the planner charges wire time and NCCL latency, not "
                                         "that host time"),
})


def category(p: Point) -> str:
    """The kind of run ``p`` is, as :data:`ERROR_BOUNDS` names it."""
    if p.design == "owner_step":
        return "simulated W=8"
    return "2 GPUs" if p.world == 2 else "1 GPU"


def bound(p: Point, quantity: str) -> float:
    """The error the planner is held to on ``quantity`` of ``p``."""
    if p.id in KNOWN_MISSES:
        return KNOWN_MISSES[p.id][0]
    kind = "step" if quantity in ("step_ms", "e2e_ms") or p.design == "owner_step" else "parts"
    return ERROR_BOUNDS[(category(p), kind)]


def _owner_step(p: Point) -> dict[str, float]:
    """``--simulate-world-size``: the busiest owner's update under the real plan, and torch's NS share."""
    sz = sizes_of(PRESETS[p.preset], p.seq)
    plan = owner_plan(sz.muon, p.world, None)
    shape_of = {fqn: shape for fqn, shape, _ in sz.muon}

    def step(r: int) -> float:
        groups = Counter(shape_of[f] for f in plan.ranks[r].fqns)
        return sum(ns_ms(p.ns, m, n, k) for (m, n), k in groups.items()) + muon_update_ms(plan.ranks[r].numel, 2)

    owner = max(step(r) for r in range(p.world))
    everything = Counter(shape for _, shape, _ in sz.muon)
    share = sum(ns_ms("torch", m, n, k) for (m, n), k in everything.items()) / p.world
    return {"opt_ms": owner, "share_ms": share, "ratio": owner / share}


def predict(p: Point) -> dict[str, float]:
    """The planner's numbers for the quantities ``p`` measured (``fwdbwd_ms``: forward + backward)."""
    if p.design == "owner_step":
        return _owner_step(p)
    sc = Scenario(PRESETS[p.preset], p.world, replicas=p.replicas, batch=p.batch, seq=p.seq, reshard=p.reshard,
                  dmuon_wrap=p.wrap, publish_async=p.publish_async, ns_backend=p.ns)
    r = simulate_design(sc, p.design, naive_backend=p.ns)
    return {"step_ms": r["step_ms"], "fwdbwd_ms": r["forward_ms"] + r["backward_ms"], "opt_ms": r["optimizer_ms"],
            "e2e_ms": r["step_ms"]}


def validate(points: tuple[Point, ...] = POINTS) -> list[dict[str, Any]]:
    """One row per measured quantity: the point, the quantity, predicted and measured ms (or ratio), the error
    ``predicted / measured - 1`` and the bound it is held to (:func:`bound`)."""
    rows = []
    for p in points:
        pred = predict(p)
        for q in ("step_ms", "e2e_ms", "fwdbwd_ms", "opt_ms", "share_ms", "ratio"):
            measured = getattr(p, q)
            if measured is None:
                continue
            rows.append({"id": p.id, "run": p.run, "quantity": q, "predicted": pred[q], "measured": measured,
                         "error": pred[q] / measured - 1, "bound": bound(p, q), "kind": category(p),
                         "calibration": p.calibration, "world": p.world})
    return rows
