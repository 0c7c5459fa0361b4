"""HF Trainer resume on the FSDP2 path checks the model and the optimizer together (2 gloo ranks, DMuonTrainer).

An uninterrupted 6-step run saves ``checkpoint-3``; from copies of it:

* a corrupt ``optimizer.pt`` (one Muon momentum value changed, so its checksum no longer matches; or the
  file cut in half) is refused on every rank, and the model, the optimizer and the scheduler are bit for
  bit what they were before the attempt (a model with two steps of history of its own, and a scheduler);
* a torn save (``optimizer.pt`` missing, ``scheduler.pt`` there) is refused, the same way, with the message
  that names the opt-in;
* ``train(resume_optimizer_state=False)`` resumes from the torn save on purpose: the checkpoint's weights and
  schedule (every group's lr), fresh optimizer state, the next loss equal to the uninterrupted run's;
* the complete checkpoint still resumes bit-identical to the uninterrupted run, into the very model,
  optimizer and scheduler the refused attempts left behind;
* (one process) which sets of files are torn, and the schedule the opt-in takes its learning rates from.

Each rank runs in its own process (``run_distributed``), so a crash or a hang fails the test, not the suite.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._asserts import differences

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from tests._dist import run_distributed  # noqa: E402
from tests._hf import WORLD, Tokens, build, rank_env, training_args  # noqa: E402
from tests._training import full_weights  # noqa: E402

STEPS, SAVE = 6, 3
BAD = ("corrupt", "truncated", "torn")


# --------------------------------------------------------------------------------------------------- #
# Helpers run inside the ranks                                                                         #
# --------------------------------------------------------------------------------------------------- #
def _recorder(on_begin: Callable[..., Any] | None = None) -> Any:
    """A callback that keeps each step's loss and every group's lr after it, and what ``on_begin`` saw when
    training began (after Trainer loaded the checkpoint)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}
            self.lrs: dict[int, list[float]] = {}
            self.begin: Any = None

        def on_train_begin(self, args, state, control, lr_scheduler=None, **kw):  # type: ignore[no-untyped-def]
            if on_begin is not None:
                self.begin = on_begin(lr_scheduler)

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

        def on_step_end(self, args, state, control, optimizer=None, **kw):  # type: ignore[no-untyped-def]
            self.lrs[state.global_step] = [g["lr"] for g in optimizer.param_groups]

    return Record()


def _snapshot(model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """Everything a resume could change: the parameters as they live (read with torch.distributed alone), the
    model's and the optimizer's full dicts (buffers, state, param groups) and the scheduler's state."""
    import dmuon

    return {"params": full_weights(model), "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt), "sched": copy.deepcopy(sched.state_dict())}


def _damaged_copies(rank: int, good: str, outdir: str) -> dict[str, str]:
    """Rank 0 copies the checkpoint three times and damages each copy's optimizer file; every rank waits."""
    import torch.distributed as dist

    paths = {name: os.path.join(outdir, name) for name in BAD}
    if rank == 0:
        for path in paths.values():
            shutil.copytree(good, path)
        opt_file = os.path.join(paths["corrupt"], "optimizer.pt")
        osd = torch.load(opt_file, weights_only=True)
        fqn = next(k for k in sorted(osd["state"]) if "momentum_buffer" in osd["state"][k])
        osd["state"][fqn]["momentum_buffer"].view(-1)[0] += 1.0  # its checksum, saved beside it, now differs
        torch.save(osd, opt_file)
        cut = os.path.join(paths["truncated"], "optimizer.pt")
        with open(cut, "r+b") as f:
            f.truncate(os.path.getsize(cut) // 2)
        os.remove(os.path.join(paths["torn"], "optimizer.pt"))
    dist.barrier()
    return paths


def _attempt(run: Callable[[], Any], snapshot: Callable[[], dict[str, Any]], before: dict[str, Any]) -> dict[str, Any]:
    """What a resume attempt did: the error it raised (``None`` if it trained) and what it changed."""
    try:
        run()
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads the type and the message
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "changed": differences(before, snapshot())}


def _resume_job(rank: int, world: int, outdir: str) -> dict[str, Any]:
    rank_env(rank, world)
    import dmuon
    from transformers import get_linear_schedule_with_warmup

    from dmuon.integrations.hf import DMuonTrainer

    def trainer(model: Any, opt: Any, sched: Any, name: str, record: Any, **kw: Any) -> Any:
        args = training_args(os.path.join(outdir, name), **{"max_steps": STEPS, "save_strategy": "no", **kw})
        return DMuonTrainer(model=model, args=args, train_dataset=Tokens(64), optimizers=(opt, sched),
                            callbacks=[record])

    def outcome(run: Callable[[], Any]) -> str | None:
        try:
            run()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    model, opt = build(seed=0, shard_root=True, groups=True)  # the uninterrupted run, saving at step 3
    full = _recorder()
    trainer(model, opt, None, "full", full, save_strategy="steps", save_steps=SAVE).train()
    out: dict[str, Any] = {"full": {"losses": full.losses, "lrs": full.lrs, "final": full_weights(model)}}
    good = os.path.join(outdir, "full", f"checkpoint-{SAVE}")
    bad = _damaged_copies(rank, good, outdir)

    # A model with a history of its own (two steps, a scheduler the user passed), then the refused attempts.
    model, opt = build(seed=1, shard_root=True, groups=True)
    sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
    trainer(model, opt, sched, "pre", _recorder(), max_steps=2).train()
    before = _snapshot(model, opt, sched)
    for name in BAD:
        attempt = trainer(model, opt, sched, name, _recorder())
        out[name] = _attempt(lambda: attempt.train(resume_from_checkpoint=bad[name]),  # noqa: B023 (called at once)
                             lambda: _snapshot(model, opt, sched), before)
    good_run = _recorder()  # the complete checkpoint, into the objects the attempts left
    out["good"] = {"error": outcome(lambda: trainer(model, opt, sched, "good", good_run).train(
        resume_from_checkpoint=good)), "losses": good_run.losses, "lrs": good_run.lrs, "final": full_weights(model)}

    model, opt = build(seed=2, shard_root=True, groups=True)  # a fresh job resuming the torn save on purpose
    opt_in = _recorder(lambda s: {"params": full_weights(model), "optim": dmuon.get_optimizer_state_dict(model, opt),
                                  "last_epoch": s.last_epoch, "lrs": [g["lr"] for g in opt.param_groups]})
    error = outcome(lambda: trainer(model, opt, None, "opt_in", opt_in).train(
        resume_from_checkpoint=bad["torn"], resume_optimizer_state=False))
    out["opt_in"] = {"error": error, "begin": opt_in.begin, "losses": opt_in.losses, "lrs": opt_in.lrs}
    return out


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    outdir = tmp_path_factory.mktemp("hf_resume")
    return outdir, run_distributed(_resume_job, WORLD, str(outdir))


def _refused(results: list[dict[str, Any]], name: str) -> str:
    """The error every rank raised for the attempt ``name`` (the same on each), having changed nothing."""
    errors = [r[name]["error"] for r in results]
    assert errors[0] is not None, f"{name}: resumed instead of being refused"
    assert errors == [errors[0]] * len(results), f"{name}: ranks disagree: {errors}"
    for rank, r in enumerate(results):
        assert not r[name]["changed"], f"{name}, rank {rank}: the refused resume changed {r[name]['changed'][:8]}"
    return errors[0]


def test_corrupt_optimizer_file_is_refused_and_changes_nothing(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    results = runs[1]
    error = _refused(results, "corrupt")
    assert error.startswith("ValueError: ") and "checksums do not match" in error, error
    error = _refused(results, "truncated")
    assert error.startswith("RuntimeError: dmuon: rank 0 failed: ") and "optimizer.pt" in error, error


def test_torn_checkpoint_is_refused_with_the_opt_in_named(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    error = _refused(runs[1], "torn")
    assert error.startswith("ValueError: dmuon: the checkpoint "), error
    assert "has scheduler.pt but no optimizer.pt" in error and "Nothing was changed" in error, error
    assert "resume_optimizer_state=False" in error, error


def test_opt_in_resumes_weights_and_schedule_without_optimizer_state(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    import safetensors.torch

    outdir, results = runs
    saved = safetensors.torch.load_file(str(outdir / "full" / f"checkpoint-{SAVE}" / "model.safetensors"))
    for rank, r in enumerate(results):
        c, full = r["opt_in"], r["full"]
        assert c["error"] is None, c["error"]
        begin = c["begin"]
        assert begin["params"].keys() <= saved.keys()
        for k, v in begin["params"].items():  # the checkpoint's weights ...
            assert torch.equal(v, saved[k]), (rank, k)
        assert begin["optim"]["state"] == {}, (rank, sorted(begin["optim"]["state"])[:4])  # ... no optimizer state
        assert begin["last_epoch"] == SAVE and begin["lrs"] == full["lrs"][SAVE], begin  # ... and the schedule
        assert sorted(c["losses"]) == list(range(SAVE + 1, STEPS + 1)), c["losses"]
        assert c["losses"][SAVE + 1] == full["losses"][SAVE + 1]  # the same weights see the same batch
        assert {s: c["lrs"][s] for s in c["lrs"]} == {s: full["lrs"][s] for s in c["lrs"]}


def test_complete_checkpoint_resumes_bit_identical_after_refusals(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(runs[1]):
        g, full = r["good"], r["full"]
        assert g["error"] is None, g["error"]
        assert sorted(g["losses"]) == list(range(SAVE + 1, STEPS + 1)), g["losses"]
        assert g["losses"] == {s: full["losses"][s] for s in g["losses"]}, (rank, g["losses"], full["losses"])
        assert g["lrs"] == {s: full["lrs"][s] for s in g["lrs"]}
        assert full["final"].keys() == g["final"].keys()
        for k, v in full["final"].items():
            assert torch.equal(v, g["final"][k]), (rank, k)


def test_which_checkpoints_are_torn_and_which_schedules_give_learning_rates() -> None:
    import types

    from dmuon.integrations.hf._files import refuse_torn
    from dmuon.integrations.hf.trainer import _schedule_lrs, _t_train

    for has_optimizer, has_scheduler in ((True, True), (False, False)):  # complete, and save_only_model's form
        refuse_torn("ckpt", has_optimizer=has_optimizer, has_scheduler=has_scheduler, optimizer_state=True)
    with pytest.raises(ValueError, match="has optimizer.pt but no scheduler.pt .*restart the learning-rate schedule"):
        refuse_torn("ckpt", has_optimizer=True, has_scheduler=False, optimizer_state=True)
    refuse_torn("ckpt", has_optimizer=False, has_scheduler=True, optimizer_state=False)  # the opt-in
    opt = types.SimpleNamespace(param_groups=[{"lr": 1.0}, {"lr": 2.0}])
    assert _schedule_lrs(opt, {"_last_lr": [0.5, 0.25]}, "scheduler.pt") == [0.5, 0.25]
    for bad in ({"_last_lr": [0.5]}, {"last_epoch": 3}, [0.5, 0.25]):
        with pytest.raises(ValueError, match="over this optimizer's 2 param groups"):
            _schedule_lrs(opt, bad, "scheduler.pt")
    with pytest.raises(TypeError, match="takes True or False, got 'no'"):
        _t_train(types.SimpleNamespace(), resume_optimizer_state="no")  # refused before the Trainer is touched
