"""Experiment (issue 6): does a symmetric-product kernel beat cuBLAS for Newton–Schulz's ``Y Y^T``?

    python scripts/gpu_syrk.py [--check] [--ns]   # on the GPU; --check also runs on CPU via TRITON_INTERPRET=1

Every Newton–Schulz step forms ``X X^T`` and ``A A`` (``A`` symmetric, so ``A A = A A^T``): products whose
result is symmetric. A kernel that computes only the tiles on and above the diagonal and mirrors them does
about half the work. This script times a Triton kernel of that kind against ``torch.bmm(Y, Y.mT)`` (cuBLAS)
and against the same Triton kernel computing every tile (which separates the half-work gain from Triton's
own matmul efficiency), on the shapes of the Llama presets' NS calls. ``--ns`` instead compares
``newton_schulz(backend="auto")`` with and without :mod:`dmuon._symmetric` (the kernel dmuon ships, grown
from this experiment): time and distance to the exact iteration per shape group. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _syrk_kernel(Y, C, pairs, M, K, s_yb, s_ym, s_yk, s_cb, s_cm, s_cn,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, MIRROR: tl.constexpr):
    """One (BLOCK x BLOCK) tile ``(i, j)`` of ``C[b] = Y[b] Y[b]^T``; with MIRROR also its transpose at (j, i)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    i = tl.load(pairs + 2 * pid)
    j = tl.load(pairs + 2 * pid + 1)
    rm = i * BLOCK + tl.arange(0, BLOCK)
    rn = j * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = Y + b * s_yb + rm[:, None] * s_ym + rk[None, :] * s_yk
    b_ptr = Y + b * s_yb + rn[:, None] * s_ym + rk[None, :] * s_yk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = rk[None, :] < K - k * BLOCK_K
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & kmask, other=0.0)
        bb = tl.load(b_ptr, mask=(rn[:, None] < M) & kmask, other=0.0)
        acc = tl.dot(a, tl.trans(bb), acc)
        a_ptr += BLOCK_K * s_yk
        b_ptr += BLOCK_K * s_yk
    out = acc.to(C.dtype.element_ty)
    mask = (rm[:, None] < M) & (rn[None, :] < M)
    tl.store(C + b * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn, out, mask=mask)
    if MIRROR:
        if i != j:
            tl.store(C + b * s_cb + rn[:, None] * s_cm + rm[None, :] * s_cn, tl.trans(out), mask=tl.trans(mask))


def _pairs(tiles: int, triangle: bool, device: torch.device) -> torch.Tensor:
    idx = [(i, j) for i in range(tiles) for j in range(tiles) if not triangle or j >= i]
    return torch.tensor(idx, dtype=torch.int32, device=device).flatten()


def syrk(Y: torch.Tensor, triangle: bool = True, block: int = 128, block_k: int = 64,
         warps: int = 8, stages: int = 3) -> torch.Tensor:
    """``Y @ Y.mT`` for a (B, M, K) tensor; ``triangle`` computes only tiles on and above the diagonal."""
    B, M, K = Y.shape
    C = torch.empty((B, M, M), dtype=Y.dtype, device=Y.device)
    pairs = _pairs(triton.cdiv(M, block), triangle, Y.device)
    grid = (pairs.numel() // 2, B)
    _syrk_kernel[grid](Y, C, pairs, M, K, *Y.stride(), *C.stride(), BLOCK=block, BLOCK_K=block_k,
                       MIRROR=triangle, num_warps=warps, num_stages=stages)
    return C


def _timed(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


#: (batch, M, K): the NS calls of the 1B and 8B presets at one owner holding every matrix of a shape
#: (wide matrices transposed so M <= K), plus the Gram/A*A products (K = M)
SHAPES = [(32, 2048, 8192), (48, 2048, 2048), (32, 512, 2048), (32, 4096, 14336), (64, 4096, 4096),
          (64, 1024, 4096), (4, 4096, 4096), (8, 2048, 8192)]


def check(device: str) -> None:
    for B, M, K in [(2, 200, 96), (1, 256, 130), (3, 64, 64)]:
        Y = torch.randn(B, M, K, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
        want = torch.bmm(Y.float(), Y.float().mT)
        for tri in (True, False):
            got = syrk(Y, triangle=tri, block=64, block_k=32, stages=1).float()
            err = ((got - want).norm() / want.norm()).item()
            print(f"check B={B} M={M} K={K} triangle={tri}: rel err {err:.2e}", flush=True)
            assert err < (1e-5 if device == "cpu" else 1e-2), err


def ns_compare() -> list[dict]:
    """``newton_schulz(backend="auto")`` with dmuon's symmetric kernels against the same without them
    (``_symmetric.usable`` patched off): time per shape group, and each one's distance to the exact
    (float64) polynomial iteration on two matrices of the shape."""
    from dmuon import _symmetric
    from dmuon.newton_schulz import POLAR_EXPRESS_COEFFICIENTS as PE
    from dmuon.newton_schulz import newton_schulz
    from dmuon.presets import projection_specs

    real = _symmetric.usable
    rows = []
    for preset in ("llama3.2-1b", "llama3-8b"):
        groups: dict[tuple, int] = {}
        for s in projection_specs(preset):
            groups[tuple(s.shape)] = groups.get(tuple(s.shape), 0) + 1
        for shape, count in groups.items():
            G = torch.randn((count, *shape), device="cuda", dtype=torch.bfloat16)
            r: dict = {"preset": preset, "shape": shape, "batch": count}
            X0 = G[:2].double()
            X0 = X0.mT if shape[0] > shape[1] else X0
            X0 = X0 / X0.norm(dim=(-2, -1), keepdim=True)
            for a, b, c in [PE[min(i, len(PE) - 1)] for i in range(5)]:
                A = X0 @ X0.mT
                X0 = a * X0 + (b * A + c * A @ A) @ X0
            exact = X0.mT if shape[0] > shape[1] else X0
            for label, on in (("sym", True), ("cublas", False)):
                _symmetric.usable = real if on else (lambda Y: False)
                r[f"{label}_ms"] = _timed(lambda: newton_schulz(G, 5, "polar_express", backend="auto"))
                out = newton_schulz(G[:2], 5, "polar_express", backend="auto").double()
                r[f"{label}_dist_to_exact"] = ((out - exact).norm() / exact.norm()).item()
            _symmetric.usable = real
            r["sym_vs_cublas"] = r["sym_ms"] / r["cublas_ms"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del G
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--ns", action="store_true", help="only the newton_schulz comparison")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if args.check or device == "cpu":
        return
    if args.ns:
        rows = ns_compare()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = []
    for B, M, K in SHAPES:
        Y = torch.randn(B, M, K, device=device, dtype=torch.bfloat16)
        flops = 2 * B * M * M * K
        r = {"shape": (B, M, K), "cublas_ms": _timed(lambda: torch.bmm(Y, Y.mT))}
        for name, kw in {"full_128x64_s3": dict(triangle=False), "tri_128x64_s3": dict(triangle=True),
                         "tri_128x64_s4": dict(triangle=True, stages=4),
                         "tri_128x128_s3": dict(triangle=True, block_k=128, stages=3),
                         "tri_64x64_s4_w4": dict(triangle=True, block=64, warps=4, stages=4)}.items():
            try:
                r[name + "_ms"] = _timed(lambda: syrk(Y, **kw))
            except Exception as e:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                r[name + "_ms"] = None
                r[name + "_error"] = type(e).__name__
        best = min(v for k, v in r.items() if k.startswith("tri") and k.endswith("_ms") and v)
        r["cublas_tflops"] = flops / r["cublas_ms"] / 1e9
        r["best_tri_vs_cublas"] = best / r["cublas_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del Y
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
