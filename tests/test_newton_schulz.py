"""Tests for dmuon.newton_schulz: torch parity, accuracy vs. the SVD polar factor, batching, validation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests._asserts import rel_err

from dmuon.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_STEPS,
    KELLER_JORDAN_COEFFICIENTS,
    newton_schulz,
)

try:
    from torch.optim import _muon as _torch_muon

    _torch_ns = _torch_muon._zeropower_via_newtonschulz
except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
    _torch_muon = None
    _torch_ns = None

needs_torch_ns = pytest.mark.skipif(
    _torch_ns is None,
    reason="torch.optim._muon._zeropower_via_newtonschulz is not available in this torch build",
)

KJ = KELLER_JORDAN_COEFFICIENTS
CUBIC = (1.5, -0.5, 0.0)  # classic Newton–Schulz: x <- 1.5x - 0.5x^3, converges to 1 on (0, sqrt(3))


# ----------------------------------------------------------------------------- helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _with_singular_values(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    """Float32 matrix U diag(s) V^T with Haar-ish random U, V, so conditioning is under our control."""
    g = _gen(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g))
    return ((U * s) @ V.T).float()


def _log_spread(m: int, n: int, smallest: float, seed: int) -> torch.Tensor:
    s = torch.logspace(0.0, math.log10(smallest), min(m, n), dtype=torch.float64)
    return _with_singular_values(m, n, s, seed)


def _scalar_poly(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    """The iteration acting on one singular value, in float64 (exact-arithmetic reference)."""
    a, b, c = coefficients
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


_rel = rel_err


def _polar(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


# Well-conditioned test matrices: (name, matrix). After Frobenius normalisation every singular
# value of these is >= 3e-3 (asserted below), which is what the accuracy bounds rely on.
def _accuracy_cases() -> list[tuple[str, torch.Tensor]]:
    return [
        ("gauss_64x32", torch.randn(64, 32, generator=_gen(1))),
        ("gauss_32x96", torch.randn(32, 96, generator=_gen(2))),
        ("spread1e-1_48x48", _log_spread(48, 48, 1e-1, seed=3)),
        ("spread3e-1_40x72", _log_spread(40, 72, 3e-1, seed=4)),
        ("spread1e-2_48x48", _log_spread(48, 48, 1e-2, seed=5)),
    ]


# ----------------------------------------------------------------------------- torch parity


@needs_torch_ns
def test_constants_match_torch_muon_defaults() -> None:
    assert KELLER_JORDAN_COEFFICIENTS == (
        _torch_muon.DEFAULT_A,
        _torch_muon.DEFAULT_B,
        _torch_muon.DEFAULT_C,
    )
    assert DEFAULT_NS_STEPS == _torch_muon.DEFAULT_NS_STEPS
    assert DEFAULT_EPS == _torch_muon.EPS


@needs_torch_ns
@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (24, 8), (7, 13), (13, 7), (1, 5), (5, 1), (33, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("steps", [0, 1, 5, 13])
@pytest.mark.parametrize("coefficients", [KJ, (2.0, -1.5, 0.5)])
def test_bitwise_equal_to_torch(
    shape: tuple[int, int], dtype: torch.dtype, steps: int, coefficients: tuple[float, float, float]
) -> None:
    G = (torch.randn(shape, generator=_gen(100 * shape[0] + shape[1] + steps)) * 3.0).to(dtype)
    # torch's function divides in place, which mutates a bfloat16 argument: hand it a copy.
    expected = _torch_ns(G.clone(), coefficients, steps, DEFAULT_EPS)
    got = newton_schulz(G, steps, coefficients)
    assert got.dtype == expected.dtype == torch.bfloat16
    assert got.shape == G.shape
    assert torch.equal(got, expected)


@needs_torch_ns
@pytest.mark.parametrize("eps", [1e-7, 1e-3, 10.0])
def test_bitwise_equal_to_torch_eps_and_noncontiguous(eps: float) -> None:
    # A strided, non-contiguous view and a norm below eps=10 exercise the layout and the clamp.
    base = torch.randn(20, 30, generator=_gen(7)) * 0.05
    for G in (base[::2, 1::3], base.T, base):
        expected = _torch_ns(G.clone(), KJ, DEFAULT_NS_STEPS, eps)
        assert torch.equal(newton_schulz(G, eps=eps), expected)


def test_defaults_are_used() -> None:
    G = torch.randn(12, 20, generator=_gen(8))
    assert torch.equal(newton_schulz(G), newton_schulz(G, DEFAULT_NS_STEPS, KJ, DEFAULT_EPS))
    assert not torch.equal(newton_schulz(G), newton_schulz(G, DEFAULT_NS_STEPS - 1))


def test_zero_steps_is_frobenius_normalisation() -> None:
    G = torch.randn(9, 6, generator=_gen(9))
    Gb = G.bfloat16()
    assert torch.equal(newton_schulz(G, steps=0), Gb / Gb.norm())


def test_zero_matrix_gives_zeros_not_nan() -> None:
    out = newton_schulz(torch.zeros(4, 7))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.zeros(4, 7, dtype=torch.bfloat16))


def test_does_not_mutate_bfloat16_input() -> None:
    G = torch.randn(6, 10, generator=_gen(10)).bfloat16()
    before = G.clone()
    out = newton_schulz(G)
    assert torch.equal(G, before)
    assert out.data_ptr() != G.data_ptr()


# ----------------------------------------------------------------------------- accuracy


def test_accuracy_cases_are_well_conditioned() -> None:
    # Guard for the bounds below: they assume every normalised singular value is >= 3e-3.
    for name, G in _accuracy_cases():
        s = torch.linalg.svdvals(G.bfloat16().double())
        assert (s / s.norm()).min() >= 3e-3, name


@pytest.mark.parametrize("case", range(len(_accuracy_cases())))
def test_keller_jordan_matches_exact_polynomial_and_is_near_polar(case: int) -> None:
    name, G = _accuracy_cases()[case]
    out = newton_schulz(G)  # KJ coefficients, 5 steps

    # Exact-arithmetic prediction: the iteration maps U S V^T to U p(S/||S||_F) V^T, where p is the
    # scalar quintic applied 5 times. Computed from the SVD of the bf16-cast input (what NS sees).
    U, S, Vh = torch.linalg.svd(G.bfloat16().double(), full_matrices=False)
    p = _scalar_poly(S / S.norm(), KJ, DEFAULT_NS_STEPS)
    predicted = (U * p) @ Vh

    # 1) It really is that polynomial: measured distance to the float64 prediction is <= 0.0185
    #    (over 20 seeds of these shapes); that is bf16 noise (unit roundoff 2^-8 ~ 3.9e-3,
    #    accumulated over 15 bf16 matmuls and amplified by the slope ~3.4 at zero). 2x margin.
    assert _rel(out, predicted) < 0.04, name

    # 2) Singular values: for normalised inputs x0 in [3e-3, 1] the exact scalar map ends in
    #    [0.682, 1.203] (KJ's coefficients trade exact convergence for a steep slope at 0).
    #    Measured bf16 range over 20 seeds: [0.677, 1.204]. Allow ~0.08/0.1 for bf16 noise.
    sv = torch.linalg.svdvals(out.double())
    assert p.min() > 0.68 and p.max() < 1.21, name
    assert sv.min() > 0.6 and sv.max() < 1.3, (name, sv.min().item(), sv.max().item())

    # 3) Distance to the true polar factor U V^T. In exact arithmetic it is rms(p - 1); KJ's
    #    coefficients deliberately leave it far from 0 (measured 0.19..0.24). bf16 noise moves it
    #    by <= ~0.02 (see 1), so allow 0.03 around the prediction.
    polar = _polar(G)
    dist = _rel(out, polar)
    predicted_dist = (p - 1).pow(2).mean().sqrt().item()
    assert 0.1 < predicted_dist < 0.32, name
    assert abs(dist - predicted_dist) < 0.03, (name, dist, predicted_dist)


@pytest.mark.parametrize(
    "name,G",
    [
        ("gauss_64x32", torch.randn(64, 32, generator=_gen(11))),
        ("gauss_32x96", torch.randn(32, 96, generator=_gen(12))),
        ("spread1e-1_48x48", _log_spread(48, 48, 1e-1, seed=13)),
        ("spread3e-1_40x72", _log_spread(40, 72, 3e-1, seed=14)),
    ],
)
def test_convergent_coefficients_reach_polar_factor(name: str, G: torch.Tensor) -> None:
    # The cubic Newton–Schulz map x <- 1.5x - 0.5x^3 converges to 1 for every x in (0, sqrt(3));
    # Frobenius normalisation puts all singular values in (0, 1]. It grows small x by 1.5x per
    # step, then converges quadratically: in float64, 30 steps take any x0 >= 1e-3 to 1 exactly.
    s = torch.linalg.svdvals(G.bfloat16().double())
    x0 = s / s.norm()
    assert x0.min() >= 1e-2  # condition number <= ~30 for these cases
    assert (_scalar_poly(x0, CUBIC, 30) - 1).abs().max() < 1e-12

    out = newton_schulz(G, steps=30, coefficients=CUBIC)
    # What is left is bf16 rounding: just rounding an exactly orthogonal matrix to bf16 gives a
    # relative distance ~1.7e-3; measured here <= 8.1e-3 over 20 seeds. Ill-conditioned inputs
    # (smallest singular value 1e-2 of the largest) measure ~2e-2 because the polar factor's
    # sensitivity to perturbations scales like 1/sigma_min, hence the conditioning guard above.
    assert _rel(out, _polar(G)) < 1e-2, name
    sv = torch.linalg.svdvals(out.double())
    assert (sv - 1).abs().max() < 1e-2, name
    # ...and far closer than the non-convergent default (~0.2), so this is not a bf16 accident.
    assert _rel(out, _polar(G)) < 0.1 * _rel(newton_schulz(G), _polar(G))


# ----------------------------------------------------------------------------- batched


@pytest.mark.parametrize("shape", [(4, 16, 16), (3, 8, 24), (3, 24, 8), (5, 7, 13), (2, 64, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 5])
def test_batched_slices_bitwise_equal_to_2d(
    shape: tuple[int, int, int], dtype: torch.dtype, steps: int
) -> None:
    g = _gen(sum(shape) + steps)
    # Very different per-slice scales: a shared (global) norm would change the result.
    scales = torch.logspace(-3, 3, shape[0]).view(-1, 1, 1)
    G = (torch.randn(shape, generator=g) * scales).to(dtype)
    out = newton_schulz(G, steps)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    for i in range(shape[0]):
        # Measured on CPU: bitwise identical (same gemm kernels, same per-matrix norm reduction).
        assert torch.equal(out[i], newton_schulz(G[i], steps)), i


def test_batched_zero_slice_does_not_affect_others() -> None:
    G = torch.randn(3, 5, 9, generator=_gen(20))
    G[1] = 0
    out = newton_schulz(G)
    assert torch.equal(out[1], torch.zeros(5, 9, dtype=torch.bfloat16))
    assert torch.equal(out[0], newton_schulz(G[0]))
    assert torch.equal(out[2], newton_schulz(G[2]))


def test_batched_empty_batch() -> None:
    out = newton_schulz(torch.zeros(0, 5, 4))
    assert out.shape == (0, 5, 4) and out.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- transposition


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (7, 13), (1, 6), (40, 17)])
def test_transpose_equivariance_bitwise_for_rectangular(shape: tuple[int, int]) -> None:
    # Both calls iterate on the same wide orientation of the same data, so results are identical.
    G = torch.randn(shape, generator=_gen(30))
    assert torch.equal(newton_schulz(G.T), newton_schulz(G).T)


@pytest.mark.parametrize("n", [16, 33, 64])
def test_transpose_equivariance_close_for_square(n: int) -> None:
    # Square input is never transposed, so G uses X X^T and G^T uses X^T X: equal only in exact
    # arithmetic. Measured relative distance 1.5e-2..1.8e-2 (bf16 noise amplified over 5 steps).
    G = torch.randn(n, n, generator=_gen(31))
    a, b = newton_schulz(G.T), newton_schulz(G).T
    assert _rel(a, b) < 4e-2
    # Sanity: the comparison is meaningful (not transposing would be far off).
    assert _rel(newton_schulz(G), b) > 0.5


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4, 5)])
def test_rejects_bad_ndim(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=f"ndim={len(shape)}"):
        newton_schulz(torch.ones(shape))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3), (2, 3, 0)])
def test_rejects_empty_matrix_dims(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"non-empty.*" + re.escape(str(shape))):
        newton_schulz(torch.ones(shape))


def test_rejects_complex() -> None:
    with pytest.raises(ValueError, match="complex64"):
        newton_schulz(torch.ones(3, 3, dtype=torch.complex64))


def test_rejects_non_tensor() -> None:
    with pytest.raises(TypeError, match="list"):
        newton_schulz([[1.0, 2.0], [3.0, 4.0]])  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [-1, 100, 1000, 2.0, True, "5", None])
def test_rejects_bad_steps(steps: object) -> None:
    with pytest.raises(ValueError, match="steps") as info:
        newton_schulz(torch.ones(3, 4), steps=steps)  # type: ignore[arg-type]
    assert repr(steps) in str(info.value)


def test_accepts_boundary_steps() -> None:
    assert newton_schulz(torch.ones(3, 4), steps=99).shape == (3, 4)


@pytest.mark.parametrize(
    "coefficients",
    [(1.0, 2.0), (1.0, 2.0, 3.0, 4.0), "abc", (1.0, None, 2.0), 5, (1.0, True, 2.0), (math.nan, 0.0, 0.0)],
)
def test_rejects_bad_coefficients(coefficients: object) -> None:
    with pytest.raises(ValueError, match="coefficients") as info:
        newton_schulz(torch.ones(3, 4), coefficients=coefficients)  # type: ignore[arg-type]
    assert repr(coefficients) in str(info.value)


def test_accepts_list_and_int_coefficients() -> None:
    G = torch.randn(5, 7, generator=_gen(40))
    assert torch.equal(newton_schulz(G, 3, [2, -1, 0]), newton_schulz(G, 3, (2.0, -1.0, 0.0)))


@pytest.mark.parametrize("eps", [0.0, -1e-7, math.nan, math.inf, "1e-7", None])
def test_rejects_bad_eps(eps: object) -> None:
    with pytest.raises(ValueError, match="eps") as info:
        newton_schulz(torch.ones(3, 4), eps=eps)  # type: ignore[arg-type]
    assert repr(eps) in str(info.value)


# ----------------------------------------------------------------------------- schedules and backends

from dmuon.optim.newton_schulz import (  # noqa: E402
    COEFFICIENT_SCHEDULES,
    GRAM_MIN_ASPECT,
    GRAM_MIN_WORK,
    POLAR_EXPRESS_COEFFICIENTS,
    newton_schulz_native,
    parse_coefficients,
    resolve_backend,
)

PE = POLAR_EXPRESS_COEFFICIENTS


def _schedule_poly(x: torch.Tensor, schedule, steps: int) -> torch.Tensor:
    """The scalar map of a per-step schedule (last entry repeating), in float64."""
    for k in range(steps):
        a, b, c = schedule[min(k, len(schedule) - 1)]
        x = a * x + b * x**3 + c * x**5
    return x


def _exact_iteration(G: torch.Tensor, schedule, steps: int, *, from_bf16: bool = True) -> torch.Tensor:
    """What the iteration computes in exact arithmetic from the bf16-cast input (or, ``from_bf16=False``,
    from ``G`` itself, where the float16 forms start): U p(S/|S|) V^T."""
    U, S, Vh = torch.linalg.svd((G.bfloat16() if from_bf16 else G).double(), full_matrices=False)
    return (U * _schedule_poly(S / S.norm(), schedule, steps)) @ Vh


def _wide_cases() -> list[tuple[str, torch.Tensor]]:
    return [
        ("spread1e-2_64x256", _log_spread(64, 256, 1e-2, seed=50)),
        ("spread1e-3_96x384", _log_spread(96, 384, 1e-3, seed=51)),
        ("spread1e-4_64x224", _log_spread(64, 224, 1e-4, seed=52)),
        ("gauss_48x96", torch.randn(48, 96, generator=_gen(53))),
        ("gauss_tall_160x40", torch.randn(160, 40, generator=_gen(54))),
    ]


def test_polar_express_scalar_map_converges() -> None:
    # The property the schedule is built for: from any normalised singular value in [1e-3, 1], five
    # steps land in [0.84, 1.13] (exact map: [0.846, 1.124]) and eight in [0.99, 1.01], while Keller
    # Jordan's quintic never leaves [0.47, 1.21] wide.
    x = torch.logspace(-3, 0, 4001, dtype=torch.float64)
    y5 = _schedule_poly(x, PE, 5)
    assert y5.min() > 0.84 and y5.max() < 1.13, (y5.min().item(), y5.max().item())
    y8 = _schedule_poly(x, PE, 8)
    assert (y8 - 1).abs().max() < 1e-2
    kj5 = _schedule_poly(x, (KJ,), 5)
    assert kj5.min() < 0.5 and kj5.max() > 1.2


@pytest.mark.parametrize("case", range(5))
def test_polar_express_is_closer_to_polar_factor_than_keller_jordan(case: int) -> None:
    name, G = _wide_cases()[case]
    polar = _polar(G)
    kj, pe = _rel(newton_schulz(G), polar), _rel(newton_schulz(G, coefficients="polar_express"), polar)
    # measured: pe/kj between 0.37 and 0.87 on these cases (the most ill-conditioned gains least)
    assert pe < 0.95 * kj, (name, pe, kj)


@needs_torch_ns
@pytest.mark.parametrize("backend", ["gram", "direct_fp16"])
@pytest.mark.parametrize("coefficients", ["keller_jordan", "polar_express"])
@pytest.mark.parametrize("case", range(5))
def test_float16_backends_as_accurate_as_torch_direct(backend: str, coefficients: str, case: int) -> None:
    name, G = _wide_cases()[case]
    schedule = parse_coefficients(coefficients)
    half = newton_schulz(G, coefficients=coefficients, backend=backend)
    direct = newton_schulz(G, coefficients=coefficients, backend="direct")
    assert half.dtype == torch.bfloat16 and half.shape == G.shape
    # 1) each tracks the exact polynomial of its own input at least as well as the bfloat16 direct form
    #    tracks its own (the float16 forms start from G, the direct one from G in bfloat16)
    ours = _rel(newton_schulz_native(G, coefficients=coefficients, backend=backend),
                _exact_iteration(G, schedule, DEFAULT_NS_STEPS, from_bf16=False))
    assert ours <= _rel(direct, _exact_iteration(G, schedule, DEFAULT_NS_STEPS)), name
    # 2) the bar: same or better distance to U V^T than torch.optim.Muon's NS, same 5 steps
    torch_kj = _torch_ns(G.clone(), KJ, DEFAULT_NS_STEPS, DEFAULT_EPS)
    polar = _polar(G)
    assert _rel(half, polar) <= _rel(torch_kj, polar) * 1.001, name


def test_gram_backend_batched_matches_slices() -> None:
    G = torch.randn(3, 24, 80, generator=_gen(60)) * torch.tensor([1e-3, 1.0, 1e3]).view(-1, 1, 1)
    out = newton_schulz(G, backend="gram")
    for i in range(3):
        assert _rel(out[i], newton_schulz(G[i], backend="gram")) < 1e-2, i


def test_gram_backend_edge_inputs() -> None:
    # zeros stay zeros; inputs beyond float16's range do not overflow (normalised before the cast)
    assert torch.equal(newton_schulz(torch.zeros(4, 12), backend="gram"), torch.zeros(4, 12, dtype=torch.bfloat16))
    big = torch.randn(8, 40, generator=_gen(61)) * 1e8
    out = newton_schulz(big, backend="gram")
    assert out.isfinite().all()
    assert _rel(out, newton_schulz(big / 1e8, backend="gram")) < 1e-2
    # zero steps: the normalised input, computed in the input's precision and rounded once to float16
    G = torch.randn(6, 20, generator=_gen(62))
    want = (G / G.norm(dim=(-2, -1), keepdim=True)).half()
    assert torch.equal(newton_schulz_native(G, steps=0, backend="gram"), want)
    assert torch.equal(newton_schulz_native(G, steps=0, backend="direct_fp16"), want)


def test_auto_backend_follows_device_aspect_ratio_and_size(monkeypatch) -> None:
    assert GRAM_MIN_ASPECT == 1.5 and GRAM_MIN_WORK == 2**33
    cuda = dict(device="cuda")  # only the device type is read: no GPU needed
    # Llama shapes on CUDA: wide and big enough -> gram; square, or too small a call -> float16 direct
    assert resolve_backend((2048, 8192), **cuda) == "gram" and resolve_backend((8192, 2048), **cuda) == "gram"
    assert resolve_backend((4, 1024, 4096), **cuda) == "gram" and resolve_backend((32, 512, 2048), **cuda) == "gram"
    assert resolve_backend((1024, 4096), **cuda) == "direct_fp16"
    assert resolve_backend((4, 512, 2048), **cuda) == "direct_fp16"
    assert resolve_backend((64, 4096, 4096), **cuda) == "direct_fp16"
    assert resolve_backend((4096, 6143), **cuda) == "direct_fp16" and resolve_backend((4096, 6144), **cuda) == "gram"
    assert resolve_backend((5, 8192, 2048), "direct", **cuda) == "direct"
    # on the CPU (and with no device given) auto is torch's bfloat16 form: float16 products are slow there
    for shape in [(2048, 8192), (64, 4096, 4096), (24, 80)]:
        assert resolve_backend(shape) == "direct" and resolve_backend(shape, device="cpu") == "direct"
    G = torch.randn(24, 80, generator=_gen(64))
    assert torch.equal(newton_schulz(G, backend="auto"), newton_schulz(G, backend="direct"))
    # the choice reaches newton_schulz: with the size floor lowered, a CUDA-typed resolution picks gram
    import sys

    monkeypatch.setattr(sys.modules["dmuon.optim.newton_schulz"], "GRAM_MIN_WORK", 1)
    assert resolve_backend((24, 80), **cuda) == "gram" and resolve_backend((40, 40), **cuda) == "direct_fp16"


def test_schedules_by_name_and_sequence() -> None:
    G = torch.randn(12, 30, generator=_gen(65))
    assert torch.equal(newton_schulz(G, coefficients="keller_jordan"), newton_schulz(G))
    assert torch.equal(newton_schulz(G, coefficients=[KJ]), newton_schulz(G))
    assert torch.equal(newton_schulz(G, 5, "polar_express"), newton_schulz(G, 5, list(PE)))
    # the last entry repeats past the end of the schedule
    assert torch.equal(newton_schulz(G, 10, PE), newton_schulz(G, 10, list(PE) + [PE[-1]] * 2))
    assert set(COEFFICIENT_SCHEDULES) == {"keller_jordan", "polar_express"}


@pytest.mark.parametrize("coefficients", [[], [(1.0, 2.0, 3.0), (1.0, 2.0)], "polar", [KJ, "x"]])
def test_rejects_bad_schedules(coefficients: object) -> None:
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.ones(3, 4), coefficients=coefficients)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["fast", "", None, "GRAM"])
def test_rejects_bad_backend(backend: object) -> None:
    with pytest.raises(ValueError, match="backend"):
        newton_schulz(torch.ones(3, 4), backend=backend)  # type: ignore[arg-type]


def test_native_output_skips_only_the_final_cast() -> None:
    G = torch.randn(3, 16, 48, generator=_gen(70))
    for backend, dtype in (("direct", torch.bfloat16), ("gram", torch.float16), ("direct_fp16", torch.float16)):
        raw = newton_schulz_native(G, backend=backend)
        assert raw.dtype == dtype and raw.shape == G.shape
        assert torch.equal(raw.bfloat16(), newton_schulz(G, backend=backend))
