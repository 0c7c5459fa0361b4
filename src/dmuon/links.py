"""The link model of ``python -m dmuon.plan --simulate`` and of ``dedicate_params(layout="auto")``: how long one
collective takes on a group of ranks. Pure Python, in the library so that the layout decision
(:mod:`dmuon.layout`) can use it; the planner (``dmuon/tools``) uses it too.

Ranks are numbered node by node (``gpus_per_node`` consecutive ranks share a node's NVLink), tensor
parallelism innermost, then the shard dimension, then HSDP's replicate dimension. A group whose ranks all sit
in one node runs at the NVLink bandwidth; a group that spans nodes runs at the per-GPU network bandwidth
(every GPU has its own NIC and NCCL's rings use them all, so the slowest hop is one NIC).

``ring_nics`` (default 1) is the what-if of a ring over several ranks of every node spreading its channels over
that many of the node's NICs, as NCCL does: a flat ring (FSDP2's all-gather, dmuon's flat broadcast) then runs at
``ring_nics x`` the per-GPU network bandwidth, a rail (one rank a node) and an all-to-all still at one NIC's.

A collective costs ``bytes on the busiest link / bandwidth + calls x latency``:

* all-gather / reduce-scatter (ring): each rank moves ``(g-1)/g`` of the whole buffer; a call's latency is a
  base plus one hop per ring step (``g - 1`` hops, ``nodes - 1`` of them over the network);
* all-reduce: twice that on the wire; a call's latency is the ring's (twice) or, where shorter, a tree's
  (up and down, ``2 ceil(log2 g)`` hops): NCCL picks the tree for all-reduces across many nodes;
* broadcast / reduce: NCCL runs them as a pipelined ring (its only algorithm for these two), so every link
  carries the whole buffer once and a call waits for the pipeline to fill, ``g - 1`` hops; ``tree``
  (a what-if: a pipelined binary tree) waits ``ceil(log2 g)`` hops instead;
* all-to-all: each rank sends ``(g-1)/g`` of its buffer, the off-node part over its NIC and the rest over
  NVLink at the same time; a call costs the base latency plus a fixed cost per peer.

The default latencies are NCCL's own tuning constants for the ring with the Simple protocol (``baseLat``
8.4 us, ``hwLat`` 3.4 us per NVLink hop and 14 us per network hop, ``src/graph/tuning.cc``); the bandwidths
are what NCCL's all-gather reaches on an H200's NVLink (~360 of 450 GB/s a direction) and on a 400 Gb/s NIC
per GPU (~45 of 50 GB/s). Nothing beyond two GPUs of one node was measured for this project: the network
numbers are assumptions, and options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["Links", "Group", "ring_latency_us", "all_gather_ms", "all_reduce_ms", "broadcast_ms", "all_to_all_ms"]

#: all-to-all: host and setup cost per peer of one call (an assumption, not measured)
A2A_PEER_US = 1.0


@dataclass(frozen=True)
class Links:
    """The machine's links. Bandwidths in GB/s per GPU and direction, latencies in microseconds."""

    gpus_per_node: int = 8
    nvlink_gbs: float = 360.0
    network_gbs: float = 45.0
    nvlink_hop_us: float = 3.4
    network_hop_us: float = 14.0
    call_us: float = 8.4
    #: ``"ring"`` (NCCL's algorithm for broadcast and reduce) or ``"tree"`` (a what-if)
    broadcast: str = "ring"
    #: NICs of a node that one ring spanning nodes spreads its channels over (a what-if: NCCL puts each channel
    #: on its own NIC); at most the ring's ranks in a node (a rail, one rank a node, has one). 1: one NIC
    ring_nics: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "broadcast":
                if v not in ("ring", "tree"):
                    raise ValueError(f"dmuon.plan: the broadcast algorithm must be 'ring' or 'tree', got {v!r}")
            elif f.name in ("gpus_per_node", "ring_nics"):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"dmuon.plan: {f.name} must be a positive int, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    f.name.endswith("gbs") and v == 0):
                raise ValueError(f"dmuon.plan: link setting {f.name} must be a finite number "
                                 f"{'> 0' if f.name.endswith('gbs') else '>= 0'}, got {v!r}")


@dataclass(frozen=True)
class Group:
    """``size`` ranks ``stride`` apart (1: neighbours), as the mesh lays them out."""

    size: int
    stride: int = 1

    def nodes(self, links: Links) -> int:
        """How many nodes the group's ranks sit in."""
        if self.size == 1:
            return 1
        if self.stride >= links.gpus_per_node:
            return self.size
        return (self.size - 1) * self.stride // links.gpus_per_node + 1

    def bandwidth(self, links: Links) -> float:
        """GB/s of the group's slowest hop: NVLink inside one node, across nodes the NIC (``links.ring_nics`` of
        them where the group has that many ranks in a node)."""
        if self.nodes(links) == 1:
            return links.nvlink_gbs
        in_node = max(1, min(self.size, links.gpus_per_node // self.stride))
        return links.network_gbs * min(links.ring_nics, in_node)


def ring_latency_us(group: Group, links: Links, *, tree: bool = False) -> float:
    """Latency of one ring call on ``group`` (``tree``: of a pipelined binary tree); 0 for one rank."""
    g = group.size
    if g == 1:
        return 0.0
    nodes = group.nodes(links)
    if tree:
        hop = links.network_hop_us if nodes > 1 else links.nvlink_hop_us
        return links.call_us + math.ceil(math.log2(g)) * hop
    inter = nodes - 1
    return links.call_us + (g - 1 - inter) * links.nvlink_hop_us + inter * links.network_hop_us


def _ms(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e6)  # GB/s = 1e6 bytes per ms


def all_gather_ms(nbytes: float, group: Group, links: Links, calls: int = 1) -> float:
    """An all-gather (or reduce-scatter) of a ``nbytes`` full buffer in ``calls`` calls."""
    if group.size == 1 or nbytes == 0:
        return 0.0
    g = group.size
    return _ms(nbytes * (g - 1) / g, group.bandwidth(links)) + calls * ring_latency_us(group, links) / 1e3


def all_reduce_ms(nbytes: float, group: Group, links: Links, calls: int = 1) -> float:
    """An all-reduce of ``nbytes`` in ``calls`` calls: a reduce-scatter and an all-gather on the wire, the
    shorter of the ring's and the tree's latency."""
    if group.size == 1 or nbytes == 0:
        return 0.0
    ring = 2 * ring_latency_us(group, links)
    tree = 2 * ring_latency_us(group, links, tree=True) - links.call_us
    g = group.size
    return 2 * _ms(nbytes * (g - 1) / g, group.bandwidth(links)) + calls * min(ring, tree) / 1e3


def broadcast_ms(nbytes: float, group: Group, links: Links, calls: int = 1) -> float:
    """Broadcasts (or reduces) of ``nbytes`` in all, in ``calls`` calls from any roots, one after another."""
    if group.size == 1 or nbytes == 0:
        return 0.0
    lat = ring_latency_us(group, links, tree=links.broadcast == "tree")
    return _ms(nbytes, group.bandwidth(links)) + calls * lat / 1e3


def all_to_all_ms(nbytes: float, group: Group, links: Links, calls: int = 1) -> float:
    """All-to-alls in which each rank sends ``nbytes`` in all (its own part included) in ``calls`` calls."""
    g = group.size
    if g == 1 or nbytes == 0:
        return 0.0
    nodes = group.nodes(links)
    off = nbytes * (1 - 1 / nodes) if nodes > 1 else 0.0
    on = nbytes * (g - 1) / g - off
    wire = max(_ms(on, links.nvlink_gbs), _ms(off, links.network_gbs))
    return wire + calls * (links.call_us + (g - 1) * A2A_PEER_US) / 1e3
