"""What dmuon asks of the FSDP2 modules in a model: which they are, and what their mixed-precision
policies cast to. (The patch that makes ``fully_shard`` skip dedicated params is ``_patch.py``.)"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["FSDPModule", "fsdp_modules", "cast_dtypes"]


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` wrapped (the root included), in module order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def cast_dtypes(model: nn.Module) -> dict[str, torch.dtype] | None:
    """``{module path: dtype}`` for every FSDP2 module whose ``MixedPrecisionPolicy`` casts its forward
    inputs to a ``param_dtype``; ``None`` when this torch's FSDP2 keeps the policy elsewhere (the state
    object and its ``_mp_policy`` are private, so a torch that moved them leaves nothing to check)."""
    out: dict[str, torch.dtype] = {}
    for path, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            policy = m._get_fsdp_state()._mp_policy  # type: ignore[operator]
        except AttributeError:
            return None
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            out[path] = policy.param_dtype
    return out
