"""Communication counter: what dmuon's own collectives move, so tests and benchmarks can check the cost model.

Every collective dmuon issues goes through :mod:`dmuon._collectives`, which records its payload here.
Counts are *payload elements per collective* (the number of tensor elements in the broadcast or reduce
buffer) and their bytes (which tell dtypes apart: a bf16 model's reduce with
``reduce_dtype=torch.float32`` moves 4 bytes per element, its broadcasts 2), identical on every rank of
the collective. For dedicated parameters of total size P, one training step therefore shows
``forward_broadcast == P``, ``backward_broadcast == P`` under Z3 (0 under Z2) and ``reduce == P``.

Example::

    dmuon.diagnostics.reset_comm_counts(model)
    loss = model(batch).loss; loss.backward(); optimizer.step()
    print(dmuon.diagnostics.comm_counts(model))
    # {'forward_broadcast': {'elements': 4096, 'bytes': 16384, 'calls': 4, 'by_dim': {'shard': {...}}}, ...}
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["CommKind", "CommCounter", "comm_counts", "reset_comm_counts"]


class CommKind(enum.Enum):
    """Why a collective was issued."""

    #: Owner -> everyone, before a boundary's forward.
    FORWARD_BROADCAST = "forward_broadcast"
    #: Owner -> everyone again before backward (Z3 only: the copy was freed after forward).
    BACKWARD_BROADCAST = "backward_broadcast"
    #: Everyone -> owner, the averaged gradient of a bucket (under HSDP: over the shard group to the
    #: owner's column, then over the replicate group to the owner; ``by_dim`` tells them apart).
    REDUCE = "reduce"
    #: HSDP: the owner's updated tensor to the other replicate rows' holders, after ``step()``.
    REPLICATE_PUBLISH = "replicate_publish"
    #: All-reduce of gradients of plain (neither dedicated nor FSDP2-sharded) parameters.
    REPLICATED_GRAD_ALL_REDUCE = "replicated_grad_all_reduce"
    #: Tensors moved by the state-dict functions (gathering to or scattering from full tensors).
    CHECKPOINT = "checkpoint"


@dataclass
class CommCounter:
    """Running totals per :class:`CommKind` and mesh dimension (``"shard"``, ``"replicate"``, ``"world"``)."""

    elements: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    calls: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[CommKind, str], int] = field(default_factory=dict)

    def record(self, kind: CommKind, tensor: torch.Tensor, dim: str) -> None:
        """One collective of ``kind`` along ``dim`` whose payload is ``tensor``."""
        key = (kind, dim)
        self.elements[key] = self.elements.get(key, 0) + tensor.numel()
        self.calls[key] = self.calls.get(key, 0) + 1
        self.nbytes[key] = self.nbytes.get(key, 0) + tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.elements.clear()
        self.calls.clear()
        self.nbytes.clear()

    def as_dict(self) -> dict[str, Any]:
        """``{kind: {"elements", "bytes", "calls", "by_dim": {dim: {"elements", "bytes", "calls"}}}}``,
        totals over dims."""
        out: dict[str, Any] = {}
        for kind in CommKind:
            by_dim = {
                dim: {"elements": self.elements[(k, dim)], "bytes": self.nbytes[(k, dim)],
                      "calls": self.calls[(k, dim)]}
                for (k, dim) in sorted(self.elements, key=lambda kd: kd[1])
                if k is kind
            }
            out[kind.value] = {
                "elements": sum(d["elements"] for d in by_dim.values()),
                "bytes": sum(d["bytes"] for d in by_dim.values()),
                "calls": sum(d["calls"] for d in by_dim.values()),
                "by_dim": by_dim,
            }
        return out


def _counter(model: nn.Module) -> CommCounter:
    from ._state import get_state

    return get_state(model).counter


def comm_counts(model: nn.Module) -> dict[str, Any]:
    """Totals since the last :func:`reset_comm_counts` for a model prepared by ``dedicate_params``.

    Example::

        counts = dmuon.diagnostics.comm_counts(model)
        assert counts["reduce"]["elements"] == sum(p.numel() for p in dmuon.get_dedicated_params(model).values())
    """
    return _counter(model).as_dict()


def reset_comm_counts(model: nn.Module) -> None:
    """Zero the counters (e.g. at the start of the step you want to measure).

    Example::

        dmuon.diagnostics.reset_comm_counts(model)
        train_one_step()
        print(dmuon.diagnostics.comm_counts(model)["forward_broadcast"])
    """
    _counter(model).reset()
