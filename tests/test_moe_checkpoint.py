"""MoE checkpoints: the experts' params and momenta in full and DCP dicts have the same format as the unsplit
tensors, whichever route holds them (layer 0's experts on one owner each, layer 1's on FSDP2's dim-0 shards);
a restart is bit-identical; a 2-rank checkpoint resumes on 4 ranks, also into expert parallelism, like an
uninterrupted 4-rank run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests._asserts import assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._moe import MOE_CFG, MoERun, build_moe, dedicate_moe
from tests._training import batches, muon_kwargs

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT, GLOBAL_BATCH = 8, 4, 8
#: layer 0's experts on one owner each, layer 1's on the engine's shards: both kinds in one checkpoint
MIXED = "mixed"


def _setup(world: int, *, seed: int = 0, ep: int = 1):
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    ep_mesh = None if ep == 1 else init_device_mesh(DEVICE_TYPE, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    model = build_moe(MOE_CFG, seed=seed).to(device())
    dedicate_moe(model, mesh, MoERun(expert_route=MIXED, ep=ep), ep_mesh)
    return model, dmuon.Muon(model, **muon_kwargs())


def _step(model, opt, rank: int, world: int, step: int) -> float:
    tok, tgt = batches(STEPS, global_batch=GLOBAL_BATCH)[step]
    per, lo = GLOBAL_BATCH // world, rank * (GLOBAL_BATCH // world)
    opt.zero_grad()
    loss = model(tok[lo:lo + per].to(device()), tgt[lo:lo + per].to(device())).loss
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def _run(model, opt, rank, world, steps) -> dict:
    losses = [_step(model, opt, rank, world, s) for s in steps]
    return {"losses": losses, "weights": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


def save_job(rank: int, world: int, ckpt_dir: str) -> dict:
    """The uninterrupted 2-rank run, saving full and DCP checkpoints after step ``SAVE_AT``; then restarts
    from each of them in fresh models (another init first, to prove the load)."""
    model, opt = _setup(world)
    for s in range(SAVE_AT):
        _step(model, opt, rank, world, s)
    full = dmuon.get_state_dict(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(ckpt_dir, "full.pt"))
    dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    dist.barrier()
    out = {"uninterrupted": _run(model, opt, rank, world, range(SAVE_AT, STEPS)), "saved": full}
    out.update(_resumes(rank, world, ckpt_dir))
    return out


def _resumes(rank: int, world: int, ckpt_dir: str, ep: int = 1) -> dict:
    out = {}
    model, opt = _setup(world, seed=7, ep=ep)
    dmuon.set_state_dict(model, opt, torch.load(os.path.join(ckpt_dir, "full.pt"), map_location="cpu",
                                                weights_only=False) if rank == 0 else {})
    out["from_full"] = _run(model, opt, rank, world, range(SAVE_AT, STEPS))
    model, opt = _setup(world, seed=8, ep=ep)
    target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
    dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    dmuon.set_state_dict(model, opt, target)
    out["from_dcp"] = _run(model, opt, rank, world, range(SAVE_AT, STEPS))
    return out


def resume4_job(rank: int, world: int, ckpt_dir: str) -> dict:
    """4 ranks: the 2-rank checkpoints into the same layout and into expert parallelism (dp 2 x ep 2), and the
    uninterrupted 4-rank run they are compared with."""
    model, opt = _setup(world)
    out = {"uninterrupted": _run(model, opt, rank, world, range(STEPS))}
    out.update(_resumes(rank, world, ckpt_dir))
    out.update({f"ep_{k}": v for k, v in _resumes(rank, world, ckpt_dir, ep=2).items()})
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_ckpt"))


@pytest.fixture(scope="module")
def two(ckpt_dir) -> dict:
    return run_distributed(save_job, 2, ckpt_dir)[0]


@pytest.fixture(scope="module")
def four(ckpt_dir, two) -> list[dict]:
    return run_distributed(resume4_job, 4, ckpt_dir)


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    for k, v in b["weights"].items():
        assert torch.equal(a["weights"][k], v), (what, k)


@pytest.mark.parametrize("source", ["from_full", "from_dcp"])
def test_restart_is_bit_identical(two, source):
    _bitwise(two[source], two["uninterrupted"], source)
    for k, v in two["uninterrupted"]["optim"]["state"].items():  # momenta too
        for name, t in v.items():
            assert torch.equal(two[source]["optim"]["state"][k][name], t), (source, k, name)


def test_expert_state_has_the_unsplit_format(two):
    """An expert param and its momentum are whole ``[E, m, n]`` tensors in the full dicts, on both routes."""
    saved = two["saved"]
    for layer in (0, 1):  # 0: one owner per param; 1: FSDP2's dim-0 shards
        for w, shape in (("w1", (4, 96, 128)), ("w2", (4, 128, 96))):
            key = f"layers.{layer}.moe.experts.{w}"
            assert tuple(saved["model"][key].shape) == shape, key
            assert tuple(saved["optim"]["state"][key]["momentum_buffer"].shape) == shape, key


@pytest.mark.parametrize("source", ["from_full", "from_dcp", "ep_from_full", "ep_from_dcp"])
def test_two_rank_checkpoint_resumes_on_four(four, source):
    want = {"losses": four[0]["uninterrupted"]["losses"][SAVE_AT:], "weights": four[0]["uninterrupted"]["weights"]}
    assert_close_to(four[0][source], want, f"4 ranks {source}")
    for rank, res in enumerate(four[1:], start=1):
        _bitwise(res[source], four[0][source], f"rank {rank} {source}")
