"""``dedicate_params``: select matrices, assign owners, free non-owner storage, install hooks.

Everything that can be wrong with the user's input is checked before anything changes: no attribute is
set, no storage freed and no hook installed until all checks passed on this rank and the owner plan was
verified identical on every rank.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import engines
from .engines.fsdp2 import FSDP2, install_patch
from .integrations import activate_installed_glue
from .layout import choose_layout
from .partition import OwnerPlan, ParamSpec, assign_node_owners, assign_owners, blocks_ns_cost
from .runtime import comm as C
from .runtime.config import RuntimeConfig
from .runtime.grid import node_blocks
from .runtime.group import BoundaryGroup
from .runtime.hooks import STATE_ATTR, DMuonState
from .runtime.param import DEDICATED_ATTR, DedicatedParam, is_dedicated, local, splits_dim0_only
from .runtime.route import REPLICATED_ATTR, Route
from .runtime.topology import Topology
from .selection import (DEFAULT_BOUNDARY_PATTERN, BlocksFn, Predicate, RouteFn, Selected, default_boundary,
                        engine_loads, plan_shape, select, tp_split)

__all__ = ["dedicate_params", "DEFAULT_BOUNDARY_PATTERN"]

logger = logging.getLogger("dmuon")


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
    found = default_boundary(module_path)
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
    blocks: BlocksFn | None = None,
    layout: str = "auto",
    verbose: bool = True,
) -> OwnerPlan:
    """Give every selected weight (a matrix, or a batch of them such as experts ``[E, m, n]``) one owner
    rank; call once per model, before ``fully_shard``.

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
        predicate: ``predicate(fqn, param) -> bool`` selects dedicated params; they must be trainable and
            at least 2-D: a matrix, or a batch of matrices over the leading dims (experts ``[E, m, n]``,
            each expert orthogonalised alone). Default: the weight of every ``nn.Linear`` inside a
            ``layers.N``/``blocks.N`` block.
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

        blocks: ``blocks(fqn, param) -> None | int | list[int]`` declares *row blocks* of a selected
            param, each orthogonalised alone ([Note: matrix blocks] in ``dmuon/runtime/blocks.py``):
            ``None`` (default) keeps one matrix per trailing two dims; ``k`` splits the rows into ``k``
            equal blocks (per-head blocks, a fused gate/up ``[E, 2 I, H]`` with ``2``); a list gives each
            block's rows (a fused QKV: ``[q_rows, k_rows, v_rows]``); ``Interleaved`` blocks repeat in
            groups; ``Columns(...)`` splits the columns instead (a gate/up ``[E, H, 2 I]``, GPT-OSS's
            interleaved one as ``Columns(Interleaved(2, I))``); ``dmuon.integrations.hf.matrix_blocks(model)``
            answers for each HF family. Blocks that do not tile raise ``ValueError``. Each block takes
            ``adjust_lr_fn`` on its own shape. Example::

                dmuon.dedicate_params(model, mesh, predicate,
                                      blocks=lambda fqn, p: [4096, 1024, 1024] if fqn.endswith("wqkv.weight") else None)

        layout: where owners sit on a 1-D mesh over several nodes ([Note: node layout] in
            ``dmuon/runtime/hierarchy.py``). ``"flat"``: anywhere in the mesh, each phase one collective over
            every rank. ``"node"``: each boundary owned inside one node, its matrices spread over that node's
            ranks; each phase crosses the network once per rail (the ranks of one local index) with about
            ``1/ranks_per_node`` of the boundary, then gathers inside every node. Needs a 1-D mesh of two or more
            whole nodes of equal size (torchrun's ``LOCAL_WORLD_SIZE``, the same on every rank); refused with
            HSDP, tensor parallelism and pipeline stages. ``"auto"`` (default): ``"node"`` where it is allowed
            and dmuon's cost model (``dmuon.layout.choose_layout``) predicts less communication time, else
            ``"flat"``: on one node, or where nodes are unknown, always ``"flat"``. The choice is in
            ``dmuon.diagnostics.summarize`` and ``python -m dmuon.plan`` prints it. Example::

                # torchrun --nnodes 8 --nproc-per-node 8 train.py
                dmuon.dedicate_params(model, init_device_mesh("cuda", (64,)), predicate, layout="node")

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
    undo_whole = None
    try:
        _check_layout(layout, mesh, replicate_mesh)
        undo_whole = engines.take_whole(model, predicate)  # DeepSpeed's zero.Init: the selected params whole again
        v = _validate(model, mesh, predicate, route, blocks, replicate_mesh, hook_boundary_predicate,
                      hook_boundary_strict, RuntimeConfig(reshard_after_forward=bool(reshard_after_forward), prefetch=bool(prefetch),
                                    param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    except Exception as err:  # noqa: BLE001 - also a user predicate's own error: the peers must not wait for it
        if undo_whole is not None:
            undo_whole()  # the engine's own params back: a refused call changes nothing
        if dist.is_available() and dist.is_initialized():
            _agree(f"{type(err).__name__}: {err}", None)  # the peers raise too, instead of waiting for this rank
        raise
    # The plan digest covers owners only; add shapes and boundaries so a rank with a differently-shaped
    # model fails here instead of hanging in its first broadcast, and the settings and dtypes: ranks
    # disagreeing on param_dtype / reduce_dtype would mismatch their buffers.
    dtypes = ([f"{s.param.dtype}/{s.route.value}" for s in v.selected] + [f"replicated {s.fqn}" for s in v.replicated]
              + [f"sharded {s.fqn} {s.blocks}" for s in v.sharded])
    # the layout too: ranks that asked for different layouts would build different groups and hang
    fingerprint = hashlib.sha256(repr((v.plan.digest(), v.specs, v.config.fingerprint(), dtypes, layout)
                                      ).encode()).hexdigest()
    try:
        topology, per_node = _agree(None, _Mine(fingerprint, tuple(s.fqn for s in v.selected), _ranks(v.mesh),
                                                _ranks(v.replicate_mesh) or (dist.get_rank(),), _links(v),
                                                v.replicate_mesh is not None or v.tp_mesh is not None, _widens(v),
                                                C.local_world_size()))
        # every rank decides from the same gathered views: all refuse together, before anything changed
        node_size = _resolve_layout(layout, v, topology, per_node)
    except Exception:
        undo_whole()  # another rank refused, or the layout: the engine's own params back
        raise
    plan = v.plan if node_size is None else assign_node_owners(v.specs, v.mesh.size() // node_size, node_size,
                                                               preload=v.preload)

    # ---------------- collective: dmuon's process groups over the grid of ranks ---------------- #
    ctx = C.CommContext.from_meshes(v.mesh, v.replicate_mesh, C.CommCounter(), node_size=node_size)
    config, selected, boundary_of, modules = v.config, v.selected, v.boundary_of, v.modules

    # ---------------- mutation ---------------- #
    state = _build_state(model, ctx, config, plan, selected, boundary_of, modules, topology)
    state.tp_mesh = v.tp_mesh
    state.sharded_muon = {s.fqn: s.blocks for s in v.sharded}  # type: ignore[misc]
    for s in v.replicated:
        setattr(s.param, REPLICATED_ATTR, True)
    setattr(model, STATE_ATTR, state)
    activate_installed_glue()
    line = plan.summary_line() + (f"; {len(v.sharded)} expert params on the engine's shards" if v.sharded else "")
    if node_size is not None:
        line += f"; node layout, {v.mesh.size() // node_size} nodes of {node_size}"
    if topology.pipelined:  # each stage's first rank says its own
        line = line.replace("dmuon: ", f"dmuon: stage {topology.stage} of {len(topology.stages)}: ", 1)
    if dist.get_rank() == topology.stage_ranks[0]:
        if verbose:
            print(line, flush=True)
        else:
            logger.info(line)
    return plan


class _Validated(NamedTuple):
    mesh: DeviceMesh
    replicate_mesh: DeviceMesh | None
    config: RuntimeConfig
    modules: dict[str, nn.Module]
    #: dedicated params (``MUON``, ``ADAMW_OWNER``)
    selected: list[Selected]
    boundary_of: dict[str, str]
    specs: list[ParamSpec]
    plan: OwnerPlan
    #: params routed ``ADAMW_REPLICATED``
    replicated: list[Selected]
    #: params routed ``MUON_SHARDED``
    sharded: list[Selected]
    #: the "tp" dimension of a ("dp", "tp") mesh ([Note: TP update] in dmuon/optim/tp_update.py)
    tp_mesh: DeviceMesh | None
    #: NS work the engine's shards put on each slot (``muon_sharded`` experts), which the plan balances around
    preload: list[float] | None


def _validate(model: nn.Module, mesh: DeviceMesh, predicate: Predicate | None, route: RouteFn | None,
              blocks: BlocksFn | None, replicate_mesh: DeviceMesh | None,
              hook_boundary_predicate: Callable[[nn.Module], bool] | None, hook_boundary_strict: bool,
              config: RuntimeConfig) -> _Validated:
    """Every local check of ``dedicate_params`` and the owner plan; changes nothing."""
    mesh, replicate_mesh, tp_mesh = _check_meshes(model, mesh, replicate_mesh)
    _check_model(model, tp_mesh)
    modules = dict(model.named_modules(remove_duplicate=False))
    chosen = select(modules, predicate=predicate, route=route, blocks=blocks, param_dtype=config.param_dtype,
                    shard_size=mesh.size(), tp_mesh=tp_mesh)
    selected = chosen.dedicated
    boundary_of = {
        s.fqn: _resolve_boundary(s.fqn, s.module_path, modules, hook_boundary_predicate, hook_boundary_strict)
        for s in selected
    }
    specs = [ParamSpec(s.fqn, plan_shape(s), boundary_of[s.fqn], tp_split=tp_split(s, tp_mesh),
                       rows=None if s.blocks is None or len(s.blocks.rows) == 1 else s.blocks.spec)
             for s in selected]
    replicas = replicate_mesh.size() if replicate_mesh is not None else 1
    preload = engine_loads(chosen.sharded, mesh.size(), replicas, blocks_ns_cost) if chosen.sharded else None
    plan = assign_owners(specs, mesh.size() * replicas, preload=preload)
    return _Validated(mesh, replicate_mesh, config, modules, selected, boundary_of, specs, plan, chosen.replicated,
                      chosen.sharded, tp_mesh, preload)


class _Mine(NamedTuple):
    """What one rank tells the others at ``dedicate_params``' agreement (its verdict aside)."""

    #: the owner plan, shapes, boundaries, settings and dtypes (must match within a stage)
    fingerprint: str
    #: the dedicated FQNs (ranks of one stage hold the same; two stages never share one)
    names: tuple[str, ...]
    #: the ranks of this rank's shard row and replicate column (itself alone without HSDP)
    row: tuple[int, ...]
    col: tuple[int, ...]
    #: the ranks this rank's meshes name: its shard row, replicate column and tp ranks
    links: tuple[int, ...]
    #: HSDP or tensor parallelism (not yet with pipeline stages)
    nd: bool
    #: a reduce dtype wider than a compute dtype (not yet with pipeline stages)
    widens: bool
    #: torchrun's LOCAL_WORLD_SIZE as this rank reads it (0: unknown)
    local_world: int


def _ranks(mesh: DeviceMesh | None) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist()) if mesh is not None else ()


def _links(v: _Validated) -> tuple[int, ...]:
    return tuple(sorted({*_ranks(v.mesh), *_ranks(v.replicate_mesh), *_ranks(v.tp_mesh)}))


def _widens(v: _Validated) -> bool:
    r = v.config.reduce_dtype
    return r is not None and any(torch.finfo(r).bits > torch.finfo(v.config.param_dtype or s.param.dtype).bits
                                 for s in v.selected)


def _agree(error: str | None, mine: _Mine | None) -> tuple[Topology, int]:
    """One gather over the default group: every rank's local verdict, plan fingerprint and mesh links. A rank
    that failed its checks makes every other rank raise too (it raises its own error); the links give the
    pipeline stages ([Note: pipeline stages] in ``dmuon/runtime/topology.py``), within which every rank must
    hold the same params and plan alike. Every rank decides from the same views, so all raise together, before
    anything has changed anywhere. Also the ranks per node every rank read alike (0: unknown, or not alike)."""
    views = C.all_gather_default((dist.get_rank(), error, mine))
    failed = [(r, e) for r, e, _ in views if e is not None]  # type: ignore[misc]
    if failed and error is None:
        raise ValueError("dmuon.dedicate_params: refused on " + "; ".join(f"rank {r}: {e}" for r, e in failed)
                         + ". Nothing was changed on any rank.")
    if failed or mine is None:
        return Topology.single(dist.get_world_size()), 0
    by_rank: dict[int, _Mine] = {r: m for r, _, m in views}  # type: ignore[misc]
    C.grids_from_views([(r, m.row, m.col) for r, m in by_rank.items()])  # a replicate mesh that is no grid
    topology = Topology.from_links([(r, m.links) for r, m in by_rank.items()], dist.get_rank())
    for ranks in topology.stages:
        _check_stage(ranks, by_rank)
    if topology.pipelined:
        _check_stages(topology, by_rank)
    read = {m.local_world for m in by_rank.values()}
    return topology, read.pop() if len(read) == 1 else 0


def _check_stage(ranks: tuple[int, ...], by_rank: dict[int, _Mine]) -> None:
    """The ranks one mesh links must hold the same params, planned alike."""
    first = by_rank[ranks[0]]
    other = next((r for r in ranks if by_rank[r].names != first.names), None)
    if other is not None:
        mine, theirs = set(first.names), set(by_rank[other].names)
        name = sorted(mine ^ theirs)[0]
        raise ValueError(
            f"dmuon.dedicate_params: the mesh links ranks {ranks[0]} and {other}, but they hold different params "
            f"({name!r} is only on rank {ranks[0] if name in mine else other}). Pass the data-parallel mesh of the "
            "ranks that hold this part of the model: a mesh over every rank, or under pipeline parallelism the "
            "stage's own, mesh['dp'] of init_device_mesh(..., (pp, dp), mesh_dim_names=('pp', 'dp')) (not "
            "mesh['pp']). Nothing was changed on any rank."
        )
    digests = [by_rank[r].fingerprint for r in ranks]
    if len(set(digests)) != 1:
        raise RuntimeError(
            "dmuon.dedicate_params: ranks computed different owner plans or settings (different models, "
            f"predicates, shapes or dtypes per rank?); plan digests: {digests}"
        )


def _check_stages(topology: Topology, by_rank: dict[int, _Mine]) -> None:
    """Pipeline stages (meshes that cover part of the world): each holds its own params, on a 1-D mesh."""
    world = sum(len(s) for s in topology.stages)
    seen: dict[str, int] = {}
    for ranks in topology.stages:
        for name in by_rank[ranks[0]].names:
            if name in seen:
                raise ValueError(
                    f"dmuon.dedicate_params: the mesh has {len(topology.stage_ranks)} ranks but the default process "
                    f"group has {world}, and ranks {seen[name]} and {ranks[0]} both hold {name!r}: a mesh that covers "
                    "part of the world is a pipeline stage's, whose ranks hold that stage's layers only. Pass a mesh "
                    "over every rank that holds these params (the data-parallel mesh of the whole job), or give "
                    "each stage its own layers. Nothing was changed on any rank."
                )
            seen[name] = ranks[0]
    if any(m.nd for m in by_rank.values()):
        raise ValueError(
            f"dmuon.dedicate_params: pipeline stages ({len(topology.stages)} stages of "
            f"{len(topology.stage_ranks)} ranks) with HSDP or tensor parallelism are not supported yet; pass each "
            "stage's 1-D data-parallel mesh (mesh['dp']). Nothing was changed on any rank."
        )
    if any(m.widens for m in by_rank.values()):
        raise ValueError(
            "dmuon.dedicate_params: reduce_dtype wider than the params' dtype is not supported with pipeline "
            "stages yet (the schedule scales param.grad, where such a gradient does not live); leave reduce_dtype "
            "unset. Nothing was changed on any rank."
        )


LAYOUTS = ("auto", "flat", "node")


def _check_layout(layout: object, mesh: object, replicate_mesh: object) -> None:
    """The ``layout`` argument, and what the node layout refuses on sight (the rest needs every rank's view:
    :func:`_resolve_layout`)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"dmuon.dedicate_params: layout must be one of {LAYOUTS}, got {layout!r}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if layout == "node" and (replicate_mesh is not None or getattr(mesh, "ndim", 1) != 1):
        raise ValueError(
            f"dmuon.dedicate_params: layout='node' needs a 1-D mesh over whole nodes; got "
            f"{'a replicate_mesh (HSDP)' if replicate_mesh is not None else f'a mesh with dims {names}'}. HSDP "
            "already keeps dmuon's gathers inside its shard groups, and the node layout with HSDP, tensor "
            "parallelism or pipeline stages is not built yet: pass layout='flat' (or leave the default, 'auto')."
        )


def _resolve_layout(layout: str, v: _Validated, topology: Topology, per_node: int) -> int | None:
    """The node size under the node layout, ``None`` for the flat one; decided alike on every rank from the
    gathered views ([Note: node layout] in ``dmuon/runtime/hierarchy.py``)."""
    if layout == "flat":
        return None
    why = None
    if v.replicate_mesh is not None or v.tp_mesh is not None:
        why = "HSDP and tensor parallelism are not supported with it yet"
    elif topology.pipelined:
        why = f"pipeline stages ({len(topology.stages)}) are not supported with it yet"
    else:
        why = node_blocks(_ranks(v.mesh), per_node)
    if why is not None:
        if layout == "node":
            raise ValueError(
                f"dmuon.dedicate_params: layout='node' needs a 1-D mesh of two or more whole nodes of equal size "
                f"(torchrun's LOCAL_WORLD_SIZE, read alike on every rank), but {why}. Pass layout='flat', or "
                "launch with torchrun (--nproc-per-node sets it). Nothing was changed on any rank."
            )
        return None
    if layout == "auto" and choose_layout(_boundary_bytes(v), v.mesh.size(), per_node,
                                          z3=v.config.reshard_after_forward).layout != "node":
        return None
    return per_node


def _boundary_bytes(v: _Validated) -> list[int]:
    """Bytes of each boundary's dedicated params as its gathers carry them (the compute dtype)."""
    size = {s.fqn: (v.config.param_dtype or s.param.dtype).itemsize for s in v.selected}
    out: dict[str, int] = {}
    for spec in v.specs:
        out[spec.layer] = out.get(spec.layer, 0) + spec.numel * size[spec.fqn]
    return [out[k] for k in sorted(out)]


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
    # a mesh over part of the world is a pipeline stage's: checked against the other ranks' in _agree
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
    """Refuse a model dmuon already prepared, one an engine already took (``fully_shard``, a DDP wrapper), or a
    ``torch.compile`` wrapper (its hooks and names belong to the module inside)."""
    engines.DDP.refuse_taken(model)  # a wrapper first: it lists the dedicated params of the model inside
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise ValueError(
            f"dmuon.dedicate_params: got a torch.compile wrapper ({type(model).__name__}); call dedicate_params "
            "(and fully_shard) on the model itself, then compile: dmuon.dedicate_params(model, mesh, ...); "
            "fully_shard(model, ...); model = torch.compile(model)."
        )
    if getattr(model, STATE_ATTR, None) is not None or any(is_dedicated(p) for p in model.parameters()):
        raise ValueError("dmuon.dedicate_params was already called on this model; call it once per model.")
    for cls in engines.ENGINES:
        cls.refuse_taken(model)
    sharded = FSDP2.sharded_modules(model)
    # a DTensor of another mesh: tensor parallelism without the 2-D mesh, or FSDP2's; expert parallelism's
    # batches split along dim 0 are left to the selection ([Note: routes])
    foreign = [(n, p) for n, p in model.named_parameters()
               if isinstance(p, DTensor) and p.device_mesh != tp_mesh and not (p.ndim > 2 and splits_dim0_only(p))]
    if foreign and not sharded:
        name, p = foreign[0]
        if p.ndim > 2:
            raise ValueError(
                f"dmuon.dedicate_params: {name!r} is a DTensor placed {tuple(p.placements)} on {p.device_mesh}; a "
                "batch of matrices (experts) must be split along dim 0 only (expert parallelism places experts "
                "Shard(0)), so that every rank holds whole matrices of it. Nothing was changed."
            )
        raise ValueError(
            f"dmuon.dedicate_params: {name!r} is a DTensor on {p.device_mesh} (tensor parallel?); pass "
            "the 2-D mesh with dims ('dp', 'tp') whose 'tp' dimension it is split over. Nothing was changed."
        )
    if sharded or foreign:
        raise ValueError(
            "dmuon.dedicate_params must run before fully_shard, but these modules are already FSDP2-sharded: "
            f"{sharded[:5]}{'...' if len(sharded) > 5 else ''}. Call dedicate_params first, then fully_shard."
        )


def _build_state(model: nn.Module, ctx: C.CommContext, config: RuntimeConfig, plan: OwnerPlan,
                 selected: list[Selected], boundary_of: dict[str, str], modules: dict[str, nn.Module],
                 topology: Topology) -> DMuonState:
    """The per-matrix records, boundary groups and hooks; the owners' values go into their buckets."""
    dps_by_boundary: dict[str, list[DedicatedParam]] = {}
    for s in selected:
        p = s.param
        owner = plan.owners[s.fqn]
        dp = DedicatedParam(s.fqn, s.module, s.name, owner, torch.Size(local(p).shape), p.dtype,
                            config.param_dtype if config.param_dtype != p.dtype else None, is_owner=owner == ctx.rank,
                            route=s.route, tp_dim=p.placements[0].dim if isinstance(p, DTensor) else None,
                            full_shape=torch.Size(p.shape), blocks=s.blocks)
        setattr(p, DEDICATED_ATTR, owner)
        dps_by_boundary.setdefault(boundary_of[s.fqn], []).append(dp)
    groups = [(modules[b], BoundaryGroup(b, dps, ctx, config)) for b, dps in dps_by_boundary.items()]
    state = DMuonState(model, ctx, config, groups, topology=topology)
    state.install_hooks()
    state.bind_if_needed(allow_meta=True)
    state.install_module_guards()
    engines.prepare_for_engines(model, [s.fqn for s in selected])  # DDP's ignore list, ...
    state.bind_engine = functools.partial(engines.bind, model)
    return state
