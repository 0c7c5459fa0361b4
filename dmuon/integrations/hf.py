"""HuggingFace ``Trainer`` and Accelerate for models prepared by dmuon (``dedicate_params`` + ``fully_shard``).

Importing this module installs the glue (the way ``import dmuon`` installs the FSDP2 patch); it only
changes what ``transformers.Trainer`` and ``accelerate.Accelerator`` do to a *dmuon model* (a module
that went through :func:`dmuon.dedicate_params`, possibly wrapped by ``torch.compile``); every other
model takes the unchanged code path. Needs transformers 5.x and accelerate 1.x (checked: 5.24, 1.15).

Trainer, the seed recipe::

    import dmuon
    from dmuon.integrations.hf import DMuonTrainer      # or plain Trainer once this module is imported

    dmuon.dedicate_params(model, mesh, predicate=...)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, num_train_epochs=3, fsdp="")
    trainer = DMuonTrainer(model=model, args=args, train_dataset=ds, optimizers=(optimizer, None))
    trainer.train()                                     # or .train(resume_from_checkpoint=True)

On a CPU-only machine pass ``use_cpu=True`` to ``TrainingArguments`` (and ``cpu=True`` to
``Accelerator``): without it Accelerate treats a torchrun job as one process, so every rank would read
the whole dataset and think it is the main process; dmuon refuses that with an error.

What Trainer / Accelerate do to such a model, and what this module does about it:

* ``Trainer.__init__`` moves the model to ``args.device`` (``model.to``). A non-owner's dedicated
  param is a 0-byte placeholder; wherever ``.to`` copies (``cpu`` -> ``cpu:0`` on CPU) the process
  crashes. **Skipped**: FSDP2 and dmuon already placed every tensor.
* ``Accelerator.prepare_model`` wraps a multi-process model in DDP (DTensor params: an error; plain
  params: DDP would broadcast the placeholders). **Replaced** by its ``evaluation_mode`` branch, the
  one Trainer itself uses for models sharded at load time: mixed-precision autocast and
  ``torch.compile`` as configured, no DDP, no device move. Accelerate's own FSDP / DeepSpeed / TP / CP
  plugins and fp16 (its ``GradScaler`` decides inf-skips per rank, so ranks could disagree) are refused
  with a ``ValueError``; use ``fsdp=""`` and bf16.
* Gradient averaging: FSDP2 reduce-scatters the sharded params, dmuon reduces the dedicated ones to
  their owners, and ``dmuon.Muon`` averages the remaining plain trainable params at the end of each
  backward -- so nothing is left for DDP to do.
* Gradient accumulation: ``Accelerator.no_sync`` (which Trainer and ``accelerator.accumulate`` use for
  all but the last micro-batch) becomes :func:`dmuon.no_sync`: no dmuon reduce and no FSDP2
  reduce-scatter until the last micro-batch.
* Clipping: Trainer chooses a code path per rank from the gradient types it sees; dedicated gradients
  exist on their owners only, so ranks would take different paths (hang, or a per-rank wrong norm).
  ``Trainer._clip_grad_norm`` / ``_get_grad_norm`` and ``Accelerator.clip_grad_norm_`` (over exactly
  the model's parameters) **call** :func:`dmuon.clip_grad_norm_`: the true global norm, identical on
  every rank, equal to single-process ``torch.nn.utils.clip_grad_norm_``.
* Learning-rate schedulers: ``dmuon.Muon``'s param groups (``muon``, ``adamw``, ``adamw_replicated``)
  carry real ``lr`` values, so Trainer's scheduler scales all of them. ``AcceleratedOptimizer``'s
  ``state_dict()``/``load_state_dict()`` round trip at prepare time is supported by ``dmuon.Muon``.
* Saving: ``Trainer._save`` and ``_save_optimizer_and_scheduler`` read ``state_dict()`` on rank 0 only
  (placeholders and shards). ``save_model`` and ``_save_optimizer_and_scheduler`` run on every rank, so
  they **gather** with :func:`dmuon.get_model_state_dict` / :func:`dmuon.get_optimizer_state_dict`
  (collective, drains async work) and the writer ranks write: ``config.json`` + safetensors via
  ``save_pretrained`` (a plain ``AutoModelForCausalLM.from_pretrained(dir)`` loads it on one process),
  ``optimizer.pt`` (dmuon's FQN-keyed dict: any world size can resume from it) and ``scheduler.pt``.
  Resuming (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_best_model``): rank 0
  reads the files and :func:`dmuon.set_model_state_dict` / :func:`dmuon.set_optimizer_state_dict`
  scatter them. ``Trainer._save`` without a gathered state dict raises instead of crashing.
* A ``callbacks`` ``on_save`` hook cannot fix saving: it runs after the files are written.

Accelerate, a plain loop (``examples/accelerate_dmuon.py``)::

    accelerator = Accelerator()                         # cpu=True on a CPU-only machine
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)     # -> dmuon.clip_grad_norm_
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Applies as usual: ``prepare`` of dataloaders (per-rank split), optimizers and schedulers;
``backward``; ``accumulate`` / ``no_sync`` / ``sync_gradients``; ``autocast`` and bf16 mixed precision;
``gather`` / ``reduce`` / ``wait_for_everyone`` / ``print`` / logging; ``clip_grad_norm_`` over
``model.parameters()``; ``get_state_dict(model)`` and ``save_model(model, dir)`` (full tensors on the
main process, ``{}`` elsewhere, as for Accelerate's own FSDP). Not supported (``ValueError``):
Accelerate's FSDP / DeepSpeed / Megatron / TP / CP plugins and fp16 on a dmuon model,
``clip_grad_norm_`` over part of a dmuon model, and ``save_state`` / ``load_state`` (they write
rank-0-only optimizer state); checkpoint with dmuon's state-dict functions instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    import accelerate
    import transformers
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dmuon.integrations.hf needs transformers and accelerate ({e}); pip install transformers accelerate"
    ) from e

from .. import checkpoint as _ckpt
from ..runtime.param import is_dedicated
from ..runtime.hooks import STATE_ATTR
from ..accumulate import no_sync as _dmuon_no_sync
from ..clip import clip_grad_norm_ as _dmuon_clip_grad_norm_
from ..optim import Muon

__all__ = ["DMuonTrainer", "install", "uninstall", "is_installed", "dmuon_model_of"]

logger = logging.getLogger("dmuon")

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"


# --------------------------------------------------------------------------------------------------- #
# Small helpers                                                                                        #
# --------------------------------------------------------------------------------------------------- #
def dmuon_model_of(module: Any) -> nn.Module | None:
    """The module ``dedicate_params`` prepared, looking through ``torch.compile`` / DDP-style wrappers;
    ``None`` for any other object (so callers can fall back to the framework's own code path)."""
    seen = 0
    while isinstance(module, nn.Module) and seen < 8:
        if getattr(module, STATE_ATTR, None) is not None:
            return module
        inner = getattr(module, "_orig_mod", None)  # not `or`: a module with __len__ can be falsy
        module = inner if inner is not None else getattr(module, "module", None)
        seen += 1
    return None


def _base_optimizer(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _muon_of(trainer: Trainer, model: nn.Module) -> Muon:
    opt = _base_optimizer(trainer.optimizer)
    if not isinstance(opt, Muon) or opt._dmuon_state is not getattr(model, STATE_ATTR):
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


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _is_distributed():
        dist.barrier()


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on global rank 0, its result (or its exception, re-raised everywhere) on every rank.

    Every rank must agree before a collective load starts, or the ranks that did not fail would wait
    forever for the one that did."""
    if not _is_distributed():
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"dmuon: rank 0 failed: {value}")
    return value


def _rank0_only(value_fn: Callable[[], Any], empty: Any) -> Any:
    """``value_fn()`` on global rank 0 and ``empty`` elsewhere, after rank 0 confirmed it succeeded."""
    result: list[Any] = [empty]

    def run() -> bool:
        result[0] = value_fn()
        return True

    _from_rank0(run)
    return result[0]


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (single or sharded, safetensors or ``.bin``), on CPU."""
    import safetensors.torch

    def index_files(index: str) -> list[str]:
        with open(os.path.join(directory, index), encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))

    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_NAME)):
        return safetensors.torch.load_file(os.path.join(directory, SAFE_WEIGHTS_NAME), device="cpu")
    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)):
        out: dict[str, torch.Tensor] = {}
        for name in index_files(SAFE_WEIGHTS_INDEX_NAME):
            out.update(safetensors.torch.load_file(os.path.join(directory, name), device="cpu"))
        return out
    if os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
        return torch.load(os.path.join(directory, WEIGHTS_NAME), map_location="cpu", weights_only=True)
    if os.path.isfile(os.path.join(directory, WEIGHTS_INDEX_NAME)):
        out = {}
        for name in index_files(WEIGHTS_INDEX_NAME):
            out.update(torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True))
        return out
    raise FileNotFoundError(f"no model weights ({SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or an index) in {directory!r}")


def _fill_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the keys ``save_pretrained`` dropped because they alias another (tied embeddings)."""
    aliases: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():  # the objects only; no data is read
        aliases.setdefault(id(t), []).append(key)
    for keys in aliases.values():
        present = [k for k in keys if k in sd]
        for k in keys:
            if present and k not in sd:
                sd[k] = sd[present[0]]
    return sd


# --------------------------------------------------------------------------------------------------- #
# Trainer behaviour for dmuon models (shared by DMuonTrainer and the patched Trainer)                  #
# --------------------------------------------------------------------------------------------------- #
def _t_move_model_to_device(trainer: Trainer, model: nn.Module, device: torch.device) -> None:
    logger.debug("dmuon: not moving the model to %s; FSDP2 and dmuon placed its tensors already", device)


def _t_create_optimizer(trainer: Trainer, model: nn.Module | None = None) -> torch.optim.Optimizer:
    if trainer.optimizer is None:
        raise ValueError(
            "dmuon: Trainer would build its own optimizer over the dedicated placeholders. Pass "
            "Trainer(..., optimizers=(dmuon.Muon(model, lr=..., adamw_lr=...), None))."
        )
    root = _root_for(trainer, None)
    _muon_of(trainer, root)
    return trainer.optimizer


def _t_clip_grad_norm(trainer: Trainer, model: nn.Module) -> torch.Tensor:
    root = _root_for(trainer, model)
    return _dmuon_clip_grad_norm_(root, trainer.args.max_grad_norm)


def _t_get_grad_norm(trainer: Trainer, model: nn.Module, grad_norm: Any = None) -> Any:
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
    root = _root_for(trainer, None)
    osd = _ckpt.get_optimizer_state_dict(root, _muon_of(trainer, root),
                                         rank0_only=not trainer.args.save_on_each_node)  # collective
    if trainer.args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(osd, os.path.join(output_dir, OPTIMIZER_NAME))
        if trainer.lr_scheduler is not None:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
    _barrier()


def _t_load_from_checkpoint(trainer: Trainer, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    root = _root_for(trainer, model)
    logger.info("dmuon: loading model weights from %s", resume_from_checkpoint)
    sd = _rank0_only(lambda: _fill_tied(root, _read_weights(resume_from_checkpoint)), {})
    _ckpt.set_model_state_dict(root, sd)  # collective; validates keys/shapes first


def _t_load_optimizer_and_scheduler(trainer: Trainer, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    root = _root_for(trainer, None)
    opt = _muon_of(trainer, root)
    opt_file = os.path.join(checkpoint, OPTIMIZER_NAME)
    sched_file = os.path.join(checkpoint, SCHEDULER_NAME)
    # Like Trainer: both files or nothing (``save_only_model`` checkpoints have neither).
    present = _from_rank0(lambda: os.path.isfile(opt_file) and os.path.isfile(sched_file))
    if not present:
        return
    osd = _rank0_only(lambda: torch.load(opt_file, map_location="cpu", weights_only=True), {})
    _ckpt.set_optimizer_state_dict(root, opt, osd)  # collective; restores each group's lr too
    sched = _from_rank0(lambda: torch.load(sched_file, map_location="cpu", weights_only=True))
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(sched)


def _t_load_best_model(trainer: Trainer) -> None:
    logger.info("dmuon: loading the best model from %s", trainer.state.best_model_checkpoint)
    _t_load_from_checkpoint(trainer, trainer.state.best_model_checkpoint)


_TRAINER_IMPLS: dict[str, Callable[..., Any]] = {
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


# --------------------------------------------------------------------------------------------------- #
# Accelerator behaviour for dmuon models                                                               #
# --------------------------------------------------------------------------------------------------- #
def _check_accelerator(acc: Accelerator) -> None:
    """Refuse the Accelerate features that would shard, wrap or skip steps per rank on a dmuon model."""
    problems = []
    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        problems.append(f"Accelerate's {acc.distributed_type.value} plugin (the model is already sharded by "
                        "fully_shard + dmuon; with Trainer pass fsdp='' and no deepspeed config)")
    pc = getattr(acc, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        problems.append("tensor / context parallelism from Accelerate's parallelism_config")
    if acc.mixed_precision == "fp16":
        problems.append("fp16 (GradScaler skips steps per rank; use bf16)")
    if _is_distributed() and acc.num_processes != dist.get_world_size():
        problems.append(
            f"Accelerate runs {acc.num_processes} process(es) but torch.distributed has {dist.get_world_size()} "
            "ranks, so every rank would read the whole dataset and act as the main process; on a CPU-only "
            "machine pass TrainingArguments(use_cpu=True) / Accelerator(cpu=True)"
        )
    if problems:
        raise ValueError("dmuon: this Accelerate setup cannot drive a dmuon model: " + "; ".join(problems) + ".")


def _a_prepare(acc: Accelerator, *args: Any, device_placement: list[bool] | None = None) -> Any:
    if any(dmuon_model_of(a) is not None for a in args):
        _check_accelerator(acc)
    return _ACCEL_ORIGINALS["prepare"](acc, *args, device_placement=device_placement)


def _a_prepare_model(acc: Accelerator, model: nn.Module, device_placement: bool | None = None,
                     evaluation_mode: bool = False) -> nn.Module:
    if dmuon_model_of(model) is None:
        return _ACCEL_ORIGINALS["prepare_model"](acc, model, device_placement, evaluation_mode)
    _check_accelerator(acc)
    # Autocast and torch.compile as configured, no DDP, no device move (what Trainer does for models that
    # were sharded at load time).
    return _ACCEL_ORIGINALS["prepare_model"](acc, model, device_placement=False, evaluation_mode=True)


def _a_clip_grad_norm_(acc: Accelerator, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                       norm_type: float = 2) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    ids = {id(p) for p in params}
    for m in acc._models:
        root = dmuon_model_of(m)
        if root is None:
            continue
        root_params = list(root.parameters())
        root_ids = {id(p) for p in root_params}
        if not ids & root_ids:
            continue
        trainable = {id(p) for p in root_params if p.requires_grad}
        if not trainable <= ids or not ids <= root_ids:
            raise ValueError(
                "dmuon: Accelerator.clip_grad_norm_ on a dmuon model needs exactly model.parameters(); "
                "the norm of a subset (or of several models) is not supported."
            )
        return _dmuon_clip_grad_norm_(root, max_norm, norm_type)
    if any(is_dedicated(p) for p in params):
        raise ValueError(
            "dmuon: these parameters belong to a dmuon model Accelerate did not prepare; pass the model to "
            "accelerator.prepare(...) or call dmuon.clip_grad_norm_(model, max_norm)."
        )
    return _ACCEL_ORIGINALS["clip_grad_norm_"](acc, params, max_norm, norm_type)


@contextlib.contextmanager
def _a_no_sync(acc: Accelerator, model: nn.Module) -> Iterator[None]:
    root = dmuon_model_of(model)
    if root is None:
        with _ACCEL_ORIGINALS["no_sync"](acc, model):
            yield
        return
    with _dmuon_no_sync(root):
        yield


def _a_get_state_dict(acc: Accelerator, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
    root = dmuon_model_of(model)
    if root is None:
        return _ACCEL_ORIGINALS["get_state_dict"](acc, model, unwrap)
    # Full tensors on the main process, {} elsewhere: what Accelerate's FSDP full state dict gives.
    return _ckpt.get_model_state_dict(root, rank0_only=True)


def _refuse_state(name: str) -> Callable[..., Any]:
    def method(acc: Accelerator, *args: Any, **kwargs: Any) -> Any:
        if any(dmuon_model_of(m) is not None for m in acc._models):
            raise ValueError(
                f"dmuon: Accelerator.{name} saves or loads optimizer state on the main process only, which "
                "loses dmuon's per-owner Muon state. Use dmuon.get/set_model_state_dict and "
                "dmuon.get/set_optimizer_state_dict (see the README's Checkpoints section)."
            )
        return _ACCEL_ORIGINALS[name](acc, *args, **kwargs)

    method.__name__ = name
    return method


_ACCEL_IMPLS: dict[str, Callable[..., Any]] = {
    "prepare": _a_prepare,
    "prepare_model": _a_prepare_model,
    "clip_grad_norm_": _a_clip_grad_norm_,
    "no_sync": _a_no_sync,
    "get_state_dict": _a_get_state_dict,
    "save_state": _refuse_state("save_state"),
    "load_state": _refuse_state("load_state"),
}


# --------------------------------------------------------------------------------------------------- #
# Installation                                                                                         #
# --------------------------------------------------------------------------------------------------- #
_TRAINER_ORIGINALS: dict[str, Callable[..., Any]] = {}
_ACCEL_ORIGINALS: dict[str, Callable[..., Any]] = {}
_MARK = "__dmuon_hf__"


def _trainer_dispatch(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    impl = _TRAINER_IMPLS[name]

    @functools.wraps(original)
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if dmuon_model_of(getattr(self, "model", None)) is not None:
            return impl(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(method, _MARK, True)
    return method


def _accel_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    impl = _ACCEL_IMPLS[name]
    wrapped = functools.wraps(original)(lambda self, *a, **k: impl(self, *a, **k))
    setattr(wrapped, _MARK, True)
    return wrapped


def is_installed() -> bool:
    """Whether ``Trainer`` and ``Accelerator`` currently carry dmuon's glue."""
    return bool(_TRAINER_ORIGINALS) and getattr(Trainer.save_model, _MARK, False)


def install() -> None:
    """Teach ``transformers.Trainer`` and ``accelerate.Accelerator`` about dmuon models (idempotent).

    Importing this module calls it. Only models prepared by :func:`dmuon.dedicate_params` see a change;
    a subclass's own overrides of these methods still take precedence (``super()`` reaches dmuon's).
    Raises ``RuntimeError`` if this transformers / accelerate lacks a method the glue relies on.
    """
    if is_installed():
        return
    missing = [f"transformers.Trainer.{n}" for n in _TRAINER_IMPLS if not callable(getattr(Trainer, n, None))]
    missing += [f"accelerate.Accelerator.{n}" for n in _ACCEL_IMPLS if not callable(getattr(Accelerator, n, None))]
    if missing:
        raise RuntimeError(
            f"dmuon.integrations.hf supports transformers 5.x / accelerate 1.x (checked 5.24 / 1.15); "
            f"transformers {transformers.__version__} / accelerate {accelerate.__version__} lack: {', '.join(missing)}."
        )
    for name in _TRAINER_IMPLS:
        _TRAINER_ORIGINALS[name] = getattr(Trainer, name)
        setattr(Trainer, name, _trainer_dispatch(name, _TRAINER_ORIGINALS[name]))
    for name in _ACCEL_IMPLS:
        _ACCEL_ORIGINALS[name] = getattr(Accelerator, name)
        # no_sync is a generator-based context manager on Accelerator; ours is one too.
        setattr(Accelerator, name, _accel_wrapper(name, _ACCEL_ORIGINALS[name]))


def uninstall() -> None:
    """Restore the original ``Trainer`` / ``Accelerator`` methods (mainly for tests)."""
    for name, fn in _TRAINER_ORIGINALS.items():
        setattr(Trainer, name, fn)
    for name, fn in _ACCEL_ORIGINALS.items():
        setattr(Accelerator, name, fn)
    _TRAINER_ORIGINALS.clear()
    _ACCEL_ORIGINALS.clear()


# --------------------------------------------------------------------------------------------------- #
# DMuonTrainer                                                                                         #
# --------------------------------------------------------------------------------------------------- #
class DMuonTrainer(Trainer):
    """``transformers.Trainer`` for a model prepared by ``dmuon.dedicate_params`` + ``fully_shard``.

    A drop-in replacement: same arguments, pass ``optimizers=(dmuon.Muon(model, ...), scheduler_or_None)``
    and ``fsdp=""``. It makes the dmuon behaviour explicit in the class (the same code the installed glue
    gives a plain ``Trainer``): no ``model.to``, no DDP, clipping by :func:`dmuon.clip_grad_norm_`,
    gradient accumulation under :func:`dmuon.no_sync`, and checkpoints gathered on every rank with dmuon's
    state-dict functions and written by the writer ranks -- ``save_pretrained`` weights + config,
    ``optimizer.pt``, ``scheduler.pt`` -- from which ``train(resume_from_checkpoint=...)`` resumes.
    For any other model it behaves exactly like ``Trainer``.

    Example::

        trainer = DMuonTrainer(model=model, args=args, train_dataset=ds, optimizers=(optimizer, None))
        trainer.train()
        trainer.save_model("final")          # on every rank; AutoModelForCausalLM.from_pretrained("final")
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install()  # Accelerator.prepare_model / no_sync / clip_grad_norm_ for the accelerator Trainer builds
        super().__init__(*args, **kwargs)

    def _uses_dmuon(self) -> bool:
        return dmuon_model_of(getattr(self, "model", None)) is not None

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if self._uses_dmuon():
            return _t_move_model_to_device(self, model, device)
        return super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self._uses_dmuon():
            return _t_create_optimizer(self, model)
        return super().create_optimizer(model)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self._uses_dmuon():
            return _t_clip_grad_norm(self, model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self._uses_dmuon():
            return _t_get_grad_norm(self, model, grad_norm)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save a ``from_pretrained``-loadable model directory. Collective: call it on every rank."""
        if self._uses_dmuon():
            return _t_save_model(self, output_dir, _internal_call)
        return super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._uses_dmuon() and state_dict is None:
            _t_save_guard(self, output_dir, state_dict)  # raises
        return super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._uses_dmuon():
            return _t_save_optimizer_and_scheduler(self, output_dir)
        return super()._save_optimizer_and_scheduler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self._uses_dmuon():
            return _t_load_from_checkpoint(self, resume_from_checkpoint, model)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._uses_dmuon():
            return _t_load_optimizer_and_scheduler(self, checkpoint)
        return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        if self._uses_dmuon():
            return _t_load_best_model(self)
        return super()._load_best_model()


install()
