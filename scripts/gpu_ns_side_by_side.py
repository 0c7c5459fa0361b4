"""Newton–Schulz side by side on one GPU: torch.optim.Muon's, dmuon's backends and Dao-AILab's
gram-newton-schulz (when installed), on one rank's share of Llama-3.2-1B and Llama-3.1-8B at 8 ranks.

    python scripts/gpu_ns_side_by_side.py --out DIR [--reps 7] [--coefficients keller_jordan]

For every shape group of a share (a batch of same-shape matrices, as an owner runs them) and variant:
the median time of the batched call, and the relative Frobenius distance of its result to the same
iteration in float64 from the same input (the worst slice of the batch). The share's time is the sum
over its groups. Writes DIR/ns_side_by_side.json, DIR/ns_side_by_side.txt and, with matplotlib,
DIR/ns_side_by_side.png. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from dmuon.optim.newton_schulz import DEFAULT_EPS, newton_schulz_native, parse_coefficients
from dmuon.tools.timing import median_ms

#: one rank's share at 8 ranks: (batch, rows, cols) per shape group
SHARES = {
    "llama3.2-1b": [(4, 2048, 2048), (4, 512, 2048), (4, 8192, 2048), (2, 2048, 8192)],
    "llama3.1-8b": [(8, 4096, 4096), (8, 1024, 4096), (8, 14336, 4096), (4, 4096, 14336)],
}


def float64_iteration(G: torch.Tensor, schedule: list[tuple[float, float, float]], eps: float) -> torch.Tensor:
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def distance(X: torch.Tensor, ref: torch.Tensor) -> float:
    d = (X.double() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))
    return float(d.max())


def variants(schedule: list[tuple[float, float, float]], coefficients: str, gns_compile: bool) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

        a_b_c = schedule[0]
        out["torch.optim.Muon"] = lambda G: torch.stack([torch_ns(g.clone(), a_b_c, len(schedule), DEFAULT_EPS)
                                                         for g in G])
    except ImportError:
        pass
    for backend in ("direct", "direct_fp16", "gram", "auto"):
        out[f"dmuon {backend}"] = (lambda G, b=backend: newton_schulz_native(G, len(schedule), coefficients,
                                                                            backend=b))
    from dmuon.optim import _graphs

    def auto(G: torch.Tensor) -> torch.Tensor:
        return newton_schulz_native(G, len(schedule), coefficients, backend="auto")

    # what dmuon.Muon runs for groups of at most _graphs.MAX_ELEMENTS (here for every group, to compare)
    out["dmuon auto + CUDA graph"] = lambda G: _graphs.run(auto, G, ("side-by-side", coefficients))
    try:
        from gram_newton_schulz import GramNewtonSchulz

        kw = {} if gns_compile else {"compile_kwargs": None}  # its default: torch.compile, reduce-overhead
        gns = GramNewtonSchulz(ns_coefficients=[list(t) for t in schedule], gram_newton_schulz_reset_iterations=[2],
                               **kw)
        out["gram-newton-schulz" + ("" if gns_compile else " (eager)")] = gns
    except Exception as e:  # noqa: BLE001 - optional: report why it is missing
        print(f"gram-newton-schulz not used: {type(e).__name__}: {e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--coefficients", default="keller_jordan")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gns-compile", action="store_true", help="gram-newton-schulz with its torch.compile default")
    ap.add_argument("--shares", default=",".join(SHARES))
    ap.add_argument("--gram-restarts", default=None, metavar="FIRST,EVERY",
                    help="experiment: the Gram form's restart schedule (GRAM_FIRST_RESTART, GRAM_RESTART_EVERY)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.gram_restarts:
        from dmuon.optim import newton_schulz as ns_module

        ns_module.GRAM_FIRST_RESTART, ns_module.GRAM_RESTART_EVERY = (int(v) for v in args.gram_restarts.split(","))
    schedule = [parse_coefficients(args.coefficients)[min(k, len(parse_coefficients(args.coefficients)) - 1)]
                for k in range(args.steps)]
    found = variants(schedule, args.coefficients, args.gns_compile)
    shares = {k: SHARES[k] for k in args.shares.split(",")}
    rows = []
    for share, groups in shares.items():
        for shape in groups:
            G = torch.randn(shape, device=dev, generator=torch.Generator(dev).manual_seed(sum(shape)))
            ref = float64_iteration(G, schedule, DEFAULT_EPS)
            for name, fn in found.items():
                try:
                    X = fn(G)
                    ms = median_ms(lambda: fn(G), reps=args.reps, warmup=3)
                    rows.append({"share": share, "shape": list(shape), "variant": name, "ms": ms,
                                 "distance": distance(X, ref)})
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                    rows.append({"share": share, "shape": list(shape), "variant": name, "error": repr(e)[:300]})
                print(json.dumps(rows[-1]), flush=True)
            del ref
    summary = {}
    for share in shares:
        for name in found:
            mine = [r for r in rows if r["share"] == share and r["variant"] == name]
            if mine and all("ms" in r for r in mine):
                summary[f"{share} | {name}"] = {"ms": sum(r["ms"] for r in mine),
                                                "worst_distance": max(r["distance"] for r in mine)}
    base = {share: summary.get(f"{share} | torch.optim.Muon", {}).get("ms") for share in shares}
    lines = [f"{'share | variant':48s} {'ms':>9s} {'x torch':>8s} {'worst f64 distance':>19s}"]
    for key, v in summary.items():
        b = base[key.split(" | ")[0]]
        lines.append(f"{key:48s} {v['ms']:9.2f} {v['ms'] / b if b else float('nan'):8.3f} {v['worst_distance']:19.2e}")
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "coefficients": args.coefficients,
            "steps": args.steps, "reps": args.reps, "gram_restarts": args.gram_restarts or "default"}
    try:
        import gram_newton_schulz
        meta["gram_newton_schulz"] = getattr(gram_newton_schulz, "__version__", "installed")
    except ImportError:
        meta["gram_newton_schulz"] = None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ns_side_by_side.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    text = "\n".join([json.dumps(meta)] + lines)
    with open(os.path.join(args.out, "ns_side_by_side.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    _chart(summary, meta, os.path.join(args.out, "ns_side_by_side.png"))


def _chart(summary: dict, meta: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = list(summary)
    axes[0].barh(keys, [summary[k]["ms"] for k in keys])
    axes[0].set_xlabel("ms per share (sum over shape groups)")
    axes[1].barh(keys, [summary[k]["worst_distance"] for k in keys])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("worst relative distance to the float64 iteration")
    axes[1].set_yticklabels([])
    fig.suptitle(f"Newton–Schulz, one rank's share at 8 ranks: {meta['device']}, torch {meta['torch']}, "
                 f"{meta['coefficients']} x{meta['steps']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
