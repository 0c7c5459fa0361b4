"""quack's symmetric GEMM (CuTeDSL kernels, Hopper and newer) for Newton–Schulz's symmetric products, used
when the optional extra is installed (``pip install "dmuon[quack]"``); :func:`dmuon.optim._symmetric.kernel_for`
decides when. Pure tensor math, no ``torch.distributed``.

Measured on an H200 (torch 2.11, quack-kernels 0.5.0, ``scripts/gpu_ns_side_by_side.py``): with it
``"auto"`` takes 73.1 ms on the Llama-3.1-8B share at 8 ranks against 88.3 ms with the Triton kernel.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    from quack.gemm_interface import gemm, gemm_add, gemm_symmetric
except Exception:  # noqa: BLE001 - optional: a missing or broken install leaves the Triton kernel in charge
    gemm = gemm_add = gemm_symmetric = None

__all__ = ["QUACK_MIN_DIM", "QUACK_BATCHED_MIN_DIM", "QUACK_BATCHED_MIN_WORK", "QUACK_EAGER_MIN_WORK", "available",
           "full_product", "why_not", "symmetric_product"]

#: smallest ``m`` worth quack's kernel inside NS: measured on an H200 the whole NS call was slower with it
#: than with cuBLAS's full products at m = 512 (4 x 512 x 2048: 1.16 ms against 0.34) and m = 1024
#: (8 x 1024 x 4096, Gram form: 1.71 ms against 1.13), faster from m = 2048 (4 x 2048^2: 1.56 against 1.81)
QUACK_MIN_DIM = 2048
#: ...unless the call is a large batch (``batch m^2 n`` of at least :data:`QUACK_BATCHED_MIN_WORK`), as an
#: expert share is: measured on an H200 (2026-12-02, ``scripts/gpu_moe_ns.py``), 3 x 128 experts of
#: 768 x 2048 took 16.4 ms with quack against 21.2 with cuBLAS's products (gram-newton-schulz: 18.5), and
#: 3 x 128 of 2048 x 768 17.6 against 21.3 (gns 18.4)
QUACK_BATCHED_MIN_DIM = 512
QUACK_BATCHED_MIN_WORK = 2**37
#: an NS call run eagerly (not replayed from a CUDA graph) takes a symmetric kernel only with at least this much
#: work: each quack launch costs host time that a small call cannot hide (a lone 2048 x 8192, eager: 3.77 ms
#: with quack against 1.24 with cuBLAS's products and torch's 1.48; replayed from a graph, 0.90)
QUACK_EAGER_MIN_WORK = 2**36


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def available(device: torch.device) -> bool:
    """quack importable and ``device`` a Hopper-or-newer GPU (compute capability 9.0+)."""
    return why_not(device) is None


def why_not(device: torch.device) -> str | None:
    """Why quack is not used on ``device`` (``None``: it is)."""
    if gemm_symmetric is None:
        return "quack-kernels is not installed (pip install 'dmuon[quack]')"
    if device.type != "cuda":
        return f"quack needs a CUDA GPU, got {device.type}"
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if major < 9:
        return f"quack's symmetric GEMM needs Hopper or newer (compute capability 9.0), got {major}.{minor}"
    return None


def symmetric_product(Y: Tensor, D: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0, *,
                      Z: Tensor | None = None) -> Tensor:
    """``alpha Y Z^T + beta D`` with a symmetric result, as :func:`dmuon.optim._symmetric.symmetric_product`
    promises (``Z`` defaults to ``Y``; otherwise ``Z`` is symmetric, so ``Z^T = Z`` is passed as is)."""
    B = Y.mT if Z is None else Z
    if D is None:
        out = gemm_symmetric(Y, B)
        return out if alpha == 1.0 else out.mul_(alpha)
    return gemm_symmetric(Y, B, C=D, alpha=alpha, beta=beta)


def full_product(Y: Tensor, Z: Tensor, C: Tensor | None = None, alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    """``alpha Y Z + beta C`` for ``(batch, m, k)`` ``Y`` and ``(batch, k, n)`` ``Z`` with quack's (autotuned) GEMM,
    in ``Y``'s dtype with fp32 accumulation, rounded once: what ``torch.baddbmm`` computes with cuBLAS."""
    if C is None or beta == 0.0:
        return gemm(Y, Z, alpha=alpha)
    return gemm_add(Y, Z, C, alpha=alpha, beta=beta)
