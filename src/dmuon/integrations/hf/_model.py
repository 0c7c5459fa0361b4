"""Which objects are dmuon models: the test every Trainer / Accelerator replacement dispatches on."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...runtime.hooks import STATE_ATTR


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
