"""Every collective dmuon issues, in one place.

Issue and wait are separate (``broadcast`` / ``reduce_avg`` return a :class:`PendingComm`; ``wait``
finishes it) so the runtime can overlap them with compute and tests can patch either side. All
functions take the :class:`CommContext` explicitly and record their payload in its counter.

dmuon runs on its own process group (same ranks as the user's mesh) so its asynchronous collectives can
never interleave with the trainer's own (logging all-reduces, checkpoint barriers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from .diagnostics import CommCounter, CommKind

__all__ = [
    "CommContext", "PendingComm", "broadcast", "reduce_avg", "all_reduce_avg", "wait", "all_gather_object",
    "broadcast_object",
]


@dataclass
class CommContext:
    """dmuon's process group over one data-parallel mesh dimension, plus the device buffers live on."""

    group: dist.ProcessGroup
    #: Global ranks in mesh order: ``global_ranks[i]`` is the process holding mesh coordinate ``i``.
    global_ranks: tuple[int, ...]
    #: This process's coordinate in the mesh (the "rank" owners are expressed in).
    rank: int
    device: torch.device
    counter: CommCounter

    @property
    def world_size(self) -> int:
        return len(self.global_ranks)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, counter: CommCounter) -> CommContext:
        """Build a private group with the mesh's ranks (collective over the default group)."""
        global_ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        backend = dist.get_backend(mesh.get_group())
        group = dist.new_group(ranks=list(global_ranks), backend=backend)
        return cls(group, global_ranks, mesh.get_local_rank(), _mesh_device(mesh), counter)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


class PendingComm(NamedTuple):
    """An issued collective: its work handle (``None`` when nothing had to be sent) and its buffer."""

    work: dist.Work | None
    tensor: torch.Tensor


def broadcast(ctx: CommContext, tensor: torch.Tensor, src: int, kind: CommKind, label: str = "") -> PendingComm:
    """Broadcast ``tensor`` in place from mesh rank ``src`` to all ranks (asynchronously)."""
    ctx.counter.record(kind, tensor.numel())
    if ctx.world_size == 1:
        return PendingComm(None, tensor)
    with record_function(f"dmuon::broadcast ({label})"):
        work = dist.broadcast(tensor, src=ctx.global_ranks[src], group=ctx.group, async_op=True)
    return PendingComm(work, tensor)


def reduce_avg(ctx: CommContext, tensor: torch.Tensor, dst: int, kind: CommKind, label: str = "") -> PendingComm:
    """Average ``tensor`` over all ranks into mesh rank ``dst`` (asynchronously).

    Only the destination's buffer is meaningful afterwards; some backends overwrite the others'.
    """
    ctx.counter.record(kind, tensor.numel())
    if ctx.world_size == 1:
        return PendingComm(None, tensor)
    with record_function(f"dmuon::reduce ({label})"):
        work = dist.reduce(tensor, dst=ctx.global_ranks[dst], op=dist.ReduceOp.AVG, group=ctx.group, async_op=True)
    return PendingComm(work, tensor)


def all_reduce_avg(ctx: CommContext, tensor: torch.Tensor, kind: CommKind, label: str = "") -> PendingComm:
    """Average ``tensor`` over all ranks, in place on every rank (asynchronously)."""
    ctx.counter.record(kind, tensor.numel())
    if ctx.world_size == 1:
        return PendingComm(None, tensor)
    with record_function(f"dmuon::all_reduce ({label})"):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=ctx.group, async_op=True)
    return PendingComm(work, tensor)


def wait(pending: PendingComm) -> torch.Tensor:
    """Finish a collective and return its buffer."""
    if pending.work is not None:
        pending.work.wait()
    return pending.tensor


def all_gather_object(ctx: CommContext, obj: object) -> list[object]:
    """Gather a small picklable object from every rank (used once, to verify plans agree)."""
    out: list[object] = [None] * ctx.world_size
    if ctx.world_size == 1:
        return [obj]
    dist.all_gather_object(out, obj, group=ctx.group)
    return out


def broadcast_object(ctx: CommContext, obj: object, src: int) -> object:
    """Send a small picklable object from mesh rank ``src`` to every rank (metadata, never tensors)."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ctx.global_ranks[src], group=ctx.group)
    return box[0]
