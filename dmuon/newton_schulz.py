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

This file is pure tensor math: no ``torch.distributed``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = [
    "KELLER_JORDAN_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "DEFAULT_EPS",
    "newton_schulz",
]

#: ``(a, b, c)`` of ``torch.optim.Muon``'s defaults (Keller Jordan's tuned quintic).
KELLER_JORDAN_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: Number of iterations ``torch.optim.Muon`` runs by default.
DEFAULT_NS_STEPS = 5
#: Floor on the Frobenius norm used for normalisation (avoids 0/0 on an all-zero update).
DEFAULT_EPS = 1e-7

# torch.optim.Muon refuses >= 100 steps; we keep the same limit so configs are interchangeable.
_MAX_STEPS = 100


def _is_real_number(x: object) -> bool:
    """True for int/float-like scalars, excluding bool (``True`` is almost surely a bug)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _validate(
    G: object, steps: object, coefficients: object, eps: object
) -> tuple[float, float, float]:
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
    try:
        coeffs = tuple(coefficients)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"coefficients must be a sequence of 3 real numbers (a, b, c), got {coefficients!r}"
        ) from None
    if len(coeffs) != 3 or not all(_is_real_number(v) and math.isfinite(v) for v in coeffs):
        raise ValueError(
            f"coefficients must be a sequence of 3 finite real numbers (a, b, c), "
            f"got {coefficients!r}"
        )
    # `not (eps > 0)` also rejects NaN.
    if not _is_real_number(eps) or not (eps > 0) or not math.isfinite(eps):  # type: ignore[operator]
        raise ValueError(f"eps must be a finite real number > 0, got {eps!r}")
    a, b, c = (float(v) for v in coeffs)
    return a, b, c


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = KELLER_JORDAN_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Approximately orthogonalise ``G`` (its polar factor ``U V^T``) with quintic Newton–Schulz.

    For a 2-D ``G`` the result is bit-identical to torch's private
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
        coefficients: ``(a, b, c)`` of the odd polynomial ``a x + b x^3 + c x^5``.
        eps: positive floor on the Frobenius norm used for normalisation.

    Returns:
        A bfloat16 tensor with the shape of ``G``.

    Raises:
        TypeError: if ``G`` is not a tensor.
        ValueError: on bad ndim, empty matrix dimensions, complex dtype, ``steps``,
            ``coefficients`` or ``eps``.

    Example::

        >>> G = torch.randn(64, 32)
        >>> O = newton_schulz(G)
        >>> O.dtype, O.shape
        (torch.bfloat16, torch.Size([64, 32]))
        >>> # singular values are pushed towards 1 (roughly into [0.5, 1.5])
        >>> s = torch.linalg.svdvals(O.float())
        >>> bool(s.min() > 0.3 and s.max() < 1.7)
        True
    """
    a, b, c = _validate(G, steps, coefficients, eps)

    transpose = G.shape[-2] > G.shape[-1]
    X = G.bfloat16()
    if transpose:
        X = X.mT  # same as .T for 2-D, so the 2-D path matches torch op for op

    if X.ndim == 2:
        # Out-of-place division: same values as torch's div_, but never aliases/mutates G.
        X = X / X.norm().clamp(min=eps)
        for _ in range(steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)

    if transpose:
        X = X.mT
    return X
