"""HuggingFace Trainer and Accelerate drive a dmuon model (2 gloo ranks on CPU).

* the Trainer script of docs/guides/hf-trainer.md (``examples/hf_trainer_dmuon.py``) trains under torchrun with Trainer's
  defaults (``max_grad_norm=1.0``, linear schedule, a checkpoint at the end) and the checkpoint loads
  with a plain ``from_pretrained``;
* the norm plain ``Trainer`` logs and clips with equals single-process ``torch.nn.utils.clip_grad_norm_``
  on an oracle model (with gradient accumulation, DTensor + dedicated + plain gradients), the gradients
  it hands to the optimizer are clipped to ``max_grad_norm``, its scheduler scales every param group,
  and plain (unsharded) params stay identical across ranks;
* ``DMuonTrainer`` with param groups: save at step 4, resume a fresh (differently initialised) model from
  it, and the continued losses, final weights and every group's settings equal an uninterrupted run's
  exactly; ``from_pretrained`` loads the
  checkpoint on one process;
* the Accelerate example runs.
"""

from __future__ import annotations

import math
import os
import re
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from tests._asserts import torchrun  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._hf import ADAMW_LR, MUON_LR, WORLD, Tokens, build, llama_config, rank_env, training_args  # noqa: E402

TIMEOUT_S = 180


# --------------------------------------------------------------------------------------------------- #
# Jobs run inside the ranks (the builders are in tests/_hf.py)                                         #
# --------------------------------------------------------------------------------------------------- #
def _clip_and_schedule_job(rank: int, world: int, outdir: str) -> dict[str, Any]:
    """Plain Trainer, default max_grad_norm, 2-step accumulation, layers sharded but not the root (so
    embeddings / final norm / lm_head are plain params that dmuon.Muon averages)."""
    rank_env(rank, world)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback

    import dmuon
    import dmuon.integrations.hf  # noqa: F401

    accum, steps = 2, 3
    torch.manual_seed(0)
    oracle = LlamaForCausalLM(llama_config())  # the same init as the dmuon model below
    model, optimizer = build(seed=0, shard_root=False)
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if len(micro_batches) < accum:  # the micro-batches of optimizer step 1
            micro_batches.append((kwargs["input_ids"].clone(), kwargs["labels"].clone()))

    handle = model.register_forward_pre_hook(capture, with_kwargs=True)

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.norms: list[float] = []
            self.clipped: list[float] = []
            self.lrs: list[list[tuple[str, float]]] = []
            self.adamw_lrs: list[list[float]] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
            # After Trainer clipped, before the step: the norm of what the optimizer will see.
            self.clipped.append(dmuon.clip_grad_norm_(model, math.inf).item())

        def on_step_end(self, args, state, control, optimizer=None, **kw):  # type: ignore[no-untyped-def]
            self.lrs.append([(g["kind"], g["lr"]) for g in optimizer.param_groups])
            self.adamw_lrs.append([g["lr"] for g in optimizer.optimizer._adamw.param_groups])

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "grad_norm" in logs:
                self.norms.append(float(logs["grad_norm"]))

    record = Record()
    trainer = Trainer(model=model, args=training_args(outdir, gradient_accumulation_steps=accum, max_steps=steps,
                                                      save_strategy="no"),
                      train_dataset=Tokens(64), optimizers=(optimizer, None), callbacks=[record])
    trainer.train()
    handle.remove()

    # Oracle: one process, the union of every rank's micro-batches of step 1, mean of the batch losses.
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, micro_batches)
    batches = [b for per_rank in everyone for b in per_rank]
    loss = torch.stack([oracle(input_ids=x, labels=y).loss for x, y in batches]).mean()
    loss.backward()
    oracle_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), math.inf).item()

    plain = {n: p.detach().clone() for n, p in model.named_parameters()
             if not isinstance(p, DTensor) and not dmuon.runtime.param.is_dedicated(p)}
    return dict(norms=record.norms, clipped=record.clipped, lrs=record.lrs, adamw_lrs=record.adamw_lrs,
                oracle_norm=oracle_norm, n_batches=len(batches), plain=plain, steps=steps,
                max_grad_norm=trainer.args.max_grad_norm)


EDITED_MOMENTUM = 0.9


def _resume_job(rank: int, world: int, outdir: str) -> dict[str, Any]:
    """DMuonTrainer with param groups: an uninterrupted 8-step run saving at 4 and 8, which sets the
    attention group's momentum to 0.9 after step 2; then a fresh model (built with the constructor's 0.95)
    resumed from 4."""
    rank_env(rank, world)
    from transformers import TrainerCallback

    import dmuon
    from dmuon.integrations.hf import DMuonTrainer

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.by_step: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                self.by_step[state.global_step] = float(logs["loss"])

        def on_step_end(self, args, state, control, optimizer=None, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                for g in optimizer.param_groups:
                    if g["name"] == "attn":
                        g["momentum"] = EDITED_MOMENTUM

    def run(seed: int, output_dir: str, resume: str | None) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
        model, optimizer = build(seed=seed, shard_root=True, groups=True)
        losses = Losses()
        trainer = DMuonTrainer(model=model, args=training_args(output_dir, max_steps=8, save_steps=4),
                               train_dataset=Tokens(64), optimizers=(optimizer, None), callbacks=[losses])
        trainer.train(resume_from_checkpoint=resume)
        hyper.append([{k: v for k, v in g.items() if k not in ("params", "param_names")}
                      for g in optimizer.param_groups])
        return losses.by_step, dmuon.get_model_state_dict(model, rank0_only=True)

    hyper: list[list[dict[str, Any]]] = []
    full_losses, full_final = run(0, os.path.join(outdir, "full"), None)
    resumed_losses, resumed_final = run(1, os.path.join(outdir, "resumed"),
                                        os.path.join(outdir, "full", "checkpoint-4"))
    return dict(full_losses=full_losses, resumed_losses=resumed_losses, full_final=full_final,
                resumed_final=resumed_final, full_hyper=hyper[0], resumed_hyper=hyper[1])


def _trainer_jobs(rank: int, world: int, outdir: str) -> dict[str, Any]:
    """Both Trainer jobs in one pair of processes (importing transformers twice per rank costs seconds)."""
    return dict(clip=_clip_and_schedule_job(rank, world, os.path.join(outdir, "clip")),
                resume=_resume_job(rank, world, os.path.join(outdir, "resume")))


# --------------------------------------------------------------------------------------------------- #
# Subprocess helpers (the examples, as a user runs them)                                               #
# --------------------------------------------------------------------------------------------------- #
def _torchrun(script: str, *args: str) -> str:
    return torchrun(script, *args, nproc=WORLD, timeout=TIMEOUT_S).stdout


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
def test_glue_leaves_other_models_alone() -> None:
    from transformers import Trainer

    from dmuon.integrations import hf

    hf.install()
    hf.install()  # idempotent
    assert hf.is_installed()
    plain = nn.Linear(2, 2)
    assert hf.dmuon_model_of(plain) is None
    fake_trainer = types.SimpleNamespace(model=plain, args=types.SimpleNamespace(parallel_mode=None))
    Trainer._move_model_to_device(fake_trainer, plain, torch.device("meta"))  # the original code path
    assert plain.weight.device.type == "meta"


def test_unsupported_accelerate_setups_are_refused() -> None:
    from accelerate.utils import DistributedType

    from dmuon.integrations.hf.accelerator import _check_accelerator

    def acc(**kw: Any) -> Any:
        base = dict(distributed_type=DistributedType.MULTI_CPU, parallelism_config=None, mixed_precision="no",
                    num_processes=1)
        return types.SimpleNamespace(**{**base, **kw})

    _check_accelerator(acc())
    _check_accelerator(acc(mixed_precision="bf16"))
    with pytest.raises(ValueError, match="already sharded"):
        _check_accelerator(acc(distributed_type=DistributedType.FSDP))
    with pytest.raises(ValueError, match="fp16"):
        _check_accelerator(acc(mixed_precision="fp16"))


def test_trainer_recipe_trains_and_saves(tmp_path: Path) -> None:
    out = _torchrun("examples/hf_trainer_dmuon.py", "--output_dir", str(tmp_path / "out"))
    match = re.search(r"hf_trainer_dmuon: OK loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the last 3\), -\d+% \(needs -10%\) "
                      r"\((\d+) steps\)", out)
    assert match, out
    assert float(match.group(2)) < float(match.group(1)), out
    assert int(match.group(3)) == 24, out  # 32 samples / (2 per device x 2 ranks) x 3 epochs: the data is split
    assert "optimizer.pt True, from_pretrained matches the trained weights: True" in out, out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    outdir = tmp_path_factory.mktemp("hf_trainer")
    return outdir, run_distributed(_trainer_jobs, WORLD, str(outdir))


def test_trainer_clipping_and_schedule_match_single_process(trainer_runs: tuple[Path, list[dict[str, Any]]]) -> None:
    results = [r["clip"] for r in trainer_runs[1]]
    for rank, r in enumerate(results):
        assert r["n_batches"] == 2 * WORLD
        norm, oracle = r["norms"][0], r["oracle_norm"]
        assert abs(norm - oracle) <= 1e-5 * oracle, (rank, norm, oracle)
        assert norm > r["max_grad_norm"], "the test needs clipping to be active"
        for logged, clipped in zip(r["norms"], r["clipped"]):  # what Muon / AdamW stepped with
            expected = logged * min(1.0, r["max_grad_norm"] / (logged + 1e-6))
            assert abs(clipped - expected) <= 1e-5 * expected, (rank, logged, clipped)
        assert len(r["lrs"]) == r["steps"]
        for step, (groups, adamw) in enumerate(zip(r["lrs"], r["adamw_lrs"]), start=1):
            factor = (r["steps"] - step) / r["steps"]  # Trainer's default linear schedule, no warmup
            assert [k for k, _ in groups] == ["muon", "adamw", "adamw_replicated"]
            expected = [MUON_LR * factor, ADAMW_LR * factor, ADAMW_LR * factor]
            assert [lr for _, lr in groups] == pytest.approx(expected, rel=1e-12, abs=1e-15), (rank, step, groups)
            assert adamw == pytest.approx(expected[1:], rel=1e-12, abs=1e-15)  # AdamW steps with these dicts
    assert set(results[0]["plain"]) >= {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}
    for name, t in results[0]["plain"].items():  # averaged gradients keep unsharded params in lockstep
        assert torch.equal(t, results[1]["plain"][name]), name


def test_dmuon_trainer_resume_equals_uninterrupted(trainer_runs: tuple[Path, list[dict[str, Any]]]) -> None:
    from transformers import AutoModelForCausalLM

    tmp_path, results = trainer_runs
    tmp_path = tmp_path / "resume"
    r0 = results[0]["resume"]
    ckpt = tmp_path / "full" / "checkpoint-4"
    for name in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    full, resumed = r0["full_losses"], r0["resumed_losses"]
    assert sorted(full) == list(range(1, 9)) and sorted(resumed) == list(range(5, 9)), (full, resumed)
    diffs = {s: abs(resumed[s] - full[s]) for s in resumed}
    assert max(diffs.values()) == 0.0, diffs  # bit-identical continuation
    for k, v in r0["full_final"].items():
        assert torch.equal(v, r0["resumed_final"][k]), k
    # the per-group settings came back from the checkpoint (the resumed model was built with momentum 0.95)
    assert r0["resumed_hyper"] == r0["full_hyper"]
    attn = [g for g in r0["full_hyper"] if g["name"] == "attn"]
    assert attn and all(g["momentum"] == EDITED_MOMENTUM and g["lr"] != MUON_LR for g in attn), attn
    # A plain single-process load of the final checkpoint gives the trained weights.
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full" / "checkpoint-8")).state_dict()
    assert loaded.keys() == r0["full_final"].keys()
    for k, v in r0["full_final"].items():
        assert torch.equal(loaded[k], v), k


def test_accelerate_example_runs(tmp_path: Path) -> None:
    out = _torchrun("examples/accelerate_dmuon.py", "--output_dir", str(tmp_path / "out"))
    match = re.search(r"accelerate_dmuon: OK loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert match, out
    assert float(match.group(2)) < float(match.group(1)), out
    assert "saved weights match the trained model: True" in out, out
