"""Which parameters dmuon takes, on which route, as which matrices: the selection of ``dedicate_params``.

``predicate`` picks the Muon params, ``route`` overrides the route per param ([Note: routes] in
``dmuon/runtime/route.py``), ``blocks`` declares row or column blocks ([Note: matrix blocks] in
``dmuon/runtime/blocks.py``). Every check here is local and changes nothing; ``dedicate.py`` gathers the
verdicts of every rank before anything is built.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .runtime.blocks import Blocks, RowBlocks
from .runtime.param import local, splits_dim0_only
from .runtime.precision import is_wider
from .runtime.route import Route

__all__ = ["DEFAULT_BOUNDARY_PATTERN", "Predicate", "RouteFn", "BlocksFn", "Selected", "Selection", "select",
           "default_boundary", "plan_shape", "tp_split", "engine_loads"]

#: A module whose name path ends in ``layers.N`` or ``blocks.N`` is a default hook boundary.
DEFAULT_BOUNDARY_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+$")

Predicate = Callable[[str, nn.Parameter], bool]
#: ``route(fqn, param)``: a :class:`dmuon.Route` (or its value, e.g. ``"adamw_owner"``), or ``None``
#: to leave the param to ``predicate`` (selected: ``Route.MUON``, or ``Route.MUON_SHARDED`` for a large
#: enough batch of matrices; else FSDP2's).
RouteFn = Callable[[str, nn.Parameter], "Route | str | None"]
#: ``blocks(fqn, param)``: the blocks of a Muon param (``None``, a count, row sizes,
#: ``dmuon.runtime.blocks.Interleaved`` for blocks that repeat per group of rows, or any of these along the
#: columns in ``dmuon.runtime.blocks.Columns``), see [Note: matrix blocks] in ``dmuon/runtime/blocks.py``;
#: ``dmuon.integrations.hf.matrix_blocks(model)`` answers it for HF models.
BlocksFn = Callable[[str, nn.Parameter], RowBlocks]


class Selected(NamedTuple):
    fqn: str
    module_path: str
    name: str
    module: nn.Module
    param: nn.Parameter
    route: Route = Route.MUON
    #: Muon routes: the matrices of the full (unsplit by TP or by the engine) parameter
    blocks: Blocks | None = None


class Selection(NamedTuple):
    #: dedicated: ``MUON`` and ``ADAMW_OWNER`` (an owner each)
    dedicated: list[Selected]
    #: ``MUON_SHARDED``: left to the engine's shards, Muon where they live
    sharded: list[Selected]
    #: ``ADAMW_REPLICATED``
    replicated: list[Selected]


def default_boundary(module_path: str) -> str | None:
    """Nearest ancestor-or-self of ``module_path`` whose path ends in ``layers.N`` / ``blocks.N``."""
    path = module_path
    while True:
        if DEFAULT_BOUNDARY_PATTERN.search(path):
            return path
        if not path:
            return None
        path = path.rsplit(".", 1)[0] if "." in path else ""


def select(modules: dict[str, nn.Module], *, predicate: Predicate | None, route: RouteFn | None,
           blocks: BlocksFn | None, param_dtype: torch.dtype | None, shard_size: int,
           tp_mesh: DeviceMesh | None) -> Selection:
    """Every parameter dmuon takes (``route`` first, then ``predicate`` under any of its names: a tied weight
    has several), each object once, under its first name, checked, with its route and matrices.
    ``shard_size``: the ranks of the data-parallel shard dimension, which decides the default route of a
    batch of matrices ([Note: routes])."""
    aliases_of: dict[int, list[Selected]] = {}
    for module_path, module in modules.items():
        for name, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{module_path}.{name}" if module_path else name
            aliases_of.setdefault(id(p), []).append(Selected(fqn, module_path, name, module, p))
    out = Selection([], [], [])
    for aliases in aliases_of.values():
        chosen = _route_of(aliases, predicate, route, shard_size)
        if chosen is None or chosen[1] is Route.ADAMW_SHARDED:
            continue
        hit, r = chosen
        if r is Route.ADAMW_REPLICATED:
            out.replicated.append(aliases[0])
            continue
        _check_selected(hit._replace(route=r), [s.fqn for s in aliases], param_dtype)
        s = aliases[0]._replace(route=r)
        if r.muon:
            s = s._replace(blocks=_blocks_of(s, blocks))
        if r is Route.MUON_SHARDED:
            _check_engine_placement(s)
            out.sharded.append(s)
        else:
            _check_tensor_parallel(s, tp_mesh)
            out.dedicated.append(s)
    if not out.dedicated and not out.sharded:
        raise ValueError(
            "dmuon.dedicate_params: the predicate selected no parameters"
            + ("" if predicate is not None else " (default: nn.Linear weights inside 'layers.N'/'blocks.N')")
            + "; pass predicate=lambda name, p: ... selecting the weight matrices Muon should update."
        )
    return out


def _route_of(aliases: list[Selected], predicate: Predicate | None, route: RouteFn | None, shard_size: int
              ) -> tuple[Selected, Route] | None:
    """The alias that decided and its route: ``route``'s answer where it has one (the same for every name
    of a tied weight), else a Muon route where ``predicate`` selects any name; ``None``: FSDP2's."""
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
    if not hits:
        return None
    p = hits[0].param
    # a batch with a matrix for every rank of the shard dimension, or one expert parallelism already split,
    # stays on the engine's shards ([Note: routes])
    batched = p.ndim > 2 and (isinstance(p, DTensor) or p.shape[0] >= shard_size)
    return hits[0], Route.MUON_SHARDED if batched else Route.MUON


def _check_selected(s: Selected, names: list[str], param_dtype: torch.dtype | None) -> None:
    fqn, p = s.fqn, s.param
    if s.route is Route.MUON and p.ndim < 2:
        raise ValueError(
            f"dmuon.dedicate_params: predicate selected {fqn!r} with shape {tuple(p.shape)}; only weight "
            "matrices (2-D, or batches of them such as experts [E, m, n]) can take Muon (it orthogonalises "
            "matrices). Exclude it from the predicate, or route it 'adamw_owner' to dedicate it with AdamW on "
            "its owner."
        )
    if s.route is Route.MUON_SHARDED and p.ndim < 3:
        raise ValueError(
            f"dmuon.dedicate_params: route 'muon_sharded' for {fqn!r} with shape {tuple(p.shape)}; only a batch of "
            "matrices (3-D or more, e.g. experts [E, m, n]) can be left to the engine's shards, whose dim 0 then "
            "holds whole matrices. Route it 'muon' to give it one owner."
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
    if param_dtype is not None and s.route.dedicated and is_wider(param_dtype, p.dtype):
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


def _blocks_of(s: Selected, blocks: BlocksFn | None) -> Blocks:
    """The matrices of a selected Muon param: ``blocks``'s answer, checked against its full shape."""
    rows = None if blocks is None else blocks(s.fqn, s.param)
    return Blocks.of(tuple(s.param.shape), rows, what=f"dmuon.dedicate_params: blocks({s.fqn!r})")


def _check_engine_placement(s: Selected) -> None:
    """A ``MUON_SHARDED`` param placed before ``dedicate_params`` (expert parallelism) must split dim 0 only."""
    p = s.param
    if isinstance(p, DTensor) and not splits_dim0_only(p):
        raise ValueError(
            f"dmuon.dedicate_params: {s.fqn!r} is a DTensor placed {tuple(p.placements)} on {p.device_mesh}; Muon "
            "on the engine's shards needs whole matrices on every rank, i.e. experts split along dim 0 only "
            "(expert parallelism places them Shard(0)). Place it Shard(0), or route it 'muon'."
        )


def _check_tensor_parallel(s: Selected, tp_mesh: DeviceMesh | None) -> None:
    """A selected DTensor must be a Muon matrix split evenly by rows or columns over the "tp" mesh."""
    p = s.param
    if not isinstance(p, DTensor):
        return
    where = f"dmuon.dedicate_params: {s.fqn!r} is a DTensor"
    if tp_mesh is None or p.device_mesh != tp_mesh:
        raise ValueError(f"{where} on {p.device_mesh}; with tensor parallelism pass the 2-D mesh with dims "
                         "('dp', 'tp') whose 'tp' dimension the weights are sharded over.")
    if s.route is not Route.MUON or tuple(p.placements) not in ((Shard(0),), (Shard(1),)) or p.ndim != 2:
        raise ValueError(f"{where} placed {tuple(p.placements)} with shape {tuple(p.shape)}; dmuon dedicates "
                         "tensor-parallel Muon matrices (2-D) sharded by rows (ColwiseParallel) or columns "
                         "(RowwiseParallel).")
    dim = p.placements[0].dim  # type: ignore[union-attr]
    if p.shape[dim] % tp_mesh.size():
        raise ValueError(f"{where} whose dim {dim} ({p.shape[dim]}) does not split evenly over {tp_mesh.size()} tp ranks.")


def plan_shape(s: Selected) -> tuple[int, ...]:
    """The shape the owner plan weighs: a Muon param's own (this rank's shard under TP); an ``ADAMW_OWNER``
    param counts as one row of its elements (its NS cost is that of a 1 x n matrix, next to nothing, so the
    plan packs it with its boundary's matrices)."""
    shape = local(s.param).shape
    if s.route is Route.MUON:
        return tuple(int(d) for d in shape)
    return 1, int(shape.numel())


def tp_split(s: Selected, tp_mesh: DeviceMesh | None) -> tuple[int, int] | None:
    """``(tp_dim, tp_size)`` of a tensor-parallel Muon matrix, for the owner plan's cost; else ``None``."""
    if not isinstance(s.param, DTensor) or tp_mesh is None or s.route is not Route.MUON:
        return None
    return int(s.param.placements[0].dim), int(tp_mesh.size())  # type: ignore[union-attr]


def engine_loads(sharded: Sequence[Selected], shard_size: int, replicas: int,
                 cost: Callable[[Blocks], float]) -> list[float]:
    """The Newton–Schulz work each owner slot gets from the ``MUON_SHARDED`` params, for the owner plan to
    balance the rest around: ``fully_shard`` chunks dim 0 like ``torch.chunk`` (``ceil(E / S)`` per shard
    index, the last ones short or empty), every replicate row alike. A param already placed by expert
    parallelism is counted as split evenly (its further split follows the user's meshes)."""
    per_shard = [0.0] * shard_size
    for s in sharded:
        blocks = Blocks.of(s.param.shape, s.blocks.spec if s.blocks is not None else None)
        E = s.param.shape[0]
        per_slice = cost(blocks) / E  # one index of dim 0 (an expert, with any inner batch and row blocks)
        if isinstance(s.param, DTensor):
            for k in range(shard_size):
                per_shard[k] += per_slice * E / shard_size
            continue
        step = -(-E // shard_size)
        for k in range(shard_size):
            per_shard[k] += per_slice * max(0, min(E, (k + 1) * step) - k * step)
    return per_shard * replicas
