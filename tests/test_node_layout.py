"""The node layout ([Note: node layout] in ``dmuon/runtime/hierarchy.py``): on a 1-D mesh over whole nodes (simulated
with torchrun's ``LOCAL_WORLD_SIZE``), each boundary owned inside one node; against the single-process oracle,
Z2 against Z3, against the flat layout, with accumulation, a checkpoint saved under it loaded under the flat
layout, its launches per step at 4 and 8 ranks, a wrong variant that the bounds catch, and the refusals. Beside the
FSDP2 runs: the tiny MoE (experts owned and on the engine's shards) against the per-expert oracle, DDP and
DeepSpeed ZeRO-3 against the oracle, and pipeline stages refused."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.runtime import comm as C
from dmuon.runtime import group as group_mod
from dmuon.runtime.hooks import STATE_ATTR, get_state
from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._moe import MoERun, train_moe, train_moe_oracle
from tests._pipeline import LAYERS, Stage, make_model
from tests._training import (GLOBAL_BATCH, KJ, batches, build_model, full_weights, muon_kwargs, projection_predicate,
                             train_oracle)

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT = 4, 2


def _build(world: int, layout: str, *, z3: bool = True, seed: int = 0):
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model(seed=seed).to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate, reshard_after_forward=z3, layout=layout)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3,
                     adamw_betas=(0.9, 0.95))
    return model, opt


def _step(model, opt, rank: int, world: int, step: int, accum: int = 1) -> float:
    tok, tgt = batches(STEPS)[step]
    per = GLOBAL_BATCH // world
    tok, tgt = tok[rank * per : (rank + 1) * per].to(device()), tgt[rank * per : (rank + 1) * per].to(device())
    opt.zero_grad()
    m, total = per // accum, 0.0
    for i in range(accum):
        with dmuon.no_sync(model) if i < accum - 1 else nullcontext():
            loss = model(tok[i * m : (i + 1) * m], tgt[i * m : (i + 1) * m]).loss / accum
            loss.backward()
        total += loss.item()
    opt.step()
    logged = torch.tensor(total, device=device())
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def _train(rank: int, world: int, layout: str, *, z3: bool = True, accum: int = 1, checkpoint: bool = False) -> dict:
    model, opt = _build(world, layout, z3=z3)
    state = get_state(model)
    losses, calls, snapshot = [], [], None
    for step in range(STEPS):
        dmuon.diagnostics.reset_comm_counts(model)
        losses.append(_step(model, opt, rank, world, step, accum))
        calls.append({k: {d: v["calls"] for d, v in c["by_dim"].items()}
                      for k, c in dmuon.diagnostics.comm_counts(model).items() if c["calls"]})
        if checkpoint and step == SAVE_AT - 1:
            snapshot = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt),
                        "weights": full_weights(model)}
    owners = {fqn: p._dedicated_owner_rank for fqn, p in dmuon.get_dedicated_params(model).items()}
    row = dmuon.diagnostics.summarize(model).rows[rank]  # the last step's counts against what it expects
    out = {"losses": losses, "weights": full_weights(model), "calls": calls, "layout": state.layout,
           "owners": owners, "boundaries": len(state.groups), "summary_layout": row["layout"],
           "summary": {k: (row["expected"][k], row["measured"].get(k, 0))
                       for k in ("forward_broadcast", "backward_broadcast", "reduce")}}
    if snapshot is not None:  # saved under this layout, loaded under the flat one (other owners)
        fresh, fresh_opt = _build(world, "flat", seed=99)
        dmuon.set_model_state_dict(fresh, snapshot["model"])
        dmuon.set_optimizer_state_dict(fresh, fresh_opt, snapshot["optim"])
        loaded = full_weights(fresh)
        out["loaded_equal"] = all(torch.equal(loaded[k], v) for k, v in snapshot["weights"].items())
        out["resumed"] = {"losses": losses[:SAVE_AT] + [_step(fresh, fresh_opt, rank, world, s)
                                                        for s in range(SAVE_AT, STEPS)],
                          "weights": full_weights(fresh)}
        out["flat_owners"] = {fqn: p._dedicated_owner_rank for fqn, p in dmuon.get_dedicated_params(fresh).items()}
    return out


def _node_only_reduce(ctx, parts, kind, label):
    """A wrong variant: the gradient averaged inside the owner's node only (no rail stage)."""
    n = ctx.node_size
    node = next(iter(parts)) // n
    like = next(iter(parts.values()))
    return C.reduce_parts(ctx, [parts.get(node * n + j, like.new_empty(0)) for j in range(n)], kind, label,
                          dim=C.Dim.NODE)


def _with_nodes(per_node: int, fn, *args, **kwargs):
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def _dedicated(world: int, layout: str) -> dict:
    """What ``dedicate_params`` decided (no training): the layout and the owners."""
    model = build_model().to(device())
    dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, (world,)), projection_predicate, layout=layout)
    return {"layout": get_state(model).layout,
            "owners": {fqn: p._dedicated_owner_rank for fqn, p in dmuon.get_dedicated_params(model).items()}}


def _refusal(world: int, layout: str, **mesh) -> dict:
    model = build_model().to(device())
    try:
        dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, **mesh), projection_predicate, layout=layout)
        return {"error": None, "untouched": False}
    except (ValueError, RuntimeError) as e:
        return {"error": str(e), "untouched": not hasattr(model, STATE_ATTR)
                and not any(hasattr(p, "_dedicated_owner_rank") for p in model.parameters())}


def _train_ddp(rank: int, world: int) -> dict:
    """The node layout under DDP (dmuon's collectives are its own; DDP averages the rest)."""
    model = build_model().to(device())
    dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, (world,)), projection_predicate, layout="node")
    ddp = DistributedDataParallel(model)
    opt = dmuon.Muon(ddp, **muon_kwargs())
    losses = [_step(ddp, opt, rank, world, step) for step in range(STEPS)]
    return {"losses": losses, "weights": full_weights(model), "layout": get_state(model).layout}


def _train_deepspeed(rank: int, world: int) -> dict:
    """The node layout under DeepSpeed ZeRO-3 (the engine partitions the rest; dmuon's collectives are its own).
    Last in the job: DeepSpeed's setup sets this process's LOCAL_RANK and accelerator."""
    from tests import _deepspeed as ds

    deepspeed = ds.setup(rank)
    torch.manual_seed(0)
    model = build_model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, layout="node", verbose=False)
    run = ds.Run(stage=3, accum=1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=dmuon.Muon(model, **muon_kwargs()),
                                           config=ds.config(world, stage=run.stage, accum=run.accum))
    return {**ds.result(model, ds.train(engine, model, rank, world, run, range(STEPS))),
            "layout": get_state(model).layout}


def _refusal_stages(rank: int) -> dict:
    """Pipeline stages (2 of 2 ranks, each "2 nodes of 1"): the node layout is refused, on every rank."""
    mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("pp", "dp"))
    stage = Stage(make_model(), LAYERS[mesh["pp"].get_local_rank()], first=rank < 2, last=rank >= 2)
    try:
        dmuon.dedicate_params(stage, mesh["dp"], projection_predicate, layout="node", verbose=False)
        return {"error": None, "untouched": False}
    except ValueError as e:
        return {"error": str(e), "untouched": not hasattr(stage, STATE_ATTR)
                and not any(hasattr(p, "_dedicated_owner_rank") for p in stage.parameters())}


def four_job(rank: int, world: int) -> dict:
    out = {
        # MoE: the dense matrices and layer 0's experts (route "muon") owned node by node, layer 1's experts on
        # the engine's shards ("muon_sharded")
        "moe": _with_nodes(2, train_moe, rank, world, MoERun(steps=STEPS, expert_route="mixed", layout="node")),
        "ddp": _with_nodes(2, _train_ddp, rank, world),
        "refused_stages": _with_nodes(1, _refusal_stages, rank),
        "node_z3": _with_nodes(2, _train, rank, world, "node", checkpoint=True),
        "node_z2": _with_nodes(2, _train, rank, world, "node", z3=False),
        "node_accum": _with_nodes(2, _train, rank, world, "node", accum=2),
        "auto": _with_nodes(2, _dedicated, world, "auto"),
        "flat": _with_nodes(2, _train, rank, world, "flat"),
        "auto_one_node": _with_nodes(world, _dedicated, world, "auto"),
        "refused_one_node": _with_nodes(world, _refusal, world, "node", mesh_shape=(world,)),
        "refused_unknown": _refusal(world, "node", mesh_shape=(world,)),
        # ranks asking for different layouts would build different groups: the plan check stops them all
        "refused_mixed": _with_nodes(2, _refusal, world, "node" if rank == 0 else "flat", mesh_shape=(world,)),
        "refused_hsdp": _with_nodes(2, _refusal, world, "node", mesh_shape=(2, world // 2),
                                    mesh_dim_names=("replicate", "shard")),
    }
    real = group_mod.reduce_boundary
    group_mod.reduce_boundary = _node_only_reduce
    try:
        out["wrong"] = _with_nodes(2, _train, rank, world, "node")
    finally:
        group_mod.reduce_boundary = real
    if DEVICE_TYPE == "cpu":  # DeepSpeed's CPU accelerator (tests/_deepspeed.py)
        out["deepspeed"] = _with_nodes(2, _train_deepspeed, rank, world)
    return out


def eight_job(rank: int, world: int) -> dict:
    return {"node": _with_nodes(4, _train, rank, world, "node")}


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_distributed(four_job, 4)


def test_node_layout_matches_the_oracle_and_the_flat_layout(four):
    oracle = train_oracle(STEPS)
    for rank, res in enumerate(four):
        assert res["node_z3"]["layout"] == res["node_z3"]["summary_layout"] == "node"
        assert all(want == got for want, got in res["node_z3"]["summary"].values()), res["node_z3"]["summary"]
        assert_close_to(res["node_z3"], oracle, f"rank {rank}: node vs oracle")
        # the two-stage average rounds in another order than the flat one: oracle bounds, not bits
        assert_close_to(res["node_z3"], res["flat"], f"rank {rank}: node vs flat")
        assert_bitwise(res["node_z3"], four[0]["node_z3"], f"rank {rank} vs rank 0")


def test_each_boundary_is_owned_inside_one_node(four):
    owners = four[0]["node_z3"]["owners"]
    by_layer: dict[str, set[int]] = {}
    for fqn, slot in owners.items():
        by_layer.setdefault(fqn.split(".")[1], set()).add(slot)
    assert [{s // 2 for s in slots} for _, slots in sorted(by_layer.items())] == [{0}, {1}], by_layer
    assert all(len(slots) == 2 for slots in by_layer.values()), by_layer  # spread over the node's ranks
    assert owners != four[0]["node_z3"]["flat_owners"]


def test_z2_equals_z3_and_accumulation(four):
    for rank, res in enumerate(four):
        assert_bitwise(res["node_z2"], res["node_z3"], f"rank {rank}: Z2 vs Z3")
        assert_close_to(res["node_accum"], res["node_z3"], f"rank {rank}: no_sync accumulation")


def test_checkpoint_saved_under_node_loads_under_flat(four):
    for rank, res in enumerate(four):
        r = res["node_z3"]
        assert r["loaded_equal"], f"rank {rank}"
        assert_close_to(r["resumed"], r, f"rank {rank}: resumed under flat")


def test_auto_takes_what_the_cost_model_predicts_cheaper(four):
    """On this tiny model the latency of the node layout's second launch outweighs its bytes: "auto" stays flat
    (on one node it must be flat whatever the sizes); on Llama-3-8B's layers over 8 nodes it takes "node"."""
    from dmuon.layout import choose_layout

    tiny = choose_layout([4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128)] * 2, 4, 2)
    assert tiny.layout == "flat" and tiny.node_ms > tiny.flat_ms, tiny
    big = choose_layout([2 * 218_103_808] * 32, 64, 8)
    assert big.layout == "node" and big.node_ms < big.flat_ms / 2, big
    for rank, res in enumerate(four):
        assert res["auto"]["layout"] == res["auto_one_node"]["layout"] == "flat", rank
        assert res["auto"]["owners"] == res["auto_one_node"]["owners"] == res["flat"]["owners"]


def test_moe_under_the_node_layout_matches_the_per_expert_oracle(four):
    """Experts owned (layer 0, route "muon") and on the engine's shards (layer 1) beside node-owned dense
    matrices: the per-expert single-process oracle, every rank alike, every boundary's owners in one node."""
    oracle = train_moe_oracle(STEPS)
    for rank, res in enumerate(four):
        assert res["moe"]["layout"] == "node", rank
        assert_close_to(res["moe"], oracle, f"rank {rank}: MoE node vs oracle")
        assert_bitwise(res["moe"], four[0]["moe"], f"rank {rank} vs rank 0: MoE")
    nodes: dict[str, set[int]] = {}
    for rank, res in enumerate(four):
        for fqn in res["moe"]["owned"]:
            nodes.setdefault(fqn.split(".")[1], set()).add(rank // 2)
    assert sorted(nodes) == ["0", "1"] and all(len(n) == 1 for n in nodes.values()), nodes
    assert any(".experts." in f for r in four for f in r["moe"]["owned"])  # layer 0's experts are owned


def test_node_layout_under_ddp_matches_the_oracle(four):
    oracle = train_oracle(STEPS)
    for rank, res in enumerate(four):
        assert res["ddp"]["layout"] == "node", rank
        assert_close_to(res["ddp"], oracle, f"rank {rank}: DDP node vs oracle")


def test_node_layout_under_deepspeed_zero3_matches_the_oracle(four):
    if "deepspeed" not in four[0]:
        pytest.skip("DeepSpeed runs on its CPU accelerator here (tests/_deepspeed.py)")
    oracle = train_oracle(STEPS)
    for rank, res in enumerate(four):
        assert res["deepspeed"]["layout"] == "node", rank
        assert_close_to(res["deepspeed"], oracle, f"rank {rank}: DeepSpeed ZeRO-3 node vs oracle")


def test_a_node_only_average_misses_the_oracle(four):
    with pytest.raises(AssertionError):
        assert_close_to(four[0]["wrong"], train_oracle(STEPS), "node-only average")


def test_node_layout_refusals_name_the_reason_and_change_nothing(four):
    for rank, res in enumerate(four):
        for key, words in (("refused_one_node", "not two or more whole nodes"),
                           ("refused_unknown", "unknown"), ("refused_hsdp", "HSDP"),
                           ("refused_mixed", "ranks computed different owner plans or settings"),
                           ("refused_stages", "pipeline stages (2) are not supported")):
            r = res[key]
            assert r["error"] is not None and words in r["error"] and r["untouched"], (rank, key, r)


def test_launches_per_step_are_the_same_on_two_nodes_of_two_and_of_four(four):
    eight = run_distributed(eight_job, 8)
    oracle = train_oracle(STEPS)
    for rank, res in enumerate(eight):
        assert_close_to(res["node"], oracle, f"rank {rank} of 2 nodes x 4: node vs oracle")
    L = four[0]["node_z3"]["boundaries"]
    want = {"forward_broadcast": {"rail": L, "node": L}, "backward_broadcast": {"rail": L, "node": L},
            "reduce": {"node": L, "rail": L}}  # FSDP2 averages the plain params
    for results in (four, eight):
        for rank, res in enumerate(results):
            run = res["node_z3"] if "node_z3" in res else res["node"]
            assert all(c == want for c in run["calls"]), (rank, run["calls"])
