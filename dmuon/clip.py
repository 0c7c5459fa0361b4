"""Gradient clipping over dedicated, FSDP2-sharded and plain gradients together.

``torch.nn.utils.clip_grad_norm_`` on a dmuon model would see placeholders without gradients on
non-owners, owner-only dedicated gradients and DTensor shards, and different ranks would take different
code paths. Here every rank adds up exactly its share of the global sum, and one all-reduce makes the
norm identical everywhere:

* a dedicated gradient lives (averaged) on its owner only, so the owner counts it (in ``main_grad``
  rather than ``.grad`` when ``dedicate_params(reduce_dtype=...)`` keeps it wider than the param);
* an FSDP2 gradient is a DTensor: its local shard counts, except where the DTensor is replicated along
  a mesh dimension (HSDP), where only coordinate 0 of that dimension counts;
* a plain gradient is the same on every rank after dmuon averaged it, so only slot 0 counts it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from .runtime import comm as C
from .runtime.hooks import get_state
from .runtime.param import is_dedicated

__all__ = ["clip_grad_norm_"]


def _counts_here(g: DTensor) -> bool:
    coord = g.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, pl in zip(coord, g.placements) if isinstance(pl, Replicate))


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of every trainable parameter of ``model`` by their global norm; return the norm.

    Collective. Waits for pending dedicated reduces first, so call it after ``backward()`` and before
    ``optimizer.step()``. The norm equals ``torch.nn.utils.clip_grad_norm_`` on the same model trained on
    one process, and is the same tensor (float32, on dmuon's device) on every rank. A NaN or inf in any
    gradient on any rank makes it NaN / inf everywhere, as torch's does (for ``norm_type=inf`` too, where a
    backend's MAX could drop a NaN), so ``error_if_nonfinite=True`` raises on every rank together.

    Example::

        loss.backward()
        norm = dmuon.clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
    """
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0 or math.isnan(max_norm):
        raise ValueError(f"dmuon.clip_grad_norm_: max_norm must be >= 0, got {max_norm!r}")
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"dmuon.clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}")
    state = get_state(model)
    state.wait_all_reduces()
    ctx = state.ctx
    inf = math.isinf(norm_type)
    grads: list[torch.Tensor] = []  # local tensors to scale
    acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    main_grads = {id(dp.param): dp.main_grad for dp in state.dedicated() if dp.main_grad is not None}
    for p in model.parameters():
        g = main_grads.get(id(p), p.grad)
        if not p.requires_grad or g is None:
            continue
        if isinstance(g, DTensor):
            local, counts = g.to_local(), _counts_here(g)
        elif is_dedicated(p):
            local, counts = g, True  # only the owner holds one
        else:
            local, counts = g, ctx.rank == 0
        grads.append(local)
        if counts and local.numel():
            n = torch.linalg.vector_norm(local.float(), norm_type).to(ctx.device)
            acc = torch.maximum(acc, n) if inf else acc + n**norm_type
    if inf:
        total = C.all_reduce_max(ctx, acc)  # NaN-propagating across ranks, whatever the backend's MAX does
    else:
        total = C.all_reduce_sum(ctx, acc) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon.clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in grads:
        # the fp32 factor as is: rounding it to a bf16 gradient's dtype first would scale by up to 0.4% off
        local.mul_(coef.to(local.device))
    return total
