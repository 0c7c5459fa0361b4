"""Checkpoints of dmuon models under DeepSpeed ZeRO (issue 26): ``engine.save_checkpoint`` / ``load_checkpoint``
restart bit-identically (ZeRO-2 with accumulation and clipping in fp32; ZeRO-1 in bf16 with fp32 masters), every
owner's Muon state in its own rank's ZeRO file; dmuon's state dicts, ZeRO's AdamW state in them, carry a run
from 2 ranks to 4: full dicts, and DCP's sharded ones at ZeRO stages 0, 2 and 3 (issue 34)."""

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


#: what carries a run to another world size: dmuon's full dicts (torch.save) at ZeRO-2, and DCP at ZeRO-2, ZeRO-3
#: and stage 0 (whose AdamW state is torch's own, keyed by the params)
CARRIES = [("full", 2), ("dcp", 2), ("dcp", 3), ("dcp", 0)]
#: ZeRO-3 splits each param group into sub-groups of about this many elements (of each rank's partition): the test
#: model's AdamW group (the embedding's 16384 and the norms' 5 x 128, over the ranks) into two or more, each with
#: its own slice and AdamW state
SUB_GROUP = {"stage": 3, "sub_group_size": 2048}
#: the DCP saves also resumed on the same 2 ranks (bit for bit): ZeRO-3's sub-groups and stage 0's own AdamW
SAME_RANKS = [("dcp", 3), ("dcp", 0)]


def _snapshot(engine, model, opt) -> list:
    """Every value a refused load must leave as it was on this rank: the params (ZeRO-3's slices), the owners'
    Muon state, ZeRO's fp32 slices and their AdamW state."""
    import dmuon

    zero = engine.optimizer
    others = set(dmuon.get_dedicated_params(model)) - set(dmuon.get_owned_params(model))  # (0 bytes here)
    params = [p for n, p in model.named_parameters() if n not in others]
    flats = [*getattr(zero, "fp32_partitioned_groups_flat", ()), *getattr(zero, "single_partition_of_fp32_groups", ())]
    ts = [p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p for p in params] + flats
    ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    ts += [v for st in zero.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in ts]


def resume_job(rank: int, world: int, path: str, save: bool) -> dict:
    """``save``: per way of :data:`CARRIES`, 2 steps of ZeRO (accumulation 2, clipping), dmuon's dicts saved
    under ``path``, 2 more steps (the uninterrupted twin); then a fresh engine on these 2 ranks loads the DCP
    checkpoint and trains the same 2 steps. Else: a fresh engine on this world size takes each and trains steps 2
    and 3, after a ZeRO-3 DCP dict with one AdamW moment changed was refused with nothing changed."""
    import torch.distributed.checkpoint as dcp

    import dmuon

    setup(rank)
    out: dict = {}
    for how, stage in CARRIES:
        run, where = Run(stage, 2, 0.5), f"{path}/{how}{stage}"
        extra = {"zero_optimization": SUB_GROUP} if stage == 3 else {}
        engine, model, opt = build(world, run, **extra)
        if stage == 3:
            out["sub_groups"] = len(engine.optimizer.fp32_partitioned_groups_flat)
        if save:
            head = train(engine, model, rank, world, run, range(SAVE_AT))
            if how == "full":
                sd = dmuon.get_state_dict(model, opt)
                if rank == 0:
                    torch.save(sd, where)
            else:
                dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=where)
            out[how, stage] = {"head": head, "whole": result(model, train(engine, model, rank, world, run,
                                                                           range(SAVE_AT, STEPS)))}
            if (how, stage) in SAME_RANKS:  # the same ranks again: bit for bit
                engine, model, opt = build(world, run, **extra)
                sd = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
                dcp.load(sd, checkpoint_id=where)
                dmuon.set_state_dict(model, opt, sd)
                out[how, stage]["resumed"] = result(model, train(engine, model, rank, world, run,
                                                                 range(SAVE_AT, STEPS)))
            continue
        if how == "full":
            sd = torch.load(where, map_location="cpu", weights_only=False) if rank == 0 else {}
        else:
            sd = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
            dcp.load(sd, checkpoint_id=where)
        if stage == 3:  # one AdamW moment of a param ZeRO-3 partitioned, changed on every rank: refused
            before = _snapshot(engine, model, opt)
            moment = sd["optim"]["state"]["norm.weight"]["exp_avg"]
            saved = moment.clone()
            moment.add_(1e-3)
            try:
                dmuon.set_state_dict(model, opt, sd)
                out["refused"] = ""
            except ValueError as e:
                out["refused"] = str(e)
            out["changed"] = sum(not torch.equal(a, b) for a, b in zip(before, _snapshot(engine, model, opt)))
            moment.copy_(saved)
        dmuon.set_state_dict(model, opt, sd)
        out[how, stage] = result(model, train(engine, model, rank, world, run, range(SAVE_AT, STEPS)))
    return out


def test_resume_on_another_world_size_through_dmuons_state_dicts(tmp_path):
    """Saved on 2 ranks (dmuon's full dicts at ZeRO-2; DCP at ZeRO-2, ZeRO-3 and stage 0), resumed on 4: each run stays
    within the oracle's bounds (dropping ZeRO's AdamW moments on the way, measured, puts the last loss 8e-4 off);
    on the same 2 ranks a DCP resume (ZeRO-3, stage 0) is bit-identical to its uninterrupted twin; a changed moment
    is refused on every rank with nothing changed."""
    from tests._asserts import assert_close_to
    from tests._training import train_oracle

    head = run_distributed(resume_job, 2, str(tmp_path), True)
    for r in head:
        for how, stage in SAME_RANKS:
            assert_bitwise(r[how, stage]["resumed"], r[how, stage]["whole"], f"ZeRO-{stage} DCP resume, 2 ranks")
    tail = run_distributed(resume_job, 4, str(tmp_path), False)
    oracle = train_oracle(STEPS, max_norm=0.5)
    for r in tail:
        for how, stage in CARRIES:
            losses = head[0][how, stage]["head"]["losses"] + r[how, stage]["losses"]
            assert_close_to({"losses": losses, "weights": r[how, stage]["weights"]}, oracle,
                            f"ZeRO-{stage} {how}: 2 ranks -> 4 ranks")
        assert "checksums do not match" in r["refused"] and "norm.weight.exp_avg" in r["refused"], r["refused"]
        assert r["changed"] == 0, r["changed"]
    assert all(r["sub_groups"] > 1 for r in head + tail), [r["sub_groups"] for r in head + tail]
