"""Mixed-precision helpers: dtype checks and the master-weight rule. Pure, no distributed code.

[Note: master weights]
A master is a wider copy (e.g. fp32) of a lower-precision parameter (e.g. bf16) that the optimizer
updates instead of the parameter, rounding the result back into it after every step. Two kinds exist:

* ``dedicate_params(param_dtype=...)``: the parameter's own value stays in its own dtype on the owner
  (``DedicatedParam.master``); the ``nn.Parameter`` is the compute copy. Model state dicts hold it.
* ``dmuon.Muon(master_dtype=...)`` on a lower-precision model: optimizer state ``"master"``, created from
  the parameter at the first step (like ``momentum_buffer``), in optimizer state dicts.

In both cases the parameter is the authority: a master only carries the bits below the parameter's
precision. Whatever writes the parameter directly (``set_model_state_dict`` alone, a manual edit
followed by ``broadcast_all_updates``, an init after ``dedicate_params``) wins: the master restarts from
it (:func:`refresh_master_`) instead of silently undoing the write at the next step. The check is
skipped while the parameter's version counter shows no write since master and parameter last agreed,
so it costs nothing per step; a write that bypasses the counter (``param.data.copy_(...)``) is not
seen.
"""

from __future__ import annotations

import torch

__all__ = ["is_wider", "check_float_dtype", "refresh_master_"]


def is_wider(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether floating dtype ``a`` has more bits than ``b`` (float32 over bfloat16; not bf16 over fp16)."""
    return torch.finfo(a).bits > torch.finfo(b).bits


def check_float_dtype(what: str, value: object) -> None:
    """``None`` or a floating-point ``torch.dtype``; a ``TypeError``/``ValueError`` naming ``what`` otherwise."""
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype such as torch.float32 (or None), got {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"{what} must be a floating-point dtype (torch.float32, torch.bfloat16, ...), got {value}")


@torch.no_grad()
def refresh_master_(master: torch.Tensor, param: torch.Tensor, seen_version: int | None = None) -> int:
    """``master <- param`` unless ``param`` is exactly ``master`` rounded to ``param``'s dtype, in place and
    without a host sync. See [Note: master weights].

    ``seen_version`` is ``param._version`` when master and param last agreed: if the parameter's version
    counter has not moved since, nothing wrote it through the parameter and the element-wise check (two
    extra passes over the master every step) is skipped. Returns the version to remember.
    """
    if seen_version is None or param._version != seen_version:
        stale = (master.to(param.dtype) != param).any()
        master.copy_(torch.where(stale, param.to(master.dtype), master))
    return param._version
