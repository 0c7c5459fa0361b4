"""The ``Trainer`` methods of a dmuon model (shared by ``DMuonTrainer`` and the patched ``Trainer``).

Each ``_t_<name>`` stands in for ``Trainer.<name>``; ``_TRAINER_IMPLS`` maps the names to them, and
``dmuon.integrations.hf.install`` patches them in, keeping the originals in ``_TRAINER_ORIGINALS``. The
package docstring says what each one changes and why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer

from ... import checkpoint as _ckpt
from ...runtime.hooks import STATE_ATTR
from ...clip import clip_grad_norm_ as _dmuon_clip_grad_norm_
from ...optim import Muon
from ._files import (OPTIMIZER_NAME, SCHEDULER_NAME, _fill_tied, _read_weights, load_file, refuse_torn,
                     save_replacing)
from ._model import dmuon_model_of
from ._ranks import _barrier, _from_rank0, _rank0_only

logger = logging.getLogger("dmuon")

#: ``Trainer``'s own methods, filled by ``install()``; ``_t_save_guard`` calls the original ``_save``.
_TRAINER_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _base_optimizer(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _muon_of(trainer: Trainer, model: nn.Module) -> Muon:
    opt = _base_optimizer(trainer.optimizer)
    if not isinstance(opt, Muon) or opt.runtime is not getattr(model, STATE_ATTR):
        raise TypeError(
            "dmuon: a model prepared by dmuon.dedicate_params trains with dmuon.Muon built for it; pass "
            "Trainer(..., optimizers=(dmuon.Muon(model, ...), None)). "
            f"Got {type(opt).__name__}."
        )
    return opt


def _root_for(trainer: Trainer, model: nn.Module | None) -> nn.Module:
    root = dmuon_model_of(model)
    root = root if root is not None else dmuon_model_of(trainer.model)
    assert root is not None, "dispatch only reaches here for dmuon models"
    return root


def _t_move_model_to_device(trainer: Trainer, model: nn.Module, device: torch.device) -> None:
    logger.debug("dmuon: not moving the model to %s; FSDP2 and dmuon placed its tensors already", device)


def _deepspeed(trainer: Trainer) -> bool:
    """Whether ``TrainingArguments(deepspeed=...)`` runs this Trainer: DeepSpeed's engine then trains the model
    (dmuon joined ``deepspeed.initialize``), and the Trainer's own DeepSpeed code paths apply unchanged."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def _original(name: str) -> Callable[..., Any]:
    """``Trainer``'s own method (not the dispatcher ``install`` put in its place)."""
    return _TRAINER_ORIGINALS[name]


@dataclasses.dataclass
class _Resume:
    """What ``train`` was asked to resume, held between Trainer's two loading hooks ([Note: one resume])."""

    optimizer_state: bool  # train(resume_optimizer_state=...)
    weights: str | None = None  # the checkpoint whose weights _load_from_checkpoint left to the second hook


# [Note: one resume]
# Trainer resumes in two hooks: ``train`` calls ``_load_from_checkpoint`` (the weights) before it builds the
# scheduler, and ``_load_optimizer_and_scheduler`` after. Loading the weights at the first hook would leave
# them written when the optimizer file is then refused (corrupt, from another save) or missing. So the first
# hook only notes the checkpoint, and the second reads every file on rank 0, checks the weights and the
# optimizer dict together (``dmuon.set_state_dict``: every rank agrees on the verdict) and only then writes
# the model, the optimizer and the scheduler. Nothing between the hooks reads the weights: FSDP2 and dmuon
# placed the tensors already, so Accelerate's prepare neither moves nor wraps them.


def _t_train(trainer: Trainer, *args: Any, resume_optimizer_state: bool = True, **kwargs: Any) -> Any:
    """Before ``train`` runs: keep the ``dmuon.Muon`` the Trainer was given (its DeepSpeed set-up drops
    ``optimizers=`` and asks ``create_optimizer`` again), install the DeepSpeed glue if it will be needed, and
    note how to resume ([Note: one resume]). ``resume_optimizer_state=False``: resume the weights and the
    schedule with fresh optimizer state, on purpose."""
    if not isinstance(resume_optimizer_state, bool):
        raise TypeError(f"dmuon: train(resume_optimizer_state=...) takes True or False, got {resume_optimizer_state!r}")
    if isinstance(trainer.optimizer, Muon):
        trainer._dmuon_optimizer = trainer.optimizer
    if _deepspeed(trainer):
        if not resume_optimizer_state:
            raise ValueError(
                "dmuon: train(resume_optimizer_state=False) is not supported with a DeepSpeed config: DeepSpeed's "
                "engine loads the optimizer together with the model. Drop the argument."
            )
        from .. import deepspeed  # noqa: F401  (importing installs the glue before deepspeed.initialize)
    trainer._dmuon_resume = _Resume(optimizer_state=resume_optimizer_state)
    try:
        return _original("train")(trainer, *args, **kwargs)
    finally:
        trainer._dmuon_resume = None


def _t_create_optimizer(trainer: Trainer, model: nn.Module | None = None) -> torch.optim.Optimizer:
    root = _root_for(trainer, None)
    if trainer.optimizer is None:  # DeepSpeed's set-up, or no optimizer given: ours, never Trainer's AdamW
        cls_kwargs = trainer.optimizer_cls_and_kwargs
        if cls_kwargs is not None and isinstance(cls_kwargs[0], type) and issubclass(cls_kwargs[0], Muon):
            trainer.optimizer = cls_kwargs[0](root, **cls_kwargs[1])
        elif isinstance(getattr(trainer, "_dmuon_optimizer", None), Muon):
            trainer.optimizer = trainer._dmuon_optimizer
        else:
            raise ValueError(
                "dmuon: Trainer would build its own optimizer over the dedicated placeholders. Pass "
                "Trainer(..., optimizers=(dmuon.Muon(model, lr=..., adamw_lr=...), None)), or "
                "Trainer(..., optimizer_cls_and_kwargs=(dmuon.Muon, {\"lr\": ..., \"adamw_lr\": ...}))."
            )
    if _deepspeed(trainer) and not isinstance(trainer.optimizer, Muon):  # prepared already: DeepSpeed's
        return trainer.optimizer
    trainer._dmuon_optimizer = _muon_of(trainer, root)
    return trainer.optimizer


def _t_create_scheduler(trainer: Trainer, num_training_steps: int, optimizer: Any = None) -> Any:
    """Under DeepSpeed, Trainer builds its scheduler on DeepSpeed's optimizer, whose groups are only those ZeRO
    steps: build it on ``dmuon.Muon`` instead, so Muon's groups follow the schedule too (the same dicts)."""
    if optimizer is None and _deepspeed(trainer) and isinstance(getattr(trainer, "_dmuon_optimizer", None), Muon):
        optimizer = trainer._dmuon_optimizer
    return _original("create_scheduler")(trainer, num_training_steps, optimizer)


def _t_clip_grad_norm(trainer: Trainer, model: nn.Module) -> torch.Tensor:
    if _deepspeed(trainer):  # DeepSpeed clips in engine.step(), by a norm with the dedicated gradients in it
        return _original("_clip_grad_norm")(trainer, model)
    root = _root_for(trainer, model)
    return _dmuon_clip_grad_norm_(root, trainer.args.max_grad_norm)


def _t_get_grad_norm(trainer: Trainer, model: nn.Module, grad_norm: Any = None) -> Any:
    if _deepspeed(trainer):
        return _original("_get_grad_norm")(trainer, model, grad_norm)
    if grad_norm is None:  # max_grad_norm <= 0: the norm only (a factor of exactly 1 changes nothing)
        grad_norm = _dmuon_clip_grad_norm_(_root_for(trainer, model), math.inf)
    return grad_norm


def _t_save_model(trainer: Trainer, output_dir: str | None = None, _internal_call: bool = False) -> None:
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    root = _root_for(trainer, None)
    sd = _ckpt.get_model_state_dict(root, rank0_only=not trainer.args.save_on_each_node)  # collective
    if trainer.args.should_save:
        trainer._save(output_dir, state_dict=sd)
    _barrier()  # the files are complete before any rank reads them (best model, resume in-process)
    if trainer.args.push_to_hub and not _internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


def _t_save_guard(trainer: Trainer, output_dir: str | None = None, state_dict: dict | None = None) -> None:
    """``Trainer._save`` runs on the writer ranks only, so it cannot gather; refuse rather than crash."""
    if state_dict is None:
        raise RuntimeError(
            "dmuon: Trainer._save without a state dict would read dedicated placeholders and FSDP2 shards "
            "on one rank. Call trainer.save_model(output_dir) on every rank; it gathers with "
            "dmuon.get_model_state_dict first."
        )
    _TRAINER_ORIGINALS["_save"](trainer, output_dir, state_dict=state_dict)


def _t_save_optimizer_and_scheduler(trainer: Trainer, output_dir: str) -> None:
    if _deepspeed(trainer):  # engine.save_checkpoint on every rank: every owner's state in its rank's file
        return _original("_save_optimizer_and_scheduler")(trainer, output_dir)
    root = _root_for(trainer, None)
    osd = _ckpt.get_optimizer_state_dict(root, _muon_of(trainer, root),
                                         rank0_only=not trainer.args.save_on_each_node)  # collective
    if trainer.args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        save_replacing(osd, os.path.join(output_dir, OPTIMIZER_NAME))
        if trainer.lr_scheduler is not None:
            save_replacing(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
    _barrier()


def _t_load_from_checkpoint(trainer: Trainer, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    if _deepspeed(trainer):  # engine.load_checkpoint, through dmuon's model state-dict setter
        return _original("_load_from_checkpoint")(trainer, resume_from_checkpoint, model)
    resume = getattr(trainer, "_dmuon_resume", None)
    if resume is not None and resume.weights is None:  # train() resuming: written at the next hook, once checked
        resume.weights = resume_from_checkpoint
        return None
    _load_weights(trainer, resume_from_checkpoint, model)


def _load_weights(trainer: Trainer, directory: str, model: nn.Module | None = None) -> None:
    root = _root_for(trainer, model)
    logger.info("dmuon: loading model weights from %s", directory)
    sd = _rank0_only(lambda: _fill_tied(root, _read_weights(directory)), {})
    _ckpt.set_model_state_dict(root, sd)  # collective; validates keys/shapes first


def _t_load_optimizer_and_scheduler(trainer: Trainer, checkpoint: str | None) -> None:
    """Resume the optimizer and the scheduler, and the weights ``_load_from_checkpoint`` left for this hook: all
    read, then checked together, then written ([Note: one resume])."""
    if _deepspeed(trainer):  # the engine loaded the optimizer with the model; Trainer reads its scheduler file
        return _original("_load_optimizer_and_scheduler")(trainer, checkpoint)
    resume, trainer._dmuon_resume = getattr(trainer, "_dmuon_resume", None), None
    if checkpoint is None:
        return None
    root = _root_for(trainer, None)
    opt = _muon_of(trainer, root)
    opt_file, sched_file = (os.path.join(checkpoint, n) for n in (OPTIMIZER_NAME, SCHEDULER_NAME))
    has_opt, has_sched = _from_rank0(lambda: (os.path.isfile(opt_file), os.path.isfile(sched_file)))
    optimizer_state = resume is None or resume.optimizer_state
    refuse_torn(checkpoint, has_optimizer=has_opt, has_scheduler=has_sched, optimizer_state=optimizer_state)
    load_opt = optimizer_state and has_opt
    weights = resume.weights if resume is not None else None
    if weights is not None:
        logger.info("dmuon: loading model weights from %s", weights)
    if not (has_opt or has_sched):
        logger.warning("dmuon: %s has no %s or %s (a save_only_model checkpoint): resuming the weights only, with "
                       "fresh optimizer state and schedule", checkpoint, OPTIMIZER_NAME, SCHEDULER_NAME)

    def read() -> dict[str, Any]:
        return {"model": _fill_tied(root, _read_weights(weights)) if weights is not None else {},
                "optim": load_file(opt_file) if load_opt else {}}

    parts = _rank0_only(read, {"model": {}, "optim": {}})  # every file read (or every rank raises) ...
    sched = _from_rank0(lambda: load_file(sched_file)) if has_sched else None
    sched = sched if trainer.lr_scheduler is not None else None
    lrs = _schedule_lrs(opt, sched, sched_file) if sched is not None and not load_opt else None
    if weights is not None and load_opt:  # ... then weights and optimizer checked together, then written
        _ckpt.set_state_dict(root, opt, parts)
    elif weights is not None:
        _ckpt.set_model_state_dict(root, parts["model"])
    elif load_opt:
        _ckpt.set_optimizer_state_dict(root, opt, parts["optim"])  # collective; restores each group's lr too
    if sched is not None:
        trainer.lr_scheduler.load_state_dict(sched)
    for group, lr in zip(opt.param_groups, lrs or ()):  # no optimizer dict: each group's lr from the schedule
        group["lr"] = lr
    return None


def _schedule_lrs(opt: Muon, sched: Any, path: str) -> list[float]:
    """The learning rates of the checkpoint's schedule, one per param group, for a resume without the optimizer
    dict (which would carry them). Checked before anything is written; the dict came from rank 0, so every rank
    reaches the same verdict."""
    lrs = sched.get("_last_lr") if isinstance(sched, Mapping) else None
    if not isinstance(lrs, list) or len(lrs) != len(opt.param_groups):
        raise ValueError(
            f"dmuon: {path} is not the state of a learning-rate scheduler over this optimizer's "
            f"{len(opt.param_groups)} param groups, so its learning rates cannot be resumed; nothing was changed. "
            "Resume from a checkpoint this training job saved."
        )
    return [float(lr) for lr in lrs]


def _t_load_best_model(trainer: Trainer) -> None:
    if _deepspeed(trainer):
        return _original("_load_best_model")(trainer)
    logger.info("dmuon: loading the best model from %s", trainer.state.best_model_checkpoint)
    _load_weights(trainer, trainer.state.best_model_checkpoint)


_TRAINER_IMPLS: dict[str, Callable[..., Any]] = {
    "train": _t_train,
    "create_scheduler": _t_create_scheduler,
    "_move_model_to_device": _t_move_model_to_device,
    "create_optimizer": _t_create_optimizer,
    "_clip_grad_norm": _t_clip_grad_norm,
    "_get_grad_norm": _t_get_grad_norm,
    "save_model": _t_save_model,
    "_save": _t_save_guard,
    "_save_optimizer_and_scheduler": _t_save_optimizer_and_scheduler,
    "_load_from_checkpoint": _t_load_from_checkpoint,
    "_load_optimizer_and_scheduler": _t_load_optimizer_and_scheduler,
    "_load_best_model": _t_load_best_model,
}
