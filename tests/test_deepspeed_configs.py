"""DeepSpeed configs people run, with dmuon (issue 34): a config ``"scheduler"``, and bf16 with fp32 gradient
accumulation at ZeRO stage 1 (DeepSpeed's ``BF16_Optimizer``), both refused before; bf16 at ZeRO-3 restarts
bit-identically (in the bf16 launch).

* ``"scheduler": WarmupLR`` sets the lr of ZeRO's AdamW groups to the config's numbers; dmuon's Muon groups follow
  at their ratio as built ([Note: DeepSpeed config schedulers]): each Muon step runs at the lr the same warm-up
  gives it, and the run trains like one with a torch ``LambdaLR`` of that warm-up on ``dmuon.Muon``.
* ``BF16_Optimizer`` (2 ranks, clipping): DeepSpeed's norm counts the dedicated gradients (at step 0, before bf16
  drift, within 1e-2 of torch's fp32 norm: 3e-4 measured; without them it is 6.5% low), and a restart from
  ``save_checkpoint`` is bit-identical, every owner's Muon state in its own ``bf16_zero_pp_rank_*`` file.
* ``"offload_optimizer": {"device": "cpu"}`` at ZeRO-2 and ZeRO-3 (accumulation 2, clipping; with
  ``"zero_force_ds_cpu_optimizer": false`` torch's AdamW steps ZeRO's CPU slices, so no CPU Adam op is built):
  ZeRO really offloads, and the runs match the oracle ([Note: DeepSpeed optimizer offload]; ``"nvme"``, refused,
  is in ``tests/test_deepspeed.py``'s misuse cases).
"""

from __future__ import annotations

import pytest
import torch

from tests._asserts import assert_bitwise, assert_close_to
from tests._deepspeed import Run, build, build_bf16, result, setup, train
from tests._dist import run_distributed
from tests._training import ADAMW_HP, MUON_HP, train_oracle

pytest.importorskip("deepspeed")

#: WarmupLR from 1e-4 to AdamW's 1e-3 over 2 steps: DeepSpeed's update t runs at min + (max - min) * gamma_t, with
#: gamma 0 before its first step and at iteration 0, 1/2 at iteration 1, then 1
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": ADAMW_HP.lr, "warmup_num_steps": 2,
                                         "warmup_type": "linear"}}
FACTORS = [0.1, 0.1, 0.55]  # each update's lr over the built one: (1e-4 + 9e-4 * gamma) / 1e-3


#: ZeRO's optimizer offloaded to the CPU, torch's AdamW allowed to step it
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_RUNS = [Run(2, 2, 0.5), Run(3, 2, 0.5)]


def _offload(rank: int, world: int) -> dict:
    out = {}
    for run in OFFLOAD_RUNS:
        engine, model, _ = build(world, run, zero_optimization={"stage": run.stage, **OFFLOAD},
                                 zero_force_ds_cpu_optimizer=False)
        zero = engine.optimizer
        offloaded = bool(getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False))
        out[run.name] = {**result(model, train(engine, model, rank, world, run, range(3))), "offloaded": offloaded}
    return out


def schedule_job(rank: int, world: int) -> dict:
    """Stage 2: the config's WarmupLR; then the same warm-up as a torch ``LambdaLR`` on ``dmuon.Muon``; then
    ZeRO-2 and ZeRO-3 with the optimizer offloaded."""
    setup(rank)
    run = Run(2, 1)
    engine, model, opt = build(world, run, scheduler=WARMUP)
    muon_lrs, losses = [], []
    for step in range(len(FACTORS)):
        losses += train(engine, model, rank, world, run, range(step, step + 1))["losses"]
        muon_lrs.append([g["lr"] for g in opt.param_groups if g["kind"] == "muon"])  # what this step ran at
    by_config = result(model, {"losses": losses})
    engine, model, _ = build(world, run, schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda t: FACTORS[min(t, len(FACTORS) - 1)]))
    by_torch = result(model, train(engine, model, rank, world, run, range(len(FACTORS))))
    return {"muon_lrs": muon_lrs, "config": by_config, "torch": by_torch, "offload": _offload(rank, world)}


def test_a_config_scheduler_drives_muon_at_its_ratio_and_offload_trains():
    oracle = train_oracle(3, max_norm=0.5)
    for r in run_distributed(schedule_job, 2):
        for step, (lrs, factor) in enumerate(zip(r["muon_lrs"], FACTORS)):
            assert lrs and all(lr == pytest.approx(MUON_HP.lr * factor, rel=1e-12) for lr in lrs), (step, lrs)
        assert_close_to(r["config"], r["torch"], "config WarmupLR vs LambdaLR")
        for run in OFFLOAD_RUNS:
            got = r["offload"][run.name]
            assert got["offloaded"], run.name
            assert_close_to(got, oracle, f"offload_optimizer, {run.name}")
            assert max(abs(a - b) / b for a, b in zip(got["norms"], oracle["norms"])) <= 1e-3, got["norms"]


#: bf16 (``build_bf16``) with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer at stage 1
ACCUM_FP32 = {"data_types": {"grad_accum_dtype": "fp32"}}
#: step 0's norm against torch's in fp32 on one process: bf16's forward and rounding only (3e-4 measured), far
#: below the 6.5% the dedicated gradients add
NORM_RTOL = 1e-2


def bf16_job(rank: int, world: int, ckpt: str) -> dict:
    import os

    setup(rank)
    run = Run(1, 1, 0.5)
    engine, model, _ = build_bf16(world, run, **ACCUM_FP32)
    kind = type(engine.optimizer).__name__
    head = train(engine, model, rank, world, run, range(2))
    engine.save_checkpoint(ckpt, tag="s")
    tail = train(engine, model, rank, world, run, range(2, 4))
    whole = result(model, {"losses": head["losses"] + tail["losses"]})
    engine, model, _ = build_bf16(world, run, **ACCUM_FP32)
    engine.load_checkpoint(ckpt, tag="s")
    again = train(engine, model, rank, world, run, range(2, 4))
    out = {"kind": kind, "norms": head["norms"], "whole": whole, "files": sorted(os.listdir(f"{ckpt}/s")),
           "resumed": result(model, {"losses": head["losses"] + again["losses"]})}
    # bf16 at ZeRO-3 (issue 34), accumulation 2 and clipping: its restart, in the same launch
    z3 = Run(3, 2, 0.5)
    engine, model, _ = build_bf16(world, z3)
    out["zero3_kind"] = type(engine.optimizer).__name__
    head = train(engine, model, rank, world, z3, range(2))
    engine.save_checkpoint(ckpt, tag="z3")
    tail = train(engine, model, rank, world, z3, range(2, 4))
    out["zero3_whole"] = result(model, {"losses": head["losses"] + tail["losses"]})
    engine, model, _ = build_bf16(world, z3)
    engine.load_checkpoint(ckpt, tag="z3")
    again = train(engine, model, rank, world, z3, range(2, 4))
    out["zero3_resumed"] = result(model, {"losses": head["losses"] + again["losses"]})
    return out


def test_bf16_with_fp32_accumulation_at_stage_1_and_zero3_restart(tmp_path):
    results = run_distributed(bf16_job, 2, str(tmp_path))
    oracle = train_oracle(1, max_norm=0.5)["norms"][0]
    for r in results:
        assert r["kind"] == "BF16_Optimizer", r["kind"]
        assert abs(r["norms"][0] - oracle) / oracle <= NORM_RTOL, (r["norms"][0], oracle)
        assert_bitwise(r["resumed"], r["whole"], "BF16_Optimizer restart")
        assert r["zero3_kind"] == "DeepSpeedZeroOptimizer_Stage3", r["zero3_kind"]
        assert_bitwise(r["zero3_resumed"], r["zero3_whole"], "ZeRO-3 bf16 restart")
    assert [f for f in results[0]["files"] if f.startswith("bf16_zero")] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
