"""What ``deepspeed.initialize`` must not be given with a dmuon model: checked on every rank, agreed in one gather,
raised on every rank together, before DeepSpeed changes anything."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...optim import Muon
from ...runtime import comm as C
from ...runtime.hooks import DMuonState
from ._part import engine_groups

__all__ = ["problems", "agree", "agreed", "offload_device", "uses_cpu_adam"]


def _dtype(config: Any) -> torch.dtype | None:
    """The dtype DeepSpeed casts every param to (``fp16`` / ``bf16`` enabled), else ``None`` (none cast)."""
    if config.float16_config.enabled:
        return torch.float16
    if config.bfloat16_config.enabled:
        return torch.bfloat16
    return None


def offload_device(config: Any) -> str | None:
    """Where the config offloads ZeRO's optimizer (``"cpu"``, ``"nvme"``), ``None`` where it does not."""
    offload = getattr(config.zero_config, "offload_optimizer", None)
    device = str(getattr(getattr(offload, "device", None), "value", getattr(offload, "device", "none"))).lower()
    return None if offload is None or device in ("none", "offloaddeviceenum.none") else device


def uses_cpu_adam(config: Any) -> bool:
    """Whether ZeRO gets DeepSpeed's ``DeepSpeedCPUAdam``: DeepSpeed requires it for an offloaded optimizer unless
    the config sets ``"zero_force_ds_cpu_optimizer": false`` (then torch's ``AdamW`` steps the CPU slices)."""
    return offload_device(config) == "cpu" and bool(getattr(config, "zero_force_ds_cpu_optimizer", True))


def _optimizer_problem(state: DMuonState, optimizer: Any, model_parameters: Any) -> str | None:
    """An optimizer other than the model's ``dmuon.Muon`` puts dedicated params into DeepSpeed's groups."""
    if isinstance(optimizer, Muon) and optimizer.runtime is state:
        if getattr(optimizer, "_deepspeed_drive", None) is not None:
            return ("this dmuon.Muon was already handed to deepspeed.initialize; build a new one for a new engine "
                    "(dmuon.Muon(model, ...))")
        if not any(g["params"] for g in optimizer.param_groups if g["kind"] in ("adamw", "adamw_replicated")):
            return ("every trainable param is dedicated, so ZeRO would get no param group (DeepSpeed needs one); "
                    "leave some params (norms, the embedding) out of dmuon.dedicate_params")
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        where = f"optimizer={type(optimizer).__name__}"
        params = [p for g in optimizer.param_groups for p in g["params"]]
    else:  # None (the config's "optimizer" section) or a callable: both over model_parameters or every param
        where = ("the config's 'optimizer' section" if optimizer is None else "the optimizer callable") + (
            " over model_parameters" if model_parameters is not None else " over model.parameters()")
        params = list(model_parameters) if model_parameters is not None else list(state.model.parameters())
        params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    ids = {id(p) for p in params}
    inside = [dp.fqn for dp in state.dedicated() if id(dp.bound()) in ids]
    if inside:
        return (f"dedicated param {inside[0]!r} is inside a DeepSpeed optimizer group ({where}), so ZeRO would "
                "average and step it as well. Pass optimizer=dmuon.Muon(model, ...): it hands DeepSpeed the other "
                "params only")
    return (f"{where} holds none of the dedicated params, so nothing would train them. Pass "
            "optimizer=dmuon.Muon(model, ...)")


def problems(state: DMuonState, optimizer: Any, model_parameters: Any, config: Any) -> list[str]:
    """Everything about this ``deepspeed.initialize`` call dmuon cannot train, each with its fix (this rank)."""
    out = []
    stage = int(config.zero_optimization_stage)
    if stage not in (0, 1, 2, 3):
        out.append(f"zero_optimization.stage is {stage}; dmuon supports DeepSpeed ZeRO stage 0, 1, 2 and 3")
    dtype = _dtype(config)
    if stage == 0 and dtype is not None:
        out.append(f"ZeRO stage 0 in {dtype} runs DeepSpeed's FP16_UnfusedOptimizer, whose norm and overflow check "
                   "dmuon does not join: use ZeRO stage 1 or 2 for bf16 / fp16, or train stage 0 in fp32")
    found = _optimizer_problem(state, optimizer, model_parameters)
    if found is not None:
        out.append(found)
    wrong = [dp for dp in state.dedicated() if dtype is not None and dp.compute_dtype != dtype]
    if wrong:
        out.append(f"the config trains in {dtype} but dedicated param {wrong[0].fqn!r} computes in "
                   f"{wrong[0].compute_dtype}: cast the model before dmuon.dedicate_params (model.to({dtype})), and "
                   "give dmuon.Muon master_dtype=torch.float32 for fp32 Muon state")
    zero = config.zero_config
    if getattr(zero, "elastic_checkpoint", False):
        out.append("zero_optimization.elastic_checkpoint saves ZeRO's AdamW state without the optimizer's own state "
                   "dict, so the owners' Muon state would not be saved; remove it (resume on another world size "
                   "through dmuon's full state dicts)")
    if offload_device(config) not in (None, "cpu"):
        out.append(f"zero_optimization.offload_optimizer.device {offload_device(config)!r} is not supported with "
                   "dmuon: ZeRO-Infinity swaps its optimizer state to files that dmuon's state dicts and checkpoint "
                   "checks do not read; offload to \"cpu\", or remove it")
    engine_lrs = [g["lr"] for g in engine_groups(optimizer)] if isinstance(optimizer, Muon) else [1.0]
    if config.scheduler_name is not None and engine_lrs and not engine_lrs[0]:
        out.append(f"the config's scheduler {config.scheduler_name!r} sets the lr of the params ZeRO trains, and "
                   "dmuon's groups follow it at their lr's ratio to the first of those groups, whose lr (adamw_lr) "
                   "is 0: give dmuon.Muon a nonzero adamw_lr, or build a torch scheduler on dmuon.Muon and pass "
                   "deepspeed.initialize(..., lr_scheduler=scheduler)")
    if state.tp_mesh is not None or state.sharded_muon or state.ctx.replicate_size > 1:
        out.append("dmuon's tensor-parallel, engine-sharded (muon_sharded) and HSDP params need FSDP2; under "
                   "DeepSpeed dedicate with a 1-D mesh over every rank")
    return out


def agreed(mine: list[str]) -> str | None:
    """One gather over the default group: every rank's problems, listed once where every rank found the same
    (``None``: no rank found any). The same on every rank, so all raise together."""
    views = C.all_gather_default((dist.get_rank(), mine))
    found = [(r, p) for r, ps in views for p in ps]  # type: ignore[misc]
    if not found:
        return None
    first: list[str] = views[0][1]  # type: ignore[index]
    same = all(ps == first for _, ps in views)  # type: ignore[misc]
    return "; ".join(first) if same else "; ".join(f"rank {r}: {p}" for r, p in found)


def agree(mine: list[str]) -> None:
    """:func:`agreed` for ``deepspeed.initialize``: if any rank found a problem, every rank raises the same error."""
    listed = agreed(mine)
    if listed is not None:
        raise ValueError(f"dmuon: deepspeed.initialize refused for this dmuon model: {listed}. Nothing was changed.")
