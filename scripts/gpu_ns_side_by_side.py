"""Newton–Schulz side by side on one GPU: torch.optim.Muon's, dmuon's backends and Dao-AILab's
gram-newton-schulz (when installed), on one rank's share of Llama-3.2-1B and Llama-3.1-8B at 8 ranks.

    python scripts/gpu_ns_side_by_side.py --out DIR [--reps 7] [--coefficients keller_jordan]
        [--variants NAME,NAME] [--shares llama3.1-8b] [--gns-compile | --gns-both] [--quack-full] [--check-kernels] [--no-chart]

For every shape group of a share (a batch of same-shape matrices, as an owner runs them) and variant:
the median time of the batched call, and the relative Frobenius distance of its result to the same
iteration in float64 from the same input (the worst slice of the batch). The share's time is the sum
over its groups. Writes DIR/ns_side_by_side.json, DIR/ns_side_by_side.txt and, with matplotlib,
DIR/ns_side_by_side.png. Not a test.

``dmuon auto (before)`` is ``"auto"`` as it was before the night of 2026-12-01 (commit 585c335: the Gram
polynomial's diagonal rounded twice, the first Gram matrix unscaled, tall inputs copied into a wide layout),
kept here so the old and new arithmetic run side by side in one process.
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
    # not a share: one Llama-3.1-70B MLP matrix, where the first Gram matrix's entries are smallest
    "llama3.1-70b-mlp": [(1, 28672, 8192)],
}


def before_auto(G: torch.Tensor, steps: int, coefficients: str) -> torch.Tensor:
    """``newton_schulz_native(G, steps, coefficients, backend="auto")`` as of commit 585c335 (see the module
    docstring); only the Gram form differs from today's."""
    from dmuon.optim import newton_schulz as ns

    if ns.resolve_backend(G.shape, "auto", device=G.device) != "gram" or steps == 0:
        return newton_schulz_native(G, steps, coefficients, backend="auto")
    schedule = parse_coefficients(coefficients)
    per_step = [schedule[min(k, len(schedule) - 1)] for k in range(steps)]
    transpose = G.shape[-2] > G.shape[-1]
    X = ns._half_normalised(G.mT if transpose else G, DEFAULT_EPS)
    sym = ns._use_symmetric(X, "auto")
    X = X.unsqueeze(0) if X.ndim == 2 else X
    bounds = [0, *range(3, len(per_step), 3), len(per_step)]
    for start, end in zip(bounds, bounds[1:]):
        segment = per_step[start:end]
        A = ns._gram_of(X, sym)
        Q = None
        for j, (a, b, c) in enumerate(segment):
            P = ns._poly(A, b, c, sym)
            P.diagonal(dim1=-2, dim2=-1).add_(a)
            Q = P if Q is None else ns._commuting_product(P, Q, sym)
            if j + 1 < len(segment):
                A = ns._commuting_product(ns._commuting_product(A, P, sym), P, sym)
        X = torch.bmm(Q, X)
    X = X.squeeze(0) if G.ndim == 2 else X
    return X.mT if transpose else X


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


def variants(schedule: list[tuple[float, float, float]], coefficients: str, gns: str,
             quack_full: bool) -> dict[str, Callable]:
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
    out["dmuon auto (before)"] = lambda G: before_auto(G, len(schedule), coefficients)
    from dmuon.optim import _graphs
    from dmuon.optim import newton_schulz as ns

    def auto(G: torch.Tensor) -> torch.Tensor:
        return newton_schulz_native(G, len(schedule), coefficients, backend="auto")

    if quack_full:
        def auto_quack(G: torch.Tensor) -> torch.Tensor:
            ns.QUACK_FULL_PRODUCTS = True
            try:
                return auto(G)
            finally:
                ns.QUACK_FULL_PRODUCTS = False

        out["dmuon auto + quack Q X"] = auto_quack  # the name of the 2026-12-01 (night) measurements
    # what dmuon.Muon runs for groups of at most _graphs.MAX_ELEMENTS (here for every group, to compare)
    out["dmuon auto + CUDA graph"] = lambda G: _graphs.run(auto, G, ("side-by-side", coefficients))
    try:
        from gram_newton_schulz import GramNewtonSchulz

        def make(compiled: bool) -> Callable:
            kw = {} if compiled else {"compile_kwargs": None}  # its default: torch.compile, reduce-overhead
            return GramNewtonSchulz(ns_coefficients=[list(t) for t in schedule],
                                    gram_newton_schulz_reset_iterations=[2], **kw)

        # gram-newton-schulz normalises a float32 input in place: it gets a copy, made outside the timing
        if gns in ("eager", "both"):
            out["gram-newton-schulz (eager)"] = make(False)
        if gns in ("compiled", "both"):
            out["gram-newton-schulz (compiled)"] = make(True)
    except Exception as e:  # noqa: BLE001 - optional: report why it is missing
        print(f"gram-newton-schulz not used: {type(e).__name__}: {e}")
    return out


def check_kernels(dev: torch.device) -> dict:
    """The GPU paths this script relies on, against their torch references: the Triton diagonal kernel of
    the Gram polynomial, and a tall input against its contiguous transpose."""
    from dmuon.optim import _symmetric

    g = torch.Generator(dev).manual_seed(0)
    A = torch.randn(3, 4096, 4096, device=dev, generator=g) / 64
    A = ((A + A.mT) / 2).half()
    P = torch.zeros_like(A)
    _symmetric.poly_diagonal(P, A, 3.4445, -4.775, 2.0315)
    Ad = A.double()
    want = 3.4445 - 4.775 * Ad.diagonal(dim1=-2, dim2=-1) + 2.0315 * (Ad * Ad).sum(-1)
    got = P.diagonal(dim1=-2, dim2=-1).double()
    G = torch.randn(2, 8192, 2048, device=dev, generator=g)
    tall = newton_schulz_native(G, backend="auto")
    wide = newton_schulz_native(G.mT.contiguous(), backend="auto")
    return {"poly_diagonal worst error / |exact| in fp16 units": float(((got - want).abs() / want.abs()).max() * 2**11),
            "poly_diagonal off-diagonal untouched": bool((P - torch.diag_embed(P.diagonal(dim1=-2, dim2=-1))).abs().max() == 0),
            "tall output contiguous": tall.is_contiguous(),
            "tall vs wide relative difference": float((tall.double() - wide.mT.double()).norm() / wide.double().norm())}


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--coefficients", default="keller_jordan")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gns-compile", action="store_true", help="gram-newton-schulz with its torch.compile default")
    ap.add_argument("--gns-both", action="store_true", help="gram-newton-schulz eager and compiled, side by side")
    ap.add_argument("--quack-full", action="store_true",
                    help="also auto with quack's autotuned GEMM for the products that are not symmetric "
                         "(dmuon.optim.newton_schulz.QUACK_FULL_PRODUCTS)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all)")
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--check-kernels", action="store_true", help="check the GPU kernels against torch first")
    ap.add_argument("--shares", default="llama3.2-1b,llama3.1-8b", help=f"comma-separated, of {sorted(SHARES)}")
    ap.add_argument("--gram-restarts", default=None, metavar="FIRST,EVERY",
                    help="experiment: the Gram form's restart schedule (GRAM_FIRST_RESTART, GRAM_RESTART_EVERY)")
    return ap.parse_args()


def _measure(found: dict, shares: dict, schedule: list, args: argparse.Namespace, dev: torch.device) -> list[dict]:
    """Every variant on every shape group, one row each (also appended to rows.jsonl as it comes)."""
    rows = []
    for share, groups in shares.items():
        for shape in groups:
            G = torch.randn(shape, device=dev, generator=torch.Generator(dev).manual_seed(sum(shape)))
            ref = float64_iteration(G, schedule, DEFAULT_EPS)
            for name, fn in found.items():
                try:
                    if name.startswith("gram-newton-schulz"):  # it normalises a float32 input in place
                        H = G.clone()
                        X = fn(H).clone()
                        ms = median_ms(lambda: fn(H), reps=args.reps, warmup=3)
                    else:
                        X = fn(G)
                        ms = median_ms(lambda: fn(G), reps=args.reps, warmup=3)
                    rows.append({"share": share, "shape": list(shape), "variant": name, "ms": ms,
                                 "distance": distance(X, ref)})
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                    rows.append({"share": share, "shape": list(shape), "variant": name, "error": repr(e)[:300]})
                print(json.dumps(rows[-1]), flush=True)
                with open(os.path.join(args.out, "rows.jsonl"), "a") as f:  # kept if a later shape runs out of time
                    f.write(json.dumps(rows[-1]) + "\n")
            del ref
    return rows


def _summarize(rows: list[dict], shares: dict, found: dict) -> tuple[dict, list[str]]:
    """Per share and variant: total ms and worst distance; and the table's lines (ratios to the baselines)."""
    summary = {}
    for share in shares:
        for name in found:
            mine = [r for r in rows if r["share"] == share and r["variant"] == name]
            if mine and all("ms" in r for r in mine):
                summary[f"{share} | {name}"] = {"ms": sum(r["ms"] for r in mine),
                                                "worst_distance": max(r["distance"] for r in mine)}

    def ref_ms(share: str, name: str) -> float | None:
        return summary.get(f"{share} | {name}", {}).get("ms")

    cols = ["torch.optim.Muon", "gram-newton-schulz (eager)", "gram-newton-schulz (compiled)"]
    lines = [f"{'share | variant':48s} {'ms':>9s} {'x torch':>8s} {'x gns eager':>12s} {'x gns compiled':>15s} "
             f"{'worst f64 distance':>19s}"]
    for key, v in summary.items():
        share = key.split(" | ")[0]
        ratios = [v["ms"] / b if (b := ref_ms(share, c)) else float("nan") for c in cols]
        lines.append(f"{key:48s} {v['ms']:9.2f} {ratios[0]:8.3f} {ratios[1]:12.3f} {ratios[2]:15.3f} "
                     f"{v['worst_distance']:19.2e}")
    return summary, lines


def main() -> None:
    args = _parse_args()
    dev = torch.device("cuda")
    if args.gram_restarts:
        from dmuon.optim import newton_schulz as ns_module

        ns_module.GRAM_FIRST_RESTART, ns_module.GRAM_RESTART_EVERY = (int(v) for v in args.gram_restarts.split(","))
    schedule = [parse_coefficients(args.coefficients)[min(k, len(parse_coefficients(args.coefficients)) - 1)]
                for k in range(args.steps)]
    gns = "both" if args.gns_both else "compiled" if args.gns_compile else "eager"
    found = variants(schedule, args.coefficients, gns, args.quack_full)
    if args.variants:
        wanted = args.variants.split(",")
        missing = [w for w in wanted if w not in found]
        if missing:
            print(f"variants not available: {missing}; available: {list(found)}")
        found = {k: v for k, v in found.items() if k in wanted}
    checks = check_kernels(dev) if args.check_kernels else None
    if checks:
        print(json.dumps({"checks": checks}), flush=True)
    shares = {k: SHARES[k] for k in args.shares.split(",")}
    os.makedirs(args.out, exist_ok=True)
    rows = _measure(found, shares, schedule, args, dev)
    summary, lines = _summarize(rows, shares, found)
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "coefficients": args.coefficients,
            "steps": args.steps, "reps": args.reps, "gram_restarts": args.gram_restarts or "default",
            "checks": checks}
    try:
        import gram_newton_schulz
        meta["gram_newton_schulz"] = getattr(gram_newton_schulz, "__version__", "installed")
    except ImportError:
        meta["gram_newton_schulz"] = None
    with open(os.path.join(args.out, "ns_side_by_side.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    text = "\n".join([json.dumps(meta)] + lines)
    with open(os.path.join(args.out, "ns_side_by_side.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    if not args.no_chart:
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
