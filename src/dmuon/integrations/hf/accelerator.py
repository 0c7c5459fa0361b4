"""The ``Accelerator`` methods of a dmuon model: ``prepare`` without DDP, dmuon's ``no_sync`` and clipping,
a full state dict, and refusals of the setups and state functions that cannot work on it.

``_ACCEL_IMPLS`` maps the method names to them; ``dmuon.integrations.hf.install`` patches them in and
keeps Accelerate's own methods in ``_ACCEL_ORIGINALS``, through which each one serves any other model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ... import checkpoint as _ckpt
from ...runtime.param import is_dedicated
from ...accumulate import no_sync as _dmuon_no_sync
from ...clip import clip_grad_norm_ as _dmuon_clip_grad_norm_
from ._model import dmuon_model_of
from ._ranks import _is_distributed

#: ``Accelerator``'s own methods, filled by ``install()``.
_ACCEL_ORIGINALS: dict[str, Callable[..., Any]] = {}


def _deepspeed(acc: Accelerator) -> bool:
    """Whether Accelerate's DeepSpeed plugin runs: ``deepspeed.initialize`` (which dmuon joined) then wraps the
    model, and Accelerate's own DeepSpeed code paths (no_sync, clipping, state) apply unchanged."""
    return acc.distributed_type == DistributedType.DEEPSPEED


def _check_accelerator(acc: Accelerator) -> None:
    """Refuse the Accelerate features that would shard, wrap or skip steps per rank on a dmuon model."""
    problems = []
    if acc.distributed_type in (DistributedType.FSDP, DistributedType.MEGATRON_LM):
        problems.append(f"Accelerate's {acc.distributed_type.value} plugin (the model is already sharded by "
                        "fully_shard + dmuon; with Trainer pass fsdp='')")
    pc = getattr(acc, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        problems.append("tensor / context parallelism from Accelerate's parallelism_config")
    if acc.mixed_precision == "fp16" and not _deepspeed(acc):  # DeepSpeed's loss scaler decides for every rank
        problems.append("fp16 (GradScaler skips steps per rank; use bf16, or DeepSpeed's fp16)")
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
    if dmuon_model_of(model) is None or _deepspeed(acc):
        return _ACCEL_ORIGINALS["prepare_model"](acc, model, device_placement, evaluation_mode)
    _check_accelerator(acc)
    # Autocast and torch.compile as configured, no DDP, no device move (what Trainer does for models that
    # were sharded at load time).
    return _ACCEL_ORIGINALS["prepare_model"](acc, model, device_placement=False, evaluation_mode=True)


def _a_clip_grad_norm_(acc: Accelerator, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                       norm_type: float = 2) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if _deepspeed(acc):  # DeepSpeed clipped in engine.step(); this returns the norm it used
        return _ACCEL_ORIGINALS["clip_grad_norm_"](acc, params, max_norm, norm_type)
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
    if root is None or _deepspeed(acc):  # DeepSpeed's boundary decides, and dmuon follows it
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
        if not _deepspeed(acc) and any(dmuon_model_of(m) is not None for m in acc._models):
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
