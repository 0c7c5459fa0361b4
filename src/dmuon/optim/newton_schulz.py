"""Quintic Newton–Schulz orthogonalisation, bit-compatible with ``torch.optim.Muon``.

Muon replaces each 2-D update ``G`` by (approximately) its polar factor ``U V^T`` where
``G = U S V^T``. Computing that with an SVD is too slow, so Muon runs a few steps of an odd
quintic polynomial iteration ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` in bfloat16.

This module re-implements the exact operation sequence of torch's private
``torch.optim._muon._zeropower_via_newtonschulz`` so that a distributed optimizer which
orthogonalises a full (gathered) matrix on one rank produces *bit-identical* results to
single-process ``torch.optim.Muon``. It also offers a batched 3-D form so several same-shape
matrices can be orthogonalised in one call.

With Keller Jordan's default coefficients the iteration intentionally does not converge to
exactly ``U V^T``: it maximises the slope at zero, and the output's singular values end up
spread around 1 (torch quotes roughly 0.5 to 1.5; for inputs whose normalised singular values
are all >= 3e-3 the exact map gives [0.68, 1.20], and the relative Frobenius distance to
``U V^T`` is about 0.2). Classic convergent coefficients such as ``(1.5, -0.5, 0.0)`` (the
cubic Newton–Schulz step) do converge to ``U V^T`` given enough steps.

Two more options sit beside that torch-identical form:

* **Coefficient schedules.** ``coefficients`` may be one ``(a, b, c)`` for every step, a sequence of
  them (one per step, the last repeating), or a name: ``"keller_jordan"`` or ``"polar_express"``. The
  Polar Express schedule (Amsel, Persson, Musco and Gower, 2025) picks each step's quintic as the
  minimax fit of 1 on the interval of singular values still possible after the earlier steps, so it
  converges to ``U V^T`` in few steps (after 5 steps every normalised singular value in [1e-3, 1] maps
  into [0.85, 1.12]; Keller Jordan's leaves [0.47, 1.20]). The published values carry a 1% safety
  factor against rounding, applied below.
* **Backends.** ``"direct"`` iterates on ``X`` in bfloat16 (torch's operation sequence).
  ``"direct_fp16"`` runs the same iteration in float16, normalised from the input's own precision: 3
  more mantissa bits at the same GPU speed, about 8x closer to the exact iteration (measured on an H200:
  1.1-1.5e-3 against torch's 8.7e-3-1.3e-2 relative distance to the float64 iteration on the Llama
  shares). ``"gram"`` iterates on the small Gram matrix instead: for a wide ``X`` (``m <= n``) every
  iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R = X_0 X_0^T``, so one can update
  ``A_k = X_k X_k^T`` and ``Q_k`` with ``m x m`` products only and touch the ``m x n`` matrix once at the
  end: ``8 m^2 n + 28 m^3`` flops for 5 steps (one restart) against ``20 m^2 n + 10 m^3``, a win once
  ``n >= 1.5 m``. Squaring the condition number makes bfloat16 unusable there (measured: the iteration
  drifts far from the exact polynomial), so the Gram space runs in float16 and restarts from the
  current ``X`` (re-forming ``R``) every 3 steps, which bounds the drift. Two roundings matter there.
  (1) With ``||X_0||_F = 1`` the entries of ``R`` are about ``1 / (m sqrt(n))`` off the diagonal, float16
  subnormals for the Llama shapes, so the first segment starts from ``X_0`` scaled to ``||X_0||_F^2 = s``
  (a power of 4 near ``m``; exact) and works with ``s R``. (2) Near convergence ``P = a I + b A + c A^2``
  is a small difference of large terms (0.70 from 3.44 - 4.78 + 2.03), so ``b A + c A^2`` rounded before
  ``a`` is added loses about 4 float16 units of ``P`` on its diagonal; the diagonal is recomputed in fp32
  and rounded once (:func:`dmuon.optim._symmetric.poly_diagonal`, one pass over ``A``). Measured on an
  H200: 1.0-1.3e-3 relative distance to the float64 iteration on the Llama shares, 1.5-1.6e-3 before both.
  A tall input's Gram form reads a transposed view of the input's own layout and returns a contiguous
  result (no transposing copy on either side).
  ``"auto"`` on CUDA takes ``"gram"`` for shapes with ``n >= GRAM_MIN_ASPECT * m`` whose work is at
  least :data:`GRAM_MIN_WORK` and ``"direct_fp16"`` otherwise, and forms the products whose result is
  symmetric (``X X^T``, ``b A + c A A``, and in the Gram form ``P Q`` and ``A P P``, products of commuting
  symmetric matrices) with quack's symmetric GEMM (Hopper+, ``dmuon[quack]``, see
  :mod:`dmuon.optim._quack`) or :mod:`dmuon.optim._symmetric`'s Triton kernel, which compute only the
  tiles on and above the diagonal. On the CPU ``"auto"`` is ``"direct"``: float16 products are several
  times slower than bfloat16 ones there.

Only ``"direct"`` with one ``(a, b, c)`` is bit-identical to torch; the others round differently.

This file is pure tensor math: no ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "KELLER_JORDAN_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "COEFFICIENT_SCHEDULES",
    "Coefficients",
    "NS_BACKENDS",
    "GRAM_MIN_ASPECT",
    "GRAM_MIN_WORK",
    "GRAM_FIRST_RESTART",
    "GRAM_RESTART_EVERY",
    "GRAM_MAX_SCALE",
    "QUACK_FULL_PRODUCTS",
    "native_dtype",
    "resolve_backend",
    "explain",
    "DEFAULT_NS_STEPS",
    "DEFAULT_EPS",
    "newton_schulz",
    "newton_schulz_native",
]

#: ``(a, b, c)`` of ``torch.optim.Muon``'s defaults (Keller Jordan's tuned quintic).
KELLER_JORDAN_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

def _with_safety(coeffs: tuple[tuple[float, float, float], ...], factor: float) -> tuple[tuple[float, float, float], ...]:
    """Scale each step's polynomial input by ``1/factor`` (``p(x / f)``) except the last, as the
    Polar Express authors recommend so bf16 rounding cannot push a singular value out of the basin."""
    scaled = tuple((a / factor, b / factor**3, c / factor**5) for a, b, c in coeffs[:-1])
    return scaled + coeffs[-1:]


#: Polar Express schedule (degree 5, lower bound 1e-3) with the 1.01 safety factor; the last entry
#: repeats for longer runs.
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = _with_safety((
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
), 1.01)

#: What ``coefficients`` accepts: one ``(a, b, c)``, a per-step sequence of them, or a schedule name.
Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]] | str

#: Named schedules accepted wherever ``coefficients`` are.
COEFFICIENT_SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "keller_jordan": (KELLER_JORDAN_COEFFICIENTS,),
    "polar_express": POLAR_EXPRESS_COEFFICIENTS,
}

#: Accepted ``backend`` values.
NS_BACKENDS = ("direct", "direct_fp16", "gram", "auto")
#: ``"auto"`` uses the Gram form when the long side is at least this many times the short side
#: (flop break-even of the two forms at 5 steps)...
GRAM_MIN_ASPECT = 1.5
#: ...and the call is big enough, ``batch * short^2 * long >= GRAM_MIN_WORK``: below that the GPU is
#: launch-bound and the Gram form's extra small products cost more than its flops save (measured on an
#: H200: 0.81x the direct time for 32 x (512 x 2048), 1.41x for 4 of them, 1.15x for one 1024 x 4096).
GRAM_MIN_WORK = 2**33
#: The Gram form re-forms ``R`` from the current ``X`` after :data:`GRAM_FIRST_RESTART` steps, then after
#: every further ``GRAM_RESTART_EVERY`` steps: for 5 steps one restart, after step 3. The products are the
#: same wherever the restart sits (a segment's work is linear in its length). gram-newton-schulz restarts
#: after step 2; measured on an H200 (Llama-3.1-8B share at 8 ranks, before the diagonal fix) that made
#: ``"auto"``'s worst distance to the float64 iteration 2.96e-3 against 1.64e-3 after step 3. On inputs
#: with a wide spread of singular values the earlier restart is worse too (a float16 emulation on the CPU,
#: 1024 x 4096 with singular values ``1/i``: 6.8e-3 against 3.9e-3), and without any restart far worse
#: (1.5e-1), so dmuon keeps 3.
GRAM_FIRST_RESTART = 3
GRAM_RESTART_EVERY = 3
#: Cap on the first Gram segment's scale (see ``_gram_scale``): that segment's ``s A_k`` has eigenvalues up to
#: ``s`` times the largest squared value of the scalar map over its steps (1.21^2 for Keller Jordan's, 1.99^2
#: for Polar Express's first 3 steps), so ``4^6 * 4 = 16384`` stays well inside float16's 65504.
GRAM_MAX_SCALE = 4**6
#: Opt-in: where quack's symmetric GEMM forms the symmetric products (``"auto"``, Hopper+, ``m >= 2048``), form
#: the others (the Gram form's ``Q X``, the direct form's ``a X + B X``) with quack's autotuned GEMM instead of
#: cuBLAS's. Measured on an H200 (Llama-3.1-8B share at 8 ranks): 68.7 ms against 71.1 ms. Off by default:
#: its first call per process and shape autotunes (compiles and times every quack configuration; on a fresh
#: H200 machine one shape took minutes), and in a distributed job a rank that tunes while its peers wait in
#: a collective can run into the collective's timeout.
QUACK_FULL_PRODUCTS = False

#: Number of iterations ``torch.optim.Muon`` runs by default.
DEFAULT_NS_STEPS = 5
#: Floor on the Frobenius norm used for normalisation (avoids 0/0 on an all-zero update).
DEFAULT_EPS = 1e-7

# torch.optim.Muon refuses >= 100 steps; we keep the same limit so configs are interchangeable.
_MAX_STEPS = 100


def _is_real_number(x: object) -> bool:
    """True for int/float-like scalars, excluding bool (``True`` is almost surely a bug)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_triple(x: object) -> bool:
    return (isinstance(x, (tuple, list)) and len(x) == 3
            and all(_is_real_number(v) and math.isfinite(v) for v in x))  # type: ignore[arg-type]


def parse_coefficients(coefficients: object) -> tuple[tuple[float, float, float], ...]:
    """Normalise ``coefficients`` to a non-empty tuple of per-step ``(a, b, c)`` (the last repeats).

    Accepts one ``(a, b, c)``, a sequence of them, or a name in :data:`COEFFICIENT_SCHEDULES`.
    """
    if isinstance(coefficients, str):
        if coefficients in COEFFICIENT_SCHEDULES:
            return COEFFICIENT_SCHEDULES[coefficients]
    elif _is_triple(coefficients):
        return (tuple(float(v) for v in coefficients),)  # type: ignore[union-attr,return-value]
    elif isinstance(coefficients, (tuple, list)) and coefficients and all(_is_triple(t) for t in coefficients):
        return tuple(tuple(float(v) for v in t) for t in coefficients)  # type: ignore[misc]
    raise ValueError(
        f"coefficients must be 3 finite real numbers (a, b, c), a sequence of such triples (one per "
        f"step), or one of {sorted(COEFFICIENT_SCHEDULES)}; got {coefficients!r}"
    )


def resolve_backend(shape: tuple[int, ...] | torch.Size, backend: str = "auto", *,
                    device: torch.device | str | None = None) -> str:
    """The concrete backend (``"direct"``, ``"direct_fp16"`` or ``"gram"``) of one call on ``shape`` (2-D,
    or 3-D with the batch first) on ``device``.

    ``"auto"`` on CUDA: ``"gram"`` for shapes with ``long >= GRAM_MIN_ASPECT * short`` and enough work
    (:data:`GRAM_MIN_WORK`), ``"direct_fp16"`` otherwise (float16 runs at bfloat16's speed there with 3
    more mantissa bits). Elsewhere (CPU): ``"direct"``, since float16 products are several times slower
    than bfloat16 ones on CPUs (6.0x on an AVX512-BF16/AMX core, 512x2048x512)."""
    if backend not in NS_BACKENDS:
        raise ValueError(f"backend must be one of {NS_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device is None or torch.device(device).type != "cuda":
        return "direct"
    short, long = sorted(shape[-2:])
    batch = math.prod(shape[:-2])
    wide = long >= GRAM_MIN_ASPECT * short and batch * short * short * long >= GRAM_MIN_WORK
    return "gram" if wide else "direct_fp16"


def _validate(
    G: object, steps: object, coefficients: object, eps: object
) -> tuple[tuple[float, float, float], ...]:
    """Check user arguments up front so mistakes fail loudly instead of producing garbage."""
    if not isinstance(G, Tensor):
        raise TypeError(f"newton_schulz expects a torch.Tensor, got {type(G).__name__}")
    if G.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz expects a 2-D matrix or a 3-D batch of matrices, "
            f"got ndim={G.ndim} (shape {tuple(G.shape)})"
        )
    if G.is_complex():
        # .bfloat16() would silently drop the imaginary part.
        raise ValueError(f"newton_schulz does not support complex input, got dtype {G.dtype}")
    if G.shape[-2] == 0 or G.shape[-1] == 0:
        raise ValueError(f"newton_schulz needs non-empty matrices, got shape {tuple(G.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise ValueError(f"steps must be an int in [0, {_MAX_STEPS}), got {steps!r}")
    if not 0 <= steps < _MAX_STEPS:
        raise ValueError(f"steps must be an int in [0, {_MAX_STEPS}), got {steps!r}")
    schedule = parse_coefficients(coefficients)
    # `not (eps > 0)` also rejects NaN.
    if not _is_real_number(eps) or not (eps > 0) or not math.isfinite(eps):  # type: ignore[operator]
        raise ValueError(f"eps must be a finite real number > 0, got {eps!r}")
    return schedule


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Coefficients = KELLER_JORDAN_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    *,
    backend: str = "direct",
) -> Tensor:
    """Approximately orthogonalise ``G`` (its polar factor ``U V^T``) with quintic Newton–Schulz.

    With the defaults and a 2-D ``G`` the result is bit-identical to torch's private
    ``torch.optim._muon._zeropower_via_newtonschulz(G, coefficients, steps, eps)``: the input is
    cast to bfloat16, transposed if it has more rows than columns (so the Gram matrix ``X X^T`` is
    the small one), divided by its Frobenius norm clamped at ``eps`` (which bounds the spectral
    norm by 1, the iteration's basin), iterated ``steps`` times with
    ``A = X X^T; B = b A + c A A; X = a X + B X``, and transposed back.

    A 3-D ``G`` of shape ``(batch, m, n)`` is treated as ``batch`` independent matrices: each is
    normalised by its own Frobenius norm and iterated with batched matmuls (``batch`` may be 0).
    Every slice equals the 2-D result for that slice up to bfloat16 rounding: batched kernels may
    accumulate in a different order. On CPU (torch 2.13) the tests observe and assert bitwise
    equality; other backends (e.g. CUDA bmm vs. mm) are not promised to match bit for bit.

    Unlike torch's function, ``G`` is never modified in place, even when it is already bfloat16.

    Args:
        G: a ``(m, n)`` matrix or a ``(batch, m, n)`` stack of matrices, real dtype.
        steps: number of iterations, an int in ``[0, 100)``.
        coefficients: ``(a, b, c)`` of the odd polynomial ``a x + b x^3 + c x^5`` for every step,
            a sequence of such triples (one per step; the last repeats), or a schedule name
            (``"keller_jordan"``, ``"polar_express"``).
        eps: positive floor on the Frobenius norm used for normalisation.
        backend: ``"direct"`` (torch's form, bfloat16), ``"direct_fp16"`` (the same in float16),
            ``"gram"`` (float16 Gram-space iteration, fewer flops for wide matrices) or ``"auto"`` (on CUDA
            ``"gram"`` when the long side is >= :data:`GRAM_MIN_ASPECT` times the short side and the call
            is big enough, else ``"direct_fp16"``, with symmetric-product kernels; on the CPU
            ``"direct"``; see :func:`resolve_backend`). See the module docstring.

    Returns:
        A bfloat16 tensor with the shape of ``G``.

    Raises:
        TypeError: if ``G`` is not a tensor.
        ValueError: on bad ndim, empty matrix dimensions, complex dtype, ``steps``,
            ``coefficients``, ``eps`` or ``backend``.

    Example::

        >>> G = torch.randn(64, 32)
        >>> O = newton_schulz(G)
        >>> O.dtype, O.shape
        (torch.bfloat16, torch.Size([64, 32]))
        >>> # singular values are pushed towards 1 (roughly into [0.5, 1.5])
        >>> s = torch.linalg.svdvals(O.float())
        >>> bool(s.min() > 0.3 and s.max() < 1.7)
        True
        >>> # Polar Express lands much closer to U V^T in the same 5 steps; Gram form for a wide G
        >>> O = newton_schulz(torch.randn(32, 128), coefficients="polar_express", backend="gram")
        >>> s = torch.linalg.svdvals(O.float())
        >>> bool(s.min() > 0.75 and s.max() < 1.2)
        True
    """
    out = newton_schulz_native(G, steps, coefficients, eps, backend=backend)
    return out if out.dtype == torch.bfloat16 else out.bfloat16()


def newton_schulz_native(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Coefficients = KELLER_JORDAN_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    *,
    backend: str = "direct",
) -> Tensor:
    """:func:`newton_schulz` without the final cast: bfloat16 from the direct form, float16 from the
    float16 forms (``"direct_fp16"``, ``"gram"``). An optimizer that adds the result into a parameter saves one pass over the update (and
    one rounding) by taking it as is.

    Example::

        >>> O = newton_schulz_native(torch.randn(16, 64), backend="gram")
        >>> O.dtype
        torch.float16
    """
    schedule = _validate(G, steps, coefficients, eps)
    resolved = resolve_backend(G.shape, backend, device=G.device)
    per_step = [schedule[min(k, len(schedule) - 1)] for k in range(steps)]
    if G.is_cuda and backend == "auto":  # one kernel choice for every product of this call
        from ._symmetric import ns_call

        with ns_call(_work(G.shape)):
            return _newton_schulz_native(G, per_step, eps, backend, resolved, steps)
    return _newton_schulz_native(G, per_step, eps, backend, resolved, steps)


def _work(shape: tuple[int, ...] | torch.Size) -> int:
    """``batch m^2 n`` of a call on ``shape`` (``m`` its short side): what its products cost."""
    short, long = sorted(shape[-2:])
    return math.prod(shape[:-2]) * short * short * long


def _newton_schulz_native(G: Tensor, per_step: list[tuple[float, float, float]], eps: float, backend: str,
                          resolved: str, steps: int) -> Tensor:
    transpose = G.shape[-2] > G.shape[-1]
    if resolved == "direct":
        X = G.bfloat16()
        X = X.mT if transpose else X  # same as .T for 2-D, so the 2-D path matches torch op for op
        X = _direct_iterate(X, per_step, eps, _use_symmetric(X, backend))
    elif resolved == "gram" and steps > 0:
        # normalised in G's own layout (a tall G is not copied into a transposed one), scaled so the first
        # Gram matrix stays clear of float16's subnormals; the iteration reads the wide view
        scale = _gram_scale(min(G.shape[-2:]))
        X = _half_normalised(G, eps, math.sqrt(scale))
        X = X.mT if transpose else X
        X = _gram_iterate(X, per_step, _use_symmetric(X, backend), scale=scale)
    else:
        X = _half_normalised(G.mT if transpose else G, eps)
        X = _direct_iterate(X, per_step, eps, _use_symmetric(X, backend), normalised=True)
    return X.mT if transpose else X


def native_dtype(shape: tuple[int, ...] | torch.Size, backend: str = "auto", *,
                 device: torch.device | str | None = None) -> torch.dtype:
    """The dtype :func:`newton_schulz_native` returns for ``shape`` on ``device``: bfloat16 from the direct
    form, float16 from the others. Known without computing, so a peer can size a buffer for the result.

    Example::

        >>> native_dtype((4, 256, 1024), "gram")
        torch.float16
    """
    return torch.bfloat16 if resolve_backend(shape, backend, device=device) == "direct" else torch.float16


def explain(shape: tuple[int, ...] | torch.Size, backend: str = "auto", *,
            device: torch.device | str | None = None) -> dict[str, str]:
    """What one call on ``shape`` (2-D, or 3-D with the batch first) on ``device`` runs inside ``dmuon.Muon``'s
    step, and why: the form (:func:`resolve_backend`), its dtype, and which kernel forms the symmetric products
    (``"quack"``, ``"triton"`` or ``"torch"``: cuBLAS's or the CPU's full products), for a call replayed from a
    CUDA graph where the step replays it (:mod:`dmuon.optim._graphs`). No tensor is allocated.

    Example::

        >>> explain((4, 2048, 8192), device="cpu")["form"]
        'direct'
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    form = resolve_backend(shape, backend, device=dev)
    dtype = native_dtype(shape, backend, device=dev)
    if backend != "auto":
        kernel, why = "torch", f"backend={backend!r}: torch's products (only 'auto' uses the symmetric kernels)"
    elif dev.type != "cuda":
        kernel, why = "torch", f"{dev.type}: 'auto' is torch's bfloat16 direct form (float16 products are slow there)"
    else:
        from . import _graphs, _symmetric

        graph = math.prod(shape) <= _graphs.MAX_ELEMENTS and _graphs.switched_on()
        with _symmetric.replayed() if graph else contextlib.nullcontext():
            kernel, why = _symmetric.kernel_for(dev, dtype, min(shape[-2:]), _work(shape))
    return {"form": form, "dtype": str(dtype).removeprefix("torch."), "symmetric_products": kernel, "why": why}


def _half_normalised(G: Tensor, eps: float, scale: float = 1.0) -> Tensor:
    """``scale G / max(||G||_F, eps)`` per matrix, computed in ``G``'s own dtype and rounded once to float16 (the
    float16 forms start from the input's precision, not from a bfloat16 copy of it), laid out as ``G``'s shape
    contiguously. The division comes before the cast: float16 overflows at 65504, gradients need not fit.
    ``scale`` is a power of two (exact)."""
    norm = G.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if scale != 1.0:
        norm = norm / scale
    return torch.div(G, norm, out=torch.empty(G.shape, dtype=torch.float16, device=G.device))


def _direct_iterate(X: Tensor, per_step: Sequence[tuple[float, float, float]], eps: float, sym: bool, *,
                    normalised: bool = False) -> Tensor:
    """``A = X X^T; B = b A + c A A; X = a X + B X`` per step, in ``X``'s dtype. A 2-D bfloat16 ``X`` without
    the symmetric kernel runs torch's exact operation sequence (normalisation included)."""
    if X.ndim == 2 and not sym and not normalised:
        # Out-of-place division: same values as torch's div_, but never aliases/mutates G.
        X = X / X.norm().clamp(min=eps)
        for a, b, c in per_step:
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
        return X
    squeeze = X.ndim == 2
    X = X.unsqueeze(0) if squeeze else X
    if not normalised:
        X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    quack = sym and _quack_full(X)
    for a, b, c in per_step:
        A = _gram_of(X, sym)
        B = _poly(A, b, c, sym)
        if quack:
            from . import _quack

            X = _quack.full_product(B, X, C=X, beta=a)
        else:
            X = torch.baddbmm(X, B, X, beta=a)
    return X.squeeze(0) if squeeze else X


def _use_symmetric(X: Tensor, backend: str) -> bool:
    """``"auto"`` on CUDA: compute ``X X^T`` and ``b A + c A A`` with the half-tile kernels of
    :mod:`dmuon.optim._symmetric` where they beat cuBLAS (imported only then: Triton is optional)."""
    if backend != "auto":
        return False
    from . import _symmetric

    return _symmetric.usable(X)


def _gram_of(X: Tensor, sym: bool) -> Tensor:
    """``X X^T`` for a batch."""
    if sym:
        from ._symmetric import symmetric_product

        return symmetric_product(X)
    return torch.bmm(X, X.mT)


def _commuting_product(P: Tensor, Q: Tensor, sym: bool) -> Tensor:
    """``P Q`` for batches of commuting symmetric matrices (polynomials in one Gram matrix): symmetric."""
    if sym:
        from ._symmetric import symmetric_product

        return symmetric_product(P, Z=Q)
    return torch.bmm(P, Q)


def _poly(A: Tensor, b: float, c: float, sym: bool) -> Tensor:
    """``b A + c A A`` for a batch of symmetric ``A``."""
    if sym:
        from ._symmetric import symmetric_product

        return symmetric_product(A, A, alpha=c, beta=b)
    return torch.baddbmm(A, A, A, beta=b, alpha=c)


def _quack_full(X: Tensor) -> bool:
    """Whether ``"auto"``'s full products on ``X`` go to quack's GEMM (:data:`QUACK_FULL_PRODUCTS`): only where
    quack is the symmetric kernel (its GEMM and its symmetric GEMM come from the same install)."""
    if not QUACK_FULL_PRODUCTS or not X.is_cuda:
        return False
    from . import _quack, _symmetric

    return _quack.gemm is not None and _symmetric.kernel_for(X.device, X.dtype, min(X.shape[-2:]))[0] == "quack"


def _gram_scale(m: int) -> float:
    """The first segment's Gram scale ``s`` for ``m`` rows: the largest power of 4 at most ``m``, and at most
    :data:`GRAM_MAX_SCALE`. With ``||X||_F = 1`` the entries of ``R = X X^T`` are about ``1 / (m sqrt(n))`` off
    the diagonal (2e-6 for 4096 x 14336), deep in float16's subnormal range, whose fixed spacing 2^-24 leaves
    them a few bits; ``s R`` (``||X||_F^2 = s``) has its eigenvalues about ``s / m``, near 1."""
    s = 1
    while 4 * s <= min(m, GRAM_MAX_SCALE):
        s *= 4
    return float(s)


def _product(Y: Tensor, Z: Tensor, alpha: float = 1.0, sym: bool = False) -> Tensor:
    """``alpha Y Z`` for a batch, rounded once. When ``Z`` is the transposed view of a contiguous tall matrix
    (a tall input's wide view), the product is computed as ``alpha Z^T Y^T`` into a contiguous tall result and
    its transposed view returned, so the caller's final ``.mT`` hands back a contiguous matrix."""
    tall = Z.mT.is_contiguous() and not Z.is_contiguous()
    if tall:
        Y, Z = Z.mT, Y.mT
    if sym and _quack_full(Y):
        from . import _quack

        out = _quack.full_product(Y, Z, alpha=alpha)
        return out.mT if tall else out
    out = torch.bmm(Y, Z) if alpha == 1.0 else torch.baddbmm(Y.new_empty(()), Y, Z, beta=0.0, alpha=alpha)
    return out.mT if tall else out


def _gram_iterate(X: Tensor, per_step: Sequence[tuple[float, float, float]], sym: bool = False, *,
                  scale: float = 1.0) -> Tensor:
    """The Gram-space iteration on a normalised wide float16 ``X`` (``m <= n``): returns float16 ``X_k``.

    ``X`` enters scaled, ``||X||_F^2 = scale`` (a power of 4), so the first segment works with ``A = scale R``
    and the polynomial's coefficients ``b / scale``, ``c / scale^2``; its closing product divides by
    ``sqrt(scale)`` (exact). Later segments start from the unscaled ``X``.

    Per segment (the first :data:`GRAM_FIRST_RESTART` steps, then :data:`GRAM_RESTART_EVERY` each):
    ``R = X X^T``; each step forms ``P = a I + b A + c A^2`` (off the diagonal in the product's epilogue,
    rounded once; the diagonal by :func:`dmuon.optim._symmetric.poly_diagonal`, also rounded once), accumulates
    ``Q <- P Q`` and (except on the segment's last step) advances ``A <- A P P`` (everything commutes, being a
    polynomial in ``R``); then ``X <- Q X``.
    """
    from ._symmetric import poly_diagonal

    squeeze = X.ndim == 2
    X = X.unsqueeze(0) if squeeze else X
    bounds = [0, *range(GRAM_FIRST_RESTART, len(per_step), GRAM_RESTART_EVERY), len(per_step)]
    for start, end in zip(bounds, bounds[1:]):
        s = scale if start == 0 else 1.0
        segment = per_step[start:end]
        A = _gram_of(X, sym)
        Q: Tensor | None = None
        for j, (a, b, c) in enumerate(segment):
            b, c = b / s, c / (s * s)
            P = poly_diagonal(_poly(A, b, c, sym), A, a, b, c)
            Q = P if Q is None else _commuting_product(P, Q, sym)
            if j + 1 < len(segment):
                A = _commuting_product(_commuting_product(A, P, sym), P, sym)
        assert Q is not None
        X = _product(Q, X, 1.0 / math.sqrt(s), sym)
    return X.squeeze(0) if squeeze else X
