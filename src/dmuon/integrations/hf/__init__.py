"""HuggingFace ``Trainer`` and Accelerate for models prepared by dmuon (``dedicate_params`` + ``fully_shard``).

Importing this package installs the glue (the way ``import dmuon`` installs the FSDP2 patch); it only
changes what ``transformers.Trainer`` and ``accelerate.Accelerator`` do to a *dmuon model* (a module
that went through :func:`dmuon.dedicate_params`, possibly wrapped by ``torch.compile``); every other
model takes the unchanged code path. Needs transformers 5.x and accelerate 1.x (checked: 5.24, 1.15).

Trainer (docs/guides/hf-trainer.md has the whole script)::

    import dmuon
    from dmuon.integrations.hf import DMuonTrainer      # or plain Trainer once this package is imported

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

What Trainer / Accelerate do to such a model, and what this package does about it:

* ``Trainer.__init__`` moves the model to ``args.device`` (``model.to``). A non-owner's dedicated
  param is a 0-byte placeholder; wherever ``.to`` copies (``cpu`` -> ``cpu:0`` on CPU) the process
  crashes. **Skipped**: FSDP2 and dmuon already placed every tensor.
* ``Accelerator.prepare_model`` wraps a multi-process model in DDP (DTensor params: an error; plain
  params: DDP would broadcast the placeholders). **Replaced** by its ``evaluation_mode`` branch, the
  one Trainer itself uses for models sharded at load time: mixed-precision autocast and
  ``torch.compile`` as configured, no DDP, no device move. Accelerate's own FSDP / TP / CP plugins and
  fp16 (its ``GradScaler`` decides inf-skips per rank, so ranks could disagree) are refused with a
  ``ValueError``; use ``fsdp=""`` and bf16.
* DeepSpeed (``TrainingArguments(deepspeed=...)``, Accelerate's DeepSpeed plugin): ``deepspeed.initialize``
  takes the model (``dmuon.integrations.deepspeed`` joined it), and Trainer's and Accelerate's own DeepSpeed
  code paths run: the engine's accumulation, clipping, fp16 and ``save_checkpoint`` / ``load_checkpoint``.
  What changes: Trainer's DeepSpeed set-up drops ``optimizers=`` and asks ``create_optimizer`` again, which
  **returns** the ``dmuon.Muon`` given (or builds one from ``optimizer_cls_and_kwargs=(dmuon.Muon, {...})``),
  never AdamW; and its scheduler is **built** on that ``dmuon.Muon`` rather than on DeepSpeed's optimizer
  (whose groups are ZeRO's only), so Muon's groups follow the schedule too.
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
  Resuming (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``): Trainer loads the weights and
  the optimizer at two hooks; the first only **notes** the checkpoint, the second has rank 0 read every file,
  checks weights and optimizer dict together (:func:`dmuon.set_state_dict`: every rank agrees, or nothing
  changes) and then writes model, optimizer and scheduler. A checkpoint with only one of ``optimizer.pt``
  and ``scheduler.pt`` is **refused**; ``train(..., resume_optimizer_state=False)`` resumes on purpose without
  optimizer state. ``_load_best_model`` loads the weights with :func:`dmuon.set_model_state_dict`.
  ``Trainer._save`` without a gathered state dict raises instead of crashing.
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
Accelerate's FSDP / Megatron / TP / CP plugins and fp16 on a dmuon model (its DeepSpeed plugin and
DeepSpeed's fp16 are: docs/guides/deepspeed.md), ``clip_grad_norm_`` over part of a dmuon model, and
``save_state`` / ``load_state`` outside DeepSpeed (they write rank-0-only optimizer state); checkpoint with
dmuon's state-dict functions instead.

The package: ``trainer.py`` (the Trainer methods), ``accelerator.py`` (the Accelerator methods),
``_model.py`` (:func:`dmuon_model_of`), ``_ranks.py`` (rank 0 acts, every rank learns the outcome),
``_files.py`` (checkpoint file names, reading ``save_pretrained`` weights); this ``__init__``
installs the methods and defines :class:`DMuonTrainer`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

try:
    import accelerate
    import transformers
    from accelerate import Accelerator
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dmuon.integrations.hf needs transformers and accelerate ({e}); pip install transformers accelerate"
    ) from e

from ._model import dmuon_model_of, matrix_blocks
from .qk_clip import QK_CLIP_ATTENTION, use_qk_clip_attention
from .accelerator import _ACCEL_IMPLS, _ACCEL_ORIGINALS
from .trainer import (
    _TRAINER_IMPLS,
    _TRAINER_ORIGINALS,
    _t_clip_grad_norm,
    _t_create_optimizer,
    _t_create_scheduler,
    _t_get_grad_norm,
    _t_load_best_model,
    _t_load_from_checkpoint,
    _t_load_optimizer_and_scheduler,
    _t_move_model_to_device,
    _t_save_guard,
    _t_save_model,
    _t_save_optimizer_and_scheduler,
    _t_train,
)

__all__ = ["DMuonTrainer", "install", "uninstall", "is_installed", "dmuon_model_of", "matrix_blocks",
           "use_qk_clip_attention", "QK_CLIP_ATTENTION"]


# --------------------------------------------------------------------------------------------------- #
# Installation                                                                                         #
# --------------------------------------------------------------------------------------------------- #
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

    Importing this package calls it. Only models prepared by :func:`dmuon.dedicate_params` see a change;
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

    def train(self, *args: Any, resume_optimizer_state: bool = True, **kwargs: Any) -> Any:
        """``Trainer.train``. Resuming (``resume_from_checkpoint=...``) checks the weights, ``optimizer.pt`` and
        ``scheduler.pt`` together before writing any of them, and refuses a checkpoint with only one of the two
        files. ``resume_optimizer_state=False`` resumes on purpose without optimizer state: the weights and
        the schedule (its learning rates too), with fresh Muon momentum and AdamW moments.

        Example::

            trainer.train(resume_from_checkpoint=True)                 # the last checkpoint in output_dir
            trainer.train(resume_from_checkpoint="out/checkpoint-500", resume_optimizer_state=False)
        """
        if self._uses_dmuon():
            return _t_train(self, *args, resume_optimizer_state=resume_optimizer_state, **kwargs)
        if resume_optimizer_state is not True:
            raise TypeError("dmuon: train(resume_optimizer_state=...) applies to models prepared by "
                            "dmuon.dedicate_params; this model is not one, so drop the argument.")
        return super().train(*args, **kwargs)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if self._uses_dmuon():
            return _t_move_model_to_device(self, model, device)
        return super()._move_model_to_device(model, device)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self._uses_dmuon():
            return _t_create_optimizer(self, model)
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self._uses_dmuon():
            return _t_create_scheduler(self, num_training_steps, optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

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
