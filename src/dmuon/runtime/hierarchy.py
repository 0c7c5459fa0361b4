"""How a boundary's owner buckets move: over the shard row (the flat layout), or node by node (the node layout).

:class:`~dmuon.runtime.group.BoundaryGroup` hands every phase here as ``{owner index along the shard row:
bucket buffer}``; this module picks the collectives of ``dmuon/runtime/comm.py`` that move them. No collective is
called from anywhere else, and nothing here calls ``torch.distributed``.

[Note: node layout]
On a flat (1-D) mesh over several nodes, owners spread over every rank make each phase one collective over the
whole job: a rank that owns nothing of a boundary receives all of it over the network (and sends all of its
gradient back), and a ring over ``W`` ranks waits ``W - 1`` hops. The node layout (``dedicate_params(...,
layout="node")``, on whole nodes of ``n`` ranks) owns each boundary inside ONE node, its matrices spread over
that node's ``n`` local ranks (``partition.assign_node_owners``: boundaries dealt to nodes by bytes, each node's
planned over its ranks), so slot ``node x n + j`` owns the boundary's bucket ``j``. A *rail* is the ranks of one
local index, one per node. Each phase is two launches per rank:

* gather (forward, and Z3's backward): (A) on every rail the owner node's rank broadcasts its bucket to the same
  local index of every node (each rank sits in one rail: one launch), issued with the boundary's ``unshard``,
  so a prefetch overlaps the network hop with compute; (B) in every node one ``gather_parts`` of the ``n``
  buckets over the node group (NVLink), issued when the boundary waits for its weights (it sends what (A)
  brought, and issuing it earlier would make the compute stream wait for (A) right away). Bytes across nodes
  per rank: one bucket, about ``1/n`` of the boundary, instead of all of it.
* gradient: (A') in every node one ``reduce_parts`` (AVG over the ``n`` ranks) gives local rank ``j`` its node's
  average of bucket ``j`` (waited for at once: NVLink, short); (B') on every rail a reduce (AVG over the nodes)
  to the owner node's rank, asynchronous like the flat layout's reduce. The owner
  gets the mean over the world: an average of ``n``-rank averages, which equals the flat layout's one average of
  ``W`` terms up to the rounding of the different order of summation (the same as HSDP's two stages), not bit for
  bit; ``tests/test_node_layout.py`` bounds it against the single-process oracle.

Memory against the flat layout: nothing persistent (each rank keeps exactly what it owns; the node's and rails'
process groups besides, ``n + W / n`` groups of which each rank joins two); transient, the same full copy of the
boundary as the flat layout, received into the same buffers, and on gloo the node gather's padding.
"""

from __future__ import annotations

import torch

from . import comm as C
from .comm import CommKind
from .errors import raise_internal

__all__ = ["gather_boundary", "reduce_boundary"]


def _parts(size: int, parts: dict[int, torch.Tensor], like: torch.Tensor, base: int = 0) -> list[torch.Tensor]:
    """One launch's parts along a dimension of ``size``: ``parts[base + i]`` at index ``i``, empty elsewhere."""
    return [parts[base + i] if base + i in parts else like.new_empty(0) for i in range(size)]


def _owner_node(ctx: C.CommContext, parts: dict[int, torch.Tensor], label: str) -> int:
    """The one node that owns every part (the node plan's promise)."""
    n = ctx.size(C.Dim.NODE)
    nodes = {i // n for i in parts}
    if len(nodes) != 1:
        raise_internal(f"boundary {label!r}: the node layout expects one owner node, got nodes {sorted(nodes)}")
    return nodes.pop()


def gather_boundary(ctx: C.CommContext, parts: dict[int, torch.Tensor], kind: CommKind, label: str) -> C.PendingComm:
    """Every owner's bucket ``parts[i]`` (``i`` its index along the shard row) to every rank of the row, in place
    (asynchronously): one ``gather_parts`` (flat), or the rail broadcast then the node gather ([Note: node
    layout])."""
    like = next(iter(parts.values()))
    if ctx.node_size is None:
        return C.gather_parts(ctx, _parts(ctx.shard_size, parts, like), kind, label)
    n, node = ctx.node_size, _owner_node(ctx, parts, label)
    mine = parts.get(node * n + ctx.index(C.Dim.NODE))
    # (A): this rail's bucket, from the owner node, now
    rail = C.broadcast(ctx, mine, node, kind, label, dim=C.Dim.RAIL) if mine is not None else None
    in_node = _parts(n, parts, like, node * n)

    def node_gather() -> None:  # (B), once (A) is waited for: by the wait of the returned PendingComm
        C.wait(C.gather_parts(ctx, in_node, kind, label, dim=C.Dim.NODE))

    return C.PendingComm(rail.work if rail is not None else None, like, node_gather)


def reduce_boundary(ctx: C.CommContext, parts: dict[int, torch.Tensor], kind: CommKind, label: str) -> C.PendingComm:
    """Every rank's gradient bucket ``parts[i]`` averaged into owner ``i``'s ``parts[i]`` (asynchronously; only the
    owner's is meaningful afterwards): one ``reduce_parts`` (flat), or the node reduce then the rail reduce ([Note:
    node layout])."""
    like = next(iter(parts.values()))
    if ctx.node_size is None:
        return C.reduce_parts(ctx, _parts(ctx.shard_size, parts, like), kind, label)
    n, node = ctx.node_size, _owner_node(ctx, parts, label)
    C.wait(C.reduce_parts(ctx, _parts(n, parts, like, node * n), kind, label, dim=C.Dim.NODE))  # (A')
    mine = parts.get(node * n + ctx.index(C.Dim.NODE))
    if mine is None:  # no bucket on this local index: nothing crosses this rail
        return C.PendingComm(None, like)
    return C.reduce_avg(ctx, mine, node, kind, label, dim=C.Dim.RAIL)  # (B')
