"""A model and its optimizer as one checkpoint: ``{"model": ..., "optim": ...}``, checked as a whole before
either is written. See ``dmuon/checkpoint/__init__.py`` and [Note: staged loads] in ``_common.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .model import apply_model_sd, check_model_sd, get_model_state_dict
from .optimizer import apply_optim_sd, check_optim_sd, get_optimizer_state_dict

__all__ = ["get_state_dict", "set_state_dict"]

#: the entries of a combined dict
PARTS = ("model", "optim")


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, cpu_offload: bool = True, rank0_only: bool = False,
    sharded: bool = False, staged: bool = False,
) -> dict[str, Any]:
    """``{"model": get_model_state_dict(...), "optim": get_optimizer_state_dict(...)}`` with these options.
    Collective.

    Full (default): whole tensors, for ``torch.save``. ``sharded=True``: for ``dcp.save``, the live tensors
    (nothing copied). ``sharded=True, staged=True``: the target for ``dcp.load``, made of copies (on the CPU
    unless ``cpu_offload=False``), so that nothing changes until :func:`set_state_dict` has checked the
    checkpoint. ``rank0_only=True``: the other ranks get ``{"model": {}, "optim": {}}``.

    Example::

        dcp.save(dmuon.get_state_dict(model, optimizer, sharded=True), checkpoint_id="ckpt/")

        sd = dmuon.get_state_dict(model, optimizer, sharded=True, staged=True)
        dcp.load(sd, checkpoint_id="ckpt/")
        dmuon.set_state_dict(model, optimizer, sd)   # refused (nothing changed) or loaded
    """
    options: dict[str, Any] = dict(cpu_offload=cpu_offload, rank0_only=rank0_only, sharded=sharded, staged=staged)
    return {"model": get_model_state_dict(model, **options),
            "optim": get_optimizer_state_dict(model, optimizer, **options)}


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a dict of :func:`get_state_dict`'s form (full or sharded) into the model and its optimizer, as
    one unit. Collective.

    Both halves go through every check of :func:`set_model_state_dict` and
    :func:`set_optimizer_state_dict` (keys, shapes, dtypes, param groups, checksums; every rank raises the
    same ``ValueError`` together) before either is written, so a checkpoint refused in either half leaves
    the model and the optimizer as they were. Pass the same dict on every rank, or the dict on rank 0 and
    ``{}`` elsewhere; entries other than ``"model"`` and ``"optim"`` (a scheduler's, a step counter) are
    ignored. A sharded dict must be the ``staged=True`` one that ``dcp.load`` filled.

    Example::

        ckpt = torch.load("checkpoint.pt", map_location="cpu") if dist.get_rank() == 0 else {}
        dmuon.set_state_dict(model, optimizer, ckpt)
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dmuon.set_state_dict: expected a mapping, got {type(state_dict).__name__}")
    missing = [k for k in PARTS if k not in state_dict] if state_dict else []
    problem = (f"expected a dict with {' and '.join(map(repr, PARTS))} entries (dmuon.get_state_dict's form), got "
               f"keys {sorted(map(str, state_dict))}",) if missing else ()
    model_sd, optim_sd = ({} if missing else state_dict.get(k, {}) for k in PARTS)
    checked_model = check_model_sd(model, model_sd, what="set_state_dict ('model')", problems=problem)
    checked_optim = check_optim_sd(model, optimizer, optim_sd, what="set_state_dict ('optim')")
    apply_model_sd(checked_model)
    apply_optim_sd(checked_optim)
