"""The Gram form's float16 arithmetic (``dmuon/optim/newton_schulz.py``, ``_symmetric.poly_diagonal``):
where it rounds, and the bounds that follow from float16 / float32 unit roundoff (moved out of
``tests/test_newton_schulz.py``, which had outgrown the module size limit)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from dmuon.optim import newton_schulz as _ns
from dmuon.optim._symmetric import poly_diagonal
from dmuon.optim.newton_schulz import COEFFICIENT_SCHEDULES, DEFAULT_EPS, KELLER_JORDAN_COEFFICIENTS, newton_schulz_native
from tests._asserts import ROOT, child_env
from tests.test_newton_schulz import _rel, _schedule_poly

KJ = KELLER_JORDAN_COEFFICIENTS


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)





U16 = 2.0**-11  # float16's unit roundoff (10 stored mantissa bits, round to nearest)
U32 = 2.0**-24  # float32's
F16_MIN_NORMAL = 2.0**-14
F16_MAX = 65504.0


def _gamma32(k: int) -> float:
    """Higham's gamma_k for float32: the relative error bound of k rounded float32 operations."""
    return k * U32 / (1 - k * U32)


def _near_converged_gram(batch: int, m: int, seed: int) -> torch.Tensor:
    """A float16 symmetric ``A = U diag(l) U^T`` with eigenvalues in [0.5, 1.4]: where Keller Jordan's
    ``a + b l + c l^2`` is a small difference of large terms (0.70 at l = 1 from 3.44 - 4.78 + 2.03)."""
    g = _gen(seed)
    out = []
    for _ in range(batch):
        U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
        lam = 0.5 + 0.9 * torch.rand(m, dtype=torch.float64, generator=g)
        A = (U * lam) @ U.T
        out.append((A + A.T) / 2)
    return torch.stack(out).half()


def _poly_diag_bound(A: torch.Tensor, a: float, b: float, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact diagonal of ``a I + b A + c A^2`` (float64, from the float16 ``A``) and the bound on a
    computation that evaluates it in float32 and rounds once to float16: ``u16 (|e| + d) + d`` with
    ``d = gamma_{m+6} (|a| + |b A_ii| + |c| sum_k A_ik^2)`` for the float32 part (the products of float16
    values are exact in float32; m - 1 additions, the square root and square of a norm, three more
    operations)."""
    Ad = A.double()
    diag, sq = Ad.diagonal(dim1=-2, dim2=-1), (Ad * Ad).sum(-1)
    exact = a + b * diag + c * sq
    d = _gamma32(A.shape[-1] + 6) * (abs(a) + abs(b) * diag.abs() + abs(c) * sq)
    return exact, U16 * (exact.abs() + d) + d


def test_poly_diagonal_rounds_the_diagonal_once() -> None:
    a, b, c = KJ
    A = _near_converged_gram(2, 96, seed=80)
    Z = _ns._poly(A, b, c, False)  # b A + c A^2, rounded once to float16 by the product
    P = poly_diagonal(Z.clone(), A, a, b, c)
    exact, bound = _poly_diag_bound(A, a, b, c)
    err = (P.diagonal(dim1=-2, dim2=-1).double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    off = ~torch.eye(96, dtype=torch.bool)
    assert torch.equal(P[:, off], Z[:, off])  # a I adds nothing off the diagonal: those stay as the product made them
    # what the old form did, Z rounded before a is added, is outside the once-rounded bound on these inputs
    twice = Z.diagonal(dim1=-2, dim2=-1).double() + a
    twice = twice.half().double()
    assert bool(((twice - exact).abs() > bound).any())


def test_poly_diagonal_validates_and_handles_empty() -> None:
    with pytest.raises(ValueError, match="batch, m, m"):
        poly_diagonal(torch.zeros(4, 4).half(), torch.zeros(4, 4).half(), 1.0, 1.0, 1.0)
    empty = torch.zeros(0, 3, 3).half()
    assert poly_diagonal(empty, empty, 1.0, 1.0, 1.0) is empty


_KERNEL_PROBE = r"""
import json, torch
from dmuon.optim import _symmetric
g = torch.Generator().manual_seed(81)
S = torch.randn(2, 150, 150, generator=g) / 40
A = (S + S.mT).half()
P = torch.zeros(2, 150, 150, dtype=torch.float16)
_symmetric._poly_diagonal_kernel[(150, 2)](A, P, 150, 3.4445, -4.775, 2.0315, *A.stride(), *P.stride(), BLOCK_K=64)
torch.save({"A": A, "P": P}, "OUT")
print(json.dumps({"ok": True}))
"""


def test_poly_diagonal_kernel_in_triton_interpreter(tmp_path) -> None:
    # the CUDA kernel's index arithmetic and its fp32 evaluation, run by Triton's interpreter on the CPU: a
    # ragged last block in k (150 = 2 x 64 + 22), two batches, and nothing written off the diagonal
    pytest.importorskip("triton")
    out = tmp_path / "probe.pt"
    proc = subprocess.run([sys.executable, "-c", _KERNEL_PROBE.replace("OUT", str(out))], cwd=ROOT,
                          env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"]
    got = torch.load(out)
    A, P = got["A"], got["P"]
    exact, bound = _poly_diag_bound(A, *KJ)
    err = (P.diagonal(dim1=-2, dim2=-1).double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert torch.equal(P - torch.diag_embed(P.diagonal(dim1=-2, dim2=-1)), torch.zeros_like(P))


def test_gram_scale_is_a_power_of_four_that_keeps_float16_finite() -> None:
    for m, want in [(1, 1), (3, 1), (4, 4), (24, 16), (512, 256), (1024, 1024), (4096, 4096), (14336, 4096),
                    (10**6, _ns.GRAM_MAX_SCALE)]:
        assert _ns._gram_scale(m) == want, m
    # sqrt(s) is a power of two, so scaling X_0 and unscaling the segment's result round nothing
    assert math.log2(math.sqrt(_ns.GRAM_MAX_SCALE)).is_integer()
    # the first segment's s A_k has eigenvalues up to s * max phi_k(x)^2 over x in [0, 1] (||X_0||_F = 1
    # bounds sigma by 1): finite in float16 for both shipped schedules, with room for the products' rounding
    x = torch.linspace(0, 1, 100001, dtype=torch.float64)
    for name, schedule in COEFFICIENT_SCHEDULES.items():
        y, worst = x, 0.0
        for k in range(_ns.GRAM_FIRST_RESTART):
            y = _schedule_poly(y, schedule[k:k + 1] if k < len(schedule) else schedule[-1:], 1)
            worst = max(worst, float(y.abs().max()))
        assert _ns.GRAM_MAX_SCALE * worst**2 < F16_MAX / 2, (name, worst)


def test_scaled_first_gram_matrix_leaves_the_subnormals() -> None:
    # ||X||_F = 1: the off-diagonal entries of R = X X^T are about N(0, 1 / (m^2 n)), for 512 x 2048 a
    # standard deviation of 4.3e-5 below float16's smallest normal 2^-14 = 6.1e-5, so most are subnormal
    # (fixed spacing 2^-24: a few bits each). Scaled by s = 256 the deviation is 1.1e-2.
    m, n = 512, 2048
    G = torch.randn(m, n, generator=_gen(82))
    off = ~torch.eye(m, dtype=torch.bool)
    fractions = {}
    for s in (1.0, _ns._gram_scale(m)):
        X = _ns._half_normalised(G, DEFAULT_EPS, math.sqrt(s)).unsqueeze(0)
        R = _ns._gram_of(X, False)[0]
        fractions[s] = float((R[off].abs() < F16_MIN_NORMAL).float().mean())
    # expected fraction below 2^-14 for a normal of deviation sigma: erf(2^-14 / (sigma sqrt 2))
    expect = {s: math.erf(F16_MIN_NORMAL * m * math.sqrt(n) / s / math.sqrt(2)) for s in fractions}
    assert expect[1.0] > 0.8 and expect[256.0] < 0.01
    for s in fractions:
        assert abs(fractions[s] - expect[s]) < 0.05, (s, fractions, expect)


def test_gram_form_of_a_tall_input_returns_a_contiguous_result() -> None:
    G = torch.randn(2, 200, 48, generator=_gen(83))
    tall = newton_schulz_native(G, backend="gram")
    assert tall.is_contiguous() and tall.shape == G.shape and tall.dtype == torch.float16
    # the same arithmetic on the transposed copy, up to the order of float32 accumulation
    wide = newton_schulz_native(G.mT.contiguous(), backend="gram")
    assert _rel(tall, wide.mT) < 1e-2


def test_quack_full_products_are_opt_in() -> None:
    # quack's GEMM autotunes at its first call per process and shape: never on by default, never on the CPU
    assert _ns.QUACK_FULL_PRODUCTS is False
    assert not _ns._quack_full(torch.zeros(1, 4096, 4096, dtype=torch.float16))
