"""The settings ``dedicate_params`` fixes for one model, stored once and never changed.

Every part of the runtime reads them from here (the model's :class:`~dmuon.runtime.hooks.DMuonState`
holds the one instance) instead of keeping its own copy, so a setting cannot be read from a stale
duplicate. They must be equal on every rank: ``dedicate_params`` puts them in the plan fingerprint it
compares across ranks before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .precision import check_float_dtype

__all__ = ["RuntimeConfig"]


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """What ``dedicate_params`` was asked for (see its docstring for each one's effect).

    Attributes:
        reshard_after_forward: ``True`` (Z3) frees non-owner copies after forward and broadcasts again
            before backward; ``False`` (Z2) keeps them from forward to backward.
        prefetch: issue the broadcast of the boundary expected next before waiting for the current one
            (see [Note: prefetch] in ``dmuon/runtime/prefetch.py``).
        param_dtype: the compute dtype of the dedicated params (``None``: each param's own dtype).
        reduce_dtype: the dtype gradients are averaged in (``None``: each bucket's compute dtype).
    """

    reshard_after_forward: bool = True
    prefetch: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("reshard_after_forward", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"dmuon.dedicate_params: {name} must be True or False, got {getattr(self, name)!r}")
        check_float_dtype("dmuon.dedicate_params: param_dtype", self.param_dtype)
        check_float_dtype("dmuon.dedicate_params: reduce_dtype", self.reduce_dtype)

    def fingerprint(self) -> str:
        """A string equal on two ranks exactly when their settings are."""
        return repr((self.reshard_after_forward, self.prefetch, str(self.param_dtype), str(self.reduce_dtype)))
