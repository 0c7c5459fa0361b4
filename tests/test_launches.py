"""dmuon's launches per training step do not grow with the world: every owner's bucket of a boundary moves in one
launch per phase ([Note: one launch per boundary] in ``dmuon/runtime/comm.py``).

Counted two ways on 2, 4 and 8 gloo ranks: by dmuon's own ``CommCounter`` (``calls``) and independently by
wrapping ``torch.distributed``'s collective functions (``dmuon.tools.side_by_side.CollectiveCounter``). The
model has no FSDP2, so every collective of the step is dmuon's: per boundary the forward gather, the backward
gather (Z3) and the gradient reduce, plus one fixed launch per step, the all-reduce of the plain params'
gradients (embeddings, norms, head: ``replicated_grad_all_reduce``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.runtime.hooks import get_state
from dmuon.tools.models import TinyLlama, projection_predicate
from dmuon.tools.side_by_side import CollectiveCounter
from tests._dist import DEVICE_TYPE, device, run_distributed, world_available
from tests._training import CFG4, KJ

RUNS_ON_CUDA = True
WORLDS = (2, 4, 8)
STEPS = 2
#: the phases of one boundary that launch: forward gather, backward gather (Z3), gradient reduce
PER_BOUNDARY = ("forward_broadcast", "backward_broadcast", "reduce")


def _job(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = TinyLlama(CFG4)
    model.init_weights(0)
    model = model.to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(STEPS):
        tok = torch.randint(0, CFG4.vocab_size, (2, 9), generator=gen).to(device())
        dmuon.diagnostics.reset_comm_counts(model)
        with CollectiveCounter() as counter:
            opt.zero_grad()
            logits = model(tok[:, :-1]).logits
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1)).backward()
            opt.step()
        ours = dmuon.diagnostics.comm_counts(model)
        steps.append({"dmuon": {k: v["calls"] for k, v in ours.items() if v["calls"]},
                      "torch": {k: v["calls"] for k, v in counter.as_dict().items()}})
    owners = {p._dedicated_owner_rank for p in dmuon.get_dedicated_params(model).values()}
    boundaries = [g.fqn for g in get_state(model).groups]
    return {"steps": steps, "boundaries": len(boundaries), "owners": len(owners), "names": boundaries}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    worlds = [w for w in WORLDS if world_available(w)]
    if len(worlds) < 2:
        pytest.skip("needs at least two of the world sizes")
    return {w: run_distributed(_job, w) for w in worlds}


def test_launches_per_step_are_the_same_at_every_world_size(runs):
    seen = {}
    for world, results in runs.items():
        assert all(r["owners"] == min(world, 28) for r in results), (world, [r["owners"] for r in results])
        for rank, res in enumerate(results):
            for step, counts in enumerate(res["steps"]):
                seen[world, rank, step] = counts["dmuon"]
    first = next(iter(seen.values()))
    assert all(c == first for c in seen.values()), seen


def test_at_most_three_launches_per_boundary_plus_the_plain_param_all_reduce(runs):
    for world, results in runs.items():
        for rank, res in enumerate(results):
            boundaries = res["boundaries"]
            for step, counts in enumerate(res["steps"]):
                ours = counts["dmuon"]
                what = (world, rank, step, counts)
                assert sum(ours.get(k, 0) for k in PER_BOUNDARY) <= 3 * boundaries, what
                assert all(ours.get(k) == boundaries for k in PER_BOUNDARY), what
                assert ours.get("replicated_grad_all_reduce") == 1, what
                assert set(ours) <= {*PER_BOUNDARY, "replicated_grad_all_reduce"}, what
                # the independent count: every torch.distributed collective of the step is one of dmuon's
                assert sum(counts["torch"].values()) == sum(ours.values()) == 3 * boundaries + 1, what


@pytest.mark.parametrize("world,replicas", [(8, 1), (64, 1), (1024, 1), (64, 8)])
def test_the_planner_counts_one_launch_per_boundary_and_phase(world, replicas):
    """``python -m dmuon.plan --simulate`` charges dmuon what the runtime launches: one call per boundary (a
    Llama-3-8B layer holds 7 matrices, spread over up to 7 owners) per phase, whatever the world size."""
    from dmuon.tools.presets import PRESETS
    from dmuon.tools.schedules import simulate_design
    from dmuon.tools.step_model import Scenario

    shape = PRESETS["llama3-8b"]
    sc = Scenario(shape, world, replicas=replicas)
    calls = {c["name"]: c["calls"] for c in simulate_design(sc, "dmuon_flat")["collectives"]}
    for phase in ("dmuon forward broadcast", "dmuon backward broadcast", "dmuon reduce"):
        assert calls[phase] == shape.layers, (phase, calls)
    if replicas == 1 and world > 8:  # the node layout: per boundary and phase one launch on the rail, one in the node
        node = {c["name"]: c["calls"] for c in simulate_design(sc, "dmuon_node")["collectives"]
                if c["name"].startswith("dmuon")}
        assert len(node) == 6, node  # a rail launches where its local index holds a bucket of the boundary
        assert all(v == shape.layers if "(node)" in k else 0 < v <= shape.layers for k, v in node.items()), node
    if replicas > 1:  # a column's holders: one launch per boundary they hold a bucket of
        assert 0 < calls["dmuon replicate reduce"] == calls["dmuon replicate publish"] <= shape.layers, calls


def _parts_job(rank: int, world: int) -> dict:
    """``gather_parts`` / ``reduce_parts`` on parts of unequal sizes (empty ones too) against one
    ``torch.distributed`` broadcast / reduce (AVG) per part, and the launches each counts."""
    from dmuon.runtime import comm as C

    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    ctx = C.CommContext.from_meshes(mesh, None, C.CommCounter())
    sizes = [0 if i == 1 else 3 + 5 * i for i in range(world)]  # index 1 owns nothing here
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(10 + rank)
        mine = [(torch.randn(n, generator=gen) * 10 ** (rank % 3)).to(dtype).to(device()) for n in sizes]
        # the oracle: one collective per part, from / to its index
        gathered = [mine[i].clone() if i == rank else torch.empty(n, dtype=dtype, device=device())
                    for i, n in enumerate(sizes)]
        for i, t in enumerate(gathered):
            if t.numel():
                dist.broadcast(t, src=i)
        reduced = [t.clone() for t in mine]
        for i, t in enumerate(reduced):
            if t.numel():
                dist.reduce(t, dst=i, op=dist.ReduceOp.AVG)
        parts = [mine[i].clone() if i == rank else torch.full((n,), float("nan"), dtype=dtype, device=device())
                 for i, n in enumerate(sizes)]
        C.wait(C.gather_parts(ctx, parts, C.CommKind.FORWARD_BROADCAST))
        red = [t.clone() for t in mine]
        C.wait(C.reduce_parts(ctx, red, C.CommKind.REDUCE))
        out[str(dtype)] = {"gather": all(torch.equal(a, b) for a, b in zip(parts, gathered)),
                           "reduce": torch.equal(red[rank], reduced[rank])}
    counts = ctx.counter.as_dict()
    out["calls"] = (counts["forward_broadcast"]["calls"], counts["reduce"]["calls"])
    out["elements"] = (counts["forward_broadcast"]["elements"], sum(sizes) * 2)
    return out


def test_one_launch_moves_what_one_collective_per_owner_moved_bit_for_bit():
    for rank, res in enumerate(run_distributed(_parts_job, 3)):
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert res[dtype] == {"gather": True, "reduce": True}, (rank, dtype, res)
        assert res["calls"] == (2, 2), res  # one launch per call, per dtype
        assert res["elements"][0] == res["elements"][1], res  # the payload, without the padding gloo needs
