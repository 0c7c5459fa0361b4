"""Gradient clipping over dedicated, FSDP2-sharded and plain gradients together.

``torch.nn.utils.clip_grad_norm_`` on a dmuon model would see placeholders without gradients on
non-owners, owner-only dedicated gradients and DTensor shards, and different ranks would take different
code paths. Here every rank adds up exactly its share of the global sum, and one all-reduce makes the
norm identical everywhere:

* a dedicated gradient lives (averaged) on its owner only, so the owner counts it (in ``main_grad``
  rather than ``.grad`` when ``dedicate_params(reduce_dtype=...)`` keeps it wider than the param);
* every other gradient is the engine's: its share comes from ``Engine.grad_share`` (``dmuon/engines``): an
  FSDP2 DTensor's local shard counts, except where it is replicated along a mesh dimension (HSDP), where only
  coordinate 0 of that dimension counts; a plain gradient is the same on every rank after it was averaged,
  so only slot 0 counts it.

Under pipeline parallelism each stage's ranks count their stage's share the same way, and the all-reduce runs
over every rank of the job, so the norm is the whole model's and every stage scales by the same factor
([Note: pipeline stages] in ``dmuon/runtime/topology.py``); every rank of every stage calls it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import engines
from .runtime import comm as C
from .runtime.hooks import DMuonState, live_states
from .runtime.param import is_dedicated

__all__ = ["clip_grad_norm_", "install_torch_clip_routing"]


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module | Sequence[nn.Module], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of every trainable parameter of ``model`` by their global norm; return the norm.

    Collective. Waits for pending dedicated reduces first, so call it after ``backward()`` and before
    ``optimizer.step()``. The norm equals ``torch.nn.utils.clip_grad_norm_`` on the same model trained on
    one process, and is the same tensor (float32, on dmuon's device) on every rank. A NaN or inf in any
    gradient on any rank makes it NaN / inf everywhere, as torch's does (for ``norm_type=inf`` too, where a
    backend's MAX could drop a NaN), so ``error_if_nonfinite=True`` raises on every rank together.
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a dmuon model comes here too.

    ``model`` may be a list of dmuon models: the stage modules one rank holds under an interleaved pipeline
    schedule (each dedicated on its own), clipped by one norm over all of them and every other rank's.

    Example::

        loss.backward()
        norm = dmuon.clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
    """
    parts = [model] if isinstance(model, nn.Module) else list(model)
    if not parts or not all(isinstance(m, nn.Module) for m in parts):
        raise TypeError("dmuon.clip_grad_norm_: model must be a module or a non-empty list of modules (this rank's "
                        f"pipeline stage modules), got {type(model).__name__}")
    return _clip([(engines.state_of(m), list(m.parameters())) for m in parts], max_norm, norm_type,
                 error_if_nonfinite)


@torch.no_grad()
def _clip(parts: list[tuple[DMuonState, list[torch.Tensor]]], max_norm: float, norm_type: float,
          error_if_nonfinite: bool) -> torch.Tensor:
    """The norm over each part's ``params`` (parameters of its state's model, the same lists on every rank of
    its stage), and clip. One reduce over the job, whatever the number of parts."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm >= 0 or math.isnan(max_norm):
        raise ValueError(f"dmuon.clip_grad_norm_: max_norm must be >= 0, got {max_norm!r}")
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"dmuon.clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}")
    for state, _ in parts:
        engines.of(state.model).check_norm("dmuon.clip_grad_norm_")
    ctx = parts[0][0].ctx
    inf = math.isinf(norm_type)
    grads: list[torch.Tensor] = []  # local tensors to scale
    acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for state, params in parts:
        share = _share(state, params, norm_type, grads)
        acc = torch.maximum(acc, share) if inf else acc + share
    if inf:  # NaN-propagating across ranks, whatever the backend's MAX does
        total = C.all_reduce_max(ctx, acc)
    else:
        total = C.all_reduce_sum(ctx, acc) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dmuon.clip_grad_norm_: the total norm of order {norm_type} is {total.item()}")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in grads:
        # the fp32 factor as is: rounding it to a bf16 gradient's dtype first would scale by up to 0.4% off
        local.mul_(coef.to(local.device))
    return total


def _share(state: DMuonState, params: list[torch.Tensor], norm_type: float, grads: list[torch.Tensor]
           ) -> torch.Tensor:
    """This rank's share of the norm of ``params`` (the max for ``norm_type=inf``, else the sum of powers);
    appends the local tensors to scale to ``grads``."""
    engine = engines.of(state.model)
    state.wait_all_reduces()
    ctx = state.ctx
    inf = math.isinf(norm_type)
    acc = torch.zeros((), dtype=torch.float32, device=ctx.device)
    main_grads = {id(dp.param): dp.main_grad for dp in state.dedicated() if dp.main_grad is not None}
    # tensor parallel: dmuon's ranks are one dp row per tp index; a tensor-parallel shard counts on its
    # own tp rank; a DTensor whose mesh has the "tp" dimension (FSDP2 over (dp, tp), e.g. a vocab-parallel
    # embedding) where its Replicate coordinates are 0, on every tp index; everything else (the same on every
    # tp index) on tp index 0; summed over every rank
    tp_first = state.tp_mesh is None or state.tp_mesh.get_local_rank() == 0
    tp_name = state.tp_mesh.mesh_dim_names[0] if state.tp_mesh is not None else None
    for p in params:
        g = main_grads.get(id(p), p.grad)
        if not p.requires_grad or g is None:
            continue
        if is_dedicated(p):
            local = g.to_local() if isinstance(g, DTensor) else g
            counts = isinstance(p, DTensor) or tp_first  # only the owner holds one (a TP shard: its tp rank's)
        else:
            local, counts = engine.grad_share(g, rank=ctx.rank, tp_first=tp_first, tp_name=tp_name)
        grads.append(local)
        if counts and local.numel():
            n = torch.linalg.vector_norm(local.float(), norm_type).to(ctx.device)
            acc = torch.maximum(acc, n) if inf else acc + n**norm_type
    return acc


# ---------------------------------------------------------------------- #
# torch's own clip functions on a dmuon model                              #
# ---------------------------------------------------------------------- #
# [Note: torch's clip on a dmuon model]
# ``torch.nn.utils.clip_grad_norm_`` adds up what each rank sees: owned dedicated gradients, DTensor
# shards, plain gradients, and nothing for dedicated gradients owned elsewhere, so each rank would get a
# different, wrong norm (or torch's "mixed torch.Tensor and DTensor" error). ``import dmuon`` therefore
# routes ``torch.nn.utils.clip_grad_norm_`` (both names torch exports it under) to :func:`_clip` when the
# parameters belong to a dmuon model (or to several: one rank's pipeline stage modules, clipped by one norm):
# the true global norm, clipped, on every rank alike. A reference
# bound before ``import dmuon`` (``from torch.nn.utils import clip_grad_norm_``) and
# ``torch.nn.utils.get_total_norm`` see only gradients, not parameters; given gradients of a dmuon model
# they raise, naming dmuon.clip_grad_norm_, on every rank (every rank passes the FSDP2 and plain ones).


def _parts_of(params: list[torch.Tensor]) -> list[tuple[DMuonState, list[torch.Tensor]]] | None:
    """``params`` split by the dmuon model each belongs to (one, or this rank's pipeline stage modules); a
    param of no dmuon model counts with the first. ``None``: no dedicated param among them."""
    if not any(is_dedicated(p) for p in params):
        return None
    owner = {id(p): st for st in live_states() for p in st.model.parameters()}
    parts: dict[int, tuple[DMuonState, list[torch.Tensor]]] = {}
    for p in params:
        st = owner.get(id(p))
        if st is not None:
            parts.setdefault(id(st), (st, []))[1].append(p)
    out = list(parts.values())
    out[0][1].extend(p for p in params if id(p) not in owner)
    return out


def _dmuon_grad_ids() -> set[int]:
    out: set[int] = set()
    for st in live_states():
        out.update(id(p.grad) for p in st.model.parameters() if p.grad is not None)
        out.update(id(dp.main_grad) for dp in st.dedicated() if dp.main_grad is not None)
    return out


def _routed_clip(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        parts = _parts_of(params)
        if parts is None:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return _clip(parts, max_norm, norm_type, error_if_nonfinite)

    clip_grad_norm_._dmuon_original = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _checked_total_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        ours = _dmuon_grad_ids() if live_states() else set()
        if any(id(t) in ours for t in ts):
            raise RuntimeError(
                "dmuon: torch.nn.utils.get_total_norm (or a clip_grad_norm_ imported before dmuon) over "
                "gradients of a dmuon model: a dedicated gradient lives only on its owner, so every rank "
                "would get a different norm. Use dmuon.clip_grad_norm_(model, max_norm), or call "
                "torch.nn.utils.clip_grad_norm_ by its module path after import dmuon."
            )
        return original(ts, *args, **kwargs)

    get_total_norm._dmuon_original = original  # type: ignore[attr-defined]
    return get_total_norm


def install_torch_clip_routing() -> None:
    """Route torch's clip functions on dmuon models (see [Note: torch's clip on a dmuon model]).
    Idempotent; ``import dmuon`` calls it."""
    import torch.nn.utils as U
    import torch.nn.utils.clip_grad as CG

    if not hasattr(CG.clip_grad_norm_, "_dmuon_original"):
        routed = _routed_clip(CG.clip_grad_norm_)
        CG.clip_grad_norm_ = routed
        U.clip_grad_norm_ = routed
    if not hasattr(CG._get_total_norm, "_dmuon_original"):
        checked = _checked_total_norm(CG._get_total_norm)
        CG._get_total_norm = checked
        U.get_total_norm = checked
