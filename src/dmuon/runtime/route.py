"""Where a parameter's update runs: the routes of ``dmuon.dedicate_params(route=...)``.

[Note: routes] Five places, decided per parameter before ``fully_shard``:

* ``MUON``: dedicated; its owner holds it whole and runs Muon (a matrix, or a batch of them such as experts).
* ``MUON_SHARDED``: a batch of matrices (experts ``[E, m, n]``) left to the engine's shards of its batch dim:
  ``fully_shard`` chunks dim 0, expert parallelism places it ``Shard(0)``, so every rank holds whole matrices
  of it and runs Muon on them where they live, with no gather and no broadcast of dmuon's. The default for a
  selected batch of at least as many matrices as the shard dimension has ranks, where each rank gets work;
  a smaller batch is better off on one owner (``MUON``).
* ``ADAMW_OWNER``: dedicated the same way (broadcast before its boundary runs, gradient reduced to the
  owner), but the owner runs AdamW on it. For the small non-matrix params of a boundary whose matrices
  are all dedicated (norms, biases): that boundary then needs no FSDP2 unit at all.
* ``ADAMW_SHARDED``: left to FSDP2 (the default for everything not dedicated, inside a ``fully_shard``).
* ``ADAMW_REPLICATED``: ``fully_shard`` skips it; every rank keeps it whole, dmuon averages its gradient
  with one all-reduce at the end of backward (as for params no ``fully_shard`` covers) and AdamW steps
  it on every rank.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Route", "REPLICATED_ATTR", "is_replicated"]

#: Marks a parameter routed ``ADAMW_REPLICATED``; FSDP2's patch skips it like a dedicated one.
REPLICATED_ATTR = "_dmuon_replicated"


class Route(enum.Enum):
    """Where one parameter's update runs ([Note: routes] in ``dmuon/runtime/route.py``)."""

    MUON = "muon"
    MUON_SHARDED = "muon_sharded"
    ADAMW_OWNER = "adamw_owner"
    ADAMW_SHARDED = "adamw_sharded"
    ADAMW_REPLICATED = "adamw_replicated"

    @property
    def dedicated(self) -> bool:
        """Whether the route gives the parameter an owner rank."""
        return self in (Route.MUON, Route.ADAMW_OWNER)

    @property
    def muon(self) -> bool:
        """Whether Muon updates the parameter (on an owner, or on the engine's shards)."""
        return self in (Route.MUON, Route.MUON_SHARDED)

    @classmethod
    def parse(cls, value: object, where: str) -> Route | None:
        """A route from a ``Route``, its name or value (``"adamw_owner"``), or ``None`` (no opinion)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            for r in cls:
                if value in (r.value, r.name):
                    return r
        raise ValueError(f"{where}: route must be a dmuon.Route, one of {[r.value for r in cls]} or None, "
                         f"got {value!r}")


def is_replicated(param: torch.Tensor) -> bool:
    """Whether ``param`` is routed ``ADAMW_REPLICATED`` (kept whole on every rank, outside FSDP2)."""
    return bool(getattr(param, REPLICATED_ATTR, False))
