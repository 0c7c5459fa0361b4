"""``python -m dmuon.bench``: step-time breakdown of dmuon against its baselines, in one run.

    python -m dmuon.bench --preset tiny                     # CPU smoke run (one process)
    python -m dmuon.bench --preset llama3.2-1b --out results/   # one GPU
    torchrun --nproc_per_node 8 -m dmuon.bench --preset llama3-8b   # 8 GPUs
    python -m dmuon.bench --preset llama3-8b --simulate-world-size 8   # busiest owner's optimizer step
    torchrun --nproc_per_node 4 -m dmuon.bench --preset llama3.2-1b --replicate 2   # HSDP: 2 x 2

Variants, all on the same Llama-shaped model (random init, synthetic tokens) in the same process run:

* ``fsdp_adamw``: FSDP2 per layer + root, ``torch.optim.AdamW`` on everything (the baseline of ratios);
* ``naive_fsdp_muon``: FSDP2 on everything, Muon by all-gathering each projection gradient and running
  NS on every rank;
* ``torch_muon``: no sharding, ``torch.optim.Muon`` + ``torch.optim.AdamW`` (each rank alone);
* ``dmuon_z3`` / ``dmuon_z2``: dmuon.

``--replicate R`` runs every sharded variant as HSDP on an ``(R, W // R)`` ``("replicate", "shard")`` mesh
(FSDP2 on the 2-D mesh; dmuon with ``replicate_mesh``, publishing updates asynchronously unless
``--replicate-async off``); ``torch_muon`` is unchanged.

Forward, backward and optimizer times are medians over the timed steps, measured with device
synchronisation at the phase boundaries (benchmark only). Those synchronisations also wait for work meant to
overlap the next step (dmuon's asynchronous HSDP publish), so ``e2e_ms`` is measured separately: the mean of
``--e2e-steps`` further full steps with one synchronisation before the first and after the last. Ratios
(``ratio`` of ``step_ms``, ``e2e_ratio`` of ``e2e_ms``) are against ``fsdp_adamw`` of the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .launch import free_port, quiet_closed_stdout
from .presets import PRESET_ALIASES, PRESETS, canonical_preset
from .timing import median_ms

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["main", "BENCH_PRESETS", "build_model"]

class _Presets(dict):
    """``BENCH_PRESETS``: keyed by the names ``python -m dmuon.plan`` uses; the old short keys (``"1b"``)
    still look up the same entry, so scripts that index it keep working."""

    def __missing__(self, key: str) -> tuple[int, int, int, int, int, int]:
        if key in PRESET_ALIASES:
            return self[PRESET_ALIASES[key]]
        raise KeyError(key)


#: preset -> (dim, intermediate, layers, heads, kv_heads, vocab): dmuon.tools.presets' shapes (``tiny`` first)
BENCH_PRESETS: dict[str, tuple[int, int, int, int, int, int]] = _Presets(
    {name: (s.hidden, s.intermediate, s.layers, s.heads, s.kv_heads, s.vocab) for name, s in PRESETS.items()})
VARIANTS = ("fsdp_adamw", "naive_fsdp_muon", "torch_muon", "dmuon_z3", "dmuon_z2")
#: one line per variant, for --help
_VARIANT_HELP = {
    "fsdp_adamw": "FSDP2 per layer + root, AdamW on everything (the baseline of the ratios)",
    "naive_fsdp_muon": "FSDP2 on everything; Muon all-gathers each projection gradient and runs NS on every rank",
    "torch_muon": "no sharding: torch.optim.Muon + AdamW, each rank alone",
    "dmuon_z3": "dmuon, weights freed after forward (reshard_after_forward=True)",
    "dmuon_z2": "dmuon, weights kept from forward to backward (reshard_after_forward=False)",
}
KJ = (3.4445, -4.7750, 2.0315)


@dataclass
class Timing:
    variant: str
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    e2e_ms: float  # mean full step without per-phase synchronisation (see the module docstring)
    peak_mem_gib: float | None

    @property
    def step_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.optimizer_ms


def _say(*parts: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replicate_error(world: int, replicate: int) -> str | None:
    """Why ``--replicate`` cannot split ``world`` ranks into an HSDP grid (``None`` if it can); checked
    before any process group exists so a bad flag fails with a usage message, not a mesh error."""
    if replicate < 1:
        return f"--replicate must be at least 1, got {replicate}"
    if world % replicate:
        return f"--replicate {replicate} does not divide the world size {world}"
    return None


def make_mesh(device_type: str, world: int, replicate: int = 1) -> DeviceMesh:
    """The run's data-parallel mesh: 1-D over every rank, or HSDP's ``(replicate, shard)`` grid."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicate == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The bench's Llama-shaped model of ``preset`` on ``device`` in ``dtype``: the same weights in every
    process and build (seed 0, initialised on ``device``); no parallelism yet."""
    from .models import TinyLlama, TinyLlamaConfig

    dim, inter, layers, heads, kv, vocab = BENCH_PRESETS[preset]
    cfg = TinyLlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                          hidden_dim=inter, max_seq_len=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyLlama(cfg)
    return model.to(dtype)


_model = build_model  # the name tests/test_plan.py imports


def _is_proj(name: str, p: nn.Parameter) -> bool:
    return p.ndim == 2 and "proj" in name


def _adamw_kw(device: torch.device) -> dict[str, Any]:
    """Every variant's AdamW uses torch's fused kernel on CUDA (its fastest), the default elsewhere."""
    return {"fused": True} if device.type == "cuda" else {}


class _NaiveFSDPMuon:
    """The approach dmuon replaces: all-gather each projection gradient, NS on every rank, keep the shard.
    Gathers and re-shards with each param's own mesh and placements, so HSDP's 2-D DTensors work too."""

    def __init__(self, model: nn.Module, lr: float, adamw_lr: float) -> None:
        from torch.distributed.tensor import distribute_tensor

        from ..optim import MuonHParams, muon_update_

        self._distribute, self._update = distribute_tensor, muon_update_
        self._hp = MuonHParams(lr=lr, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients=KJ,
                               eps=1e-7)
        self.muon = [p for n, p in model.named_parameters() if _is_proj(n, p)]
        self.adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if not _is_proj(n, p)], lr=adamw_lr,
                                       **_adamw_kw(next(model.parameters()).device))
        self.lr, self.bufs = lr, {}

    def zero_grad(self) -> None:
        for p in self.muon:
            p.grad = None
        self.adamw.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        for p in self.muon:
            g = p.grad.full_tensor()
            full = p.full_tensor()
            buf = self.bufs.setdefault(p, torch.zeros_like(g))
            self._update(full, g, buf, self._hp)
            p.to_local().copy_(self._distribute(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        self.adamw.step()


def _layer_norm_route(route: str) -> Any:
    """``--dmuon-norms``: route the 1-D params inside ``layers.N`` (the norms) to ``route``."""
    return lambda fqn, p: route if fqn.startswith("layers.") and p.ndim == 1 else None


def _build(variant: str, preset: str, device: torch.device, dtype: torch.dtype, mesh,
           ns: dict[str, Any] | None = None, dmuon_wrap: str = "layers", *, replicate_async: bool = True,
           prefetch: bool = True, dmuon_norms: str = "fsdp") -> tuple[nn.Module, Any]:
    """One variant's model and optimizer; ``mesh`` is 1-D or the 2-D ``(replicate, shard)`` HSDP grid."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    model = build_model(preset, device, dtype)
    lr, adamw_lr = 0.02, 1e-3
    if variant == "torch_muon":
        muon = [p for n, p in model.named_parameters() if _is_proj(n, p)]
        other = [p for n, p in model.named_parameters() if not _is_proj(n, p)]
        opts = [torch.optim.Muon(muon, lr=lr, ns_coefficients=KJ), torch.optim.AdamW(other, lr=adamw_lr, **_adamw_kw(device))]

        class Both:
            def zero_grad(self) -> None:
                for o in opts:
                    o.zero_grad()

            def step(self) -> None:
                for o in opts:
                    o.step()

        return model, Both()
    if variant.startswith("dmuon"):
        hsdp = mesh.ndim == 2
        dmuon.dedicate_params(model, mesh["shard"] if hsdp else mesh, _is_proj,
                              replicate_mesh=mesh["replicate"] if hsdp else None,
                              reshard_after_forward=variant == "dmuon_z3", prefetch=prefetch,
                              route=None if dmuon_norms == "fsdp" else _layer_norm_route(dmuon_norms),
                              verbose=False)  # built once per round and variant: the bench prints its own lines
    if not variant.startswith("dmuon") or dmuon_wrap == "layers":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
    if not variant.startswith("dmuon") or dmuon_wrap != "none":
        fully_shard(model, mesh=mesh)
    if variant == "fsdp_adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=adamw_lr, **_adamw_kw(device))
    if variant == "naive_fsdp_muon":
        return model, _NaiveFSDPMuon(model, lr, adamw_lr)
    ns = ns or {}
    return model, dmuon.Muon(model, lr=lr, ns_coefficients=ns.get("ns_coefficients", KJ),
                             ns_backend=ns.get("ns_backend", "auto"), adamw_lr=adamw_lr,
                             adamw_fused=_adamw_kw(device).get("fused"), master_dtype=ns.get("master_dtype"),
                             replicate_async=replicate_async)


def _e2e_ms(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> float:
    """Mean full step with a device synchronisation only before the first and after the last, so work that
    overlaps the next step (dmuon's asynchronous HSDP publish) counts only where it is not hidden."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x, y).loss.backward()
        opt.step()
    _sync(device)
    return 1e3 * (time.perf_counter() - t) / steps


def _time_variant(variant: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, mesh) -> Timing:
    model, opt = _build(variant, args.preset, device, dtype, mesh, _ns_options(args), args.dmuon_wrap,
                        replicate_async=args.replicate_async == "on", dmuon_norms=args.dmuon_norms)
    vocab = BENCH_PRESETS[args.preset][5]
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    x, y = tok[:, :-1], tok[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd, bwd, opt_t = [], [], []
    for step in range(args.warmup + args.steps):
        opt.zero_grad()
        _sync(device)
        t0 = time.perf_counter()
        loss = model(x, y).loss
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        _sync(device)
        t3 = time.perf_counter()
        if step >= args.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            opt_t.append(t3 - t2)
    e2e = _e2e_ms(model, opt, x, y, args.e2e_steps, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if variant.startswith("dmuon"):
        import dmuon

        dmuon.wait_all_replicate_broadcasts(model)  # no publish left in flight when the model goes
    del model, opt
    return Timing(variant, 1e3 * statistics.median(fwd), 1e3 * statistics.median(bwd),
                  1e3 * statistics.median(opt_t), e2e, peak)


def _simulate(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The most loaded owner's Muon step under the real W-rank plan vs torch's NS on all matrices / W."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from ..optim import MuonHParams, muon_update_batch_
    from ..partition import assign_owners
    from .presets import projection_specs

    specs = projection_specs(args.preset)
    plan = assign_owners(specs, args.simulate_world_size)
    if args.simulate_world_size > len(specs):
        _say(f"warning: {args.simulate_world_size} ranks but only {len(specs)} dedicated matrices: "
             f"{args.simulate_world_size - len(specs)} ranks own none, and the busiest owner's NS (one matrix at "
             f"least) is a floor that more ranks cannot lower")
    busiest = max(plan.ranks, key=lambda r: r.cost)
    shape_of = {s.fqn: s.shape for s in specs}
    gen = torch.Generator(device=device).manual_seed(0)

    def mats(fqns: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(torch.randn(shape_of[f], device=device, dtype=torch.bfloat16, generator=gen),
                 torch.randn(shape_of[f], device=device, dtype=torch.bfloat16, generator=gen),
                 torch.zeros(shape_of[f], device=device, dtype=torch.bfloat16)) for f in fqns]

    def timed(fn: Callable[[], object]) -> float:
        return median_ms(fn, reps=args.steps)

    _say(f"[1/2] dmuon: the busiest owner's Muon step ({len(busiest.fqns)} matrices, rank {busiest.rank} of "
         f"{args.simulate_world_size}) ...")
    owned = mats(list(busiest.fqns))
    by_shape: dict[tuple, list] = {}
    for w, g, b in owned:  # as dmuon.Muon.step groups them
        by_shape.setdefault(tuple(w.shape), []).append((w, g, b))
    ns = _ns_options(args)
    hp = MuonHParams(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                     ns_coefficients=ns["ns_coefficients"], eps=1e-7, ns_backend=ns["ns_backend"])
    dmuon_ms = timed(lambda: [muon_update_batch_([w for w, _, _ in grp], [g for _, g, _ in grp], [b for _, _, b in grp], hp)
                              for grp in by_shape.values()])
    owned.clear()  # free the busiest owner's matrices before torch's pass (the lambda above is done with them)
    by_shape.clear()
    _say(f"[2/2] torch.optim.Muon's NS on all {len(specs)} matrices ...")
    everything = [g for _, g, _ in mats([s.fqn for s in specs])]
    torch_ms = timed(lambda: [_zeropower_via_newtonschulz(g, KJ, 5, 1e-7) for g in everything])
    return {"world_size": args.simulate_world_size, "busiest_rank": busiest.rank, "busiest_params": len(busiest.fqns),
            "imbalance": plan.imbalance, "dmuon_owner_step_ms": dmuon_ms, "torch_ns_all_ms": torch_ms,
            "torch_ns_share_ms": torch_ms / args.simulate_world_size,
            "ratio": dmuon_ms / (torch_ms / args.simulate_world_size)}


def _ns_options(args: argparse.Namespace) -> dict[str, Any]:
    """dmuon's Newton-Schulz options from the command line (torch's form and coefficients by default)."""
    coefficients: Any = KJ if args.ns_coefficients == "keller_jordan" else args.ns_coefficients
    master = {"none": None, "fp32": torch.float32}[args.master_dtype]
    return {"ns_backend": args.ns_backend, "ns_coefficients": coefficients, "master_dtype": master}


def _chart(results: list[Timing], spread: dict[str, tuple[float, float, float]], base: str, rounds: int,
           path: str, title: str) -> None:
    """Stacked forward / backward / optimizer medians per variant, each bar labelled with its step-time ratio
    to ``base`` and that ratio's quartiles over the rounds (the table's ``ratio [q1-q3]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.variant for r in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(results)
    for label, key in (("forward", "forward_ms"), ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        vals = [getattr(r, key) for r in results]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(results):
        q1, med, q3 = spread[r.variant]
        ax.annotate(f"{med:.2f}x\n[{q1:.2f}-{q3:.2f}]", (i, bottom[i]), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(bottom) * 1.25)
    ax.set_ylabel(f"ms per step (median of {rounds} rounds)")
    ax.set_title(f"{title}\nlabels: step time / {base}'s, median [quartiles] over the rounds", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    variants = "\n".join(f"  {k:<16} {v}" for k, v in _VARIANT_HELP.items())
    parser = argparse.ArgumentParser(
        prog="python -m dmuon.bench",
        description="Forward, backward and optimizer-step times of dmuon and its baselines on one Llama-shaped\n"
                    "model, in one run, as ratios to FSDP2 + AdamW. Runs as one process, or one per GPU\n"
                    "under torchrun.",
        epilog=f"variants:\n{variants}\n\nexamples:\n  python -m dmuon.bench --preset tiny\n"
               "  torchrun --nproc_per_node 8 -m dmuon.bench --preset llama3-8b --out results/\n"
               "  python -m dmuon.bench --preset llama3-8b --simulate-world-size 8",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    aliases = ", ".join(f"{k}={v}" for k, v in PRESET_ALIASES.items())
    parser.add_argument("--preset", type=canonical_preset, choices=list(BENCH_PRESETS), default="tiny", metavar="NAME",
                        help=f"model shape, one of: {', '.join(BENCH_PRESETS)} (short names accepted: {aliases}; "
                             "default tiny, a CPU smoke run)")
    parser.add_argument("--variants", default=",".join(VARIANTS), metavar="A,B,...",
                        help=f"comma-separated variants to time, from: {', '.join(VARIANTS)} (default: all; "
                             "listed below)")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default: 2 tiny, else 4)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 32 tiny, else 512)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps per variant and round; the per-phase times are their medians (default 5)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each builds and times every variant once, in a rotated order, so noise that "
                             "comes and goes over seconds spreads over all of them. Reported: medians over the "
                             "rounds, and each ratio's quartiles over the rounds (vs fsdp_adamw of the same round); default 3")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before the timed ones, per variant and round (default 2)")
    parser.add_argument("--e2e-steps", type=int, default=None,
                        help="full steps timed end to end after the phase-timed ones, synchronised only before "
                             "the first and after the last (e2e_ms; default: --steps)")
    parser.add_argument("--replicate", type=int, default=1,
                        help="HSDP: R replicas x W/R shards ('replicate', 'shard' mesh) for the FSDP2 and dmuon "
                             "variants (default 1: one 1-D mesh over all W ranks)")
    parser.add_argument("--replicate-async", choices=["on", "off"], default="on",
                        help="dmuon variants with --replicate > 1: publish updated weights over the replicate "
                             "group without waiting in step() (Muon(replicate_async=...); default on)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--simulate-world-size", type=int, default=0, metavar="W",
                        help="instead of training: time the busiest owner's Muon step of a W-rank job on this one "
                             "device against torch's NS on all matrices / W (default 0: off)")
    parser.add_argument("--master-dtype", choices=["none", "fp32"], default="none",
                        help="dmuon variants: fp32 master copies of the owned matrices (Muon(master_dtype=...); default "
                             "none)")
    parser.add_argument("--dmuon-wrap", choices=["layers", "root", "none"], default="layers",
                        help="dmuon variants: fully_shard each layer and the root (the recipe), only the root "
                             "(after dedication a layer keeps only its norms, too small to be worth an FSDP unit), "
                             "or nothing (other params replicated, gradients averaged by dmuon like DDP); default layers")
    parser.add_argument("--dmuon-norms", choices=["fsdp", "adamw_owner", "adamw_replicated"], default="fsdp",
                        help="dmuon variants: where the layers' norms go (dedicate_params(route=...)): FSDP2 (the "
                             "recipe), their owners (AdamW there), or replicated; with either of the last two a "
                             "layer holds no FSDP2 params, so pair it with --dmuon-wrap root; default fsdp")
    parser.add_argument("--ns-backend", choices=["direct", "direct_fp16", "gram", "auto"], default="auto",
                        help="dmuon's Newton-Schulz form (default: auto, dmuon.Muon's; direct: torch's)")
    parser.add_argument("--ns-coefficients", choices=["keller_jordan", "polar_express"], default="keller_jordan",
                        help="dmuon's coefficient schedule (default keller_jordan, which torch.optim.Muon always uses)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write DIR/results.json (everything printed, and the settings) and DIR/chart.png (the phase "
                             "times, with each ratio and its quartiles) on rank 0 (default: print only)")
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on this process group (a one-rank group when not under torchrun); returns the exit
    code: 0 on success, also when a reader such as ``head`` stopped reading early (the run goes on quietly)."""
    parser, args = _parse_args(argv)
    quiet_closed_stdout()
    args.batch = args.batch or (2 if args.preset == "tiny" else 4)
    args.seq = args.seq or (32 if args.preset == "tiny" else 512)
    args.e2e_steps = args.steps if args.e2e_steps is None else args.e2e_steps
    if args.e2e_steps < 1:
        parser.error(f"--e2e-steps must be at least 1, got {args.e2e_steps}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    bad = replicate_error(int(os.environ.get("WORLD_SIZE", "1")), args.replicate)
    if bad:
        parser.error(bad)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if use_cuda else "fp32")]
    is_main = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 writes files
    out: dict[str, Any] = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
                           "torch": torch.__version__, "dtype": str(dtype), "batch": args.batch, "seq": args.seq,
                           "ns_backend": args.ns_backend, "ns_coefficients": args.ns_coefficients,
                           "dmuon_wrap": args.dmuon_wrap, "dmuon_norms": args.dmuon_norms,
                           "master_dtype": args.master_dtype,
                           "replicate": args.replicate, "replicate_async": args.replicate_async,
                           "e2e_steps": args.e2e_steps}
    if args.simulate_world_size:
        sim = _simulate(args, device)
        out["simulate"] = sim
        print(f"{args.preset}, simulated world {sim['world_size']}: busiest owner (rank {sim['busiest_rank']}, "
              f"{sim['busiest_params']} matrices) Muon step {sim['dmuon_owner_step_ms']:.1f} ms vs torch NS on all "
              f"matrices / {sim['world_size']} = {sim['torch_ns_share_ms']:.1f} ms -> ratio {sim['ratio']:.2f} "
              f"(imbalance {sim['imbalance']:.3f})")
    else:
        _run_variants(args, variants, device, dtype, out, is_main)
    if args.out and is_main:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "results.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        chart = os.path.join(args.out, "chart.png")
        print(f"wrote {path}" + (f" and {chart}" if os.path.exists(chart) and not args.simulate_world_size else ""),
              flush=True)
    return 0


def _alternate(args: argparse.Namespace, variants: list[str], device: torch.device, dtype: torch.dtype,
               mesh) -> list[dict[str, Timing]]:
    """Every variant once per round, built fresh, in an order rotated by one each round."""
    per_round: list[dict[str, Timing]] = []
    for rnd in range(args.rounds):
        order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
        timings = {}
        for i, v in enumerate(order):
            _say(f"[round {rnd + 1}/{args.rounds}, {i + 1}/{len(order)}] {v} ...")
            timings[v] = _time_variant(v, args, device, dtype, mesh)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        per_round.append(timings)
    return per_round


def _median_timing(variant: str, ts: list[Timing]) -> Timing:
    peaks = [t.peak_mem_gib for t in ts if t.peak_mem_gib is not None]
    return Timing(variant, statistics.median(t.forward_ms for t in ts), statistics.median(t.backward_ms for t in ts),
                  statistics.median(t.optimizer_ms for t in ts), statistics.median(t.e2e_ms for t in ts),
                  max(peaks) if peaks else None)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); one value is its own quartiles."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def _run_variants(args: argparse.Namespace, variants: list[str], device: torch.device, dtype: torch.dtype,
                  out: dict[str, Any], is_main: bool) -> None:
    """Time every variant on this process group (started here when not under torchrun); fill ``out``."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device.type == "cuda":  # device_id binds the NCCL communicator to this rank's GPU (no guessing at barrier())
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    mesh = make_mesh(device.type, dist.get_world_size(), args.replicate)
    out["world_size"] = dist.get_world_size()
    per_round = _alternate(args, variants, device, dtype, mesh)
    results = [_median_timing(v, [rnd[v] for rnd in per_round]) for v in variants]
    base = next((r for r in results if r.variant == "fsdp_adamw"), results[0])
    spread = {v: _quartiles([rnd[v].step_ms / rnd[base.variant].step_ms for rnd in per_round]) for v in variants}
    hsdp = (f", HSDP {args.replicate} x {out['world_size'] // args.replicate}, replicate async "
            f"{args.replicate_async}" if args.replicate > 1 else "")
    _say(f"\n{args.preset} on {out['world_size']} x {out['device']} ({dtype}, batch {args.batch} x {args.seq}"
         f"{hsdp}); ratios vs {base.variant}, median of {len(per_round)} rounds [quartiles]")
    _say(f"{'variant':<16} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8} {'step ms':>8} {'ratio':>6} {'[q1-q3]':>13} "
         f"{'e2e ms':>8} {'e2e r':>6} {'peak GiB':>8}")
    for r in results:
        peak = f"{r.peak_mem_gib:8.2f}" if r.peak_mem_gib is not None else "       -"
        q1, med, q3 = spread[r.variant]
        _say(f"{r.variant:<16} {r.forward_ms:8.2f} {r.backward_ms:8.2f} {r.optimizer_ms:8.2f} {r.step_ms:8.2f} "
             f"{med:6.2f} [{q1:5.2f}-{q3:5.2f}] {r.e2e_ms:8.2f} {r.e2e_ms / base.e2e_ms:6.2f} {peak}")
    for line in smoke_run_note(device.type, out["world_size"], args.preset):
        _say(line)
    out["rounds"] = len(per_round)
    out["results"] = [dict(asdict(r), step_ms=r.step_ms, ratio=spread[r.variant][1], ratio_q1=spread[r.variant][0],
                           ratio_q3=spread[r.variant][2], e2e_ratio=r.e2e_ms / base.e2e_ms) for r in results]
    if args.out and is_main:
        os.makedirs(args.out, exist_ok=True)
        try:
            _chart(results, spread, base.variant, len(per_round), os.path.join(args.out, "chart.png"),
                   f"{args.preset} on {out['world_size']} x {out['device']}{hsdp}: {args.batch} x {args.seq} = "
                   f"{args.batch * args.seq} tokens per rank, {dtype}".replace("torch.", ""))
        except ImportError:
            _say("matplotlib not installed: no chart.png (pip install matplotlib)")
    dist.barrier()
    dist.destroy_process_group()


def smoke_run_note(device_type: str, world: int, preset: str) -> list[str]:
    """What a run on the CPU, on one rank or on the tiny shape cannot say (empty for a run that can)."""
    why = []
    if device_type == "cpu" or preset == "tiny":
        why.append("a tiny model or a CPU run times Python, hook and launch overhead, not the matrix work dmuon "
                   "divides")
    if world == 1:
        why.append("on 1 rank nothing is sharded or sent: dmuon pays its bookkeeping without the Newton-Schulz "
                   "work it spreads over ranks")
    if not why:
        return []
    text = ("note: a smoke run, whose ratios say nothing about speed: " + "; ".join(why) + ". GPU measurements, "
            "with the command behind each: docs/benchmarks.md")
    return textwrap.wrap(text, width=100, subsequent_indent="      ")


if __name__ == "__main__":
    sys.exit(main())
