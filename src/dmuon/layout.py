"""Which owner layout ``dedicate_params(layout="auto")`` takes: the one whose collectives cost less time.

The two layouts ([Note: node layout] in ``dmuon/runtime/hierarchy.py``) differ only in how each boundary's
buckets move; the matrices, their Newton–Schulz and everything the engine does are the same. So the decision
compares the time of dmuon's own collectives of one step under the link model of :mod:`dmuon.links` (the one
``python -m dmuon.plan --simulate`` uses, with its default links: its bandwidths are assumptions), per boundary
and phase (the forward gather, the backward gather under Z3, the gradient reduce):

* flat: NCCL's grouped broadcasts (reduces) over all ``W`` ranks, the whole boundary on every link, one call;
* node: on each rail, one bucket (the busiest local index's share, about ``1/n`` of the boundary) across the
  ``W / n`` nodes, one call; then the whole boundary inside each node, one call.

Pure Python: every rank computes the same answer from the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .links import Group, Links, broadcast_ms

__all__ = ["LayoutChoice", "layout_ms", "choose_layout"]


class LayoutChoice(NamedTuple):
    """The layout taken and the predicted milliseconds of dmuon's collectives per step under each."""

    layout: str
    flat_ms: float
    node_ms: float

    def why(self) -> str:
        """One line for people: both predictions and the pick."""
        return (f"layout {self.layout!r}: dmuon's collectives predicted {self.flat_ms:.2f} ms a step flat, "
                f"{self.node_ms:.2f} ms node by node")


def layout_ms(boundary_bytes: Sequence[float], world: int, per_node: int, layout: str, *, z3: bool = True,
              links: Links | None = None) -> float:
    """Predicted ms of dmuon's collectives in one step on a 1-D mesh of ``world`` ranks, ``per_node`` a node,
    each boundary of ``boundary_bytes`` (bytes as gathered), under ``layout`` (``"flat"`` or ``"node"``). The
    node layout's rail carries ``1/per_node`` of each boundary (its buckets are about equal). Example::

        flat = layout_ms([436_207_616] * 32, 64, 8, "flat")   # Llama-3-8B's layers in bf16, 8 nodes of 8
        node = layout_ms([436_207_616] * 32, 64, 8, "node")   # about a quarter of it
    """
    if layout not in ("flat", "node"):
        raise ValueError(f"layout_ms: layout must be 'flat' or 'node', got {layout!r}")
    links = Links(gpus_per_node=per_node) if links is None else links
    phases = 3 if z3 else 2
    total, calls = float(sum(boundary_bytes)), sum(1 for b in boundary_bytes if b)
    if layout == "flat":
        return phases * broadcast_ms(total, Group(world, 1), links, calls)
    node, rail = Group(per_node, 1), Group(world // per_node, per_node)
    return phases * (broadcast_ms(total / per_node, rail, links, calls) + broadcast_ms(total, node, links, calls))


def choose_layout(boundary_bytes: Sequence[float], world: int, per_node: int, *, z3: bool = True,
                  links: Links | None = None) -> LayoutChoice:
    """The layout with the lower :func:`layout_ms` (``"flat"`` on a tie, and on one node). Example::

        from dmuon.layout import choose_layout
        pick = choose_layout([436_207_616] * 32, world=64, per_node=8)   # Llama-3-8B's layers in bf16
        print(pick.layout, pick.why())                                   # node ...
    """
    if world % per_node or world // per_node < 2:
        flat = layout_ms(boundary_bytes, world, world, "flat", z3=z3, links=links)
        return LayoutChoice("flat", flat, flat)
    flat = layout_ms(boundary_bytes, world, per_node, "flat", z3=z3, links=links)
    node = layout_ms(boundary_bytes, world, per_node, "node", z3=z3, links=links)
    return LayoutChoice("node" if node < flat else "flat", flat, node)
