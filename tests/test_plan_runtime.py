"""The planner's schedule is what the runtime does: ``python -m dmuon.plan --simulate`` charges dmuon, per step and
rank, the collectives the runtime issues (kind, group, payload bytes, launches), exactly.

The runtime side: a 4-layer Llama-shaped model (``tests._training.CFG4``; its projections dedicated, the rest in
one FSDP2 root unit: the planner's ``dmuon_wrap="root"``) on 8 and 16 gloo ranks, flat, HSDP (2 x 4, 4 x 4) and flat
under dmuon's node layout (2 and 4 nodes of 4, [Note: node layout] in ``dmuon/runtime/hierarchy.py``; taken by
``layout="auto"``),
two steps; the second step is recorded (the first also publishes what the bind left stale). dmuon's
``CommCounter`` gives every collective dmuon issued by kind and mesh dimension; wrapping ``torch.distributed``
(``dmuon.tools.side_by_side.CollectiveCounter``) counts every launch of the step independently, FSDP2's included.
The planner side: :func:`dmuon.tools.schedules.dmuon_schedule` for the same shape, mesh and rank, given the
matrices as the model names them (the owner plan breaks ties by name). And the owner table of ``python -m
dmuon.plan`` (:func:`dmuon.tools.plan.make_plan`) takes the layout ``dedicate_params(layout="auto")`` took on the
node runs, with the same owner for every (layer, shape). At 8 ranks also the tiny MoE under the node layout (its
experts on the engine's shards), against the planner's MoE schedule.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.links import Links
from dmuon.runtime.hooks import get_state
from dmuon.tools.models import TinyLlama, projection_predicate
from dmuon.tools.plan import make_plan
from dmuon.tools.moe import expert_predicate
from dmuon.tools.presets import LlamaShape, MoEShape
from dmuon.tools.schedules import dmuon_schedule, simulate_design
from dmuon.tools.side_by_side import CollectiveCounter
from dmuon.tools.step_model import Scenario, sizes_of
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._moe import build_moe, moe_cfg
from tests._training import CFG4, KJ

RUNS_ON_CUDA = True
#: world size -> the replicate sizes run on it (1: flat FSDP2; "node": flat FSDP2, dmuon's node layout on nodes of
#: NODE ranks, simulated with torchrun's LOCAL_WORLD_SIZE)
MESHES: dict[int, tuple[int | str, ...]] = {8: (1, 2, "node"), 16: (1, 4, "node")}
NODE = 4
#: CFG4 as the planner reads it
SHAPE = LlamaShape("cfg4", hidden=CFG4.dim, intermediate=CFG4.hidden_dim, layers=CFG4.n_layers, heads=CFG4.n_heads,
                   kv_heads=CFG4.n_kv_heads, head_dim=CFG4.head_dim, vocab=CFG4.vocab_size)


def _one(rank: int, world: int, replicas: int | str) -> dict:
    torch.manual_seed(0)
    # on the node meshes "auto": dedicate_params' own cost model takes the node layout there (the owner-table
    # test checks that the planner predicts the same pick)
    layout = "auto" if replicas == "node" else "flat"
    if replicas == "node":
        os.environ["LOCAL_WORLD_SIZE"] = str(NODE)
    try:
        return _run(world, 1 if replicas == "node" else replicas, layout)  # type: ignore[arg-type]
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def _run(world: int, replicas: int, layout: str) -> dict:
    if replicas > 1:
        mesh = init_device_mesh(DEVICE_TYPE, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh["shard"], mesh["replicate"]
    else:
        mesh = shard = init_device_mesh(DEVICE_TYPE, (world,))
        replicate = None
    model = TinyLlama(CFG4)
    model.init_weights(0)
    model = model.to(device())
    dmuon.dedicate_params(model, shard, projection_predicate, replicate_mesh=replicate, layout=layout)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        tok = torch.randint(0, CFG4.vocab_size, (2, 9), generator=gen).to(device())
        dmuon.diagnostics.reset_comm_counts(model)
        with CollectiveCounter() as launches:
            opt.zero_grad()
            logits = model(tok[:, :-1]).logits
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1)).backward()
            opt.step()
    state = get_state(model)
    counts = {(kind, dim): {"calls": d["calls"], "bytes": d["bytes"]}
              for kind, v in dmuon.diagnostics.comm_counts(model).items() for dim, d in v["by_dim"].items()}
    return {"slot": state.ctx.rank, "counts": counts, "launches": sum(v["calls"] for v in launches.as_dict().values()),
            "matrices": tuple((dp.fqn, tuple(dp.shape), g.fqn) for g in state.groups for dp in g.params),
            "owners": sorted((dp.owner, g.fqn.rsplit(".", 1)[1], tuple(dp.shape)) for g in state.groups
                             for dp in g.params), "layout": state.layout}


#: the tiny MoE with one expert a rank at 8 ranks (its experts on the engine's shards), as the planner reads it
MOE = moe_cfg(n_experts=8)
MOE_SHAPE = MoEShape("tiny-moe", hidden=MOE.dim, intermediate=MOE.hidden_dim, layers=MOE.n_layers, heads=MOE.n_heads,
                     kv_heads=MOE.n_kv_heads, head_dim=MOE.head_dim, vocab=MOE.vocab_size, experts=MOE.n_experts,
                     expert_intermediate=MOE.expert_dim, top_k=MOE.top_k)


def _moe_node(world: int) -> dict:
    """The tiny MoE under ``layout="node"`` (2 nodes of 4), experts on FSDP2's shards: dmuon's counts of a step."""
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE)
    try:
        model = build_moe(MOE).to(device())
        dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, (world,)), expert_predicate, layout="node",
                              route=lambda n, p: "muon_sharded" if p.ndim == 3 else None, verbose=False)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    fully_shard(model, mesh=init_device_mesh(DEVICE_TYPE, (world,)))
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        tok = torch.randint(0, MOE.vocab_size, (2, 9), generator=gen).to(device())
        dmuon.diagnostics.reset_comm_counts(model)
        opt.zero_grad()
        model(tok[:, :-1], tok[:, 1:]).loss.backward()
        opt.step()
    state = get_state(model)
    return {"slot": state.ctx.rank, "layout": state.layout,
            "counts": {(kind, dim): {"calls": d["calls"], "bytes": d["bytes"]}
                       for kind, v in dmuon.diagnostics.comm_counts(model).items() for dim, d in v["by_dim"].items()},
            "matrices": tuple((dp.fqn, tuple(dp.shape), g.fqn) for g in state.groups for dp in g.params)}


def _job(rank: int, world: int) -> dict:
    out: dict = {replicas: _one(rank, world, replicas) for replicas in MESHES[world]}
    if world == 8:
        out["moe"] = _moe_node(world)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {world: run_distributed(_job, world) for world in MESHES}


def _planned(world: int, replicas: int | str, res: dict) -> tuple[dict, int]:
    """The planner's dmuon schedule for ``res``'s rank, and its FSDP2 launches of the step."""
    layout = "node" if replicas == "node" else "flat"
    sc = Scenario(SHAPE, world, replicas=1 if layout == "node" else replicas, dtype_bytes=4,  # type: ignore[arg-type]
                  links=Links(gpus_per_node=NODE))
    sizes = dataclasses.replace(sizes_of(SHAPE, sc.seq), muon=tuple(sorted(res["matrices"])))
    fsdp2 = sum(c["calls"] for c in simulate_design(sc, "dmuon_flat")["collectives"] if c["name"].startswith("fsdp2"))
    return dmuon_schedule(sc, slot=res["slot"], sizes=sizes, layout=layout), fsdp2


@pytest.mark.parametrize("world,replicas", [(w, r) for w, rs in MESHES.items() for r in rs])
def test_runtime_issues_the_planners_schedule(runs, world, replicas):
    results = [r[replicas] for r in runs[world]]
    assert sorted(r["slot"] for r in results) == list(range(world))
    # the planner's matrices are the preset's shapes, under the model's names
    assert sorted(s for _, s, _ in results[0]["matrices"]) == sorted(s for _, s, _ in sizes_of(SHAPE, 1).muon)
    for res in results:
        planned, fsdp2 = _planned(world, replicas, res)
        what = (world, replicas, res["slot"])
        assert res["counts"] == planned, what
        # every launch of the step is dmuon's or FSDP2's, as planned
        assert res["launches"] == sum(v["calls"] for v in planned.values()) + fsdp2, (what, res["launches"])


@pytest.mark.parametrize("world,replicas", [(w, r) for w, rs in MESHES.items() for r in rs])
def test_the_owner_table_is_the_runtimes_plan(runs, world, replicas):
    """``python -m dmuon.plan``'s owner table (without ``--simulate``) names the layout and the owners the
    runtime built: the layout "auto" takes on the node runs (node) and the HSDP ones (flat), the flat one asked."""
    res = runs[world][0][replicas]
    info = make_plan(SHAPE, world, 1 if replicas == "node" else replicas, "fp32",  # type: ignore[arg-type]
                     layout="flat" if replicas == 1 else "auto", gpus_per_node=NODE)
    assert info["layout"] == res["layout"] == ("node" if replicas == "node" else "flat"), (world, replicas,
                                                                                        info["layout_why"])
    # the same slot for every (layer, shape): names differ (the preset's HF names), ties break alike by order
    table = sorted((p["owner"], p["fqn"].split(".")[2], tuple(p["shape"])) for p in info["per_param"])
    assert table == res["owners"], (world, replicas)


def test_runtime_issues_the_planners_schedule_for_moe_under_the_node_layout(runs):
    """The planner's MoE: the dense matrices owned node by node, the experts where the engine puts them (no dmuon
    collective of theirs); its preload (one expert a rank) as the runtime's."""
    for res in (r["moe"] for r in runs[8]):
        assert res["layout"] == "node", res["slot"]
        sc = Scenario(MOE_SHAPE, 8, dtype_bytes=4, links=Links(gpus_per_node=NODE))
        sizes = dataclasses.replace(sizes_of(MOE_SHAPE, sc.seq), muon=tuple(sorted(
            (f, (s[0], s[1]), b) for f, s, b in res["matrices"])))
        assert res["counts"] == dmuon_schedule(sc, slot=res["slot"], sizes=sizes, layout="node"), res["slot"]
