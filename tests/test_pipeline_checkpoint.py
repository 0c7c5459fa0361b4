"""Checkpoints under pipeline parallelism: each stage saves its part of one DCP checkpoint (the full model's
FQNs), which resumes on another pp or dp degree. A pp 2 x dp 2 job trains, saves, trains on (the uninterrupted
twin), is refused a corrupted copy and a full dict on every rank with nothing changed, then restores and
trains again; a pp 2 x dp 1 and a pp 1 x dp 2 job load the same checkpoint and train on (the first then
refused a save whose stages' param groups differ).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.checkpoint.checksum import CHECKSUMS_KEY
from tests._asserts import LOSS_RTOL, WEIGHT_RTOL, assert_close_to
from tests._dist import run_distributed
from tests._pipeline import PartsTrainer, Trainer, batches, full_weights

STEPS, SAVE_AT = 3, 2


def _mesh(world: int, pp: int):
    return init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))


def _corrupt(sd: dict) -> str:
    """Change one word of this rank's first non-empty model tensor (a flipped byte in the file, as read)."""
    for k, v in sd["model"].items():
        local = v.to_local() if hasattr(v, "to_local") else v
        if k != CHECKSUMS_KEY and isinstance(local, torch.Tensor) and local.numel() > 0:
            local.view(-1)[0] += 1.0
            return k
    raise AssertionError("no tensor to corrupt")


def save_job(rank: int, world: int, pp: int, path: str) -> dict:
    t = Trainer(_mesh(world, pp))
    data = batches(STEPS)
    for s in range(SAVE_AT):
        t.step(*data[s])
    t.save(path)
    saved = full_weights(t.model)
    twin_losses = [t.step(*data[s]) for s in range(SAVE_AT, STEPS)]
    twin = full_weights(t.model)
    before = t.snapshot()
    try:
        dmuon.get_state_dict(t.model, t.opt)  # a full dict
        full = ("no error", "")
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test
        full = (type(e).__name__, str(e))
    sd = t.staged(path)
    corrupted = _corrupt(sd) if rank == world - 1 else None  # a rank of the last stage; global rank 0 is not in it
    try:
        dmuon.set_state_dict(t.model, t.opt, sd)
        refusal = ("no error", "")
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test
        refusal = (type(e).__name__, str(e))
    after = t.snapshot()
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    dmuon.set_state_dict(t.model, t.opt, t.staged(path))
    restored = full_weights(t.model)
    losses = [t.step(*data[s]) for s in range(SAVE_AT, STEPS)]
    out = {"saved": saved, "twin": {"losses": twin_losses, "weights": twin}, "refusal": refusal, "full": full,
           "corrupted": corrupted, "unchanged": unchanged, "restored": restored,
           "resumed": {"losses": losses, "weights": full_weights(t.model)}}
    out.update(_parts_save(rank, world, pp, path + "_parts"))
    dist.barrier()
    return out


def _parts_save(rank: int, world: int, pp: int, path: str) -> dict:
    """Two stage modules per rank (interleaved 1F1B): save after SAVE_AT steps, train on (the twin), be refused
    a copy with one word of one rank's second module changed (nothing changed in either module), restore the
    checkpoint in place and train again."""
    v = PartsTrainer(_mesh(world, pp))
    data = batches(STEPS)
    for s in range(SAVE_AT):
        v.step(*data[s])
    v.save(path)
    saved = v.weights()
    twin = {"losses": [v.step(*data[s]) for s in range(SAVE_AT, STEPS)], "weights": v.weights()}
    before = v.snapshot()
    sd = v.staged(path)
    corrupted = _corrupt(sd["part1"]) if rank == world - 1 else None  # the second module only, on one rank
    try:
        dmuon.set_state_dict(v.models, v.opts, sd)
        refusal = ("no error", "")
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test
        refusal = (type(e).__name__, str(e))
    after = v.snapshot()
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    v.load(path)
    restored = v.weights()
    losses = [v.step(*data[s]) for s in range(SAVE_AT, STEPS)]
    return {"parts_saved": saved, "parts_twin": twin, "parts_restored": restored,
            "parts_resumed": {"losses": losses, "weights": v.weights()},
            "parts_refusal": refusal, "parts_corrupted": corrupted, "parts_unchanged": unchanged}


def resume_job(rank: int, world: int, pp: int, path: str) -> dict:
    t = Trainer(_mesh(world, pp))
    data = batches(STEPS)
    dmuon.set_state_dict(t.model, t.opt, t.staged(path))
    restored = full_weights(t.model)
    losses = [t.step(*data[s]) for s in range(SAVE_AT, STEPS)]
    out = {"restored": restored, "resumed": {"losses": losses, "weights": full_weights(t.model)}}
    if pp > 1:  # the checkpoint of two stage modules per rank, into a fresh job of this layout
        v = PartsTrainer(_mesh(world, pp))
        v.load(path + "_parts")
        out["parts_restored"] = v.weights()
        out["parts_resumed"] = {"losses": [v.step(*data[s]) for s in range(SAVE_AT, STEPS)], "weights": v.weights()}
    if pp > 1:  # a per-stage lr (a scheduler on one stage only): one param_groups in DCP cannot hold both
        if not t.pipe.is_first:
            t.opt.param_groups[0]["lr"] *= 2
        try:
            dmuon.get_state_dict(t.model, t.opt, sharded=True)
            out["groups"] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - recorded and checked by the test
            out["groups"] = (type(e).__name__, str(e))
    dist.barrier()
    return out


def _merged(results: list[dict], part: str) -> dict:
    """One part of every rank's result as the whole model's: every stage's weights, the last stage's losses
    (averaged over its dp ranks)."""
    weights: dict[str, torch.Tensor] = {}
    for r in results:
        weights.update(r[part]["weights"] if "weights" in r[part] else r[part])
    if "losses" not in results[0][part]:
        return weights
    last = [r[part]["losses"] for r in results if r[part]["losses"][0] is not None]
    return {"losses": [sum(x[s] for x in last) / len(last) for s in range(len(last[0]))], "weights": weights}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("pp_ckpt") / "step2")


@pytest.fixture(scope="module")
def pp2dp2(ckpt) -> list[dict]:
    return run_distributed(save_job, 4, 2, ckpt)


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} vs {sorted(b)}"
    for k in b:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item():.3e}"


def test_restart_in_place_bit_identical(pp2dp2):
    _bitwise(_merged(pp2dp2, "restored"), _merged(pp2dp2, "saved"), "restored")
    resumed, twin = _merged(pp2dp2, "resumed"), _merged(pp2dp2, "twin")
    assert resumed["losses"] == twin["losses"], f"{resumed['losses']} vs {twin['losses']}"
    _bitwise(resumed["weights"], twin["weights"], "resumed vs twin")


def test_corrupt_checkpoint_refused_on_every_rank(pp2dp2):
    assert pp2dp2[-1]["corrupted"] is not None
    for rank, r in enumerate(pp2dp2):
        kind, message = r["refusal"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert "checksum" in message, f"rank {rank}: {message!r}"
        assert r["unchanged"], f"rank {rank}: the model or optimizer changed although the load was refused"


def test_full_dicts_refused_under_stages(pp2dp2):
    for rank, r in enumerate(pp2dp2):
        kind, message = r["full"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert "sharded=True" in message and "pipeline stages" in message, f"rank {rank}: {message!r}"


def test_resume_on_one_stage_bit_identical(pp2dp2, ckpt):
    """pp 1 x dp 2: the whole model on one stage, the same dp degree and microbatches as the twin, so the same
    arithmetic (only the owners move, and an owner's update does not depend on which rank runs it)."""
    results = run_distributed(resume_job, 2, 1, ckpt)
    _bitwise(_merged(results, "restored"), _merged(pp2dp2, "saved"), "restored")
    resumed, twin = _merged(results, "resumed"), _merged(pp2dp2, "twin")
    assert resumed["losses"] == twin["losses"], f"{resumed['losses']} vs {twin['losses']}"
    _bitwise(resumed["weights"], twin["weights"], "pp 1 x dp 2 resumed vs the pp 2 x dp 2 twin")


@pytest.fixture(scope="module")
def pp2dp1(pp2dp2, ckpt) -> list[dict]:
    return run_distributed(resume_job, 2, 2, ckpt)


def test_resume_on_another_dp_degree(pp2dp2, pp2dp1):
    """pp 2 x dp 1: the checkpoint loads bit for bit; the step after it matches the twin within the oracle
    bounds, not bit for bit: one rank's gradient over the batch sums in another order than two ranks' means."""
    results = pp2dp1
    _bitwise(_merged(results, "restored"), _merged(pp2dp2, "saved"), "restored")
    resumed, twin = _merged(results, "resumed"), _merged(pp2dp2, "twin")
    assert_close_to(resumed, twin, "pp 2 x dp 1 resumed", loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)


def test_stages_with_different_group_settings_refused(pp2dp1):
    for rank, r in enumerate(pp2dp1):
        kind, message = r["groups"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert "differ in number or settings" in message, f"rank {rank}: {message!r}"


def test_parts_restart_in_place_bit_identical(pp2dp2):
    """Two stage modules per rank (interleaved 1F1B), one DCP dict keyed by stage index: restoring in place is
    bit for bit the saved state, and the steps after it are their uninterrupted twin's."""
    _bitwise(_merged(pp2dp2, "parts_restored"), _merged(pp2dp2, "parts_saved"), "restored")
    resumed, twin = _merged(pp2dp2, "parts_resumed"), _merged(pp2dp2, "parts_twin")
    assert resumed["losses"] == twin["losses"], f"{resumed['losses']} vs {twin['losses']}"
    _bitwise(resumed["weights"], twin["weights"], "resumed vs twin")


def test_parts_resume_on_another_dp_degree(pp2dp2, pp2dp1):
    """pp 2 x dp 1 with two modules per rank loads it bit for bit; the next step is within the oracle bounds of
    the twin's (one rank's gradient sums in another order than two ranks' mean)."""
    _bitwise(_merged(pp2dp1, "parts_restored"), _merged(pp2dp2, "parts_saved"), "restored")
    assert_close_to(_merged(pp2dp1, "parts_resumed"), _merged(pp2dp2, "parts_twin"), "pp 2 x dp 1 resumed",
                    loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)


def test_parts_corrupt_module_refused_with_every_module_unchanged(pp2dp2):
    """One changed word in the second module's dict on one rank: every rank refuses, and neither module nor
    optimizer changed, the first module's (whose dict is sound) included: all are checked before any is written."""
    assert pp2dp2[-1]["parts_corrupted"] is not None
    for rank, r in enumerate(pp2dp2):
        kind, message = r["parts_refusal"]
        assert kind == "ValueError" and "checksum" in message, f"rank {rank}: {kind}: {message}"
        assert r["parts_unchanged"], f"rank {rank}: a module or optimizer changed although the load was refused"
