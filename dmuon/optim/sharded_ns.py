"""Newton–Schulz of a matrix whose rows (or columns) are split over ranks, without gathering it.

[Note: sharded NS] Tensor parallelism keeps each weight split over the "tp" ranks: ``ColwiseParallel``
shards a ``Linear`` weight's rows (``Shard(0)``), ``RowwiseParallel`` its columns (``Shard(1)``). Muon
must orthogonalise the *full* matrix; orthogonalising each shard alone is another update (tested in
``tests/test_sharded_ns.py``). Each NS step is ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which equals
``X <- X (a I + b G + c G^2)`` with ``G = X^T X``, and ``X <- (a I + b A + c A^2) X`` with ``A = X X^T``.
Pick the Gram matrix that *sums over the split dimension*: rows split, ``G = sum_i X_i^T X_i``; columns
split, ``A = sum_j X_j X_j^T``. One all-reduce of that square matrix gives every rank the full Gram
matrix, and everything after it stays in Gram space: with ``P_k`` the step's polynomial in the current
Gram matrix, the next Gram matrix is ``P_k G_k P_k = G_k P_k^2`` (all of them are polynomials in the
first one, so they commute), the Frobenius norm that normalises ``X`` is ``sqrt(trace(G))``, and the
result is ``X_i Q`` (rows split) or ``Q X_j`` (columns split) with ``Q = P_0 P_1 ... P_{K-1}``. No rank
ever holds more of the matrix than its shard.

Bytes: one all-reduce of ``s x s`` elements per matrix and NS call (``s`` the unsplit side), in
``dtype``, against an all-gather of ``m x n`` for the gather-then-orthogonalise design; an optional
restart (re-forming the Gram matrix from the current ``X``, against drift in low precision) costs one
more all-reduce of the same size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .newton_schulz import DEFAULT_EPS, DEFAULT_NS_STEPS, KELLER_JORDAN_COEFFICIENTS, Coefficients, parse_coefficients

__all__ = ["newton_schulz_sharded", "gram_side"]


def gram_side(shape: tuple[int, int], sharded_dim: int) -> int:
    """The side of the square Gram matrix the all-reduce carries: the unsplit dimension's length."""
    if sharded_dim not in (0, 1):
        raise ValueError(f"sharded_dim must be 0 (rows split) or 1 (columns split), got {sharded_dim!r}")
    return int(shape[1 - sharded_dim])


def newton_schulz_sharded(
    local: Tensor,
    *,
    sharded_dim: int,
    all_reduce: Callable[[Tensor], Tensor],
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Coefficients = KELLER_JORDAN_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.float32,
    restart_after: tuple[int, ...] = (),
) -> Tensor:
    """This rank's shard of the Newton–Schulz result of the full matrix ([Note: sharded NS]).

    Args:
        local: this rank's shard, ``(..., m_i, n)`` with ``sharded_dim=0`` or ``(..., m, n_j)`` with
            ``sharded_dim=1``; a leading batch of same-shape matrices is allowed.
        sharded_dim: which dimension of the full 2-D matrix is split over the ranks.
        all_reduce: sums a tensor over the ranks that hold the shards and returns the sum (the caller's
            collective, e.g. ``dist.all_reduce`` over the "tp" group; this module stays free of
            distributed code).
        steps, coefficients, eps: as :func:`dmuon.newton_schulz`.
        dtype: the arithmetic's dtype (the Gram matrices and ``Q``); the result is cast back to
            ``local.dtype``.
        restart_after: step numbers after which the Gram matrix is formed again from the current ``X``
            (one all-reduce each), against drift of the Gram recursion in low precision.

    Example::

        shard = full[rank * rows : (rank + 1) * rows]           # ColwiseParallel's Shard(0)
        out = newton_schulz_sharded(shard, sharded_dim=0,
                                    all_reduce=lambda t: (dist.all_reduce(t, group=tp_group), t)[1])
    """
    if local.ndim < 2:
        raise ValueError(f"newton_schulz_sharded: expected a (batch of) matrices, got shape {tuple(local.shape)}")
    gram_side((local.shape[-2], local.shape[-1]), sharded_dim)  # validates sharded_dim
    per_step = parse_coefficients(coefficients)
    per_step = [per_step[min(k, len(per_step) - 1)] for k in range(steps)]
    rows = sharded_dim == 0  # rows split: G = X^T X, applied on the right

    def gram(X: Tensor) -> Tensor:
        return all_reduce(X.mT @ X if rows else X @ X.mT)

    def apply(X: Tensor, Q: Tensor) -> Tensor:
        return X @ Q if rows else Q @ X

    X = local.to(dtype)
    G = gram(X)
    norm = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1).clamp_min(0).sqrt()[..., None, None] + eps
    X = X / norm
    G = G / (norm * norm)
    eye = torch.eye(G.shape[-1], dtype=dtype, device=G.device).expand_as(G)
    Q = eye.clone()
    for k, (a, b, c) in enumerate(per_step):
        G2 = G @ G
        P = a * eye + b * G + c * G2
        Q = Q @ P
        if k + 1 in restart_after and k + 1 < steps:
            X, Q = apply(X, Q), eye.clone()
            G = gram(X)
        else:
            G = G @ P @ P
    return apply(X, Q).to(local.dtype)
