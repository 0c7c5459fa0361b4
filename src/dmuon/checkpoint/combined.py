"""A model and its optimizer as one checkpoint: ``{"model": ..., "optim": ...}``, checked as a whole before
either is written. See ``dmuon/checkpoint/__init__.py`` and [Note: staged loads] in ``_common.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from .model import apply_model_sd, check_model_sd, get_model_state_dict
from .optimizer import apply_optim_sd, check_optim_sd, get_optimizer_state_dict

__all__ = ["get_state_dict", "set_state_dict"]

#: the entries of a combined dict
PARTS = ("model", "optim")

Models = nn.Module | Sequence[nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def part_key(k: int) -> str:
    """The entry of the ``k``-th stage module's dict when a rank holds several (see :func:`get_state_dict`)."""
    return f"part{k}"


def _pairs(model: Models, optimizer: Optimizers, what: str) -> list[tuple[nn.Module, torch.optim.Optimizer]] | None:
    """``None`` for one model and its optimizer; for lists (a rank's stage modules under an interleaved pipeline
    schedule) the pairs, checked before anything runs (every rank holds as many modules: every rank agrees)."""
    if isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.Optimizer):
        return None
    if isinstance(model, nn.Module) or isinstance(optimizer, torch.optim.Optimizer) or len(model) != len(optimizer):
        n = lambda x: "1" if isinstance(x, (nn.Module, torch.optim.Optimizer)) else str(len(x))  # noqa: E731
        raise TypeError(
            f"dmuon.{what}: {n(model)} model(s) and {n(optimizer)} optimizer(s); pass one model and its optimizer, "
            "or the rank's list of stage modules and the list of their optimizers, in the same order.")
    return list(zip(model, optimizer))


def get_state_dict(
    model: Models, optimizer: Optimizers, *, cpu_offload: bool = True, rank0_only: bool = False,
    sharded: bool = False, staged: bool = False,
) -> dict[str, Any]:
    """``{"model": get_model_state_dict(...), "optim": get_optimizer_state_dict(...)}`` with these options.
    Collective.

    Full (default): whole tensors, for ``torch.save``. ``sharded=True``: for ``dcp.save``, the live tensors
    (nothing copied). ``sharded=True, staged=True``: the target for ``dcp.load``, made of copies (on the CPU
    unless ``cpu_offload=False``), so that nothing changes until :func:`set_state_dict` has checked the
    checkpoint. ``rank0_only=True``: the other ranks get ``{"model": {}, "optim": {}}``.

    With several stage modules per rank (interleaved pipeline schedules), pass the rank's list of modules and
    the list of their optimizers: ``{"part0": {"model": ..., "optim": ...}, "part1": ...}``, the k-th module's
    dict under ``"part{k}"``, one dict for one ``dcp.save`` (each module's optimizer entries apart). Every rank
    passes its modules in the same order, as it built them.

    Example::

        dcp.save(dmuon.get_state_dict(model, optimizer, sharded=True), checkpoint_id="ckpt/")

        sd = dmuon.get_state_dict(model, optimizer, sharded=True, staged=True)
        dcp.load(sd, checkpoint_id="ckpt/")
        dmuon.set_state_dict(model, optimizer, sd)   # refused (nothing changed) or loaded
    """
    options: dict[str, Any] = dict(cpu_offload=cpu_offload, rank0_only=rank0_only, sharded=sharded, staged=staged)
    pairs = _pairs(model, optimizer, "get_state_dict")
    if pairs is not None:
        return {part_key(k): get_state_dict(m, o, **options) for k, (m, o) in enumerate(pairs)}
    return {"model": get_model_state_dict(model, **options),  # type: ignore[arg-type]
            "optim": get_optimizer_state_dict(model, optimizer, **options)}  # type: ignore[arg-type]


def set_state_dict(model: Models, optimizer: Optimizers, state_dict: Mapping[str, Any]) -> None:
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

    With lists of stage modules and their optimizers (the dict :func:`get_state_dict` gave for them), every
    module's halves are checked, in order, before any module is written: a checkpoint refused for one module
    leaves every module and optimizer as it was.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dmuon.set_state_dict: expected a mapping, got {type(state_dict).__name__}")
    pairs = _pairs(model, optimizer, "set_state_dict")
    if pairs is None:
        checked = [_check(model, optimizer, state_dict, "")]  # type: ignore[arg-type]
    else:
        checked = []
        for k, (m, o) in enumerate(pairs):  # the k-th module of every rank at the same time: collectives agree
            key = part_key(k)
            sub = state_dict.get(key) if state_dict else {}
            bad = not isinstance(sub, Mapping)
            problem = (f"expected a {key!r} entry holding the {k}-th stage module's dict (dmuon.get_state_dict over "
                       f"the rank's list of modules), got keys {sorted(map(str, state_dict))}",) if bad else ()
            checked.append(_check(m, o, {} if bad else sub, f" {key!r}", problem))
    for checked_model, checked_optim in checked:
        apply_model_sd(checked_model)
        apply_optim_sd(checked_optim)


def _check(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], where: str,
           problem: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """Both halves of one model's combined dict checked (collective; every rank raises together), nothing
    written."""
    missing = [k for k in PARTS if k not in state_dict] if state_dict and not problem else []
    if missing:
        problem = (f"expected a dict with {' and '.join(map(repr, PARTS))} entries (dmuon.get_state_dict's form), "
                   f"got keys {sorted(map(str, state_dict))}",)
    model_sd, optim_sd = ({} if problem else state_dict.get(k, {}) for k in PARTS)
    return (check_model_sd(model, model_sd, what=f"set_state_dict{where} ('model')", problems=problem),
            check_optim_sd(model, optimizer, optim_sd, what=f"set_state_dict{where} ('optim')"))
