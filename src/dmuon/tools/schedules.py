"""What each design does in one step, per rank: its collectives, its Newton–Schulz and its element-wise work.

The designs (:data:`DESIGNS`):

* ``fsdp_adamw``: FSDP2 per layer + root, AdamW on everything: the baseline every overhead is against.
* ``dmuon``: persistent ownership (``docs/architecture.md`` section 5): FSDP2 keeps only the params outside
  Muon; each Muon matrix's owner broadcasts it to its shard group before its boundary runs (forward, and
  again in backward under Z3) and receives its gradient by reduce, every owner of a boundary in one launch
  per phase (NCCL's broadcasts or reduces grouped: the bytes of one per owner, one call's latency); under
  HSDP the owner's shard column holds it, the column reduces over the replicate group and the owner
  publishes after ``step()``, one launch per boundary each. The owner
  plan is :func:`dmuon.partition.assign_owners` over every (replicate, shard) slot, experts preloaded where
  FSDP2 / expert parallelism put them (``Route.MUON_SHARDED``).
* ``distmuon`` and ``dion``: the all-to-all design (torchtitan's DistMuon, microsoft/dion's Muon, Megatron's
  plan): FSDP2 as in the baseline for every param, and in ``step()``, per batch of ``g`` same-shape matrices
  (``g`` the ranks of the shard x tp group), one all-to-all that brings each matrix's momentum shards to its
  compute rank and one that scatters the update back; each rank orthogonalises one matrix per batch, so the
  busiest rank (rank 0, first in every batch) runs ``ceil(n / g)`` single-matrix calls per shape group.
  ``distmuon`` runs torch's NS and waits for each all-to-all; ``dion`` runs gram-newton-schulz's NS (the
  stand-in for dion's own, :mod:`dmuon.tools.ns_table`) and overlaps one batch's all-to-alls with another's
  NS. Under HSDP both orthogonalise within the shard group, so every replica repeats the work. Experts,
  already whole on each rank (dim-0 shards), run a batched NS where they live in every design.
* ``dmuon_flat`` and ``dmuon_node``: ``dmuon`` in each layout of ``dedicate_params`` (``dmuon`` itself is the one
  ``layout="auto"`` takes, :func:`auto_layout`). ``dmuon_node`` ([Note: node layout] in
  ``dmuon/runtime/hierarchy.py``), on a 1-D mesh over two or more whole nodes: each boundary owned inside one
  node (:func:`dmuon.partition.assign_node_owners`), each phase a broadcast (reduce) on every rail (the ranks of
  one local index, carrying that index's bucket: about ``1/gpus_per_node`` of the boundary across the network)
  and one launch over every node (NVLink); experts stay where the engine puts them.
* validation only: ``naive`` (the benchmark's naive FSDP2 + Muon: every rank gathers every matrix and its
  gradient and orthogonalises all of them) and ``torch_muon`` (one unsharded ``torch.optim.Muon`` per GPU).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import lru_cache
from typing import Any

from ..layout import LayoutChoice, choose_layout
from ..partition import OwnerPlan, ParamSpec, assign_node_owners, assign_owners, ns_cost
from ..links import Group, all_gather_ms, all_reduce_ms, all_to_all_ms, broadcast_ms
from .ns_table import ns_ms
from .step_model import ModelSizes, Scenario, adamw_ms, compute_ms, exposed_ms, muon_update_ms, sizes_of

__all__ = ["DESIGNS", "LAYOUT_DESIGNS", "WHAT_IF_DESIGNS", "auto_layout", "node_layout_allowed", "VALIDATION_DESIGNS", "DMUON_COMM", "design_parts", "simulate_design",
           "dmuon_schedule", "expert_counts", "owner_plan"]

DESIGNS = {
    "fsdp_adamw": "FSDP2 + AdamW on everything (the baseline)",
    "dmuon": "persistent ownership: broadcast before each boundary, reduce to the owner, NS where it is owned; "
             "in the layout dedicate_params(layout='auto') takes",
    "distmuon": "all-to-all design with torch's NS per matrix, all-to-alls not overlapped (torchtitan)",
    "dion": "all-to-all design, batches of the shard group, NS overlapped with the all-to-alls (microsoft/dion)",
}
#: dmuon in each layout of ``dedicate_params`` (``"dmuon"`` is the one ``layout="auto"`` takes)
LAYOUT_DESIGNS = {
    "dmuon_flat": "dmuon with layout='flat': owners anywhere in the mesh, each phase one launch over every rank",
    "dmuon_node": "dmuon with layout='node': each boundary owned inside one node, a rail broadcast and a node "
                  "gather per phase",
}
WHAT_IF_DESIGNS: dict[str, str] = {}
VALIDATION_DESIGNS = {
    "naive": "every rank all-gathers each Muon matrix and gradient in step() and orthogonalises all of them",
    "torch_muon": "one unsharded model per GPU, torch.optim.Muon + AdamW, no communication",
}
#: a design's NS backends: (2-D matrices, local experts)
_NS = {"distmuon": ("torch", "direct-2026-11-29"), "dion": ("gns", "gns")}


def expert_counts(experts: int, shard: int) -> list[int]:
    """Experts of one layer's batched param on each shard index: FSDP2 and expert parallelism both split dim 0
    like ``torch.chunk`` (``ceil(E / S)`` each, the last ones short or empty)."""
    step = -(-experts // shard)
    return [max(0, min(experts, (k + 1) * step) - k * step) for k in range(shard)]


@lru_cache(maxsize=64)
def owner_plan(muon: tuple[tuple[str, tuple[int, int], str], ...], slots: int, preload: tuple[float, ...] | None
               ) -> OwnerPlan:
    """``dedicate_params``'s owner plan for these matrices over ``slots`` owner slots (cached: sweeps reuse it)."""
    specs = [ParamSpec(fqn, shape, layer) for fqn, shape, layer in muon]
    return assign_owners(specs, slots, preload=list(preload) if preload is not None else None)


def _coll(sc: Scenario, name: str, phase: str, kind: str, group: Group, nbytes: float, calls: int,
          units: int) -> dict[str, Any]:
    """One collective of a step: ``kind`` gather (all-gather or reduce-scatter), all_reduce, broadcast (or
    reduce) or a2a; ``nbytes`` as its time function takes it; ``phase`` forward, backward, step (inside
    ``step()``, exposed) or optimizer (an all-to-all design's, costed with its NS); ``units``: the per-unit
    calls it is issued in, of which all but the first (forward) or last (backward) can hide (0: none can).
    ``bytes`` in the result: what each rank sends; ``payload``: ``nbytes`` (0 on one rank), what a runtime
    counter records."""
    links = sc.links
    fn = {"gather": all_gather_ms, "all_reduce": all_reduce_ms, "broadcast": broadcast_ms, "a2a": all_to_all_ms}
    g = group.size
    wire = {"gather": nbytes * (g - 1) / g, "all_reduce": 2 * nbytes * (g - 1) / g, "broadcast": nbytes,
            "a2a": nbytes * (g - 1) / g}[kind] if g > 1 else 0.0
    return {"name": name, "phase": phase, "group": g, "link": "nvlink" if group.nodes(links) == 1 else "network",
            "bytes": wire, "payload": nbytes if g > 1 else 0.0, "calls": calls if g > 1 else 0, "units": units,
            "ms": fn[kind](nbytes, group, links, calls)}


def _groups(sc: Scenario) -> dict[str, Group]:
    S, T, R = sc.shard, sc.tp, sc.replicas
    return {"shard": Group(S, T), "replicate": Group(R, S * T), "tp": Group(T, 1), "ep": Group(sc.ep, T),
            "efsdp": Group(S // sc.ep, sc.ep * T), "a2a": Group(S * T, 1)}


def _fsdp2(sc: Scenario, sz: ModelSizes, wrap: str, root: float, layers: float) -> list[dict[str, Any]]:
    """FSDP2's collectives: a root unit of ``root`` elements (gathered first in forward, reduced last in
    backward: nothing to hide under) and, with ``wrap="layers"``, one unit per layer of ``layers`` elements in
    all (gathered again in backward); ``wrap="none"``: the params are plain, averaged by one all-reduce. Plus
    the experts' over the expert-FSDP group, HSDP's all-reduce and expert parallelism's token all-to-alls."""
    b, T, L, g = sc.dtype_bytes, sc.tp, sz.layers, _groups(sc)
    out = []
    if wrap == "none":
        out.append(_coll(sc, "plain-param all-reduce", "backward", "all_reduce", Group(sc.shard * sc.replicas, T),
                         (root + layers) * b / T, 1, 1))
    units = [] if wrap == "none" else [("root", root, 1)] + ([("layers", layers, L)] if wrap == "layers" else [])
    for what, elements, n in units:
        nb = elements * b / T
        out += [_coll(sc, f"fsdp2 all-gather ({what})", "forward", "gather", g["shard"], nb, n, n),
                _coll(sc, f"fsdp2 reduce-scatter ({what})", "backward", "gather", g["shard"], nb, n, n)]
        if what == "layers":
            out.append(_coll(sc, "fsdp2 all-gather (layers, backward)", "backward", "gather", g["shard"], nb, n, n))
        if sc.replicas > 1:
            out.append(_coll(sc, f"fsdp2 all-reduce ({what}, replicate)", "backward", "all_reduce", g["replicate"],
                             nb / sc.shard, n, n))
    if sz.experts:
        xb = sz.expert_elements * b / sc.ep
        out += [_coll(sc, "fsdp2 experts all-gather", "forward", "gather", g["efsdp"], xb, L, L),
                _coll(sc, "fsdp2 experts all-gather (backward)", "backward", "gather", g["efsdp"], xb, L, L),
                _coll(sc, "fsdp2 experts reduce-scatter", "backward", "gather", g["efsdp"], xb, L, L)]
        if sc.replicas > 1:
            out.append(_coll(sc, "fsdp2 experts all-reduce (replicate)", "backward", "all_reduce", g["replicate"],
                             sz.expert_elements * b / sc.shard, L, L))
    if sc.ep > 1:
        nbytes = sc.tokens / T * sc.shape.top_k * sz.hidden * b  # type: ignore[attr-defined]
        for phase in ("forward", "backward"):
            out.append(_coll(sc, "expert-parallel token all-to-all", phase, "a2a", g["ep"], nbytes * 2 * L, 2 * L, 0))
    return out


def _expert_ns(sc: Scenario, sz: ModelSizes, backend: str, count: int, per_param: bool) -> float:
    """NS ms of one rank's local experts (``count`` per layer and param): one call per param and layer
    (``per_param``), or one batched call per shape over all layers (dmuon)."""
    if not sz.experts or count == 0:
        return 0.0
    shapes = Counter(sz.expert_params)
    if per_param:
        return sum(k * sz.layers * ns_ms(backend, m, n, count) for (m, n), k in shapes.items())
    return sum(ns_ms(backend, m, n, k * sz.layers * count) for (m, n), k in shapes.items())


def _phases(sc: Scenario, sz: ModelSizes, colls: list[dict[str, Any]], units: int) -> dict[str, float]:
    """Forward and backward: compute plus what their collectives expose; ``step()``'s exposed collectives."""
    fwd, bwd = compute_ms(sc, sz, units)
    exp_fwd, exp_bwd = exposed_ms(colls, "forward", fwd), exposed_ms(colls, "backward", bwd)
    return {"compute_ms": fwd + bwd, "forward_ms": fwd + exp_fwd, "backward_ms": bwd + exp_bwd,
            "exposed_step_ms": exposed_ms(colls, "step", 0.0), "exposed_forward_ms": exp_fwd,
            "exposed_backward_ms": exp_bwd}


def _baseline(sc: Scenario, sz: ModelSizes) -> dict[str, Any]:
    root = sz.embed + sz.head + sz.hidden
    colls = _fsdp2(sc, sz, "layers", root, sz.muon_elements + sz.rest - root)
    local_experts = expert_counts(sz.experts, sc.shard)[0] * sz.layers * sum(r * c for r, c in sz.expert_params)
    elementwise = adamw_ms((sz.muon_elements + sz.rest) / (sc.shard * sc.tp) + local_experts, sc.dtype_bytes)
    return {"collectives": colls, "ns_ms": 0.0, "ns_rank": 0, "elementwise_ms": elementwise,
            "fsdp_units": sz.layers + 1, "local_experts": local_experts}


def _expert_share(sc: Scenario, sz: ModelSizes, slot: int) -> int:
    """Experts per layer and param whose update ``slot`` computes: its chunk's, split over the replicate rows
    like ``torch.chunk`` ([Note: expert NS across replicas] in ``dmuon/optim/routes/sharded.py``)."""
    count = expert_counts(sz.experts, sc.shard)[slot % sc.shard] if sz.experts else 0
    return expert_counts(count, sc.replicas)[slot // sc.shard] if count and _splits_experts(sc) else count


def _splits_experts(sc: Scenario) -> bool:
    """Whether the replicate rows split the experts' updates: HSDP without expert parallelism, the replicate
    group inside one node (the runtime's rule, ``dmuon/optim/routes/sharded.py``)."""
    return sc.replicas > 1 and sc.ep == 1 and _groups(sc)["replicate"].nodes(sc.links) == 1


def _dmuon_ns(sc: Scenario, sz: ModelSizes, plan: OwnerPlan, slot: int) -> float:
    shape_of = {fqn: shape for fqn, shape, _ in sz.muon}
    groups = Counter(shape_of[f] for f in plan.ranks[slot].fqns)
    dense = sum(ns_ms(sc.ns_backend, m, n, -(-k // sc.tp)) for (m, n), k in groups.items())
    return dense + _expert_ns(sc, sz, sc.ns_backend, _expert_share(sc, sz, slot), per_param=False) / sc.tp


def _launches(sz: ModelSizes, plan: OwnerPlan, shard: int) -> tuple[int, Counter]:
    """Launches of one pass over the shard group (one per boundary, whatever its owners: [Note: one launch per
    boundary] in ``dmuon/runtime/comm.py``) and, per shard column, the boundaries it holds a bucket of (its
    replicate-group launches)."""
    pairs = {(layer, plan.owners[fqn] % shard) for fqn, _, layer in sz.muon}
    return len({layer for layer, _ in pairs}), Counter(column for _, column in pairs)


#: dmuon's collectives as the runtime counts them (``dmuon.diagnostics.comm_counts``): planner name -> (kind, dim)
DMUON_COMM = {"dmuon forward broadcast": ("forward_broadcast", "shard"),
              "dmuon backward broadcast": ("backward_broadcast", "shard"),
              "dmuon reduce": ("reduce", "shard"), "dmuon replicate reduce": ("reduce", "replicate"),
              "dmuon replicate publish": ("replicate_publish", "replicate"), "dmuon tp exchange": ("tp_exchange", "tp"),
              "dmuon expert gather": ("sharded_update", "replicate"),
              "dmuon forward broadcast (rail)": ("forward_broadcast", "rail"),
              "dmuon forward gather (node)": ("forward_broadcast", "node"),
              "dmuon backward broadcast (rail)": ("backward_broadcast", "rail"),
              "dmuon backward gather (node)": ("backward_broadcast", "node"),
              "dmuon reduce (node)": ("reduce", "node"), "dmuon reduce (rail)": ("reduce", "rail")}


def _dmuon_plan(sc: Scenario, sz: ModelSizes) -> OwnerPlan:
    """``dedicate_params``'s owner plan for ``sz`` on ``sc``'s grid, experts preloaded where the engine puts them."""
    counts = expert_counts(sz.experts, sc.shard) if sz.experts else [0] * sc.shard
    per_expert = sum(ns_cost((m, n)) for m, n in sz.expert_params) * sz.layers
    preload = tuple(float(c * per_expert) for c in counts) * sc.replicas if sz.experts else None
    return owner_plan(sz.muon, sc.shard * sc.replicas, preload)


def _dmuon_comm(sc: Scenario, sz: ModelSizes, plan: OwnerPlan, column: int) -> list[dict[str, Any]]:
    """dmuon's own collectives of one step on a rank of shard column ``column`` (the replicate stages differ by
    column: a column's holders reduce and publish what it holds)."""
    S, R, T, b, L = sc.shard, sc.replicas, sc.tp, sc.dtype_bytes, sz.layers
    g = _groups(sc)
    calls, columns = _launches(sz, plan, S)
    nb = sz.muon_elements * b / T
    colls = [_coll(sc, "dmuon forward broadcast", "forward", "broadcast", g["shard"], nb, calls, L)]
    if sc.reshard == "z3":
        colls.append(_coll(sc, "dmuon backward broadcast", "backward", "broadcast", g["shard"], nb, calls, L))
    colls.append(_coll(sc, "dmuon reduce", "backward", "broadcast", g["shard"], nb, calls, L))
    if R > 1:
        cb, cc = sum(plan.ranks[r * S + column].numel for r in range(R)) * b / T, columns.get(column, 0)
        colls.append(_coll(sc, "dmuon replicate reduce", "backward", "broadcast", g["replicate"], cb, cc, L))
        publish = ("forward", L) if sc.publish_async else ("step", 0)
        colls.append(_coll(sc, "dmuon replicate publish", publish[0], "broadcast", g["replicate"], cb, cc, publish[1]))
        # the experts' split over the rows: every share's value and momentum, one launch
        if sz.experts and expert_counts(sz.experts, S)[column] and _splits_experts(sc):
            xb = 2 * expert_counts(sz.experts, S)[column] * L * sum(r * c for r, c in sz.expert_params) * b / T
            colls.append(_coll(sc, "dmuon expert gather", "step", "gather", g["replicate"], xb, 1, 0))
    return colls


def _node_plan(sc: Scenario, sz: ModelSizes) -> OwnerPlan:
    """``dedicate_params(layout="node")``'s plan: :func:`dmuon.partition.assign_node_owners`, experts preloaded as
    in :func:`_dmuon_plan`."""
    n = sc.links.gpus_per_node
    flat = _dmuon_plan(sc, sz)
    preload = [r.engine_cost for r in flat.ranks] if sz.experts else None
    return assign_node_owners([ParamSpec(fqn, shape, layer) for fqn, shape, layer in sz.muon], sc.shard // n, n,
                              preload=preload)


def _node_comm(sc: Scenario, sz: ModelSizes, plan: OwnerPlan, slot: int) -> list[dict[str, Any]]:
    """The node layout's collectives of one step on the rank at ``slot``, as the runtime issues them ([Note: node
    layout] in ``dmuon/runtime/hierarchy.py``): per boundary and phase one rail broadcast (reduce) of the bucket
    of this rank's local index, where the owner node has one, and one launch over the node of every bucket."""
    n, b, L = sc.links.gpus_per_node, sc.dtype_bytes, sz.layers
    node, rail = Group(n, 1), Group(sc.shard // n, n)
    local = slot % n
    mine = [(layer, r * c) for fqn, (r, c), layer in sz.muon if plan.owners[fqn] % n == local]
    rb, rc = sum(e for _, e in mine) * b, len({layer for layer, _ in mine})
    nb, nc = sz.muon_elements * b, len({layer for _, _, layer in sz.muon})
    phases = [("forward", "forward")] + ([("backward", "backward")] if sc.reshard == "z3" else [])
    colls = []
    for phase, what in phases:
        colls += [_coll(sc, f"dmuon {what} broadcast (rail)", phase, "broadcast", rail, rb, rc, L),
                  _coll(sc, f"dmuon {what} gather (node)", phase, "broadcast", node, nb, nc, L)]
    return colls + [_coll(sc, "dmuon reduce (node)", "backward", "broadcast", node, nb, nc, L),
                    _coll(sc, "dmuon reduce (rail)", "backward", "broadcast", rail, rb, rc, L)]


def node_layout_allowed(sc: Scenario) -> bool:
    """Whether ``dedicate_params`` takes the node layout on ``sc``: a 1-D mesh of two or more whole nodes."""
    n = sc.links.gpus_per_node
    return sc.replicas == 1 and sc.tp == 1 and sc.shard % n == 0 and sc.shard // n >= 2


def _dmuon_node(sc: Scenario, sz: ModelSizes) -> dict[str, Any]:
    """``dmuon_node``: ``dmuon`` under ``layout="node"`` ([Note: node layout]): its owner plan per node, its shard-row
    phases replaced by :func:`_node_comm` on the busiest rank; FSDP2's and the experts' parts as ``dmuon``'s."""
    n = sc.links.gpus_per_node
    if not node_layout_allowed(sc):
        raise ValueError(f"dmuon.plan: the node layout needs a 1-D mesh over two or more whole nodes, got "
                         f"{sc.replicas} x {sc.shard}, tp {sc.tp}, {n} GPUs a node")
    out = _dmuon(sc, sz)
    plan = _node_plan(sc, sz)
    ns = [_dmuon_ns(sc, sz, plan, s) for s in range(sc.shard)]
    busiest = max(range(sc.shard), key=lambda s: ns[s] + muon_update_ms(plan.ranks[s].numel, sc.dtype_bytes))
    rail = max(range(n), key=lambda j: sum(r * c for f, (r, c), _ in sz.muon if plan.owners[f] % n == j))
    local = _expert_share(sc, sz, busiest) * sz.layers * sum(r * c for r, c in sz.expert_params)
    out["collectives"] = ([c for c in out["collectives"] if not c["name"].startswith("dmuon")]
                          + _node_comm(sc, sz, plan, rail))
    out.update(ns_ms=ns[busiest], ns_rank=busiest, plan=plan, idle_owners=sum(1 for r in plan.ranks if not r.fqns),
               elementwise_ms=muon_update_ms(plan.ranks[busiest].numel + local, sc.dtype_bytes)
               + adamw_ms(sz.rest / sc.shard, sc.dtype_bytes))
    return out


def auto_layout(sc: Scenario, sz: ModelSizes | None = None) -> LayoutChoice:
    """What ``dedicate_params(layout="auto")`` takes on ``sc``: :func:`dmuon.layout.choose_layout` on the model's
    boundaries, ``"flat"`` where the node layout is not allowed."""
    sz = sizes_of(sc.shape, sc.seq) if sz is None else sz
    per_layer: dict[str, int] = {}
    for _, (r, c), layer in sz.muon:
        per_layer[layer] = per_layer.get(layer, 0) + r * c * sc.dtype_bytes
    n = sc.links.gpus_per_node if node_layout_allowed(sc) else sc.shard
    return choose_layout(list(per_layer.values()), sc.shard, n, z3=sc.reshard == "z3", links=sc.links)


def dmuon_schedule(sc: Scenario, *, slot: int, sizes: ModelSizes | None = None, layout: str = "flat"
                   ) -> dict[tuple[str, str], dict[str, int]]:
    """What dmuon's runtime launches in one training step (forward, backward, ``step()``) on the rank at owner
    slot ``slot`` (``replicate index x shard + shard index``): ``{(kind, dim): {"calls", "bytes"}}``, named as
    ``dmuon.diagnostics.comm_counts`` names them (``bytes``: the payload, every part of a launch). ``sizes``:
    the model's matrices as it names them (default: the preset's, :func:`sizes_of`). Without tensor
    parallelism: its exchange depends on the busiest owner's shape groups only. ``layout``: ``dedicate_params``'
    ``"flat"`` or ``"node"`` (nodes of ``sc.links.gpus_per_node`` ranks).

    Example::

        from dmuon.tools.presets import PRESETS
        sched = dmuon_schedule(Scenario(PRESETS["llama3-8b"], 64, replicas=8), slot=0)
        print(sched[("reduce", "replicate")])   # {'calls': ..., 'bytes': ...}
    """
    sz = sizes_of(sc.shape, sc.seq) if sizes is None else sizes
    if sc.tp > 1 or not 0 <= slot < sc.shard * sc.replicas:
        raise ValueError(f"dmuon_schedule: slot must be in [0, {sc.shard * sc.replicas}) and tp 1, got slot "
                         f"{slot!r}, tp {sc.tp}")
    out: dict[tuple[str, str], dict[str, int]] = {}
    if layout == "node":
        if not node_layout_allowed(sc):
            raise ValueError("dmuon_schedule: layout='node' needs a 1-D mesh over two or more whole nodes")
        colls = _node_comm(sc, sz, _node_plan(sc, sz), slot)
    else:
        colls = _dmuon_comm(sc, sz, _dmuon_plan(sc, sz), slot % sc.shard)
    for c in colls:
        if c["calls"]:
            out[DMUON_COMM[c["name"]]] = {"calls": c["calls"], "bytes": round(c["payload"])}
    return out


def _dmuon(sc: Scenario, sz: ModelSizes) -> dict[str, Any]:
    S, R, T, b, L = sc.shard, sc.replicas, sc.tp, sc.dtype_bytes, sz.layers
    counts = expert_counts(sz.experts, S) if sz.experts else [0] * S
    plan = _dmuon_plan(sc, sz)
    g = _groups(sc)
    root = sz.rest if sc.dmuon_wrap != "layers" else sz.embed + sz.head + sz.hidden
    colls = _fsdp2(sc, sz, sc.dmuon_wrap, root, sz.rest - root)
    column = [sum(plan.ranks[r * S + s].numel for r in range(R)) for s in range(S)]
    colls += _dmuon_comm(sc, sz, plan, max(range(S), key=lambda s: column[s]))  # the busiest column
    ns = [_dmuon_ns(sc, sz, plan, s) for s in range(S * R)]
    busiest = max(range(S * R), key=lambda s: ns[s] + muon_update_ms(plan.ranks[s].numel / T, b))
    if T > 1:
        shapes = len({shape for fqn, shape, _ in sz.muon if plan.owners[fqn] == busiest})
        slot_bytes = plan.ranks[busiest].numel * b / T
        colls.append(_coll(sc, "dmuon tp exchange", "step", "a2a", g["tp"], 2 * slot_bytes, 2 * shapes, 0))
    local = _expert_share(sc, sz, busiest) * L * sum(r * c for r, c in sz.expert_params)
    elementwise = (muon_update_ms(plan.ranks[busiest].numel / T + local, b)
                   + adamw_ms(sz.rest / (S * T), b))
    # experts stay in per-layer FSDP2 units whatever the wrap of the rest
    units = L + 1 if sc.dmuon_wrap == "layers" or sz.experts else {"root": 1, "none": 0}[sc.dmuon_wrap]
    return {"collectives": colls, "ns_ms": ns[busiest], "ns_rank": busiest, "elementwise_ms": elementwise,
            "fsdp_units": units, "plan": plan, "idle_owners": sum(1 for r in plan.ranks if not r.fqns)}


def _all_to_all(sc: Scenario, sz: ModelSizes, design: str) -> dict[str, Any]:
    out = _baseline(sc, sz)
    single, batched = _NS[design]
    g = sc.shard * sc.tp
    groups = Counter(shape for _, shape, _ in sz.muon)
    batches = sum(-(-k // g) for k in groups.values())
    ns = sum(-(-k // g) * ns_ms(single, m, n, 1) for (m, n), k in groups.items())
    ns += _expert_ns(sc, sz, batched, expert_counts(sz.experts, sc.shard)[0] if sz.experts else 0, per_param=True)
    nb = sz.muon_elements * sc.dtype_bytes / g
    group = _groups(sc)["a2a"]
    # phase "optimizer": costed with the design's NS below (serial or pipelined), not as an exposed collective
    a2a = [_coll(sc, "all-to-all to the compute rank", "optimizer", "a2a", group, nb, batches, 0),
           _coll(sc, "all-to-all back to the shards", "optimizer", "a2a", group, nb, batches, 0)]
    comm = sum(c["ms"] for c in a2a)
    if design == "dion":  # one batch's all-to-alls under another's NS: only the longer of the two, plus a fill
        muon_step = max(ns, comm) + min(ns, comm) / max(batches, 1)
    else:
        muon_step = ns + comm
    out["collectives"] += a2a
    out.update(ns_ms=ns, elementwise_ms=adamw_ms(sz.rest / g, sc.dtype_bytes)
               + muon_update_ms(sz.muon_elements / g + out["local_experts"], sc.dtype_bytes),
               a2a_ms=comm, muon_step_ms=muon_step)
    return out


def _naive(sc: Scenario, sz: ModelSizes, backend: str) -> dict[str, Any]:
    out = _baseline(sc, sz)
    n = len(sz.muon)
    nb = sz.muon_elements * sc.dtype_bytes / sc.tp
    group = _groups(sc)["shard"]
    out["collectives"] += [_coll(sc, "all-gather of each gradient", "step", "gather", group, nb, n, 0),
                           _coll(sc, "all-gather of each matrix", "step", "gather", group, nb, n, 0)]
    out["ns_ms"] = sum(ns_ms(backend, m, c, 1) for _, (m, c), _ in sz.muon)
    out["elementwise_ms"] = (muon_update_ms(sz.muon_elements, sc.dtype_bytes)
                             + adamw_ms(sz.rest / (sc.shard * sc.tp), sc.dtype_bytes))
    return out


def _torch_muon(sc: Scenario, sz: ModelSizes) -> dict[str, Any]:
    groups = Counter(shape for _, shape, _ in sz.muon)
    ns = sum(ns_ms("torch", m, n, k) for (m, n), k in groups.items())
    elementwise = muon_update_ms(sz.muon_elements, sc.dtype_bytes) + adamw_ms(sz.rest, sc.dtype_bytes)
    return {"collectives": [], "ns_ms": ns, "ns_rank": 0, "elementwise_ms": elementwise, "fsdp_units": 0}


def design_parts(sc: Scenario, design: str, *, sizes: ModelSizes | None = None,
                 naive_backend: str = "direct-2026-11-29") -> dict[str, Any]:
    """What ``design`` issues and computes in one step on ``sc`` (of ``sizes``, default the preset's): its
    collectives, NS, element-wise work and FSDP2 units, before any phase is timed (the pipeline model,
    :mod:`dmuon.tools.pipeline`, times them per microbatch)."""
    sz = sizes_of(sc.shape, sc.seq) if sizes is None else sizes
    if design == "fsdp_adamw":
        parts = _baseline(sc, sz)
    elif design == "dmuon":  # what layout="auto" takes
        parts = _dmuon_node(sc, sz) if auto_layout(sc, sz).layout == "node" else _dmuon(sc, sz)
    elif design == "dmuon_flat":
        parts = _dmuon(sc, sz)
    elif design == "dmuon_node":
        parts = _dmuon_node(sc, sz)
    elif design in _NS:
        parts = _all_to_all(sc, sz, design)
    elif design == "naive":
        parts = _naive(sc, sz, naive_backend)
    elif design == "torch_muon":
        parts = _torch_muon(sc, sz)
    else:
        raise ValueError(f"dmuon.plan: unknown design {design!r}; one of "
                         f"{', '.join([*DESIGNS, *LAYOUT_DESIGNS, *VALIDATION_DESIGNS])}")
    return parts


def simulate_design(sc: Scenario, design: str, *, naive_backend: str = "direct-2026-11-29") -> dict[str, Any]:
    """One design's step on ``sc``, per rank (the busiest where ranks differ): phase times, NS, element-wise
    work, every collective with its bytes and time, and the exposed communication of each phase."""
    sz = sizes_of(sc.shape, sc.seq)
    parts = design_parts(sc, design, sizes=sz, naive_backend=naive_backend)
    out = _phases(sc, sz, parts["collectives"], parts["fsdp_units"])
    muon_step = parts.get("muon_step_ms", parts["ns_ms"])
    out["optimizer_ms"] = muon_step + parts["elementwise_ms"] + out["exposed_step_ms"]
    out["step_ms"] = out["forward_ms"] + out["backward_ms"] + out["optimizer_ms"]
    out["exposed_ms"] = (out["exposed_forward_ms"] + out["exposed_backward_ms"] + out["exposed_step_ms"]
                         + parts.get("a2a_exposed_ms", max(0.0, muon_step - parts["ns_ms"])))
    out.update({k: parts[k] for k in ("ns_ms", "ns_rank", "elementwise_ms")})
    out["step_all_to_all_ms"] = parts.get("a2a_ms", 0.0)
    out["bytes_per_rank"] = sum(c["bytes"] for c in parts["collectives"])
    out["collectives"] = parts["collectives"]
    if "plan" in parts:
        out["idle_owners"] = parts["idle_owners"]
        out["imbalance"] = parts["plan"].imbalance
    out["design"] = design
    return out
