"""HF Trainer with a DeepSpeed ZeRO-3 config (``TrainingArguments(deepspeed=...)``) trains a dmuon model (issues
26, 34): the ``dmuon.Muon`` reaches DeepSpeed (given as ``optimizers=`` or ``optimizer_cls_and_kwargs=``; Trainer's
DeepSpeed set-up would otherwise build AdamW), Trainer's schedule scales Muon's groups too, and a run resumed from
its checkpoint (``engine.save_checkpoint`` + ``scheduler.pt``; its ``model.safetensors`` whole) equals the
uninterrupted one bit for bit. An optimizer other than ``dmuon.Muon`` is refused on every rank. Accelerate's
DeepSpeed plugin with the same ZeRO-3 config: ``save_state`` / ``load_state`` resume bit for bit. 2 gloo ranks on
CPU."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests._deepspeed import setup  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._hf import PROJ, Tokens, llama_config  # noqa: E402

STEPS = 8
#: ZeRO-3 (issue 34): the stage HF fine-tuning configs use most; ZeRO-0/1/2 take the same Trainer glue
#: (tests/test_deepspeed*.py train them without Trainer)
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
      "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}


def _gloo_state() -> None:
    """Accelerate picks no backend for DeepSpeed on a CPU (it would count one process): a gloo ``PartialState``
    made under DeepSpeed, which ``TrainingArguments(accelerator_config={"use_configured_state": True})`` takes."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the previous Trainer's
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _model(world: int, seed: int) -> torch.nn.Module:
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config())
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), verbose=False,
                          predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    return model


def _train(world: int, seed: int, out: str, resume: str | None, how: str) -> dict[str, Any]:
    import dmuon
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}
            self.lrs: dict[int, list[float]] = {}

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                self.losses[state.global_step] = float(logs["loss"])

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self.lrs[state.global_step] = [g["lr"] for g in trainer._dmuon_optimizer.param_groups]

    _gloo_state()
    model = _model(world, seed)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=STEPS, save_steps=4, deepspeed=dict(DS), report_to="none", logging_steps=1,
                             disable_tqdm=True, accelerator_config={"use_configured_state": True})
    kw: dict[str, Any] = ({"optimizers": (dmuon.Muon(model, lr=0.02, adamw_lr=1e-3), None)} if how == "optimizers"
                          else {"optimizer_cls_and_kwargs": (dmuon.Muon, {"lr": 0.02, "adamw_lr": 1e-3})})
    record = Record()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[record], **kw)
    trainer.train(resume_from_checkpoint=resume)
    muon = trainer._dmuon_optimizer
    return {"losses": record.losses, "lrs": record.lrs, "weights": dmuon.get_model_state_dict(model, rank0_only=True),
            "momenta": sum("momentum_buffer" in st for st in muon.state.values()),
            "owned": len(dmuon.get_owned_params(model)), "kinds": [g["kind"] for g in muon.param_groups]}


def _refused(world: int, out: str) -> str:
    from transformers import Trainer, TrainingArguments

    _gloo_state()
    model = _model(world, 0)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                             deepspeed={**DS, "zero_optimization": {"stage": 2}},
                             report_to="none", disable_tqdm=True, accelerator_config={"use_configured_state": True})
    other = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad][:1])
    try:
        Trainer(model=model, args=args, train_dataset=Tokens(8), optimizers=(other, None)).train()
    except ValueError as e:
        return str(e)
    return ""


def _accelerate(world: int, out: str, *, resume: bool) -> dict[str, Any]:
    """Accelerate's DeepSpeed plugin with the ZeRO-3 config: 4 steps of 2 micro-batches, ``save_state`` after 2
    (``resume``: a fresh ``Accelerator`` loads that state and trains the last 2); the losses and the whole model."""
    import dmuon
    from accelerate import Accelerator, DeepSpeedPlugin

    _gloo_state()
    model = _model(world, 0 if not resume else 1)
    config = {**DS, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    engine, opt = acc.prepare(model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3))
    data, rank, losses = Tokens(64), acc.process_index, {}
    for step in range(2 if resume else 0, 4):
        if resume and step == 2:
            acc.load_state(out)
        for micro in range(2):
            i = (step * 2 + micro) * 2 * world + rank * 2
            batch = torch.stack([data[j]["input_ids"] for j in range(i, i + 2)])
            loss = engine(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses[step, micro] = loss.item()
        if step == 1 and not resume:
            acc.save_state(out)
    return {"losses": losses, "weights": dmuon.get_model_state_dict(model, rank0_only=True)}


def trainer_job(rank: int, world: int, outdir: str) -> dict[str, Any]:
    os.environ.update(LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    setup(rank)
    full = _train(world, 0, os.path.join(outdir, "full"), None, "optimizers")
    resumed = _train(world, 1, os.path.join(outdir, "resumed"), os.path.join(outdir, "full", "checkpoint-4"),
                     "optimizer_cls_and_kwargs")
    accelerate = [_accelerate(world, os.path.join(outdir, "accelerate"), resume=r) for r in (False, True)]
    return {"full": full, "resumed": resumed, "refused": _refused(world, os.path.join(outdir, "refused")),
            "accelerate": accelerate}


def test_trainer_with_a_deepspeed_config_trains_and_resumes_bit_identically(tmp_path):
    results = run_distributed(trainer_job, 2, str(tmp_path))
    ckpt = tmp_path / "full" / "checkpoint-4"
    for name in ("model.safetensors", "scheduler.pt", "latest"):
        assert (ckpt / name).exists(), sorted(os.listdir(ckpt))
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))  # whole tensors: ZeRO-3's params gathered, dmuon's too
    want = results[0]["full"]["weights"]
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(want[k].shape) for k in saved}
    assert all(v.numel() for v in saved.values())
    for r in results:
        full, resumed = r["full"], r["resumed"]
        assert full["momenta"] == full["owned"] > 0, "dmuon.Muon did not step the owned matrices"
        assert sorted(full["losses"]) == list(range(1, STEPS + 1)) and sorted(resumed["losses"]) == [5, 6, 7, 8]
        assert {s: resumed["losses"][s] for s in resumed["losses"]} == {s: full["losses"][s] for s in resumed["losses"]}
        for k, v in full["weights"].items():
            assert torch.equal(v, resumed["weights"][k]), k
        # Trainer's linear schedule (no warm-up) scales every group, Muon's included, from its own lr
        for step, lrs in full["lrs"].items():
            factor = (STEPS - step) / STEPS
            assert lrs == pytest.approx([base * factor for base in (0.02, 1e-3, 1e-3)], rel=1e-12, abs=1e-15), lrs
        assert resumed["lrs"] == {s: full["lrs"][s] for s in resumed["lrs"]}
        assert "Trainer would build its own optimizer" in r["refused"], r["refused"]
        whole, again = r["accelerate"]  # Accelerate's DeepSpeed plugin at ZeRO-3: save_state / load_state
        assert set(again["losses"]) == {(s, m) for s in (2, 3) for m in (0, 1)}
        assert again["losses"] == {k: whole["losses"][k] for k in again["losses"]}
        for k, v in whole["weights"].items():
            assert torch.equal(v, again["weights"][k]), k
