"""HSDP on 4 ranks as a 2 x 2 (replicate, shard) grid: two-stage reduce, post-step publish over the
replicate group (async or not), against the oracle, the 1-D layout, checkpoints and accumulation."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.runtime.hooks import STATE_ATTR
from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, full_weights, projection_predicate, train_oracle

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT = 10, 5


@dataclass(frozen=True)
class Run:
    hsdp: bool = True
    replicate_async: bool = True
    z3: bool = True
    single_mesh_arg: bool = False  # pass one 2-D mesh instead of shard + replicate meshes
    accum: int = 1
    init_seed: int = 0


def _build(world: int, run: Run):
    if run.hsdp:
        mesh = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fsdp_mesh = mesh
    else:
        mesh = fsdp_mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model(seed=run.init_seed).to(device())
    if run.hsdp and not run.single_mesh_arg:
        dmuon.dedicate_params(model, mesh["shard"], projection_predicate, replicate_mesh=mesh["replicate"],
                              reshard_after_forward=run.z3)
    else:
        dmuon.dedicate_params(model, mesh, projection_predicate, reshard_after_forward=run.z3)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct",
                     adamw_lr=1e-3, adamw_betas=(0.9, 0.95),
                     replicate_async=run.replicate_async)
    return model, opt


def _step(model, opt, rank: int, world: int, step: int, accum: int = 1) -> float:
    tok, tgt = batches(STEPS)[step]
    per = GLOBAL_BATCH // world
    tok, tgt = tok[rank * per : (rank + 1) * per].to(device()), tgt[rank * per : (rank + 1) * per].to(device())
    opt.zero_grad()
    m = per // accum
    total = 0.0
    for i in range(accum):
        with dmuon.no_sync(model) if i < accum - 1 else nullcontext():
            loss = model(tok[i * m : (i + 1) * m], tgt[i * m : (i + 1) * m]).loss / accum
            loss.backward()
        total += loss.item()
    opt.step()
    # a logger's all-reduce on the default group, right between step() and the next forward
    logged = torch.tensor(total, device=device())
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def _holder_storage_ok(model) -> bool:
    """Between steps only the owners' shard column holds storage for a dedicated tensor."""
    ctx = getattr(model, STATE_ATTR).ctx
    for p in dmuon.get_dedicated_params(model).values():
        holder = p._dedicated_owner_rank % ctx.shard_size == ctx.shard_index
        if holder != (p.untyped_storage().nbytes() > 0):
            return False
    return True


def train(rank: int, world: int, run: Run, checkpoint: bool = False) -> dict:
    model, opt = _build(world, run)
    losses, counts, storage_ok, snapshot = [], [], [], None
    for step in range(STEPS):
        dmuon.diagnostics.reset_comm_counts(model)
        losses.append(_step(model, opt, rank, world, step, run.accum))
        counts.append(dmuon.diagnostics.comm_counts(model))
        storage_ok.append(_holder_storage_ok(model))
        if checkpoint and step == SAVE_AT - 1:
            # right after step(), no manual drain: the getters must see the published weights
            snapshot = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    out = {"losses": losses, "weights": full_weights(model), "counts": counts, "storage_ok": storage_ok,
           "owned": sorted(dmuon.get_owned_params(model)),
           "P": sum(p.numel() for p in dmuon.get_dedicated_params(model).values())}
    if snapshot is not None:
        fresh, fresh_opt = _build(world, Run(replicate_async=run.replicate_async, init_seed=99))
        dmuon.set_model_state_dict(fresh, snapshot["model"])
        dmuon.set_optimizer_state_dict(fresh, fresh_opt, snapshot["optim"])
        out["resumed"] = [_step(fresh, fresh_opt, rank, world, s) for s in range(SAVE_AT, STEPS)]
        out["resumed_weights"] = full_weights(fresh)
    return out


def hsdp_job(rank: int, world: int) -> dict:
    return {
        "async_z3": train(rank, world, Run(), checkpoint=True),
        "sync_z3": train(rank, world, Run(replicate_async=False)),
        "async_z2": train(rank, world, Run(z3=False)),
        "single_mesh": train(rank, world, Run(single_mesh_arg=True)),
        "accum": train(rank, world, Run(accum=2)),
        "flat": train(rank, world, Run(hsdp=False)),
    }


def misuse_job(rank: int, world: int) -> dict:
    hsdp = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = build_model().to(device())
    before = {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()}
    try:
        # the shard mesh twice: its ranks cannot be a replicate column
        dmuon.dedicate_params(model, hsdp["shard"], projection_predicate, replicate_mesh=hsdp["shard"])
        error = ("no error", "")
    except ValueError as e:
        error = ("ValueError", str(e))
    untouched = (not hasattr(model, STATE_ATTR)
                 and not any(hasattr(p, "_dedicated_owner_rank") for p in model.parameters())
                 and before == {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()})
    return {"error": error, "untouched": untouched}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(hsdp_job, 4)


def test_async_publish_equals_sync_bitwise(runs):
    for rank, res in enumerate(runs):
        assert_bitwise(res["async_z3"], res["sync_z3"], f"rank {rank} async vs sync")


def test_z2_equals_z3_and_mesh_forms_agree(runs):
    for rank, res in enumerate(runs):
        assert_bitwise(res["async_z2"], res["async_z3"], f"rank {rank} Z2 vs Z3")
        assert_bitwise(res["single_mesh"], res["async_z3"], f"rank {rank} 2-D mesh argument")


def test_hsdp_matches_flat_mesh_and_oracle(runs):
    r = runs[0]
    assert_close_to(r["async_z3"], r["flat"], "HSDP vs 1-D over 4 ranks")
    oracle = train_oracle(STEPS)
    assert_close_to(r["async_z3"], oracle, "HSDP vs oracle")


def test_every_rank_ends_with_identical_weights(runs):
    for rank, res in enumerate(runs[1:], start=1):
        assert_bitwise(res["async_z3"], runs[0]["async_z3"], f"rank {rank} vs rank 0")


def test_ns_runs_once_per_matrix_and_only_columns_hold_storage(runs):
    owned = [set(res["async_z3"]["owned"]) for res in runs]
    assert sum(len(o) for o in owned) == len(set().union(*owned)) == 14
    assert all(o for o in owned), "the 2 x 2 grid should give every slot work"
    for res in runs:
        assert all(res["async_z3"]["storage_ok"]) and all(res["async_z2"]["storage_ok"])


def test_counters_split_by_mesh_dimension(runs):
    P = runs[0]["async_z3"]["P"]
    for step in range(STEPS):
        per_rank = [res["async_z3"]["counts"][step] for res in runs]
        for c in per_rank:
            # every row broadcasts all of P within its shard group, and reduces all of P within it
            assert c["forward_broadcast"]["by_dim"] == {
                "shard": {"elements": P, "bytes": 4 * P, "calls": c["forward_broadcast"]["calls"]}}  # fp32
            assert c["backward_broadcast"]["elements"] == P
            assert c["reduce"]["by_dim"]["shard"]["elements"] == P
        # each tensor's column holds it on both rows: the replicate stage moves it once per holder
        assert sum(c["reduce"]["by_dim"]["replicate"]["elements"] for c in per_rank) == 2 * P
        # and so does the post-step publish; before the first forward the holders also take the owners'
        # initial values once (ranks may initialise differently: the owners' values win)
        published = sum(c["replicate_publish"]["by_dim"]["replicate"]["elements"] for c in per_rank)
        assert published == (4 * P if step == 0 else 2 * P), (step, published / P)
    flat = runs[0]["flat"]["counts"][0]
    assert "replicate" not in flat["reduce"]["by_dim"] and flat["replicate_publish"]["calls"] == 0


def test_checkpoint_right_after_async_step_has_new_weights_and_restarts_exactly(runs):
    for rank, res in enumerate(runs):
        r = res["async_z3"]
        assert r["resumed"] == r["losses"][SAVE_AT:], f"rank {rank}"
        for k, v in r["weights"].items():
            assert torch.equal(r["resumed_weights"][k], v), f"rank {rank} {k}"


def test_no_sync_accumulation_under_hsdp(runs):
    r = runs[0]
    assert_close_to(r["accum"], r["async_z3"], "accumulation under HSDP")


def test_replicate_mesh_that_is_not_a_grid_is_rejected():
    res = run_distributed(misuse_job, 4)
    for rank, r in enumerate(res):
        kind, message = r["error"]
        assert kind == "ValueError", (rank, r["error"])
        assert "do not complete the shard mesh to a grid" in message
        assert r["untouched"], f"rank {rank}: the model changed"
