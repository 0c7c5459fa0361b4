"""Distributed Muon side by side: FSDP2 + AdamW, dmuon, torchtitan's DistMuon and dion's Muon training the same
model on the same batches in the same precision: per-phase and whole-step times, peak memory, bytes per rank
by collective, and whether the Muon variants agree on the weights after the first steps.

    python scripts/gpu_side_by_side.py --preset 1b --out DIR                           # one GPU
    python scripts/gpu_side_by_side.py --preset qwen3-moe-debug --out DIR              # a small MoE, one GPU
    torchrun --nproc_per_node 8 scripts/gpu_side_by_side.py --preset 8b --out DIR      # one process per GPU
    torchrun --nproc_per_node 2 scripts/gpu_side_by_side.py --preset tiny              # CPU, 2 gloo ranks

Every variant builds the preset's model from one seed, wraps each decoder layer and the root in FSDP2
(``fully_shard``) and trains the Muon matrices (projections; in an MoE model also the experts, not the
router) with Muon and everything else with ``torch.optim.AdamW`` (fused on CUDA). Muon everywhere: lr 0.02,
momentum 0.95 (Nesterov), 5 Newton-Schulz steps with Keller Jordan's coefficients, eps 1e-7, lr scaled by
``sqrt(max(1, rows / cols))`` of each matrix (torch.optim.Muon's rule), no weight decay. AdamW: lr 1e-3,
betas (0.9, 0.999), eps 1e-8, weight decay 0.01.

* ``fsdp_adamw``: AdamW on everything (the baseline of the ratios);
* ``dmuon``: ``dmuon.dedicate_params`` before ``fully_shard``, then ``dmuon.Muon`` (its default NS forms);
* ``torchtitan_distmuon``: torchtitan's DistMuon (``torchtitan.distributed.flex_shard.build_dist_muon``): each
  2-D matrix ``Owned`` on the ``dp_shard`` mesh axis, experts ``Shard(0)``, one bucket per decoder layer.
  CUDA only (it refuses other devices); ``pip install 'dmuon[torchtitan]'``;
* ``dion_muon``: ``dion.Muon`` (github.com/microsoft/dion; not on the package index: install its wheel) on
  the FSDP2 DTensors, given torch's bf16 Newton-Schulz form with the coefficients above through its
  ``newton_schulz_func`` (its default, Polar Express, is another polynomial: its update differs by more than
  rounding), one param group per lr scale (its own ``adjust_lr`` rules are not torch's);
* ``perturbed_dmuon`` (a control, agreement only): dmuon with twice the learning rate, which the agreement
  check must flag, or it cannot tell the variants apart.

A variant whose package is missing (or that needs CUDA on the CPU) is skipped with a line saying why.

1. Agreement: dmuon, dmuon again with its other 16-bit Newton-Schulz arithmetic (the noise floor), each other
   Muon variant and the control train ``--agree-steps`` steps from the same weights on the same batches;
   rank 0 compares each Muon matrix with dmuon's (relative Frobenius error) and flags what is over the
   bf16-noise bound of [Note: agreement bound] in dmuon/tools/side_by_side.py (three times the larger of the
   noise floor's error on that matrix and an analytic bound).
2. Timing: ``--rounds`` rounds, each building and timing every variant once in an order rotated by one:
   ``--warmup`` steps, ``--steps`` steps synchronised at the phase boundaries (forward, backward, optimizer:
   their medians), ``--steps`` whole steps synchronised only before the first and after the last (``step``:
   their mean), then one step whose collectives are counted (bytes per rank by kind: the size of the buffer
   each collective covers, as nccl-tests count it). Times and peak memory are the slowest rank's; the table
   gives the medians over the rounds.

Writes DIR/side_by_side.json, DIR/side_by_side.txt and, with matplotlib, DIR/side_by_side.png (rank 0).
Exits 1 when a Muon variant disagrees with dmuon or the control is not flagged. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import dmuon
from dmuon.tools.bench import smoke_run_note
from dmuon.tools.launch import free_port
from dmuon.tools.presets import canonical_preset
from dmuon.tools.side_by_side import (PRESET_NAMES, CollectiveCounter, build_model, matrix_agreement,
                                      summarize_agreement)

KJ = (3.4445, -4.7750, 2.0315)
LR, MOMENTUM, EPS, NS_STEPS = 0.02, 0.95, 1e-7, 5
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
MESH_AXIS = "dp_shard"  # DistMuon reads the mesh axis by name
REFERENCE, FLOOR = "dmuon", "noise_floor"


# --------------------------------------------------------------------------------------------------- #
# Variants                                                                                              #
# --------------------------------------------------------------------------------------------------- #
class _Pair:
    """Muon on the Muon matrices and AdamW on the rest, stepped as one optimizer."""

    def __init__(self, *opts: Any) -> None:
        self.opts = opts

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def _adamw(params: list[nn.Parameter], device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **ADAMW, **({"fused": True} if device.type == "cuda" else {}))


def _shard(model: nn.Module, mesh) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _split(model: nn.Module, muon: set[str]) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if n in muon], [p for n, p in named if n not in muon]


def _lr_scale(p: torch.Tensor) -> float:
    """torch.optim.Muon's ``adjust_lr_fn="original"`` of one matrix (an expert's for a 3-D param)."""
    rows, cols = p.shape[-2:]
    return math.sqrt(max(1.0, rows / cols))


def build_fsdp_adamw(model: nn.Module, muon: set[str], mesh, device: torch.device) -> Any:
    _shard(model, mesh)
    return _adamw(list(model.parameters()), device)


def build_dmuon(model: nn.Module, muon: set[str], mesh, device: torch.device, lr_factor: float = 1.0,
                ns_backend: str = "auto") -> Any:
    dmuon.dedicate_params(model, mesh, lambda n, p: n in muon, verbose=False)
    _shard(model, mesh)
    return dmuon.Muon(model, lr=LR * lr_factor, momentum=MOMENTUM, nesterov=True, ns_steps=NS_STEPS,
                      ns_coefficients=KJ, eps=EPS, weight_decay=0.0, adjust_lr_fn="original",
                      adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                      adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"],
                      adamw_fused=True if device.type == "cuda" else None, ns_backend=ns_backend)


def build_distmuon(model: nn.Module, muon: set[str], mesh, device: torch.device) -> Any:
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon

    _shard(model, mesh)
    mine, rest = _split(model, muon)
    owned, per_expert = ComputeLayout({MESH_AXIS: Owned()}), ComputeLayout({MESH_AXIS: Shard(0)})
    layouts = {n: per_expert if p.ndim == 3 else owned for n, p in mine}
    buckets = [BucketConfig(patterns=(f"layers.{i}.*",), name=f"layers.{i}") for i in range(len(model.layers))]
    opt = build_dist_muon([{"params": [p for _, p in mine], "param_names": [n for n, _ in mine]}],
                          compute_sharding_by_fqn=layouts, bucket_configs=buckets, lr=LR, weight_decay=0.0,
                          momentum=MOMENTUM, nesterov=True, ns_coefficients=KJ, eps=EPS, ns_steps=NS_STEPS,
                          adjust_lr_fn="original")
    return _Pair(opt, _adamw(rest, device))


def torch_form_ns(G: torch.Tensor, epsilon: float | torch.Tensor = EPS) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz iteration (bf16, the input scaled to unit Frobenius norm, a tall
    matrix transposed) over a batch of matrices: dion's ``newton_schulz_func`` for ``dion_muon``."""
    a, b, c = KJ
    X = G.to(torch.bfloat16)
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (torch.clamp_min(norm, epsilon.to(norm)) if isinstance(epsilon, torch.Tensor) else norm.clamp_min(epsilon))
    for _ in range(NS_STEPS):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.mT if tall else X


def build_dion(model: nn.Module, muon: set[str], mesh, device: torch.device) -> Any:
    import dion

    _shard(model, mesh)
    mine, rest = _split(model, muon)
    by_scale: dict[float, list[nn.Parameter]] = {}
    for _, p in mine:
        by_scale.setdefault(_lr_scale(p), []).append(p)
    groups = [{"params": ps, "lr": LR * s} for s, ps in sorted(by_scale.items())]
    opt = dion.Muon(groups, distributed_mesh=mesh, lr=LR, mu=MOMENTUM, weight_decay=0.0, epsilon=EPS, nesterov=True,
                    adjust_lr=None, flatten=False, use_polar_express=False, newton_schulz_func=torch_form_ns)
    return _Pair(opt, _adamw(rest, device))


def _missing(module: str, install: str, cuda: bool = False) -> Callable[[torch.device], str | None]:
    """A variant's ``why_not``: ``module`` does not import (or, with ``cuda``, the device is not a GPU)."""
    def why_not(device: torch.device) -> str | None:
        if cuda and device.type != "cuda":
            return "CUDA only (DistMuon refuses parameters on any other device)"
        try:
            __import__(module)
        except ImportError as e:
            return f"{module} does not import ({e}): {install}"
        except Exception as e:  # noqa: BLE001 - installed, but not for this torch: say so and run the others
            return f"{module} is installed but fails to import: {type(e).__name__}: {e}"
        return None

    return why_not


@dataclass(frozen=True)
class Variant:
    name: str
    build: Callable[..., Any]
    #: why this variant cannot run on ``device`` (``None``: it can)
    why_not: Callable[[torch.device], str | None] = lambda device: None
    muon: bool = True
    control: bool = False
    #: it calls ``dmuon.dedicate_params``
    dmuon: bool = False


VARIANTS = {v.name: v for v in (
    Variant("fsdp_adamw", build_fsdp_adamw, muon=False),
    Variant("dmuon", build_dmuon, dmuon=True),
    Variant("torchtitan_distmuon", build_distmuon,
            _missing("torchtitan.distributed.flex_shard", "pip install 'dmuon[torchtitan]'", cuda=True)),
    Variant("dion_muon", build_dion,
            _missing("dion", "not on the package index: pip install the wheel built from github.com/microsoft/dion")),
    Variant("perturbed_dmuon", lambda *a: build_dmuon(*a, lr_factor=2.0), control=True, dmuon=True),
    # the agreement check's noise floor: dmuon with its other 16-bit Newton-Schulz arithmetic (torch's bf16 form
    # where dmuon's own are fp16, on a GPU; fp16 on the CPU, where its own is bf16)
    Variant("noise_floor", lambda *a: build_dmuon(*a, ns_backend="direct" if a[3].type == "cuda" else "direct_fp16"),
            dmuon=True),
)}
DEFAULT_VARIANTS = ("fsdp_adamw", "dmuon", "torchtitan_distmuon", "dion_muon")
CHOICES = tuple(v for v in VARIANTS if v != FLOOR)


# --------------------------------------------------------------------------------------------------- #
# Runs                                                                                                  #
# --------------------------------------------------------------------------------------------------- #
@dataclass
class Run:
    """What every build of this run shares."""

    preset: str
    device: torch.device
    dtype: torch.dtype
    mesh: Any
    x: torch.Tensor
    y: torch.Tensor

    def build(self, variant: str) -> tuple[nn.Module, Any, list[str]]:
        """A fresh model of the preset, wrapped and given its optimizer by ``variant``, and the names of
        its Muon matrices."""
        model, predicate = build_model(self.preset, self.device, self.dtype)
        muon = [n for n, p in model.named_parameters() if predicate(n, p)]
        return model, VARIANTS[variant].build(model, set(muon), self.mesh, self.device), muon

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, model: nn.Module, opt: Any) -> None:
        opt.zero_grad()
        model(self.x, self.y).loss.backward()
        opt.step()


def _say(*parts: Any) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def _release(run: Run) -> None:
    """After the caller dropped a build: free it (FSDP2's hooks hold cycles) before the next one."""
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()


def full_weights(model: nn.Module, names: list[str], dedicated: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each named matrix whole on rank 0 (``None`` on the others), in ``names`` order; ``dedicated``: the model
    went through ``dmuon.dedicate_params``. Collective."""
    if dedicated:
        full = dmuon.get_model_state_dict(model, rank0_only=True, checksums=False)
        for n in names:
            yield n, full.get(n)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            p = params[n]
            value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            yield n, value if dist.get_rank() == 0 else None


def _snapshot(model: nn.Module, names: list[str], variant: str) -> dict[str, torch.Tensor]:
    """The named matrices whole on rank 0's CPU (empty elsewhere)."""
    return {n: w.cpu() for n, w in full_weights(model, names, VARIANTS[variant].dmuon) if w is not None}


def agreement_phase(run: Run, variants: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """dmuon, its noise floor, then every other Muon variant and control, ``steps`` steps each from the same
    weights; rank 0 compares each with dmuon ([Note: agreement bound] in dmuon/tools/side_by_side.py)."""
    others = [v for v in variants if VARIANTS[v].muon and v != REFERENCE]
    out: dict[str, dict[str, Any]] = {REFERENCE: {"reference": True}}
    init: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    floor: dict[str, float] = {}
    for v in [REFERENCE, FLOOR, *others]:
        _say(f"[agreement] {v}: {steps} steps ...")
        model, opt, names = run.build(v)
        if v == REFERENCE:
            init = _snapshot(model, names, v)
        for _ in range(steps):
            run.step(model, opt)
        rows = []
        for n, w in full_weights(model, names, VARIANTS[v].dmuon):
            if w is None:
                continue
            if v == REFERENCE:
                want[n] = w.cpu()
            else:
                rows.append(matrix_agreement(n, init[n].to(w.device), want[n].to(w.device), w, floor.get(n, 0.0)))
        if rows:
            out[v] = summarize_agreement(rows)
        if v == FLOOR and rows:  # the measure of the others' noise, not a variant with a verdict of its own
            floor = {r.name: r.error for r in rows}
            out[v] = {"floor": True, **{k: out[v][k] for k in ("error", "of_update", "matrices", "rows")}}
        del model, opt
        _release(run)
    return out if dist.get_rank() == 0 else {}


def time_variant(run: Run, variant: str, warmup: int, steps: int) -> dict[str, Any]:
    """One build of ``variant``: phase times, whole-step time, peak memory and one step's collectives."""
    model, opt, _ = run.build(variant)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    phases: dict[str, list[float]] = {"forward_ms": [], "backward_ms": [], "optimizer_ms": []}
    for i in range(warmup + steps):
        opt.zero_grad()
        run.sync()
        t0 = time.perf_counter()
        loss = model(run.x, run.y).loss
        run.sync()
        t1 = time.perf_counter()
        loss.backward()
        run.sync()
        t2 = time.perf_counter()
        opt.step()
        run.sync()
        t3 = time.perf_counter()
        if i >= warmup:
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[key].append(1e3 * dt)
    t = time.perf_counter()
    for _ in range(steps):
        run.step(model, opt)
    run.sync()
    whole = 1e3 * (time.perf_counter() - t) / steps
    with CollectiveCounter() as counter:
        run.step(model, opt)
        run.sync()
    peak = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else float("nan")
    mine = torch.tensor([statistics.median(v) for v in phases.values()] + [whole, peak], dtype=torch.float64,
                        device=run.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict())
    del model, opt
    _release(run)
    fwd, bwd, opt_ms, step, peak = mine.tolist()
    kinds = sorted({k for counts in per_rank for k in counts})
    return {"forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": opt_ms, "step_ms": step,
            "peak_gib": None if math.isnan(peak) else peak,
            "bytes_per_rank": {k: max(c.get(k, {"bytes": 0})["bytes"] for c in per_rank) for k in kinds},
            "calls_per_rank": {k: max(c.get(k, {"calls": 0})["calls"] for c in per_rank) for k in kinds},
            "bytes_by_rank": [sum(v["bytes"] for v in c.values()) for c in per_rank]}


def timing_phase(run: Run, variants: list[str], rounds: int, warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    """Every variant once per round, built fresh, in an order rotated by one each round; medians over rounds."""
    per_round: list[dict[str, dict[str, Any]]] = []
    for rnd in range(rounds):
        order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
        timings = {}
        for i, v in enumerate(order):
            _say(f"[round {rnd + 1}/{rounds}, {i + 1}/{len(order)}] {v} ...")
            timings[v] = time_variant(run, v, warmup, steps)
        per_round.append(timings)
    out = {}
    for v in variants:
        rs = [r[v] for r in per_round]
        med = {k: statistics.median(r[k] for r in rs) for k in ("forward_ms", "backward_ms", "optimizer_ms", "step_ms")}
        peaks = [r["peak_gib"] for r in rs if r["peak_gib"] is not None]
        out[v] = {**med, "peak_gib": max(peaks) if peaks else None, "step_ms_rounds": [r["step_ms"] for r in rs],
                  **{k: rs[-1][k] for k in ("bytes_per_rank", "calls_per_rank", "bytes_by_rank")}}
    return out


# --------------------------------------------------------------------------------------------------- #
# Report                                                                                                #
# --------------------------------------------------------------------------------------------------- #
KIND_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC", "reduce": "RD",
              "all_to_all": "A2A", "send_recv": "P2P"}


def _agreement_cell(a: dict[str, Any] | None) -> str:
    if a is None:
        return "-"
    if a.get("reference"):
        return "reference"
    w = a["worst"]
    return f"{w['error']:.1e} / tol {w['tolerance']:.1e} {'FLAGGED' if a['flagged'] else 'ok'}"


def report(out: dict[str, Any]) -> tuple[list[str], int]:
    """The text table and verdict lines, and the exit status (1: a Muon variant disagrees or the control
    was not flagged)."""
    timing, agree = out["timing"], out["agreement"]
    base = timing.get("fsdp_adamw", {}).get("step_ms")
    lines = [f"{out['preset']} on {out['world_size']} x {out['device']} ({out['dtype']}, {out['batch']} x {out['seq']} "
             f"tokens per rank), medians of {out['rounds']} rounds; times and peak: the slowest rank's; MiB: per rank "
             "and step, by collective",
             f"{'variant':<20} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8} {'step ms':>8} {'x adamw':>7} "
             f"{'peak GiB':>8}  "
             f"{'MiB per rank':<34} agreement with {REFERENCE} after {out['agree_steps']} steps (worst matrix)"]
    for v, t in timing.items():
        mib = " ".join(f"{KIND_SHORT.get(k, k)} {b / 2**20:.3g}" for k, b in t["bytes_per_rank"].items() if b) or "none"
        peak = f"{t['peak_gib']:8.2f}" if t["peak_gib"] is not None else "       -"
        ratio = f"{t['step_ms'] / base:7.2f}" if base else "      -"
        lines.append(f"{v:<20} {t['forward_ms']:8.2f} {t['backward_ms']:8.2f} {t['optimizer_ms']:8.2f} "
                     f"{t['step_ms']:8.2f} {ratio} {peak}  {mib:<34} {_agreement_cell(agree.get(v))}")
    for v, why in out["skipped"].items():
        lines.append(f"{v:<20} skipped: {why}")
    checked = {v: a for v, a in agree.items() if v not in (REFERENCE, FLOOR)}
    if FLOOR in agree:
        f = agree[FLOOR]
        lines.append(f"noise floor (dmuon, its other 16-bit NS arithmetic): error {f['error']:.2e} over all Muon "
                     f"matrices, {f['of_update']:.1%} of the distance they moved")
    for v, a in checked.items():
        if VARIANTS[v].control:
            w = a["worst"]
            verdict = ("flagged, as it must be" if a["flagged"] else
                       "NOT FLAGGED: the check cannot tell variants apart here")
            lines.append(f"control {v} (lr x 2): worst {w['name']} error {w['error']:.2e}, {w['ratio']:.1f}x its "
                         f"tolerance: {verdict}")
    wrong = [v for v, a in checked.items() if a["flagged"] != VARIANTS[v].control]
    muons = [v for v in checked if not VARIANTS[v].control]
    if muons:
        worst = max(muons, key=lambda v: checked[v]["worst"]["ratio"])
        w = checked[worst]["worst"]
        disagree = [v for v in wrong if not VARIANTS[v].control]
        lines.append(f"agreement: {'DISAGREE: ' + ', '.join(disagree) if disagree else 'all agree'} (worst: {worst}, "
                     f"{w['ratio']:.2f}x its tolerance on {w['name']})")
    return lines, 1 if wrong else 0


def chart(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing = out["timing"]
    names = list(timing)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(names)
    for label, key in (("forward", "forward_ms"), ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        vals = [timing[v][key] for v in names]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.scatter(names, [timing[v]["step_ms"] for v in names], color="black", marker="_", s=600, zorder=3,
               label="whole step")
    ax.set_ylabel("ms (medians over rounds; phases synchronised)")
    ax.legend(fontsize=8)
    kinds = sorted({k for v in names for k in timing[v]["bytes_per_rank"]})
    bottom = [0.0] * len(names)
    for k in kinds:
        vals = [timing[v]["bytes_per_rank"].get(k, 0) / 2**20 for v in names]
        bx.bar(names, vals, bottom=bottom, label=k)
        bottom = [b + x for b, x in zip(bottom, vals)]
    bx.set_ylabel("MiB per rank and step")
    if kinds:
        bx.legend(fontsize=8)
    for a in (ax, bx):
        a.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(f"{out['preset']} on {out['world_size']} x {out['device']}, {out['dtype']}, {out['batch']} x "
                 f"{out['seq']} tokens per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- #
# Main                                                                                                  #
# --------------------------------------------------------------------------------------------------- #
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", type=canonical_preset, choices=PRESET_NAMES, default="tiny", metavar="NAME",
                    help=f"model: one of {', '.join(PRESET_NAMES)} (1b, 3b, 8b: the Llama ones; default tiny)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of {', '.join(CHOICES)} (default: {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--controls", default="perturbed_dmuon",
                    help="agreement-only variants the check must flag (default perturbed_dmuon; '' for none)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank (default 2 for tiny presets, else 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 32 for tiny presets, else 512)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="params (default bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--agree-steps", type=int, default=3, help="steps before the agreement check (0: no check)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per build, phase-timed and whole each")
    ap.add_argument("--out", default=None, metavar="DIR", help="write side_by_side.{json,txt,png} there (rank 0)")
    args = ap.parse_args(argv)
    tiny = args.preset in ("tiny", "moe-tiny")
    args.batch = args.batch or (2 if tiny else 4)
    args.seq = args.seq or (32 if tiny else 512)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    unknown = [v for v in args.variants.split(",") + args.controls.split(",") if v and v not in CHOICES]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(CHOICES)}")
    return args


def _start(device: torch.device) -> bool:
    """Join torchrun's process group, or start a one-rank one; ``True`` if this call started it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    started = _start(device)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(MESH_AXIS,))
    model, _ = build_model(args.preset, torch.device("meta"), dtype)  # for the vocabulary only
    vocab = model.lm_head.out_features
    del model
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own batch, the same for all
    tok = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    run = Run(args.preset, device, dtype, mesh, tok[:, :-1], tok[:, 1:])
    wanted = [v for v in args.variants.split(",") if v]
    controls = [v for v in args.controls.split(",") if v]
    skipped = {v: why for v in wanted + controls if (why := VARIANTS[v].why_not(device))}
    for v, why in skipped.items():
        _say(f"skipped {v}: {why}")
    variants = [v for v in wanted if v not in skipped]
    out: dict[str, Any] = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                           "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "world_size": world,
                           "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "warmup": args.warmup,
                           "steps": args.steps, "agree_steps": args.agree_steps, "skipped": skipped,
                           "hyperparameters": {"muon": {"lr": LR, "momentum": MOMENTUM, "nesterov": True,
                                                        "ns_coefficients": KJ, "ns_steps": NS_STEPS, "eps": EPS,
                                                        "adjust_lr_fn": "original", "weight_decay": 0.0},
                                               "adamw": ADAMW}}
    checked = variants + [v for v in controls if v not in skipped]
    out["agreement"] = agreement_phase(run, checked, args.agree_steps) if args.agree_steps > 0 else {}
    out["timing"] = timing_phase(run, variants, args.rounds, args.warmup, args.steps) if variants else {}
    status = 0
    if dist.get_rank() == 0:
        lines, status = report(out)
        lines += smoke_run_note(device.type, world, args.preset if args.preset not in ("tiny", "moe-tiny") else "tiny")
        print("\n" + "\n".join(lines), flush=True)
        if args.out:
            _write(out, lines, args.out)
    flag = torch.tensor([status], device=device)
    dist.broadcast(flag, src=0)
    dist.barrier()
    if started:
        dist.destroy_process_group()
    return int(flag.item())


def _write(out: dict[str, Any], lines: list[str], where: str) -> None:
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "side_by_side.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(where, "side_by_side.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        chart(out, os.path.join(where, "side_by_side.png"))
    except ImportError:
        print("matplotlib not installed: no side_by_side.png", flush=True)
    print(f"wrote {where}/side_by_side.{{json,txt}}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
