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
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._fsdp import FSDPModule
from ._patch import install_patch
from .integrations import activate_installed_glue
from .partition import OwnerPlan, ParamSpec, assign_owners
from .runtime import comm as C
from .runtime.config import RuntimeConfig
from .runtime.group import BoundaryGroup
from .runtime.hooks import STATE_ATTR, DMuonState
from .runtime.param import DEDICATED_ATTR, DedicatedParam, is_dedicated, local
from .runtime.precision import is_wider
from .runtime.route import REPLICATED_ATTR, Route

__all__ = ["dedicate_params", "DEFAULT_BOUNDARY_PATTERN"]

logger = logging.getLogger("dmuon")

#: A module whose name path ends in ``layers.N`` or ``blocks.N`` is a default hook boundary.
DEFAULT_BOUNDARY_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+$")

Predicate = Callable[[str, nn.Parameter], bool]
#: ``route(fqn, param)``: a :class:`dmuon.Route` (or its value, e.g. ``"adamw_owner"``), or ``None``
#: to leave the param to ``predicate`` (selected: ``Route.MUON``; else FSDP2's).
RouteFn = Callable[[str, nn.Parameter], "Route | str | None"]


class _Selected(NamedTuple):
    fqn: str
    module_path: str
    name: str
    module: nn.Module
    param: nn.Parameter
    route: Route = Route.MUON


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
    route: RouteFn | None = None,
    verbose: bool = True,
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
            are named ``("replicate", "shard")``; or, with tensor parallelism, the 2-D mesh with dims
            ``("dp", "tp")`` whose "tp" dimension ``ColwiseParallel`` / ``RowwiseParallel`` split the
            selected weights over (owners over "dp"; see the README's "Tensor parallelism"); or both, the
            3-D mesh ``("replicate", "shard", "tp")`` (HSDP x TP: FSDP2 over ``mesh["replicate", "shard"]``).
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

        route: ``route(fqn, param) -> dmuon.Route | str | None`` says per parameter where its update runs
            ([Note: routes] in ``dmuon/runtime/route.py``); ``None`` leaves it to ``predicate``.
            ``"muon"``: dedicated, Muon on its owner. ``"adamw_owner"``: dedicated, AdamW on its owner (any
            non-scalar param, e.g. a norm of a block whose matrices are all dedicated, which then needs
            no ``fully_shard`` of its own; not with ``param_dtype``). ``"adamw_sharded"``: FSDP2's, even if
            ``predicate`` selects it. ``"adamw_replicated"``: ``fully_shard`` skips it, every rank keeps it
            whole and dmuon averages its gradient. Default ``None``: ``predicate`` alone. Example::

                def route(fqn, p):
                    return "adamw_owner" if fqn.startswith("layers.") and p.ndim == 1 else None

                dmuon.dedicate_params(model, mesh, predicate, route=route)
                fully_shard(model, mesh=mesh)  # the layers hold no FSDP2 params any more

        verbose: ``True`` (default) prints the plan's one-line summary on rank 0 (``dmuon: 84 dedicated
            params over 8 ranks ...``), so a new user sees what was dedicated without configuring logging;
            ``False`` sends it to the ``"dmuon"`` logger at INFO instead.

    Returns:
        The :class:`~dmuon.partition.OwnerPlan`: owner per param, per-rank params/elements/NS cost and
        the imbalance (max/mean NS cost).

    Example::

        mesh = init_device_mesh("cuda", (world_size,))
        plan = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    """
    install_patch()
    # ---------------- validation: nothing changes before this block passes, on any rank ---------------- #
    try:
        v = _validate(model, mesh, predicate, route, replicate_mesh, hook_boundary_predicate, hook_boundary_strict,
                      RuntimeConfig(reshard_after_forward=bool(reshard_after_forward), prefetch=bool(prefetch),
                                    param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    except Exception as err:  # noqa: BLE001 - also a user predicate's own error: the peers must not wait for it
        if dist.is_available() and dist.is_initialized():
            _agree(f"{type(err).__name__}: {err}", None)  # the peers raise too, instead of waiting for this rank
        raise
    # The plan digest covers owners only; add shapes and boundaries so a rank with a differently-shaped
    # model fails here instead of hanging in its first broadcast, and the settings and dtypes: ranks
    # disagreeing on param_dtype / reduce_dtype would mismatch their buffers.
    dtypes = [f"{s.param.dtype}/{s.route.value}" for s in v.selected] + [f"replicated {s.fqn}" for s in v.replicated]
    _agree(None, hashlib.sha256(repr((v.plan.digest(), v.specs, v.config.fingerprint(), dtypes)).encode()).hexdigest())

    # ---------------- collective: dmuon's process groups over the grid of ranks ---------------- #
    ctx = C.CommContext.from_meshes(v.mesh, v.replicate_mesh, C.CommCounter())
    config, plan, selected, boundary_of, modules = v.config, v.plan, v.selected, v.boundary_of, v.modules

    # ---------------- mutation ---------------- #
    state = _build_state(model, ctx, config, plan, selected, boundary_of, modules)
    state.tp_mesh = v.tp_mesh
    for s in v.replicated:
        setattr(s.param, REPLICATED_ATTR, True)
    setattr(model, STATE_ATTR, state)
    activate_installed_glue()
    if dist.get_rank() == 0:
        if verbose:
            print(plan.summary_line(), flush=True)
        else:
            logger.info(plan.summary_line())
    return plan


class _Validated(NamedTuple):
    mesh: DeviceMesh
    replicate_mesh: DeviceMesh | None
    config: RuntimeConfig
    modules: dict[str, nn.Module]
    selected: list[_Selected]
    boundary_of: dict[str, str]
    specs: list[ParamSpec]
    plan: OwnerPlan
    #: params routed ``ADAMW_REPLICATED``
    replicated: list[_Selected]
    #: the "tp" dimension of a ("dp", "tp") mesh ([Note: TP update] in dmuon/optim/tp_update.py)
    tp_mesh: DeviceMesh | None


def _validate(model: nn.Module, mesh: DeviceMesh, predicate: Predicate | None, route: RouteFn | None,
              replicate_mesh: DeviceMesh | None,
              hook_boundary_predicate: Callable[[nn.Module], bool] | None, hook_boundary_strict: bool,
              config: RuntimeConfig) -> _Validated:
    """Every local check of ``dedicate_params`` and the owner plan; changes nothing."""
    mesh, replicate_mesh, tp_mesh = _check_meshes(model, mesh, replicate_mesh)
    _check_model(model, tp_mesh)
    modules = dict(model.named_modules(remove_duplicate=False))
    selected, replicated = _select(modules, predicate, route, config.param_dtype)
    for s in selected:
        _check_tensor_parallel(s, tp_mesh)
    boundary_of = {
        s.fqn: _resolve_boundary(s.fqn, s.module_path, modules, hook_boundary_predicate, hook_boundary_strict)
        for s in selected
    }
    specs = [ParamSpec(s.fqn, _plan_shape(s), boundary_of[s.fqn], tp_split=_tp_split(s, tp_mesh)) for s in selected]
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    plan = assign_owners(specs, mesh.size() * replicas)
    return _Validated(mesh, replicate_mesh, config, modules, selected, boundary_of, specs, plan, replicated, tp_mesh)


def _plan_shape(s: _Selected) -> tuple[int, int]:
    """The shape the owner plan weighs: a matrix's own; an ``ADAMW_OWNER`` param counts as one row of its
    elements (its NS cost is that of a 1 x n matrix, next to nothing, so the plan packs it with its
    boundary's matrices)."""
    shape = local(s.param).shape
    if s.route is Route.MUON:
        return int(shape[0]), int(shape[1])
    return 1, int(shape.numel())


def _tp_split(s: _Selected, tp_mesh: DeviceMesh | None) -> tuple[int, int] | None:
    """``(tp_dim, tp_size)`` of a tensor-parallel Muon matrix, for the owner plan's cost; else ``None``."""
    if not isinstance(s.param, DTensor) or tp_mesh is None or s.route is not Route.MUON:
        return None
    return int(s.param.placements[0].dim), int(tp_mesh.size())  # type: ignore[union-attr]


def _check_tensor_parallel(s: _Selected, tp_mesh: DeviceMesh | None) -> None:
    """A selected DTensor must be a Muon matrix split evenly by rows or columns over the "tp" mesh."""
    from torch.distributed.tensor import Shard

    p = s.param
    if not isinstance(p, DTensor):
        return
    where = f"dmuon.dedicate_params: {s.fqn!r} is a DTensor"
    if tp_mesh is None or p.device_mesh != tp_mesh:
        raise ValueError(f"{where} on {p.device_mesh}; with tensor parallelism pass the 2-D mesh with dims "
                         "('dp', 'tp') whose 'tp' dimension the weights are sharded over.")
    if s.route is not Route.MUON or tuple(p.placements) not in ((Shard(0),), (Shard(1),)):
        raise ValueError(f"{where} placed {tuple(p.placements)}; dmuon dedicates tensor-parallel Muon matrices "
                         "sharded by rows (ColwiseParallel) or columns (RowwiseParallel).")
    dim = p.placements[0].dim  # type: ignore[union-attr]
    if p.shape[dim] % tp_mesh.size():
        raise ValueError(f"{where} whose dim {dim} ({p.shape[dim]}) does not split evenly over {tp_mesh.size()} tp ranks.")


def _agree(error: str | None, fingerprint: str | None) -> None:
    """One gather over the default group: every rank's local verdict and plan fingerprint. A rank that
    failed its checks makes every other rank raise too (it raises its own error), and ranks with
    different plans all raise; nothing has changed anywhere yet."""
    views = C.all_gather_default((dist.get_rank(), error, fingerprint))
    failed = [(r, e) for r, e, _ in views if e is not None]  # type: ignore[misc]
    if failed and error is None:
        raise ValueError("dmuon.dedicate_params: refused on " + "; ".join(f"rank {r}: {e}" for r, e in failed)
                         + ". Nothing was changed on any rank.")
    if failed:
        return
    digests = [fp for _, _, fp in views]  # type: ignore[misc]
    if len(set(digests)) != 1:
        raise RuntimeError(
            "dmuon.dedicate_params: ranks computed different owner plans or settings (different models, "
            f"predicates, shapes or dtypes per rank?); plan digests: {digests}"
        )


def _check_meshes(model: nn.Module, mesh: DeviceMesh, replicate_mesh: DeviceMesh | None
                  ) -> tuple[DeviceMesh, DeviceMesh | None, DeviceMesh | None]:
    """The (shard, replicate) meshes, or the error naming what is wrong with the arguments."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"dmuon.dedicate_params: model must be an nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dmuon.dedicate_params needs torch.distributed initialised (dist.init_process_group).")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"dmuon.dedicate_params: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    tp_mesh = None
    if replicate_mesh is None and names == ("replicate", "shard", "tp"):  # HSDP x TP
        mesh, replicate_mesh, tp_mesh = mesh["shard"], mesh["replicate"], mesh["tp"]
    elif replicate_mesh is None and names == ("replicate", "shard"):
        mesh, replicate_mesh = mesh["shard"], mesh["replicate"]
    elif replicate_mesh is None and names == ("dp", "tp"):
        mesh, tp_mesh = mesh["dp"], mesh["tp"]  # tensor parallel: owners over "dp" ([Note: TP update])
    if mesh.ndim != 1:
        raise ValueError(
            f"dmuon.dedicate_params: mesh must be 1-D (the data-parallel dimension, e.g. mesh['dp']), a 2-D "
            f"HSDP mesh with dims named ('replicate', 'shard'), a 2-D tensor-parallel mesh with dims ('dp', "
            f"'tp'), or a 3-D HSDP x TP mesh with dims ('replicate', 'shard', 'tp'); got a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} with dims {mesh.mesh_dim_names}."
        )
    if replicate_mesh is not None and (not isinstance(replicate_mesh, DeviceMesh) or replicate_mesh.ndim != 1):
        raise ValueError(f"dmuon.dedicate_params: replicate_mesh must be a 1-D DeviceMesh, got {replicate_mesh!r}")
    if replicate_mesh is not None:
        _check_not_swapped(mesh, replicate_mesh)
    replicas = (replicate_mesh.size() if replicate_mesh is not None else 1) * (tp_mesh.size() if tp_mesh else 1)
    if mesh.size() * replicas != dist.get_world_size():
        raise ValueError(
            f"dmuon.dedicate_params: the mesh has {mesh.size()} ranks"
            + (f" x {replicas} replicas" if replicate_mesh is not None else "")
            + f" but the default process group has {dist.get_world_size()}; dmuon needs its data-parallel "
            "mesh (with replicate_mesh for HSDP) to cover every rank."
        )
    return mesh, replicate_mesh, tp_mesh


def _check_not_swapped(mesh: DeviceMesh, replicate_mesh: DeviceMesh) -> None:
    """Refuse shard and replicate meshes passed the wrong way round, where their dim names say so (they
    would train, with dmuon's broadcasts on the replicate dimension: across nodes instead of within)."""
    shard_name, replicate_name = (m.mesh_dim_names[0] if m.mesh_dim_names else "" for m in (mesh, replicate_mesh))
    if (("replicate" in shard_name and "replicate" not in replicate_name)
            or ("shard" in replicate_name and "shard" not in shard_name)):
        raise ValueError(
            f"dmuon.dedicate_params: the mesh is named {shard_name!r} and replicate_mesh {replicate_name!r}: they "
            "look swapped. Pass the shard dimension as mesh and the replicate dimension as replicate_mesh, e.g. "
            "dedicate_params(model, hsdp['shard'], replicate_mesh=hsdp['replicate']), or the 2-D mesh itself."
        )


def _check_model(model: nn.Module, tp_mesh: DeviceMesh | None = None) -> None:
    """Refuse a model dmuon already prepared, one ``fully_shard`` already sharded, or a ``torch.compile``
    wrapper (its hooks and names belong to the module inside)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "dmuon.dedicate_params: got a DistributedDataParallel wrapper; call dedicate_params on the model "
            "first, then wrap it: dmuon.dedicate_params(model, mesh, ...); ddp = DistributedDataParallel(model); "
            "optimizer = dmuon.Muon(ddp, ...). DDP then leaves the dedicated params to dmuon."
        )
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise ValueError(
            f"dmuon.dedicate_params: got a torch.compile wrapper ({type(model).__name__}); call dedicate_params "
            "(and fully_shard) on the model itself, then compile: dmuon.dedicate_params(model, mesh, ...); "
            "fully_shard(model, ...); model = torch.compile(model)."
        )
    if getattr(model, STATE_ATTR, None) is not None or any(is_dedicated(p) for p in model.parameters()):
        raise ValueError("dmuon.dedicate_params was already called on this model; call it once per model.")
    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    foreign = [(n, p.device_mesh) for n, p in model.named_parameters()
               if isinstance(p, DTensor) and p.device_mesh != tp_mesh]
    if foreign and not sharded:
        raise ValueError(
            f"dmuon.dedicate_params: {foreign[0][0]!r} is a DTensor on {foreign[0][1]} (tensor parallel?); pass "
            "the 2-D mesh with dims ('dp', 'tp') whose 'tp' dimension it is split over. Nothing was changed."
        )
    if sharded or foreign:
        raise ValueError(
            "dmuon.dedicate_params must run before fully_shard, but these modules are already FSDP2-sharded: "
            f"{sharded[:5]}{'...' if len(sharded) > 5 else ''}. Call dedicate_params first, then fully_shard."
        )


def _select(modules: dict[str, nn.Module], predicate: Predicate | None, route: RouteFn | None,
            param_dtype: torch.dtype | None) -> tuple[list[_Selected], list[_Selected]]:
    """Every parameter to dedicate (``route`` first, then ``predicate`` under any of its names: a tied
    weight has several), each object once, under its first name, checked; and those routed
    ``ADAMW_REPLICATED``."""
    aliases_of: dict[int, list[_Selected]] = {}
    for module_path, module in modules.items():
        for name, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{module_path}.{name}" if module_path else name
            aliases_of.setdefault(id(p), []).append(_Selected(fqn, module_path, name, module, p))
    selected, replicated = [], []
    for aliases in aliases_of.values():
        chosen = _route_of(aliases, predicate, route)
        if chosen is None or chosen[1] is Route.ADAMW_SHARDED:
            continue
        hit, r = chosen
        if r is Route.ADAMW_REPLICATED:
            replicated.append(aliases[0])
            continue
        _check_selected(hit._replace(route=r), [s.fqn for s in aliases], param_dtype)
        selected.append(aliases[0]._replace(route=r))
    if not selected:
        raise ValueError(
            "dmuon.dedicate_params: the predicate selected no parameters"
            + ("" if predicate is not None else " (default: nn.Linear weights inside 'layers.N'/'blocks.N')")
            + "; pass predicate=lambda name, p: ... selecting the 2-D weights Muon should own."
        )
    return selected, replicated


def _route_of(aliases: list[_Selected], predicate: Predicate | None, route: RouteFn | None
              ) -> tuple[_Selected, Route] | None:
    """The alias that decided and its route: ``route``'s answer where it has one (the same for every name
    of a tied weight), else ``Route.MUON`` where ``predicate`` selects any name; ``None``: FSDP2's."""
    if route is not None:
        answers = [(s, Route.parse(route(s.fqn, s.param), f"dmuon.dedicate_params: route({s.fqn!r})"))
                   for s in aliases]
        answers = [(s, r) for s, r in answers if r is not None]
        if len({r for _, r in answers}) > 1:
            raise ValueError(
                f"dmuon.dedicate_params: {aliases[0].fqn!r} is one tensor under several names, and route gives "
                f"them different routes ({', '.join(f'{s.fqn}: {r.value}' for s, r in answers)}); give every "
                "name the same one."
            )
        if answers:
            return answers[0]
    hits = [s for s in aliases if (predicate(s.fqn, s.param) if predicate is not None
                                   else _default_select(s.module_path, s.module, s.name, s.param))]
    return (hits[0], Route.MUON) if hits else None


def _check_selected(s: _Selected, names: list[str], param_dtype: torch.dtype | None) -> None:
    fqn, p = s.fqn, s.param
    if s.route is Route.MUON and p.ndim != 2:
        raise ValueError(
            f"dmuon.dedicate_params: predicate selected {fqn!r} with shape {tuple(p.shape)}; only 2-D weight "
            "matrices can take Muon (it orthogonalises matrices). Exclude it from the predicate, or route it "
            "'adamw_owner' to dedicate it with AdamW on its owner."
        )
    if s.route is Route.ADAMW_OWNER and p.ndim == 0:
        raise ValueError(f"dmuon.dedicate_params: route 'adamw_owner' for the scalar {fqn!r}; only params with at "
                         "least one dimension can be dedicated. Route it 'adamw_replicated' or leave it to FSDP2.")
    if s.route is Route.ADAMW_OWNER and param_dtype is not None:
        raise ValueError(
            f"dmuon.dedicate_params: route 'adamw_owner' for {fqn!r} with param_dtype={param_dtype}: an owner's "
            "AdamW on a param_dtype compute copy is not supported. Leave it to FSDP2 (its MixedPrecisionPolicy "
            "casts it) or drop param_dtype."
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
    if len(names) > 1:
        others = [n for n in names if n != fqn]
        raise ValueError(
            f"dmuon.dedicate_params: {fqn!r} is shared (also registered as {others}); tied "
            "weights cannot be dedicated. Exclude every name of it from the predicate."
        )


def _build_state(model: nn.Module, ctx: C.CommContext, config: RuntimeConfig, plan: OwnerPlan,
                 selected: list[_Selected], boundary_of: dict[str, str], modules: dict[str, nn.Module]
                 ) -> DMuonState:
    """The per-matrix records, boundary groups and hooks; the owners' values go into their buckets."""
    dps_by_boundary: dict[str, list[DedicatedParam]] = {}
    for s in selected:
        p = s.param
        owner = plan.owners[s.fqn]
        dp = DedicatedParam(s.fqn, s.module, s.name, owner, torch.Size(local(p).shape), p.dtype,
                            config.param_dtype if config.param_dtype != p.dtype else None, is_owner=owner == ctx.rank,
                            route=s.route, tp_dim=p.placements[0].dim if isinstance(p, DTensor) else None,
                            full_shape=torch.Size(p.shape))
        setattr(p, DEDICATED_ATTR, owner)
        dps_by_boundary.setdefault(boundary_of[s.fqn], []).append(dp)
    groups = [(modules[b], BoundaryGroup(b, dps, ctx, config)) for b, dps in dps_by_boundary.items()]
    state = DMuonState(model, ctx, config, groups)
    state.install_hooks()
    state.bind_if_needed(allow_meta=True)
    state.install_module_guards()
    # A DistributedDataParallel built on this model later reads this list and leaves these params out of
    # its broadcasts and all-reduces (torch's own ignore mechanism); without DDP nothing reads it.
    model._ddp_params_and_buffers_to_ignore = [s.fqn for s in selected]
    return state


def _default_select(module_path: str, module: nn.Module, name: str, p: nn.Parameter) -> bool:
    """``predicate=None``: the weight of every ``nn.Linear`` inside a ``layers.N``/``blocks.N`` block.
    Embeddings and output heads stay on AdamW, as Muon intends."""
    return (
        isinstance(module, nn.Linear)
        and name == "weight"
        and p.ndim == 2
        and _default_boundary(module_path) is not None
    )
