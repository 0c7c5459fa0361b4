"""Experts on the engine's shards under HSDP (2 x 2 on 4 gloo ranks): the replicate rows split each chunk's
Newton-Schulz and gather the results ([Note: expert NS across replicas] in ``dmuon/optim/routes/sharded.py``).

The split runs where a shard column sits in one node (torchrun's ``LOCAL_WORLD_SIZE``; set here as torchrun
would): with 4 ranks a node it splits, with 2 a node the column's rows are on two nodes and every row computes
its copy (the path before the split). Against the single-process oracle (torch's Muon per expert), split
against not split bit for bit, with plain Muon and with NorMuon (whose per-row statistic travels in the gather
too); each expert orthogonalised once per shard column; one launch per step.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.optim import normuon as normuon_mod
from dmuon.optim import update as update_mod
from dmuon.tools.moe import expert_predicate
from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._moe import MOE_CFG, build_moe, train_moe_oracle
from tests._training import GLOBAL_BATCH, batches, full_weights, muon_kwargs

RUNS_ON_CUDA = True
STEPS = 4
WORLD, REPLICAS = 4, 2
#: the experts' matrix shapes (w1 / w3 and w2 of MOE_CFG); no dense matrix has these
EXPERT_SHAPES = {(MOE_CFG.expert_dim, MOE_CFG.dim), (MOE_CFG.dim, MOE_CFG.expert_dim)}


def _train(rank: int, world: int, split: bool | str, algorithm: str) -> dict:
    saved = update_mod.orthogonalise, normuon_mod.orthogonalise
    # one node, or the rows on two nodes; "mixed": ranks 0-1 read one node, ranks 2-3 two (nodes of different
    # sizes): each column's ranks would decide differently if each read its own value
    nodes = {True: world, False: REPLICAS, "mixed": world if rank < world // 2 else REPLICAS}[split]
    os.environ["LOCAL_WORLD_SIZE"] = str(nodes)
    try:
        return _train_with(rank, world, algorithm)
    finally:
        update_mod.orthogonalise, normuon_mod.orthogonalise = saved
        del os.environ["LOCAL_WORLD_SIZE"]


def _train_with(rank: int, world: int, algorithm: str) -> dict:
    seen: list[int] = []
    real = update_mod.orthogonalise

    def counting(update, hp, blocks):  # the real Newton-Schulz, counting expert matrices
        if tuple(update.shape[-2:]) in EXPERT_SHAPES:
            seen.append(update.shape[:-2].numel())
        return real(update, hp, blocks)

    update_mod.orthogonalise = normuon_mod.orthogonalise = counting
    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE_TYPE, (REPLICAS, world // REPLICAS), mesh_dim_names=("replicate", "shard"))
    model = build_moe(MOE_CFG).to(device())
    dmuon.dedicate_params(model, mesh["shard"], expert_predicate, replicate_mesh=mesh["replicate"], verbose=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **{**muon_kwargs(), "algorithm": algorithm})
    per, dev = GLOBAL_BATCH // world, device()
    losses, counts = [], []
    for tok, tgt in batches(STEPS):
        opt.zero_grad()
        dmuon.diagnostics.reset_comm_counts(model)
        loss = model(tok[rank * per:(rank + 1) * per].to(dev), tgt[rank * per:(rank + 1) * per].to(dev)).loss
        loss.backward()
        opt.step()
        counts.append(dmuon.diagnostics.comm_counts(model)["sharded_update"])
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    experts = [p for p in model.parameters() if p.ndim == 3]
    value_and_state = sum(t.to_local().numel() * t.element_size() for p in experts for t in (p, *opt.state[p].values()))
    return {"losses": losses, "weights": full_weights(model), "counts": counts, "ns_experts": sum(seen),
            "expert_bytes": value_and_state, "state_keys": sorted(opt.state[experts[0]])}


def _job(rank: int, world: int) -> dict:
    runs = {(split, algorithm): _train(rank, world, split, algorithm)
            for algorithm in ("muon", "normuon") for split in (True, False)}
    runs["mixed", "muon"] = _train(rank, world, "mixed", "muon")
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_job, WORLD)


@pytest.mark.parametrize("algorithm", ["muon", "normuon"])
def test_split_equals_every_row_computing_its_copy_bitwise(runs, algorithm):
    for rank, r in enumerate(runs):
        assert_bitwise(r[True, algorithm], r[False, algorithm], f"rank {rank} {algorithm}")


def test_ranks_that_read_different_node_sizes_all_keep_computing_their_copy(runs):
    """The node layout is agreed in dedicate_params' gather: where ranks read different LOCAL_WORLD_SIZE values,
    nobody splits (rather than some rows splitting and the others never joining their gather)."""
    for rank, r in enumerate(runs):
        assert_bitwise(r["mixed", "muon"], r[False, "muon"], f"rank {rank}")
        assert r["mixed", "muon"]["ns_experts"] == r[False, "muon"]["ns_experts"], rank
        assert all(c["calls"] == 0 for c in r["mixed", "muon"]["counts"]), (rank, r["mixed", "muon"]["counts"])


def test_matches_per_expert_oracle(runs):
    assert_close_to(runs[0][True, "muon"], train_moe_oracle(STEPS), "2 x 2 HSDP, experts split over the rows")


@pytest.mark.parametrize("algorithm", ["muon", "normuon"])
def test_each_expert_is_orthogonalised_once_per_column_and_gathered_in_one_launch(runs, algorithm):
    experts = MOE_CFG.n_layers * 3 * MOE_CFG.n_experts  # w1, w3, w2 of every layer
    shard = WORLD // REPLICAS
    for rank, r in enumerate(runs):
        run, before = r[True, algorithm], r[False, algorithm]
        # not split: each row all of its chunk; split: each row its share
        assert before["ns_experts"] == STEPS * experts // shard, (rank, before["ns_experts"])
        assert run["ns_experts"] == STEPS * experts // (shard * REPLICAS), (rank, run["ns_experts"])
        # the value and every state tensor (NorMuon's per-row statistic too) of the chunk's experts, all shares
        keys = ["momentum_buffer"] + (["row_second_moment"] if algorithm == "normuon" else [])
        assert run["state_keys"] == keys, run["state_keys"]
        for c in run["counts"]:
            assert c["calls"] == 1, (rank, c)
            assert c["by_dim"].keys() == {"replicate"}, (rank, c)
            assert c["bytes"] == run["expert_bytes"], (rank, c, run["expert_bytes"])
        assert all(c["calls"] == 0 for c in before["counts"]), (rank, before["counts"])
