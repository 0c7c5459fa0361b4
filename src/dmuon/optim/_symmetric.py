"""Products whose result is symmetric, at about half the cost of a general matmul (Triton, CUDA).

Newton–Schulz forms ``X X^T`` and ``b A + c A A`` with ``A`` symmetric (so ``A A = A A^T``) in every step,
and the Gram form also ``P Q`` and ``A P P`` of commuting symmetric matrices. :func:`symmetric_product`
computes ``alpha Y Z^T + beta D`` on the tiles on and above the diagonal only and writes each off-diagonal
tile twice, as itself and as its transpose. :func:`poly_diagonal` writes the diagonal of ``a I + b A + c A^2``
rounded once (the Gram form's polynomial; see its docstring for why the diagonal needs it). Measured
on an H200 against ``torch.bmm`` (cuBLAS) on the Llama presets' NS shapes: 0.59-0.81x the time for ``m >=
1024``, slower for ``m = 512`` (too few tiles; :data:`SYMMETRIC_MIN_DIM`). Accumulation is fp32 like
cuBLAS's, in a different order, so results differ from it in the last bit: only ``ns_backend="auto"``
uses this. Pure tensor math, no ``torch.distributed``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor

from . import _quack

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional: without Triton, callers keep torch's matmuls
    triton = None

__all__ = ["SYMMETRIC_MIN_DIM", "kernel_for", "ns_call", "replayed", "poly_diagonal", "symmetric_product", "usable"]

#: smallest ``m`` (rows of ``Y``) worth the kernel: at ``m = 512`` cuBLAS's full product was faster, and at
#: ``m = 1024`` the whole Gram-form NS call was (8 x 1024 x 4096 on an H200: 1.77 ms against 1.17)
SYMMETRIC_MIN_DIM = 2048
_BLOCK, _BLOCK_K = 128, 64

if triton is not None:

    @triton.jit
    def _upper_tiles_kernel(Y, Z, D, C, pairs, M, K, alpha, beta, s_yb, s_ym, s_yk, s_zb, s_zm, s_zk, s_db, s_dm,
                            s_dn, s_cb, s_cm, s_cn, HAS_D: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """Tile ``(i, j)``, ``i <= j``, of ``C[b] = alpha Y[b] Z[b]^T + beta D[b]``, stored at (i, j) and (j, i)."""
        pid = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        i = tl.load(pairs + 2 * pid)
        j = tl.load(pairs + 2 * pid + 1)
        rm = i * BLOCK + tl.arange(0, BLOCK)
        rn = j * BLOCK + tl.arange(0, BLOCK)
        rk = tl.arange(0, BLOCK_K)
        a_ptr = Y + b * s_yb + rm[:, None] * s_ym + rk[None, :] * s_yk
        b_ptr = Z + b * s_zb + rn[:, None] * s_zm + rk[None, :] * s_zk
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptr, mask=(rm[:, None] < M) & k_ok, other=0.0)
            bt = tl.load(b_ptr, mask=(rn[:, None] < M) & k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(bt), acc)
            a_ptr += BLOCK_K * s_yk
            b_ptr += BLOCK_K * s_zk
        mask = (rm[:, None] < M) & (rn[None, :] < M)
        acc = acc * alpha
        if HAS_D:
            d = tl.load(D + b * s_db + rm[:, None] * s_dm + rn[None, :] * s_dn, mask=mask, other=0.0)
            acc += beta * d.to(tl.float32)
        out = acc.to(C.dtype.element_ty)
        tl.store(C + b * s_cb + rm[:, None] * s_cm + rn[None, :] * s_cn, out, mask=mask)
        if i != j:
            tl.store(C + b * s_cb + rn[:, None] * s_cm + rm[None, :] * s_cn, tl.trans(out), mask=tl.trans(mask))

    @triton.jit
    def _poly_diagonal_kernel(A, P, M, a, b, c, s_ab, s_am, s_ak, s_pb, s_pm, s_pn, BLOCK_K: tl.constexpr):
        """``P[b, i, i] = a + b A[b, i, i] + c sum_k A[b, i, k]^2``, in fp32, stored once in ``P``'s dtype."""
        i = tl.program_id(0).to(tl.int64)
        bb = tl.program_id(1).to(tl.int64)
        row = A + bb * s_ab + i * s_am
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, M, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(row + offs * s_ak, mask=offs < M, other=0.0).to(tl.float32)
            acc += v * v
        d = tl.load(row + i * s_ak).to(tl.float32)
        val = a + b * d + c * tl.sum(acc, axis=0)
        tl.store(P + bb * s_pb + i * (s_pm + s_pn), val.to(P.dtype.element_ty))


_PAIRS: dict[tuple[int, torch.device], Tensor] = {}


def _upper_pairs(tiles: int, device: torch.device) -> Tensor:
    """``(i, j)`` for every tile with ``i <= j``, flattened, cached per size and device."""
    key = (tiles, device)
    if key not in _PAIRS:
        idx = [v for i in range(tiles) for j in range(i, tiles) for v in (i, j)]
        _PAIRS[key] = torch.tensor(idx, dtype=torch.int32, device=device)
    return _PAIRS[key]


_call = threading.local()


@contextmanager
def _scoped(name: str, value: object) -> Iterator[None]:
    prev = getattr(_call, name, None)
    setattr(_call, name, value)
    try:
        yield
    finally:
        setattr(_call, name, prev)


def ns_call(work: int) -> AbstractContextManager[None]:
    """One Newton–Schulz call of ``work = batch m^2 n``: every product in it takes the same kernel, decided from
    the call's size, never from one operand's (a Gram matrix has fewer columns than ``X``)."""
    return _scoped("work", work)


def replayed() -> AbstractContextManager[None]:
    """The calls inside will be captured into a CUDA graph and replayed (:mod:`dmuon.optim._graphs`, its warm-up
    included, so the capture finds every kernel compiled): host costs per launch do not count."""
    return _scoped("replayed", True)


def kernel_for(device: torch.device, dtype: torch.dtype, m: int, work: int | None = None) -> tuple[str, str]:
    """Which kernel forms ``Y Y^T``-like products of ``m`` rows on ``device`` in ``dtype``, and why:
    ``"quack"`` (Hopper+, installed; ``m >= QUACK_MIN_DIM``, or a large batch from ``QUACK_BATCHED_MIN_DIM``),
    ``"triton"`` (CUDA, Triton importable, ``m >= SYMMETRIC_MIN_DIM``), or ``"torch"`` (the full product; also
    for an eager call with too little work to hide the kernels' launch costs, ``QUACK_EAGER_MIN_WORK``). ``work`` (``batch m^2 n`` of the NS call)
    defaults to the enclosing :func:`ns_call`'s. The one place this is decided."""
    if device.type != "cuda":
        return "torch", f"{device.type}: torch's products"
    if dtype not in (torch.bfloat16, torch.float16):
        return "torch", f"{dtype}: the symmetric kernels take 16-bit floats"
    work = getattr(_call, "work", None) if work is None else work
    graph = getattr(_call, "replayed", False)
    if not graph and work is not None and work < _quack.QUACK_EAGER_MIN_WORK:
        # measured on an H200: a lone 2048 x 8192 run eagerly took 1.76 ms with Triton's kernel, 1.05 with
        # cuBLAS's products (torch's own NS: 1.43)
        return "torch", "an eager call too small for the symmetric kernels: cuBLAS's full products are faster"
    quack_no = _quack.why_not(device)
    big = work is not None and work >= _quack.QUACK_BATCHED_MIN_WORK
    if quack_no is None and (m >= _quack.QUACK_MIN_DIM or (big and m >= _quack.QUACK_BATCHED_MIN_DIM)):
        return "quack", "quack's symmetric GEMM (Hopper+)" + ("" if m >= _quack.QUACK_MIN_DIM else ", a large batch")
    if triton is not None and m >= SYMMETRIC_MIN_DIM:
        return "triton", f"Triton's symmetric kernel ({quack_no or 'quack below its size'})"
    if m < SYMMETRIC_MIN_DIM:
        return "torch", f"m = {m} < {SYMMETRIC_MIN_DIM}: cuBLAS's full products are faster"
    return "torch", "neither quack nor Triton is installed"


def usable(Y: Tensor) -> bool:
    """Whether :func:`symmetric_product` should replace torch's matmul for ``Y Y^T`` on this tensor (see
    :func:`kernel_for`)."""
    return kernel_for(Y.device, Y.dtype, Y.shape[-2])[0] != "torch"


def symmetric_product(Y: Tensor, D: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0, *,
                      Z: Tensor | None = None) -> Tensor:
    """``alpha Y Z^T + beta D`` (``Z`` defaults to ``Y``) for ``(batch, m, k)`` ``Y``, ``Z`` and a symmetric
    ``(batch, m, m)`` ``D``, in ``Y``'s dtype with fp32 accumulation. Only the tiles on and above the
    diagonal are computed (``D`` is read there only) and mirrored, so the caller promises a symmetric
    result: ``Z = Y``, or ``Y`` and ``Z`` symmetric and commuting (polynomials in one symmetric matrix,
    where ``Y Z^T = Y Z``).

    Example::

        A = symmetric_product(X)                       # X X^T
        B = symmetric_product(A, A, alpha=c, beta=b)   # b A + c A A, for symmetric A
        Q = symmetric_product(P, Z=Q)                  # P Q, for commuting symmetric P, Q
    """
    if kernel_for(Y.device, Y.dtype, Y.shape[-2])[0] == "quack":
        return _quack.symmetric_product(Y, D, alpha, beta, Z=Z)
    if triton is None:
        raise RuntimeError("dmuon: symmetric_product needs Triton")
    if Y.ndim != 3 or (D is not None and D.shape != (Y.shape[0], Y.shape[1], Y.shape[1])):
        raise ValueError(f"expected Y (batch, m, k) and D (batch, m, m), got {tuple(Y.shape)} and "
                         f"{None if D is None else tuple(D.shape)}")
    Z = Y if Z is None else Z
    if Z.shape != Y.shape or Z.dtype != Y.dtype:
        raise ValueError(f"Z must match Y (batch, m, k) and dtype, got {tuple(Z.shape)} {Z.dtype} and "
                         f"{tuple(Y.shape)} {Y.dtype}")
    batch, m, k = Y.shape
    C = torch.empty((batch, m, m), dtype=Y.dtype, device=Y.device)
    if batch == 0 or m == 0:
        return C
    pairs = _upper_pairs(triton.cdiv(m, _BLOCK), Y.device)
    Dt = D if D is not None else C  # unread without HAS_D
    _upper_tiles_kernel[(pairs.numel() // 2, batch)](
        Y, Z, Dt, C, pairs, m, k, float(alpha), float(beta), *Y.stride(), *Z.stride(), *Dt.stride(), *C.stride(),
        HAS_D=D is not None, BLOCK=_BLOCK, BLOCK_K=_BLOCK_K, num_warps=8, num_stages=4 if m >= 4096 else 3,
    )
    return C


def poly_diagonal(P: Tensor, A: Tensor, a: float, b: float, c: float) -> Tensor:
    """Overwrite the diagonal of ``P`` (``(batch, m, m)``) with that of ``a I + b A + c A A^T`` (``A`` symmetric:
    ``A A^T = A^2``), computed in fp32 from ``A`` and rounded once to ``P``'s dtype; returns ``P``.

    The Gram form's ``P = a I + b A + c A^2`` is formed as ``b A + c A^2`` by a matmul epilogue, rounded to
    float16, and ``a`` added to its diagonal. Near convergence the three terms cancel (at ``A``'s eigenvalue
    1, Keller Jordan's ``3.4445 - 4.775 + 2.0315 = 0.70`` from a ``b A + c A^2`` of -2.74), so rounding that
    intermediate costs about 4 float16 units of ``P``'s own size on the diagonal, where ``P``'s Frobenius
    norm sits. Off the diagonal ``a I`` adds nothing, so those entries are rounded once already; this
    recomputes the diagonal alone (one pass over ``A``: ``m^2`` reads against the ``m^3`` of the product).
    On CUDA with Triton one kernel; elsewhere torch's reductions.
    """
    if P.ndim != 3 or A.shape != P.shape or P.shape[-1] != P.shape[-2]:
        raise ValueError(f"expected P and A (batch, m, m), got {tuple(P.shape)} and {tuple(A.shape)}")
    batch, m, _ = A.shape
    if batch == 0 or m == 0:
        return P
    if triton is not None and A.is_cuda:
        _poly_diagonal_kernel[(m, batch)](A, P, m, float(a), float(b), float(c), *A.stride(), *P.stride(),
                                          BLOCK_K=1024, num_warps=4)
        return P
    sq = torch.linalg.vector_norm(A, dim=-1, dtype=torch.float32).square_()
    diag = A.diagonal(dim1=-2, dim2=-1).float()
    P.diagonal(dim1=-2, dim2=-1).copy_(sq.mul_(c).add_(diag, alpha=b).add_(a))
    return P
