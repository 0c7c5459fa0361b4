"""The protocol every Muon route's strategy answers, and what it is handed.

[Note: route strategies]
A Muon param group holds params of three routes (``runtime/route.py``'s [Note: routes]): whole matrices on
their owner (``owner.py``), tensor-parallel shards on every tp rank of the owner's slot (``tp.py``), and
batches of experts left on the engine's dim-0 shards (``sharded.py``). What a route means is answered by
its strategy alone, as ``engines/`` answers what an engine means:

* where its Newton-Schulz runs and its update (:meth:`RouteStrategy.update_`, one call per param group
  with this rank's members of the route, in the group's order; :meth:`RouteStrategy.ns_batch` and
  :meth:`RouteStrategy.ns_work` tell ``dmuon.diagnostics`` what that costs this rank);
* its state layout: the zero state a first step makes (:meth:`RouteStrategy.materialise_`) and the state keys
  and dtypes it keeps (:meth:`RouteStrategy.state_dtypes`);
* its checkpoint view: whether its state lives on the owner or on every rank (:attr:`RouteStrategy.on_owner`)
  and what a state key is laid out like in a dict (:meth:`RouteStrategy.laid_out_like`), which
  ``checkpoint/optimizer.py`` asks instead of branching on tensor parallelism or the route.

``dmuon.Muon`` never branches on the route: ``routes.of`` looks each param's strategy up and
``routes.members`` splits a group among them. The collectives a route needs are ``runtime/comm.py``'s,
called here; the tensor math (``update.py``, ``tp_update.py``, ``normuon.py``) stays free of them. A new route
(an all-to-all one, issue 32) is one module with one strategy and a line in the lookup.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ...runtime.blocks import Blocks
from ...runtime.errors import raise_internal
from ...runtime.hooks import DMuonState
from ...runtime.param import DedicatedParam
from ..rules import UpdateRule
from ..update import MuonHParams

__all__ = ["StepContext", "Member", "RouteStrategy"]


@dataclass(frozen=True)
class StepContext:
    """What a route reads and writes of ``dmuon.Muon``: its runtime, its state (written only through a route's
    update and materialise, and ``Muon``'s own loads), its ``master_dtype``, and the param version each master
    of the engine's shards last agreed with (by ``id(param)``; ``Muon`` clears it on loads)."""

    runtime: DMuonState
    state: MutableMapping[Tensor, dict[str, Any]]
    master_dtype: torch.dtype | None
    seen: dict[int, int]


@dataclass(frozen=True)
class Member:
    """One param of a Muon group on a route: its name in the group (canonical FQN), the param this rank steps
    (an owner's bound param, or the engine's DTensor), and its ``DedicatedParam`` (``None`` on the engine's
    shards, which have no owner)."""

    name: str
    param: Tensor
    dp: DedicatedParam | None

    @property
    def dedicated(self) -> DedicatedParam:
        """Its ``DedicatedParam``, for the routes with an owner (an internal error on the engine's shards)."""
        if self.dp is None:
            raise_internal(f"{self.name} has no owner: it lives on the engine's shards")
        return self.dp


class RouteStrategy(Protocol):
    """What one Muon route means ([Note: route strategies])."""

    #: the route's name in diagnostics and errors
    name: str
    #: whether its state lives on the owner only (else on every rank, laid out like the param)
    on_owner: bool

    def update_(self, ctx: StepContext, members: Sequence[Member], hp: MuonHParams, rule: UpdateRule) -> None:
        """One step of this rank's ``members`` of one param group (collective where the route needs one, on
        every rank of the group that calls it, in the same order)."""
        ...

    def materialise_(self, ctx: StepContext, member: Member, rule: UpdateRule) -> None:
        """The zero state a first step would create for ``member`` (mathematically a no-op)."""
        ...

    def state_dtypes(self, member: Member, rule: UpdateRule, *, master_dtype: torch.dtype | None
                     ) -> dict[str, torch.dtype]:
        """The state keys ``member`` keeps and their dtypes under ``dmuon.Muon(master_dtype=...)`` (rank-independent)."""
        ...

    def laid_out_like(self, member: Member, key: str) -> Tensor | None:
        """The DTensor state ``key`` is laid out like in a checkpoint (its shards are this rank's part; a
        full dict gathers them); ``None`` where the owner keeps it whole."""
        ...

    def ns_batch(self, runtime: DMuonState, member: Member) -> tuple[Blocks, Any] | None:
        """For diagnostics: the matrices of ``member`` whose Newton-Schulz this rank's step takes part in (their
        ``Blocks``) and a key of how the route splits that work (``None``: this rank runs all of it); ``None``:
        no Newton-Schulz here (an empty chunk)."""
        ...

    def ns_work(self, runtime: DMuonState, n: int, split: Any) -> tuple[int, int]:
        """For diagnostics: of ``n`` members with one ``ns_batch``, how many matrices this rank orthogonalises
        and how many elements it sends for that."""
        ...
