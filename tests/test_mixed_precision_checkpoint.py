"""Mixed precision across a restart: masters (both kinds) in every checkpoint form, a restart bit-identical
to an uninterrupted run, and the master refresh skipped until the param is written. Setup and oracle:
tests/_mixed_precision.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dmuon
from tests._dist import run_distributed
from tests._mixed_precision import (
    BF16,
    FP32,
    MP,
    WORLD,
    build,
    train_step,
)
from tests._training import batches, build_model

# --------------------------------------------------------------------------------------------------- #
# Checkpoints                                                                                          #
# --------------------------------------------------------------------------------------------------- #
SAVE_AT = 3


def save_job(rank: int, world: int, ckpt_dir: str, opts: MP) -> dict:
    model, opt = build(world, opts)
    data = batches(opts.steps)
    losses = []
    for step, (tok, tgt) in enumerate(data):
        if step == SAVE_AT:
            model_sd = dmuon.get_model_state_dict(model)
            optim_sd = dmuon.get_optimizer_state_dict(model, opt)
            if rank == 0:
                torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(ckpt_dir, "full.pt"))
            torch.save(opt.state_dict(), os.path.join(ckpt_dir, f"native{rank}.pt"))
            dist.barrier()
            dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                      "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)},
                     checkpoint_id=os.path.join(ckpt_dir, "dcp"))
        losses.append(train_step(model, opt, opts, rank, world, tok, tgt))
    return {"losses": losses, "model": dmuon.get_model_state_dict(model)}


def resume_job(rank: int, world: int, ckpt_dir: str, opts: MP, modes: list[str]) -> dict:
    out = {}
    data = batches(opts.steps)
    for mode in modes:
        model, opt = build(world, opts, seed=123)  # a different init: the load must replace it
        ckpt = torch.load(os.path.join(ckpt_dir, "full.pt"), map_location="cpu", weights_only=False)
        if mode == "dcp":
            target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
            dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
            dmuon.set_state_dict(model, opt, target)
        elif mode == "rank0":
            dmuon.set_model_state_dict(model, ckpt["model"] if rank == 0 else {})
            dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"] if rank == 0 else {})
        elif mode == "native":
            dmuon.set_model_state_dict(model, ckpt["model"])
            opt.load_state_dict(torch.load(os.path.join(ckpt_dir, f"native{rank}.pt"), weights_only=False))
        else:
            optim_sd = ckpt["optim"]
            if mode == "no_master":  # what a checkpoint that forgot the masters would resume to
                optim_sd = {"param_groups": optim_sd["param_groups"],
                            "state": {n: {k: v for k, v in e.items() if k != "master"}
                                      for n, e in optim_sd["state"].items()}}
            dmuon.set_model_state_dict(model, ckpt["model"])
            dmuon.set_optimizer_state_dict(model, opt, optim_sd)
        losses = [train_step(model, opt, opts, rank, world, tok, tgt) for tok, tgt in data[SAVE_AT:]]
        out[mode] = {"losses": losses, "model": dmuon.get_model_state_dict(model)}
    return out


CKPT_RUNS = {"bf16": (MP(), ["full", "rank0", "dcp", "native", "no_master"]),
             "fsdp_mp": (MP(recipe="fsdp_mp", master=False), ["full", "dcp", "native"])}


@pytest.fixture(scope="module", params=sorted(CKPT_RUNS))
def restarted(request, tmp_path_factory) -> tuple[str, dict, dict, dict]:
    opts, modes = CKPT_RUNS[request.param]
    ckpt_dir = str(tmp_path_factory.mktemp(f"mp_ckpt_{request.param}"))
    original = run_distributed(save_job, WORLD, ckpt_dir, opts)[0]
    resumed = run_distributed(resume_job, WORLD, ckpt_dir, opts, modes)[0]
    saved = torch.load(os.path.join(ckpt_dir, "full.pt"), map_location="cpu", weights_only=False)
    return request.param, original, resumed, saved


def test_restart_with_masters_is_bit_identical(restarted):
    recipe, original, resumed, _ = restarted
    for mode, r in resumed.items():
        if mode == "no_master":
            continue
        assert r["losses"] == original["losses"][SAVE_AT:], (recipe, mode)
        for k, v in original["model"].items():
            assert torch.equal(r["model"][k], v), (recipe, mode, k)


def test_checkpoints_hold_the_masters(restarted):
    recipe, original, resumed, saved = restarted
    key = "layers.0.attention.q_proj.weight"
    if recipe == "bf16":
        entry = saved["optim"]["state"][key]
        assert entry["master"].dtype == entry["momentum_buffer"].dtype == FP32
        assert saved["model"][key].dtype == BF16 and torch.equal(entry["master"].to(BF16), saved["model"][key])
        assert not torch.equal(entry["master"], saved["model"][key].float()), "the master carries no extra bits"
        # and those bits matter: resuming without them leaves the uninterrupted trajectory
        assert resumed["no_master"]["losses"] != original["losses"][SAVE_AT:]
    else:
        # the model dict holds the fp32 values (loadable into the plain fp32 model); no optimizer masters
        assert saved["model"][key].dtype == FP32
        assert not torch.equal(saved["model"][key], saved["model"][key].to(BF16).float())
        assert "master" not in saved["optim"]["state"][key]
        assert saved["optim"]["state"][key]["momentum_buffer"].dtype == FP32
        plain = build_model(seed=5)
        plain.load_state_dict(saved["model"], strict=True)


def test_refresh_skips_the_check_until_the_param_is_written():
    """The per-step master check costs nothing while the param's version counter shows no write."""
    from dmuon.runtime.precision import refresh_master_

    p = torch.nn.Parameter(torch.randn(4, 6).bfloat16())
    master = p.detach().float() * (1 + 2**-12)  # low bits only the master knows: rounds back to p
    assert torch.equal(master.bfloat16(), p.detach())
    v = refresh_master_(master, p)  # unknown version: compares, they agree, master kept
    keep = master.clone()
    master[0, 0] += 1.0  # a master p does not match any more...
    assert refresh_master_(master, p, v) == v  # ...is kept: nothing wrote p, so nothing is checked
    assert master[0, 0] == keep[0, 0] + 1.0
    with torch.no_grad():
        p[1, 1] = 7.0  # a direct write bumps the counter: the check runs and the param wins
    v2 = refresh_master_(master, p, v)
    assert v2 != v and torch.equal(master, p.detach().float())
