"""NorMuon where a matrix is not one 2-D tensor on one rank: experts (each expert, and each row block of a fused
gate/up, its own rows and its own RMS) on both routes of a batch of matrices, and tensor-parallel shards (rows
split by ``ColwiseParallel``, columns by ``RowwiseParallel``: the row statistic comes back from each matrix's
Newton-Schulz root with its shards, [Note: TP update] and ``dmuon/optim/normuon.py``).

Oracles: the single-process reference from the paper's formulas on one 2-D parameter per matrix
(``tests/_moe.py`` with a NorMuon record) and on the unsplit TP model. Checkpoints: the experts' per-row second
moments (``[E, m, 1]``, on owners and as DTensors on the engine's shards) and the TP matrices' (whole on every
tp rank) restart bit for bit from full and DCP dicts.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.optim import NorMuonHParams
from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._moe import MOE_CFG, MoERun, build_moe, dedicate_moe, moe_cfg, train_moe, train_moe_oracle
from tests._training import ADAMW_HP, KJ, batches, full_weights, muon_kwargs
from tests._variants import reference_optimizer

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT = 8, 4
NOR = NorMuonHParams(lr=0.01, weight_decay=0.1, ns_coefficients=KJ, ns_backend="direct", cautious_weight_decay=True)
FUSED = moe_cfg(layout="fused", dead_expert=1)
MOE_RUNS = {
    "owner": MoERun(steps=STEPS, expert_route="muon", hp=NOR),
    "sharded": MoERun(steps=STEPS, hp=NOR),
    "fused_dead": MoERun(steps=STEPS, cfg=FUSED, hp=NOR),
}


# --------------------------------------------------------------------------------------------------- #
# Experts                                                                                              #
# --------------------------------------------------------------------------------------------------- #
def _moe_model(world: int, seed: int = 0):
    model = build_moe(MOE_CFG, seed=seed).to(device())
    dedicate_moe(model, init_device_mesh(DEVICE_TYPE, (world,)), MoERun(expert_route="mixed", hp=NOR))
    return model, dmuon.Muon(model, **muon_kwargs(NOR))


def _moe_steps(model, opt, rank: int, world: int, steps: range) -> dict:
    per, losses = 8 // world, []
    for s in steps:
        tok, tgt = batches(STEPS)[s]
        opt.zero_grad()
        loss = model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return {"losses": losses, "weights": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


def _moe_restarts(rank: int, world: int, ckpt: str) -> dict:
    """Layer 0's experts on owners, layer 1's on the engine's shards: save after ``SAVE_AT`` steps (full and DCP),
    go on, and restart from each in fresh models."""
    model, opt = _moe_model(world)
    _moe_steps(model, opt, rank, world, range(SAVE_AT))
    full = dmuon.get_state_dict(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(ckpt, "moe.pt"))
    dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(ckpt, "moe_dcp"))
    dist.barrier()
    out = {"uninterrupted": _moe_steps(model, opt, rank, world, range(SAVE_AT, STEPS)), "saved": full["optim"]}
    model, opt = _moe_model(world, seed=7)
    dmuon.set_state_dict(model, opt, torch.load(os.path.join(ckpt, "moe.pt"), weights_only=False) if rank == 0 else {})
    out["from_full"] = _moe_steps(model, opt, rank, world, range(SAVE_AT, STEPS))
    model, opt = _moe_model(world, seed=8)
    target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
    dcp.load(target, checkpoint_id=os.path.join(ckpt, "moe_dcp"))
    dmuon.set_state_dict(model, opt, target)
    out["from_dcp"] = _moe_steps(model, opt, rank, world, range(SAVE_AT, STEPS))
    return out


def moe_job(rank: int, world: int, ckpt: str) -> dict:
    out = {name: train_moe(rank, world, run) for name, run in MOE_RUNS.items()}
    if world == 2:
        out["restarts"] = _moe_restarts(rank, world, ckpt)
    return out


@pytest.fixture(scope="module")
def moe_oracles() -> dict:
    return {"separate": train_moe_oracle(STEPS, hp=NOR), "fused": train_moe_oracle(STEPS, FUSED, hp=NOR)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def moe_runs(request, tmp_path_factory) -> tuple[int, list[dict]]:
    return request.param, run_distributed(moe_job, request.param, str(tmp_path_factory.mktemp("moe")))


@pytest.mark.parametrize("name", list(MOE_RUNS))
def test_experts_match_the_per_expert_oracle(moe_runs, moe_oracles, name):
    world, results = moe_runs
    assert_close_to(results[0][name], moe_oracles["fused" if "fused" in name else "separate"], f"world {world} {name}")
    for rank, res in enumerate(results[1:], start=1):
        assert_bitwise(res[name], results[0][name], f"world {world} {name} rank {rank}")


def test_expert_state_is_per_expert_rows_in_float32(moe_runs):
    world, results = moe_runs
    for key, entry in results[0]["sharded"]["expert_state"].items():
        assert entry == {"momentum_buffer": "torch.float32", "row_second_moment": "torch.float32"}, (key, entry)


@pytest.mark.parametrize("source", ["from_full", "from_dcp"])
def test_expert_restart_is_bit_identical_on_both_routes(moe_runs, source):
    world, results = moe_runs
    if world != 2:
        pytest.skip("the restarts run at 2 ranks")
    for rank, res in enumerate(results):
        r = res["restarts"]
        assert_bitwise(r[source], r["uninterrupted"], f"rank {rank} {source}")
        for k, v in r["uninterrupted"]["optim"]["state"].items():
            for name, t in v.items():
                assert torch.equal(r[source]["optim"]["state"][k][name], t), (source, k, name)
    saved = results[0]["restarts"]["saved"]["state"]
    for layer in (0, 1):  # 0: one owner per param; 1: the engine's shards
        assert saved[f"layers.{layer}.moe.experts.w1"]["row_second_moment"].shape == (4, 96, 1)
        assert saved[f"layers.{layer}.moe.experts.w2"]["row_second_moment"].shape == (4, 128, 1)


# --------------------------------------------------------------------------------------------------- #
# Tensor parallelism: dp 2 x tp 2                                                                     #
# --------------------------------------------------------------------------------------------------- #
def _tp_setup(seed: int = 0):
    from tests.test_tp import DP, TP, _net, _tp_model

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    net = _net()
    if seed:
        torch.manual_seed(seed)
        net = type(net)()
    model = _tp_model(mesh, mesh["dp"], net)
    return model, dmuon.Muon(model, **muon_kwargs(NOR)), mesh


def _tp_steps(model, opt, mesh, steps: range) -> list[float]:
    from tests.test_tp import BATCH, DP, _batches

    dp_rank, per, losses = mesh.get_coordinate()[0], BATCH // DP, []
    for s in steps:
        tok, tgt = _batches()[s]
        opt.zero_grad()
        loss = model(tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return losses


def tp_job(rank: int, world: int, ckpt: str) -> dict:
    model, opt, mesh = _tp_setup()
    losses = _tp_steps(model, opt, mesh, range(SAVE_AT))
    full = dmuon.get_state_dict(model, opt)
    dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(ckpt, "tp_dcp"))
    losses += _tp_steps(model, opt, mesh, range(SAVE_AT, STEPS))
    out = {"run": {"losses": losses, "weights": full_weights(model)}, "saved": full["optim"]}
    for source in ("from_full", "from_dcp"):
        model, opt, mesh = _tp_setup(seed=3)
        if source == "from_full":  # every rank passes the same dict
            dmuon.set_state_dict(model, opt, full)
        else:
            target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
            dcp.load(target, checkpoint_id=os.path.join(ckpt, "tp_dcp"))
            dmuon.set_state_dict(model, opt, target)
        out[source] = {"losses": _tp_steps(model, opt, mesh, range(SAVE_AT, STEPS)), "weights": full_weights(model)}
    return out


@rank_threads()
def tp_oracle() -> dict:
    from tests.test_tp import _batches, _is_matrix, _net

    model = _net()
    named = dict(model.named_parameters())
    opt_m = reference_optimizer([p for n, p in named.items() if _is_matrix(n, p)], NOR)
    opt_a = torch.optim.AdamW([p for n, p in named.items() if not _is_matrix(n, p)], **ADAMW_HP.group_entries())
    losses = []
    for tok, tgt in _batches()[:STEPS]:
        for o in (opt_m, opt_a):
            o.zero_grad()
        loss = model(tok, tgt)
        loss.backward()
        for o in (opt_m, opt_a):
            o.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> list[dict]:
    return run_distributed(tp_job, 4, str(tmp_path_factory.mktemp("tp")))


def test_tp_shards_match_the_unsplit_oracle(tp_runs):
    assert_close_to(tp_runs[0]["run"], tp_oracle(), "dp 2 x tp 2, NorMuon")
    for rank, res in enumerate(tp_runs[1:], start=1):
        assert_bitwise(res["run"], tp_runs[0]["run"], f"rank {rank}")


@pytest.mark.parametrize("source", ["from_full", "from_dcp"])
def test_tp_restart_is_bit_identical(tp_runs, source):
    for rank, res in enumerate(tp_runs):
        tail = {"losses": res["run"]["losses"][SAVE_AT:], "weights": res["run"]["weights"]}
        assert_bitwise(res[source], tail, f"rank {rank} {source}")
    state = tp_runs[0]["saved"]["state"]
    for name, (rows, cols) in {"layers.0.w1.weight": (96, 32), "layers.0.w2.weight": (32, 96)}.items():
        assert state[name]["momentum_buffer"].shape == (rows, cols) and state[name]["row_second_moment"].shape == (rows, 1)
    for res in tp_runs[1:]:  # the full dict is the same on every rank
        for name, entry in res["saved"]["state"].items():
            for k, v in entry.items():
                assert torch.equal(v, state[name][k]), (name, k)


def test_rms_target_none_is_the_norm_preserving_form():
    """``rms_target=None``: NorMuon's step has the Frobenius norm of Muon's (same lr rule), one matrix."""
    from dmuon.optim.normuon import normuon_update_batch_
    from dmuon.optim.update import muon_update_

    gen = torch.Generator().manual_seed(0)
    w0, g = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    hp = replace(NOR, weight_decay=0.0, rms_target=None)
    a, b = w0.clone(), w0.clone()
    normuon_update_batch_([a], [g], [torch.zeros_like(g)], [torch.zeros(64, 1)], hp)
    muon_update_(b, g, torch.zeros_like(g), hp)
    assert abs((a - w0).norm() / (b - w0).norm() - 1) < 1e-5
    assert (a - b).norm() > 1e-3 * (b - w0).norm()  # the rows were rescaled
