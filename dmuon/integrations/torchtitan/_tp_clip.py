"""The gradient norm of a tensor-parallel torchtitan model, until :func:`dmuon.clip_grad_norm_` counts
FSDP2's (dp, tp) DTensors itself.

[Note: TP clipping stopgap]
Under tensor parallelism :func:`dmuon.clip_grad_norm_` counts every gradient that is not a dedicated TP
shard on tp index 0 only, which is right for FSDP2 DTensors over "dp" alone (the same values on every tp
index) but drops half of torchtitan's vocab-sharded ``tok_embeddings`` and ``lm_head``: FSDP2 makes those
(and the norms) DTensors over ("fsdp", "tp"), and the embedding's and head's tp shards differ (measured on
the debug model at dp=1 x tp=2: 0.555 instead of 0.833). A DTensor whose mesh has the "tp" dimension
already tells which ranks hold distinct values (its Replicate dimensions), so this module counts such a
gradient wherever its Replicate coordinates are 0, on every tp index, and keeps dmuon's rule for the rest.
Delete it once ``dmuon/clip.py`` applies its ``tp_first`` only to DTensors whose mesh lacks "tp".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from ...runtime.hooks import DMuonState
from ...runtime.param import is_dedicated


def _distinct_here(g: DTensor) -> bool:
    """Whether this rank's local shard of ``g`` is the first copy of it (coordinate 0 on every Replicate dim)."""
    coord = g.device_mesh.get_coordinate()
    return coord is not None and all(c == 0 for c, pl in zip(coord, g.placements) if isinstance(pl, Replicate))


@torch.no_grad()
def clip_tensor_parallel_(
    model: nn.Module, state: DMuonState, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """:func:`dmuon.clip_grad_norm_` for a model with ``state.tp_mesh``, counting (dp, tp) DTensors on every
    tp index. Collective over every rank; finite ``norm_type`` only. See [Note: TP clipping stopgap]."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0 or math.isnan(max_norm):
        raise ValueError(f"dmuon torchtitan clip_grad_norm_: max_norm must be >= 0, got {max_norm!r}")
    if not 0 < norm_type < math.inf:
        raise ValueError(f"dmuon torchtitan clip_grad_norm_: with tensor parallelism norm_type must be finite and "
                         f"> 0, got {norm_type!r}")
    state.wait_all_reduces()
    tp_first = state.tp_mesh.get_local_rank() == 0
    tp_shards = {id(dp.param) for dp in state.dedicated() if dp.tp_dim is not None}
    main_grads = {id(dp.param): dp.main_grad for dp in state.dedicated() if dp.main_grad is not None}
    grads: list[torch.Tensor] = []
    acc = torch.zeros((), dtype=torch.float32, device=state.ctx.device)
    for p in model.parameters():
        g = main_grads.get(id(p), p.grad)
        if not p.requires_grad or g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        if is_dedicated(p):
            counts = id(p) in tp_shards or tp_first  # only the owner holds one
        elif isinstance(g, DTensor):
            spans_tp = "tp" in (g.device_mesh.mesh_dim_names or ())
            counts = _distinct_here(g) and (spans_tp or tp_first)
        else:
            counts = state.ctx.rank == 0 and tp_first
        grads.append(local)
        if counts and local.numel():
            acc += torch.linalg.vector_norm(local.float(), norm_type).to(acc.device) ** norm_type
    dist.all_reduce(acc)  # every rank: dp rows and tp indices; NaN and inf propagate through the sum
    total = acc ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon torchtitan clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in grads:
        local.mul_(coef.to(local.device))
    return total
