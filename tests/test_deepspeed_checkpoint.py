"""Checkpoints of dmuon models under DeepSpeed ZeRO (issue 26): ``engine.save_checkpoint`` / ``load_checkpoint``
restart bit-identically (ZeRO-2 with accumulation and clipping in fp32; ZeRO-1 in bf16 with fp32 masters), every
owner's Muon state in its own rank's ZeRO file; dmuon's full state dicts, ZeRO's AdamW state in them, carry a run
from 2 ranks to 4."""

from __future__ import annotations

import pytest
import torch

from tests._asserts import assert_bitwise
from tests._deepspeed import Run, build, build_bf16, result, setup, train
from tests._dist import run_distributed

pytest.importorskip("deepspeed")

STEPS, SAVE_AT = 4, 2


def _build(world: int, run: Run, bf16: bool) -> tuple:
    return build_bf16(world, run) if bf16 else build(world, run)


def restart_job(rank: int, world: int, run: Run, bf16: bool, ckpt: str) -> dict:
    setup(rank)
    engine, model, _ = _build(world, run, bf16)
    head = train(engine, model, rank, world, run, range(SAVE_AT))
    engine.save_checkpoint(ckpt, tag="step2")
    tail = train(engine, model, rank, world, run, range(SAVE_AT, STEPS))
    whole = result(model, {"losses": head["losses"] + tail["losses"]})
    engine, model, opt = _build(world, run, bf16)
    engine.load_checkpoint(ckpt, tag="step2")
    again = train(engine, model, rank, world, run, range(SAVE_AT, STEPS))
    resumed = result(model, {"losses": head["losses"] + again["losses"]})
    return {"whole": whole, "resumed": resumed, "state_keys": sorted(k for st in opt.state.values() for k in st)}


@pytest.mark.parametrize("run, bf16", [(Run(2, 2, 0.5), False), (Run(1, 1), True)], ids=["zero2-fp32", "zero1-bf16"])
def test_restart_from_save_checkpoint_is_bit_identical(tmp_path, run, bf16):
    results = run_distributed(restart_job, 2, run, bf16, str(tmp_path))
    for r in results:
        assert_bitwise(r["resumed"], r["whole"], f"restart {run.name}{' bf16' if bf16 else ''}")
    keys = {k for r in results for k in r["state_keys"]}
    assert keys >= ({"momentum_buffer", "master"} if bf16 else {"momentum_buffer"}), keys


def resume_job(rank: int, world: int, path: str, save: bool) -> dict:
    """``save``: 2 steps of ZeRO-2 (accumulation 2, clipping), then dmuon's full model and optimizer dicts into
    ``path``; else: a fresh engine on this world size takes them and trains steps 2 and 3."""
    import dmuon

    setup(rank)
    run = Run(2, 2, 0.5)
    engine, model, opt = build(world, run)
    if save:
        trained = train(engine, model, rank, world, run, range(SAVE_AT))
        sd = dmuon.get_state_dict(model, opt)
        if rank == 0:
            torch.save(sd, path)
        return trained
    sd = torch.load(path, map_location="cpu", weights_only=False) if rank == 0 else {}
    dmuon.set_state_dict(model, opt, sd)
    return result(model, train(engine, model, rank, world, run, range(SAVE_AT, STEPS)))


def test_resume_on_another_world_size_through_dmuons_full_state_dicts(tmp_path):
    """Saved on 2 ranks, resumed on 4: the run stays within the oracle's bounds (dropping ZeRO's AdamW moments on
    the way, measured, puts the last loss 8e-4 off)."""
    from tests._asserts import assert_close_to
    from tests._training import train_oracle

    path = str(tmp_path / "state.pt")
    head = run_distributed(resume_job, 2, path, True)[0]
    tail = run_distributed(resume_job, 4, path, False)
    oracle = train_oracle(STEPS, max_norm=0.5)
    for r in tail:
        assert_close_to({"losses": head["losses"] + r["losses"], "weights": r["weights"]}, oracle, "2 ranks -> 4 ranks")
