"""GPU measurement of dmuon's symmetric-product kernel (``dmuon/optim/_symmetric.py``).

    python scripts/gpu_symmetric_kernel.py [--out FILE]        # the kernel alone against torch.bmm(Y, Y.mT) (cuBLAS)
    python scripts/gpu_symmetric_kernel.py --ns [--out FILE]   # newton_schulz(backend="auto") with and without it

Every Newton–Schulz step forms products whose result is symmetric (``X X^T``, ``b A + c A A``); the kernel
computes only the tiles on and above the diagonal, about half the work. The default mode times it on the
shapes of the Llama presets' NS calls. ``--ns`` times ``newton_schulz(backend="auto")`` per shape group with
the kernel and with ``_symmetric.usable`` patched off, and gives each one's distance to the exact (float64)
iteration on two matrices of the shape. Not a test; results in docs/benchmarks.md. (The first version of
this script, commit 9bd4989, also timed tile configurations and the kernel computing every tile.)
"""

from __future__ import annotations

import argparse
import json

import torch

from dmuon.tools.presets import shape_groups
from dmuon.tools.timing import median_ms

#: (batch, m, k): the NS calls of the 1B and 8B presets at one owner holding every matrix of a shape
#: (wide matrices transposed so m <= k), plus the Gram / A A products (k = m)
SHAPES = [(32, 2048, 8192), (48, 2048, 2048), (32, 512, 2048), (32, 4096, 14336), (64, 4096, 4096),
          (64, 1024, 4096), (4, 4096, 4096), (8, 2048, 8192)]


def product_compare() -> list[dict]:
    from dmuon.optim._symmetric import symmetric_product

    rows = []
    for B, M, K in SHAPES:
        Y = torch.randn(B, M, K, device="cuda", dtype=torch.bfloat16)
        r = {"shape": (B, M, K), "cublas_ms": median_ms(lambda: torch.bmm(Y, Y.mT), reps=10),
             "kernel_ms": median_ms(lambda: symmetric_product(Y), reps=10)}
        r["cublas_tflops"] = 2 * B * M * M * K / r["cublas_ms"] / 1e9
        r["kernel_vs_cublas"] = r["kernel_ms"] / r["cublas_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del Y
    return rows


def ns_compare() -> list[dict]:
    from dmuon.optim import _symmetric
    from dmuon.optim.newton_schulz import POLAR_EXPRESS_COEFFICIENTS as PE
    from dmuon.optim.newton_schulz import newton_schulz

    real = _symmetric.usable
    rows = []
    for preset in ("llama3.2-1b", "llama3-8b"):
        for shape, count in shape_groups(preset).items():
            G = torch.randn((count, *shape), device="cuda", dtype=torch.bfloat16)
            r: dict = {"preset": preset, "shape": shape, "batch": count}
            X0 = G[:2].double()
            X0 = X0.mT if shape[0] > shape[1] else X0
            X0 = X0 / X0.norm(dim=(-2, -1), keepdim=True)
            for a, b, c in [PE[min(i, len(PE) - 1)] for i in range(5)]:
                A = X0 @ X0.mT
                X0 = a * X0 + (b * A + c * A @ A) @ X0
            exact = X0.mT if shape[0] > shape[1] else X0
            try:
                for label, on in (("sym", True), ("cublas", False)):
                    _symmetric.usable = real if on else (lambda Y: False)
                    r[f"{label}_ms"] = median_ms(lambda: newton_schulz(G, 5, "polar_express", backend="auto"), reps=10)
                    out = newton_schulz(G[:2], 5, "polar_express", backend="auto").double()
                    r[f"{label}_dist_to_exact"] = ((out - exact).norm() / exact.norm()).item()
            finally:
                _symmetric.usable = real
            r["sym_vs_cublas"] = r["sym_ms"] / r["cublas_ms"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del G
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ns", action="store_true", help="newton_schulz with and without the kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = ns_compare() if args.ns else product_compare()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
