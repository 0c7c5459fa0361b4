"""Muon's routes as strategies, one module each behind one protocol ([Note: route strategies] in ``base.py``):
``owner.py`` (whole matrices on their owner), ``tp.py`` (tensor-parallel shards of an owner slot),
``sharded.py`` (batches on the engine's dim-0 shards); this module looks a param's strategy up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...runtime.hooks import DMuonState
from ...runtime.param import DedicatedParam
from .base import Member, RouteStrategy, StepContext
from .owner import Owner
from .sharded import Sharded, layouts
from .tp import TensorParallel

__all__ = ["OWNER", "TP", "SHARDED", "of", "members", "Member", "RouteStrategy", "StepContext"]

OWNER, TP, SHARDED = Owner(), TensorParallel(), Sharded()


def of(dp: DedicatedParam | None) -> RouteStrategy:
    """The strategy of a param: ``dp`` its ``DedicatedParam``, ``None`` for one on the engine's shards. A
    dedicated param's checkpoint view is its holding's (owner or tensor-parallel), AdamW-owned ones' too."""
    if dp is None:
        return SHARDED
    return OWNER if dp.tp_dim is None else TP


def members(group: Mapping[str, Any], runtime: DMuonState, owned: Mapping[int, DedicatedParam]
            ) -> list[tuple[RouteStrategy, list[Member]]]:
    """This rank's params of a Muon param group by strategy (engine's shards first, then owner and tensor-
    parallel matrices), each list in the group's order; ``owned``: this rank's dedicated params by ``id(param)``.
    The same strategies in the same order on every rank that holds the same params."""
    sharded = layouts(runtime)
    out: dict[RouteStrategy, list[Member]] = {SHARDED: [], OWNER: [], TP: []}
    for name, p in zip(group["param_names"], group["params"]):
        if name in sharded:
            out[SHARDED].append(Member(name, p, None))
        elif id(p) in owned:
            dp = owned[id(p)]
            out[of(dp)].append(Member(name, p, dp))
    return [(s, ms) for s, ms in out.items() if ms]
