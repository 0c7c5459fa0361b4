"""``dedicate_params``: select matrices, assign owners, free non-owner storage, install hooks.

Everything that can be wrong with the user's input is checked before anything changes: no attribute is
set, no storage freed and no hook installed until all checks passed on this rank and the owner plan was
verified identical on every rank.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _collectives as C
from ._patch import DEDICATED_ATTR, install_patch, is_dedicated
from ._state import STATE_ATTR, DMuonState
from .diagnostics import CommCounter
from ._precision import check_float_dtype, is_wider
from .group import BoundaryGroup, DedicatedParam
from .partition import OwnerPlan, ParamSpec, assign_owners

__all__ = ["dedicate_params", "DEFAULT_BOUNDARY_PATTERN"]

logger = logging.getLogger("dmuon")

#: A module whose name path ends in ``layers.N`` or ``blocks.N`` is a default hook boundary.
DEFAULT_BOUNDARY_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+$")

Predicate = Callable[[str, nn.Parameter], bool]


def _is_fsdp_module(m: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(m, FSDPModule)


def _default_boundary(module_path: str) -> str | None:
    """Nearest ancestor-or-self of ``module_path`` whose path ends in ``layers.N`` / ``blocks.N``."""
    path = module_path
    while True:
        if DEFAULT_BOUNDARY_PATTERN.search(path):
            return path
        if not path:
            return None
        path = path.rsplit(".", 1)[0] if "." in path else ""


def _resolve_boundary(
    fqn: str,
    module_path: str,
    modules: dict[str, nn.Module],
    hook_boundary_predicate: Callable[[nn.Module], bool] | None,
    strict: bool,
) -> str:
    if hook_boundary_predicate is not None:
        path = module_path
        while True:
            if hook_boundary_predicate(modules[path]):
                return path
            if not path:
                break
            path = path.rsplit(".", 1)[0] if "." in path else ""
        if strict:
            raise ValueError(
                f"dmuon: hook_boundary_predicate matched no ancestor of dedicated param {fqn!r} (nor its own "
                "module). Widen the predicate, or pass hook_boundary_strict=False to fall back to the default "
                "(nearest 'layers.N'/'blocks.N', else the param's own module)."
            )
    found = _default_boundary(module_path)
    return module_path if found is None else found


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh,
    predicate: Predicate | None = None,
    *,
    replicate_mesh: DeviceMesh | None = None,
    hook_boundary_predicate: Callable[[nn.Module], bool] | None = None,
    hook_boundary_strict: bool = True,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> OwnerPlan:
    """Give every selected 2-D weight one owner rank; call once per model, before ``fully_shard``.

    The owner keeps the full tensor (and later its Muon momentum); every other rank keeps the same
    ``nn.Parameter`` object with 0 bytes of storage. Before a *hook boundary* module runs, each owner
    broadcasts its tensors of that boundary; after backward the gradients are averaged back to the owner.
    ``fully_shard`` (patched by ``import dmuon``) skips these parameters.

    Args:
        model: the root module (the one you later pass to :class:`dmuon.Muon`).
        mesh: 1-D data-parallel ``DeviceMesh`` spanning every rank (e.g. ``mesh["dp"]``); or, for HSDP,
            the shard dimension (``hsdp["shard"]``) with ``replicate_mesh``, or one 2-D mesh whose dims
            are named ``("replicate", "shard")``.
        replicate_mesh: HSDP's replicate dimension (``hsdp["replicate"]``). Each dedicated tensor then
            has one owner over all replicate x shard ranks; the ranks of its shard column keep a copy,
            gradients reduce over the shard group then the replicate group, and ``Muon.step()``
            publishes updates over the replicate group.
        predicate: ``predicate(fqn, param) -> bool`` selects dedicated params; they must be 2-D and
            trainable. Default: the weight of every ``nn.Linear`` inside a ``layers.N``/``blocks.N`` block.
        hook_boundary_predicate: ``fn(module) -> bool``; a param's boundary becomes its lowest ancestor
            (or own module) for which it is true. Default: nearest ``layers.N``/``blocks.N`` ancestor,
            else the param's own module.
        hook_boundary_strict: with a ``hook_boundary_predicate``, raise ``ValueError`` naming any param
            with no matching ancestor (``False``: fall back to the default rule).
        reshard_after_forward: ``True`` (Z3) frees non-owner copies after forward and broadcasts again
            before backward; ``False`` (Z2) keeps them from forward to backward.
        prefetch: start the broadcast of the boundary expected to run next (the order the previous
            forward recorded; in backward its reverse) before waiting for the current one, so
            communication overlaps compute. At most one boundary is fetched ahead; a wrong guess costs
            one broadcast, never correctness. ``False``: every boundary fetches its own weights and waits.
        param_dtype: compute dtype of the dedicated params (e.g. ``torch.bfloat16`` for an fp32 model
            under FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, whose bf16 activations
            would otherwise meet fp32 weights). The ``nn.Parameter`` becomes a ``param_dtype`` copy (what
            is broadcast and what the module sees); the owner keeps the value in the parameter's own
            dtype as the master that ``dmuon.Muon`` updates, and the model state-dict functions read and
            write that value. Must not be wider than any selected param's dtype. Default ``None``: the
            params' own dtype. Example::

                dmuon.dedicate_params(model, mesh, predicate, param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32)
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in model.layers:
                    fully_shard(layer, mesh=mesh, mp_policy=mp)
                fully_shard(model, mesh=mesh, mp_policy=mp)

        reduce_dtype: dtype of the gradient reduce (e.g. ``torch.float32`` for a bf16 model: averaging
            in fp32 avoids bf16 summation error across ranks). When it is wider than the compute dtype,
            the owner's averaged gradient stays in it (``dmuon.get_owned_grads``; ``param.grad`` stays
            ``None`` since torch requires a ``.grad`` of the param's dtype) and feeds the fp32 master
            directly, and :func:`dmuon.no_sync` accumulates in it. A narrower one is cast back to the
            param's dtype after the reduce. Default ``None``: the compute dtype. Example::

                dmuon.dedicate_params(bf16_model, mesh, predicate, reduce_dtype=torch.float32)
                optimizer = dmuon.Muon(bf16_model, lr=0.02, master_dtype=torch.float32)

    Returns:
        The :class:`~dmuon.partition.OwnerPlan`: owner per param, per-rank params/elements/NS cost and
        the imbalance (max/mean NS cost). One summary line is logged on rank 0 (logger ``"dmuon"``).

    Example::

        mesh = init_device_mesh("cuda", (world_size,))
        plan = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    """
    install_patch()
    # ---------------- validation: nothing changes before this block passes ---------------- #
    if not isinstance(model, nn.Module):
        raise TypeError(f"dmuon.dedicate_params: model must be an nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dmuon.dedicate_params needs torch.distributed initialised (dist.init_process_group).")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"dmuon.dedicate_params: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2 and replicate_mesh is None and tuple(mesh.mesh_dim_names or ()) == ("replicate", "shard"):
        mesh, replicate_mesh = mesh["shard"], mesh["replicate"]
    if mesh.ndim != 1:
        raise ValueError(
            f"dmuon.dedicate_params: mesh must be 1-D (the data-parallel dimension, e.g. mesh['dp']) or a 2-D "
            f"HSDP mesh with dims named ('replicate', 'shard'); got a {mesh.ndim}-D mesh {tuple(mesh.shape)} "
            f"with dims {mesh.mesh_dim_names}."
        )
    if replicate_mesh is not None and (not isinstance(replicate_mesh, DeviceMesh) or replicate_mesh.ndim != 1):
        raise ValueError(f"dmuon.dedicate_params: replicate_mesh must be a 1-D DeviceMesh, got {replicate_mesh!r}")
    for arg, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        check_float_dtype(f"dmuon.dedicate_params: {arg}", value)
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    if mesh.size() * replicas != dist.get_world_size():
        raise ValueError(
            f"dmuon.dedicate_params: the mesh has {mesh.size()} ranks"
            + (f" x {replicas} replicas" if replicate_mesh is not None else "")
            + f" but the default process group has {dist.get_world_size()}; dmuon needs its data-parallel "
            "mesh (with replicate_mesh for HSDP) to cover every rank."
        )
    if getattr(model, STATE_ATTR, None) is not None or any(is_dedicated(p) for p in model.parameters()):
        raise ValueError("dmuon.dedicate_params was already called on this model; call it once per model.")
    sharded = [name or "<root>" for name, m in model.named_modules() if _is_fsdp_module(m)]
    if sharded or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "dmuon.dedicate_params must run before fully_shard, but these modules are already FSDP2-sharded: "
            f"{sharded[:5]}{'...' if len(sharded) > 5 else ''}. Call dedicate_params first, then fully_shard."
        )

    modules = dict(model.named_modules(remove_duplicate=False))
    owners_of: dict[int, list[str]] = {}
    entries: list[tuple[str, str, str, nn.Module, nn.Parameter]] = []  # fqn, module_path, name, module, p
    for module_path, module in modules.items():
        for name, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{module_path}.{name}" if module_path else name
            owners_of.setdefault(id(p), []).append(fqn)
            if len(owners_of[id(p)]) == 1:
                entries.append((fqn, module_path, name, module, p))

    selected: list[tuple[str, str, str, nn.Module, nn.Parameter]] = []
    for fqn, module_path, name, module, p in entries:
        chosen = predicate(fqn, p) if predicate is not None else _default_select(module_path, module, name, p)
        if not chosen:
            continue
        if p.ndim != 2:
            raise ValueError(
                f"dmuon.dedicate_params: predicate selected {fqn!r} with shape {tuple(p.shape)}; only 2-D weight "
                "matrices can be dedicated (Muon orthogonalises matrices). Exclude it from the predicate."
            )
        if not p.requires_grad:
            raise ValueError(
                f"dmuon.dedicate_params: predicate selected frozen param {fqn!r} (requires_grad=False); frozen "
                "params have no gradient to reduce. Exclude it from the predicate."
            )
        if param_dtype is not None and is_wider(param_dtype, p.dtype):
            raise ValueError(
                f"dmuon.dedicate_params: param_dtype={param_dtype} is wider than {fqn!r} ({p.dtype}); "
                "param_dtype is the lower-precision compute dtype (the owner keeps the param's own dtype as "
                "the master). Pass a narrower param_dtype, or None."
            )
        if len(owners_of[id(p)]) > 1:
            raise ValueError(
                f"dmuon.dedicate_params: {fqn!r} is shared (also registered as {owners_of[id(p)][1:]}); tied "
                "weights cannot be dedicated. Exclude it from the predicate."
            )
        selected.append((fqn, module_path, name, module, p))
    if not selected:
        raise ValueError(
            "dmuon.dedicate_params: the predicate selected no parameters"
            + ("" if predicate is not None else " (default: nn.Linear weights inside 'layers.N'/'blocks.N')")
            + "; pass predicate=lambda name, p: ... selecting the 2-D weights Muon should own."
        )

    boundary_of = {
        fqn: _resolve_boundary(fqn, mp, modules, hook_boundary_predicate, hook_boundary_strict)
        for fqn, mp, *_ in selected
    }
    specs = [ParamSpec(fqn, (int(p.shape[0]), int(p.shape[1])), boundary_of[fqn]) for fqn, _, _, _, p in selected]
    plan = assign_owners(specs, mesh.size() * replicas)

    # ---------------- collective preflight: grid of ranks, and the same plan everywhere ---------------- #
    ctx = C.CommContext.from_meshes(mesh, replicate_mesh, CommCounter())
    # The plan digest covers owners only; add shapes and boundaries so a rank with a differently-shaped
    # model fails here instead of hanging in its first broadcast.
    # Dtypes too: ranks disagreeing on param_dtype / reduce_dtype would mismatch their buffers.
    dtypes = (str(param_dtype), str(reduce_dtype), [str(p.dtype) for *_, p in selected])
    fingerprint = hashlib.sha256(repr((plan.digest(), specs, dtypes)).encode()).hexdigest()
    digests = C.all_gather_object(ctx, fingerprint)
    if len(set(digests)) != 1:
        raise RuntimeError(
            "dmuon.dedicate_params: ranks computed different owner plans (different models, predicates or "
            f"shapes per rank?); plan digests: {digests}"
        )

    # ---------------- mutation ---------------- #
    dps_by_boundary: dict[str, list[DedicatedParam]] = {}
    for fqn, _, name, module, p in selected:
        dp = DedicatedParam(fqn, module, name, plan.owners[fqn], torch.Size(p.shape), p.dtype,
                            param_dtype if param_dtype != p.dtype else None)
        setattr(p, DEDICATED_ATTR, dp.owner)
        dps_by_boundary.setdefault(boundary_of[fqn], []).append(dp)
    groups = [
        (modules[b], BoundaryGroup(b, dps, ctx, reshard_after_forward, reduce_dtype=reduce_dtype))
        for b, dps in dps_by_boundary.items()
    ]
    state = DMuonState(model, ctx, plan, groups, reshard_after_forward, prefetch=bool(prefetch))
    state.install_hooks()
    state.bind_if_needed(allow_meta=True)
    setattr(model, STATE_ATTR, state)
    if dist.get_rank() == 0:
        logger.info(plan.summary_line())
    return plan


def _default_select(module_path: str, module: nn.Module, name: str, p: nn.Parameter) -> bool:
    """``predicate=None``: the weight of every ``nn.Linear`` inside a ``layers.N``/``blocks.N`` block.
    Embeddings and output heads stay on AdamW, as Muon intends."""
    return (
        isinstance(module, nn.Linear)
        and name == "weight"
        and p.ndim == 2
        and _default_boundary(module_path) is not None
    )
