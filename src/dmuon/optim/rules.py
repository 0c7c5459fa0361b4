"""The update-rule seam: which Muon-family algorithm a param group runs, and what each keeps per param.

A Muon param group says ``"algorithm": "muon"`` (the default) or ``"normuon"``; everything that differs between
the algorithms lives in their own files (``update.py``: Muon, with the shared momentum, Newton-Schulz, decay and
lr-rule pieces; ``normuon.py``: NorMuon), and this module is the one table that maps a name to:

* its hyperparameter record (``MuonHParams``, ``NorMuonHParams``: the group's keys and their checks);
* its optimizer state per param (:class:`StateSpec`: Muon's ``momentum_buffer``; NorMuon's plus
  ``row_second_moment``, one value per matrix row), which ``dmuon.Muon`` creates and the checkpoint functions
  save, check and place (a per-row tensor is ``[..., m, 1]`` of the *full* matrix: under tensor parallelism
  every tp rank of the owner slot keeps it whole);
* its update of an owner's (or the engine's shards') same-layout params, and of tensor-parallel shards.

``dmuon.Muon`` steps every route through :func:`rule_of` and never names an algorithm itself. Adding one is a
file with its update functions and record, and a row here.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..runtime.blocks import Blocks
from . import normuon as _normuon
from . import tp_update as _tp_update
from . import update as _update
from .normuon import NorMuonHParams, stat_dtype
from .update import MuonHParams

__all__ = ["Algorithm", "StateSpec", "UpdateRule", "RULES", "rule_of", "hparams_of", "muon_record",
           "PER_ROW_KEYS", "ADAMW"]

#: The ``algorithm`` of a group that takes AdamW (``"use_muon": False``).
ADAMW = "adamw"


class Algorithm(enum.Enum):
    """The Muon-family update rules a param group can take (``"algorithm"``).

    Example::

        Algorithm.parse("NorMuon")   # Algorithm.NORMUON; "normun" raises naming 'normuon'
    """

    MUON = "muon"
    NORMUON = "normuon"

    @classmethod
    def parse(cls, value: object, where: str = "dmuon.Muon", *, adamw_ok: bool = False) -> Algorithm:
        """An algorithm from its name (or itself); ``ValueError`` naming the closest names otherwise.
        ``adamw_ok``: the caller (a param group's ``algorithm``) takes ``"adamw"`` itself, so it may be
        suggested; elsewhere (``dmuon.Muon(algorithm=...)``, the rule of the dedicated matrices) an AdamW-like
        name is told where AdamW is chosen instead."""
        if isinstance(value, cls):
            return value
        names = [a.value for a in cls]
        if isinstance(value, str):
            for a in cls:
                if value.lower() == a.value:
                    return a
        text = str(value).lower()
        if not adamw_ok and difflib.get_close_matches(text, [ADAMW], n=1, cutoff=0.6):
            raise ValueError(
                f"{where}: algorithm={value!r} is not a Muon algorithm: it chooses the update of the dedicated "
                f"matrices, one of {names}. AdamW already trains every param that is not dedicated (set it with "
                "adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay, or a param group {'params': [...], "
                "'use_muon': False} of its own); to train a matrix with AdamW, leave it out of "
                "dmuon.dedicate_params(predicate=...), or route it 'adamw_owner' there."
            )
        close = difflib.get_close_matches(text, names + ([ADAMW] if adamw_ok else []), n=2, cutoff=0.5)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        others = f" (and {ADAMW!r} for the others)" if adamw_ok else ""
        raise ValueError(f"{where}: unknown algorithm {value!r}; Muon params take {names}{others}.{hint}")


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One optimizer-state tensor an update rule keeps per param (besides a ``master_dtype`` master)."""

    key: str
    #: one value per matrix row: the param's shape with the last dim 1 (of the full matrix under TP);
    #: otherwise the param's own shape (a TP shard's)
    per_row: bool = False
    #: a statistic, kept at least in float32; otherwise in the update's dtype (like the momentum)
    stat: bool = False

    def dtype(self, update_dtype: torch.dtype) -> torch.dtype:
        return stat_dtype(update_dtype) if self.stat else update_dtype

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """Its full (unsplit) shape for a param of ``full_shape``."""
        return (*full_shape[:-1], 1) if self.per_row else tuple(full_shape)


MOMENTUM = StateSpec("momentum_buffer")


class UpdateRule:
    """One algorithm: its record, its state, its updates. The functions are looked up in their modules at call
    time, so a test that swaps one for a wrong variant reaches every route.

    Example::

        rule = RULES[Algorithm.NORMUON]
        st = {}
        rule.init_state_(st, w, w.dtype)          # momentum_buffer, row_second_moment
        rule.update_([w], [g], [st], NorMuonHParams(lr=0.01))
    """

    def __init__(self, algorithm: Algorithm, hparams: type[MuonHParams], state: tuple[StateSpec, ...], *,
                 column_blocks: bool = True):
        self.algorithm, self.hparams, self.state = algorithm, hparams, state
        #: whether it updates params split into ``Columns`` blocks ([Note: matrix blocks]); a per-row state
        #: (one value per row of the param) cannot serve column blocks, which each need their own rows
        self.column_blocks = column_blocks

    def __repr__(self) -> str:
        return f"UpdateRule({self.algorithm.value!r})"

    def init_state_(self, st: dict[str, Any], like: Tensor, update_dtype: torch.dtype, *,
                    full_rows: int | None = None) -> None:
        """Create the missing zero state of one param in ``st``: tensors laid out like ``like`` (the param's
        local tensor, or its DTensor on the engine's shards); a per-row one ``[..., m, 1]`` from ``like[..., :1]``,
        or ``[full_rows, 1]`` for a tensor-parallel shard (every tp rank keeps the whole matrix's rows)."""
        for spec in self.state:
            if spec.key in st:
                continue
            dtype = spec.dtype(update_dtype)
            if not spec.per_row:
                st[spec.key] = torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
            elif full_rows is not None:
                st[spec.key] = torch.zeros((full_rows, 1), dtype=dtype, device=like.device)
            else:
                st[spec.key] = torch.zeros_like(like[..., :1], dtype=dtype, memory_format=torch.contiguous_format)

    def state_dtypes(self, update_dtype: torch.dtype) -> dict[str, torch.dtype]:
        return {spec.key: spec.dtype(update_dtype) for spec in self.state}

    def update_(self, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Mapping[str, Tensor]],
                hp: MuonHParams, blocks: Blocks | None = None) -> None:
        """One step of same-layout params (whole matrices: an owner's, or the engine's shards' local tensors);
        ``states``: each param's state tensors (local tensors), by key."""
        raise NotImplementedError

    def update_tp_(self, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Mapping[str, Tensor]],
                   hp: MuonHParams, **tp: Any) -> None:
        """One step of same-shape tensor-parallel shards ([Note: TP update] in ``tp_update.py``); ``tp``:
        ``full_shape``, ``tp_dim``, ``tp_rank``, ``tp_size``, ``exchange``, ``blocks``."""
        raise NotImplementedError


class _Muon(UpdateRule):
    def update_(self, params, grads, states, hp, blocks=None):  # type: ignore[no-untyped-def]
        _update.muon_update_batch_(params, grads, [s["momentum_buffer"] for s in states], hp, blocks)

    def update_tp_(self, params, grads, states, hp, **tp):  # type: ignore[no-untyped-def]
        _tp_update.muon_update_tp_(params, grads, [s["momentum_buffer"] for s in states], hp, **tp)


class _NorMuon(UpdateRule):
    def update_(self, params, grads, states, hp, blocks=None):  # type: ignore[no-untyped-def]
        _normuon.normuon_update_batch_(params, grads, [s["momentum_buffer"] for s in states],
                                       [s["row_second_moment"] for s in states], hp, blocks)

    def update_tp_(self, params, grads, states, hp, **tp):  # type: ignore[no-untyped-def]
        _normuon.normuon_update_tp_(params, grads, [s["momentum_buffer"] for s in states],
                                    [s["row_second_moment"] for s in states], hp, **tp)


RULES: dict[Algorithm, UpdateRule] = {
    Algorithm.MUON: _Muon(Algorithm.MUON, MuonHParams, (MOMENTUM,)),
    Algorithm.NORMUON: _NorMuon(Algorithm.NORMUON, NorMuonHParams,
                                  (MOMENTUM, StateSpec("row_second_moment", per_row=True, stat=True)),
                                  column_blocks=False),
}
#: every rule's per-row state keys (the checkpoint functions lay these out as whole rows)
PER_ROW_KEYS = frozenset(s.key for r in RULES.values() for s in r.state if s.per_row)


def rule_of(group: Mapping[str, Any]) -> UpdateRule:
    """The rule of a Muon param group (a group saved before algorithms existed is Muon's)."""
    return RULES[Algorithm.parse(group.get("algorithm", Algorithm.MUON.value))]


def hparams_of(group: Mapping[str, Any]) -> MuonHParams:
    """The record of a Muon param group as it stands now (a scheduler may have changed ``lr``)."""
    return rule_of(group).hparams.from_group(group)


def muon_record(algorithm: object, values: Mapping[str, Any], where: str = "dmuon.Muon") -> MuonHParams:
    """``algorithm``'s record from ``values``, which may hold the keys of every Muon-family algorithm (those
    of the others are dropped; ``"algorithm"`` itself too)."""
    cls = RULES[Algorithm.parse(algorithm, where)].hparams
    return cls(**{k: v for k, v in values.items() if k in cls.names()})
