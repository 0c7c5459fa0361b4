"""Every collective dmuon issues, in one place, and the counter that records what they move.

Issue and wait are separate (``broadcast`` / ``gather_parts`` / ``reduce_parts`` return a
:class:`PendingComm`; ``wait`` finishes it) so the runtime can overlap them with compute and tests can
patch either side. All functions take the :class:`CommContext` explicitly and record their payload in its
counter: one call there is one launch (one ``torch.distributed`` call).

dmuon runs on its own process group (same ranks as the user's mesh) so its asynchronous collectives can
never interleave with the trainer's own (logging all-reduces, checkpoint barriers).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from .errors import raise_internal
from .grid import grids_from_views
from .lifetime import track as _track

__all__ = [
    "CommKind", "CommCounter", "Dim", "CommContext", "PendingComm", "broadcast", "reduce_avg", "gather_parts",
    "reduce_parts", "gather_shares", "all_reduce_avg", "wait", "all_reduce_sum", "all_reduce_max",
    "all_gather_object", "broadcast_object", "grids_from_views", "local_world_size",
]


# --------------------------------------------------------------------------------------------------- #
# What moved, and why                                                                                  #
# --------------------------------------------------------------------------------------------------- #
class CommKind(enum.Enum):
    """Why a collective was issued."""

    #: Owners -> everyone, before a boundary's forward: every owner's bucket in one launch
    #: ([Note: one launch per boundary]).
    FORWARD_BROADCAST = "forward_broadcast"
    #: Owners -> everyone again before backward (Z3 only: the copies were freed after forward).
    BACKWARD_BROADCAST = "backward_broadcast"
    #: Everyone -> owners, the averaged gradients of a boundary's buckets in one launch (under HSDP: over
    #: the shard group to the owners' columns, then over the replicate group to the owners; ``by_dim``
    #: tells them apart).
    REDUCE = "reduce"
    #: HSDP: the owners' updated tensors to the other replicate rows' holders, after ``step()``.
    REPLICATE_PUBLISH = "replicate_publish"
    #: All-reduce of gradients of plain (neither dedicated nor FSDP2-sharded) parameters.
    REPLICATED_GRAD_ALL_REDUCE = "replicated_grad_all_reduce"
    #: Tensors moved by the state-dict functions (gathering to or scattering from full tensors).
    CHECKPOINT = "checkpoint"
    #: Tensor parallelism, in ``step()``: the shards of each owned matrix's update to the tp rank that runs its
    #: Newton-Schulz, and the result's shards back ([Note: TP update] in ``dmuon/optim/tp_update.py``); counted
    #: as what this rank sends to its tp peers.
    TP_EXCHANGE = "tp_exchange"
    #: HSDP, in ``step()``: each replicate row's share of the experts' updated values and state to the other
    #: rows of its shard column ([Note: expert NS across replicas] in ``dmuon/optim/routes/sharded.py``); counted as
    #: the bytes of every share.
    SHARDED_UPDATE = "sharded_update"


@dataclass
class CommCounter:
    """Running totals per :class:`CommKind` and mesh dimension (``"shard"``, ``"replicate"``, ``"world"``; the
    node layout's ``"node"`` and ``"rail"``):
    ``calls`` are launches (one ``torch.distributed`` call each), ``elements`` / ``nbytes`` the payload they
    deliver (without any padding a backend needs)."""

    elements: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    calls: dict[tuple[CommKind, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[CommKind, str], int] = field(default_factory=dict)

    def record(self, kind: CommKind, tensor: torch.Tensor, dim: str, *, numel: int | None = None) -> None:
        """One collective of ``kind`` along ``dim`` whose payload is ``tensor`` (``numel`` of its elements
        where only part of it leaves this rank)."""
        key = (kind, dim)
        numel = tensor.numel() if numel is None else numel
        self.elements[key] = self.elements.get(key, 0) + numel
        self.calls[key] = self.calls.get(key, 0) + 1
        self.nbytes[key] = self.nbytes.get(key, 0) + numel * tensor.element_size()

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


# --------------------------------------------------------------------------------------------------- #
# Process groups                                                                                       #
# --------------------------------------------------------------------------------------------------- #
class Dim(enum.Enum):
    """Which of dmuon's process groups a collective runs on."""

    #: The ranks of this rank's replicate row (the 1-D mesh itself when there is no HSDP).
    SHARD = "shard"
    #: The ranks of this rank's shard column: same shard index, every replicate row.
    REPLICATE = "replicate"
    #: Every rank (checkpoints, plan checks, plain-parameter gradients).
    WORLD = "world"
    #: The node layout ([Note: node layout] in ``hierarchy.py``): the ranks of this rank's node.
    NODE = "node"
    #: The node layout: the ranks of this rank's local index, one in every node (a *rail*).
    RAIL = "rail"


@dataclass
class CommContext:
    """dmuon's private process groups over a (replicate x shard) grid of ranks, and the buffer device.

    A 1-D mesh is the grid with one replicate row. Owners are *slots* ``r * shard_size + s`` of the grid;
    ``grid[r][s]`` is the global rank at replicate index ``r`` and shard index ``s``.
    """

    grid: tuple[tuple[int, ...], ...]
    replicate_index: int
    shard_index: int
    groups: dict[Dim, dist.ProcessGroup | None]
    device: torch.device
    counter: CommCounter
    #: ranks per node by torchrun's numbering (``LOCAL_WORLD_SIZE`` consecutive ranks a node), where every rank
    #: of the job read the same value; ``None`` where unknown, not the same everywhere, or not needed (no
    #: replicate dim). Learnt in :meth:`from_meshes`' gather.
    ranks_per_node: int | None = None
    #: the node layout ([Note: node layout] in ``hierarchy.py``): ranks per node, whose node and rail groups
    #: ``groups`` holds; ``None``: the flat layout (owners anywhere in the shard row)
    node_size: int | None = None

    # -- geometry --------------------------------------------------------------------------------- #
    @property
    def replicate_size(self) -> int:
        return len(self.grid)

    @property
    def shard_size(self) -> int:
        return len(self.grid[0])

    @property
    def world_size(self) -> int:
        return self.replicate_size * self.shard_size

    @property
    def rank(self) -> int:
        """This process's slot, the unit owners are expressed in (the mesh rank on a 1-D mesh)."""
        return self.replicate_index * self.shard_size + self.shard_index

    @property
    def spans_job(self) -> bool:
        """Whether dmuon's grid holds every rank of the job: so except under tensor parallelism, where there is
        one grid per tp index, and under pipeline parallelism, where the grid is one stage's data-parallel ranks
        ([Note: pipeline stages] in ``topology.py``). The agreement collectives below (small gathers and sums
        that every rank must see alike: the clip norm sums every stage's share) run over dmuon's world group
        when it does, over the default group when not."""
        return self.world_size == dist.get_world_size()

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global rank of every slot, in slot order."""
        return tuple(r for row in self.grid for r in row)

    def __post_init__(self) -> None:
        # asked on every hook call: computed once
        self._sizes = {Dim.SHARD: self.shard_size, Dim.REPLICATE: self.replicate_size, Dim.WORLD: self.world_size}
        self._indices = {Dim.SHARD: self.shard_index, Dim.REPLICATE: self.replicate_index, Dim.WORLD: self.rank}
        if self.node_size is not None:  # a 1-D grid: slot = node x node_size + local index
            n = self.node_size
            self._sizes.update({Dim.NODE: n, Dim.RAIL: self.shard_size // n})
            self._indices.update({Dim.NODE: self.shard_index % n, Dim.RAIL: self.shard_index // n})
        #: per dim, whether its group's backend gathers parts of unequal sizes in one launch (asked lazily)
        self._uneven: dict[Dim, bool] = {}

    def size(self, dim: Dim) -> int:
        return self._sizes[dim]

    def index(self, dim: Dim) -> int:
        """This process's index along ``dim``."""
        return self._indices[dim]

    def global_rank(self, dim: Dim, index: int) -> int:
        """Global rank of ``index`` along ``dim`` as seen from this process."""
        if dim is Dim.SHARD:
            return self.grid[self.replicate_index][index]
        if dim is Dim.REPLICATE:
            return self.grid[index][self.shard_index]
        if dim is Dim.NODE:
            return self.grid[0][self.shard_index - self.shard_index % self.node_size + index]  # type: ignore[operator]
        if dim is Dim.RAIL:
            return self.grid[0][index * self.node_size + self.shard_index % self.node_size]  # type: ignore[operator]
        return self.grid[index // self.shard_size][index % self.shard_size]

    # -- construction ------------------------------------------------------------------------------ #
    @classmethod
    def from_meshes(cls, shard_mesh: DeviceMesh, replicate_mesh: DeviceMesh | None, counter: CommCounter, *,
                    node_size: int | None = None) -> CommContext:
        """Private groups with the meshes' ranks. Collective over the default group.

        With a ``replicate_mesh``, every rank's shard and replicate ranks must form one grid; otherwise
        every rank raises the same ``ValueError`` before any group is created. ``node_size``: the node layout
        on a 1-D mesh of whole nodes of that many consecutive slots (checked by ``dedicate_params`` on every
        rank alike): its node and rail groups too.
        """
        backend = dist.get_backend(shard_mesh.get_group())
        timeout = _user_timeout(_mesh_device(shard_mesh))
        me = dist.get_rank()
        row = tuple(int(r) for r in shard_mesh.mesh.flatten().tolist())
        col = tuple(int(r) for r in replicate_mesh.mesh.flatten().tolist()) if replicate_mesh is not None else (me,)
        # Tensor parallelism: one grid of data-parallel ranks per tp index; pipeline parallelism: one per stage
        # (the ranks whose shard and replicate meshes cover only part of the world). Every rank learns every grid, so that each creates every group
        # in the same order: new_group is collective over the default group.
        views: list[object] = [None] * dist.get_world_size()
        per_node = None
        if len(row) * len(col) == dist.get_world_size() and replicate_mesh is None:
            views = [(r, row, (r,)) for r in row]  # plain data parallelism: nothing to gather
        else:  # the node layout rides along (the HSDP expert split reads it: [Note: expert NS across replicas])
            dist.all_gather_object(views, ((me, row, col), local_world_size()))
            read = {v[1] for v in views}  # type: ignore[index]
            per_node = read.pop() if len(read) == 1 else None  # every rank the same, or unknown
            views = [v[0] for v in views]  # type: ignore[index]
        grids = grids_from_views(views)  # type: ignore[arg-type]
        groups: dict[Dim, dist.ProcessGroup | None] = {}
        mine: tuple[tuple[int, ...], ...] = ()
        for grid in grids:
            made = _new_grid_groups(grid, me, backend, timeout)
            if made is not None:
                mine, groups = grid, made
        if node_size is not None:
            groups.update(_new_node_groups(mine[0], me, node_size, backend, timeout))
        r_idx = next(i for i, rr in enumerate(mine) if me in rr)
        ctx = cls(mine, r_idx, mine[r_idx].index(me), groups, _mesh_device(shard_mesh), counter, per_node or None,
                  node_size)
        _track(ctx)
        return ctx


def _new_grid_groups(grid: tuple[tuple[int, ...], ...], me: int, backend: str, timeout: Any
                     ) -> dict[Dim, dist.ProcessGroup | None] | None:
    """Create the shard rows, replicate columns and world group of one grid, in order (every rank runs this for
    every grid); the groups of ``me`` if it is in the grid, else ``None``."""
    r_idx = next((i for i, rr in enumerate(grid) if me in rr), None)
    groups: dict[Dim, dist.ProcessGroup | None] = {}
    for r, ranks in enumerate(grid):
        g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if r == r_idx:
            groups[Dim.SHARD] = g
    if len(grid) == 1:
        groups[Dim.REPLICATE] = None
        groups[Dim.WORLD] = groups.get(Dim.SHARD)
    else:
        for s in range(len(grid[0])):
            g = dist.new_group(ranks=[grid[r][s] for r in range(len(grid))], backend=backend, timeout=timeout)
            if r_idx is not None and grid[r_idx][s] == me:
                groups[Dim.REPLICATE] = g
        groups[Dim.WORLD] = dist.new_group(ranks=[r for rr in grid for r in rr], backend=backend, timeout=timeout)
    return groups if r_idx is not None else None


def _new_node_groups(row: tuple[int, ...], me: int, n: int, backend: str, timeout: Any
                     ) -> dict[Dim, dist.ProcessGroup | None]:
    """The node groups (``n`` consecutive slots each), then the rails (one slot of every node), in order."""
    groups: dict[Dim, dist.ProcessGroup | None] = {}
    for ranks in [row[i : i + n] for i in range(0, len(row), n)] + [row[j::n] for j in range(n)]:
        g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
        if me in ranks:
            groups[Dim.RAIL if Dim.NODE in groups else Dim.NODE] = g
    return groups


def local_world_size() -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (0 where unset or unreadable)."""
    try:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0


def _user_timeout(device: torch.device) -> timedelta | None:
    """The timeout given to ``init_process_group``, so that dmuon's groups give up on a dead peer when the
    user's own would (``new_group`` alone takes the backend's default, 30 minutes for gloo). ``None`` (the
    default) where this torch keeps it elsewhere: the backend's options are not public API."""
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


# --------------------------------------------------------------------------------------------------- #
# Collectives: issue returns a PendingComm, wait finishes it                                           #
# --------------------------------------------------------------------------------------------------- #
class PendingComm(NamedTuple):
    """An issued collective: its work handle (``None`` when nothing had to be sent), its buffer, and what
    :func:`wait` still does once the work is done (copying a padded gather out; ``None``: nothing)."""

    work: dist.Work | None
    tensor: torch.Tensor
    then: Callable[[], None] | None = None


def broadcast(ctx: CommContext, tensor: torch.Tensor, src: int, kind: CommKind, label: str = "",
              dim: Dim = Dim.SHARD) -> PendingComm:
    """Broadcast ``tensor`` in place from index ``src`` along ``dim`` (asynchronously).

    Over a dimension of size 1 nothing moves and nothing is counted."""
    if ctx.size(dim) == 1:
        return PendingComm(None, tensor)
    ctx.counter.record(kind, tensor, dim.value)
    with record_function(f"dmuon::broadcast[{dim.value}] ({label})"):
        work = dist.broadcast(tensor, src=ctx.global_rank(dim, src), group=ctx.groups[dim], async_op=True)
    return PendingComm(work, tensor)


def reduce_avg(ctx: CommContext, tensor: torch.Tensor, dst: int, kind: CommKind, label: str = "",
               dim: Dim = Dim.SHARD) -> PendingComm:
    """Average ``tensor`` along ``dim`` into index ``dst`` (asynchronously).

    Only the destination's buffer is meaningful afterwards; some backends overwrite the others'.
    """
    if ctx.size(dim) == 1:
        return PendingComm(None, tensor)
    ctx.counter.record(kind, tensor, dim.value)
    with record_function(f"dmuon::reduce[{dim.value}] ({label})"):
        work = dist.reduce(tensor, dst=ctx.global_rank(dim, dst), op=dist.ReduceOp.AVG, group=ctx.groups[dim],
                           async_op=True)
    return PendingComm(work, tensor)


# [Note: one launch per boundary]
# A boundary's dedicated matrices have up to one owner bucket per shard index, each with its own source (its
# holder). Broadcasting each bucket on its own makes the launches per boundary grow with the world (up to the
# boundary's matrix count, each a ring whose latency grows with the group). Instead every owner's bucket moves
# in one launch per phase: ``gather_parts`` is one ``all_gather`` in which index ``i`` sends ``parts[i]`` and
# every rank receives every part in place, ``reduce_parts`` one ``reduce_scatter`` (AVG) in which index ``i``
# receives the average of everyone's ``parts[i]``. The parts' sizes differ (an empty part where an index owns
# nothing here), which NCCL runs as its broadcasts (reduces) grouped into one launch: the bytes of one
# broadcast (reduce) per bucket, the latency of one. gloo reduce-scatters parts of unequal sizes itself; its
# all-gather takes equal sizes only, so there the parts are padded to the largest (a gloo-only cost: ``(g-1)``
# times the largest part per rank on the wire and ``g + 1`` padded buffers of scratch). A padded all-gather
# everywhere was rejected by its arithmetic: a boundary with k owners among g ranks would move ``(g-1) x
# largest`` bytes per rank instead of the sum of k buckets, 9x to 17x more for a Llama-3 layer on 64 ranks.
# Bits: a broadcast or an all-gather copies; gloo's reduce-scatter AVG equals its reduce AVG bit for bit
# (measured on torch 2.13, fp32 and bf16, 2 to 8 ranks, parts of 0 to 265k elements). A phase with one
# non-empty part stays one broadcast (reduce).
def _parts_payload(ctx: CommContext, parts: Sequence[torch.Tensor], kind: CommKind, dim: Dim, label: str,
                   verb: str) -> tuple[int, int] | None:
    """``(this index, the one non-empty index or -1)``, or ``None`` when nothing moves (a dimension of size 1,
    or every part empty). Counts the launch unless one part moves: :func:`broadcast` / :func:`reduce_avg`
    count that one."""
    if len(parts) != ctx.size(dim):
        raise_internal(f"{verb} ({label}): {len(parts)} parts for a {dim.value} group of {ctx.size(dim)} ranks")
    full = [i for i, p in enumerate(parts) if p.numel() > 0]
    if ctx.size(dim) == 1 or not full:
        return None
    if len(full) == 1:
        return ctx.index(dim), full[0]
    ctx.counter.record(kind, parts[full[0]], dim.value, numel=sum(p.numel() for p in parts))
    return ctx.index(dim), -1


def gather_parts(ctx: CommContext, parts: Sequence[torch.Tensor], kind: CommKind, label: str = "",
                 dim: Dim = Dim.SHARD) -> PendingComm:
    """Every index ``i`` along ``dim`` sends its ``parts[i]`` (1-D, one dtype, sizes may differ, empty where
    ``i`` sends nothing) and every rank receives all of them in place: one launch (asynchronously), [Note: one
    launch per boundary]. Counted as one call of the parts' total elements."""
    found = _parts_payload(ctx, parts, kind, dim, label, "gather_parts")
    if found is None:
        return PendingComm(None, parts[0])
    me, only = found
    if only >= 0:
        return broadcast(ctx, parts[only], only, kind, label, dim)
    group = ctx.groups[dim]
    with record_function(f"dmuon::all_gather[{dim.value}] ({label})"):
        if len({p.numel() for p in parts}) == 1 or _gathers_uneven(ctx, dim):
            work = dist.all_gather(list(parts), parts[me], group=group, async_op=True)
            return PendingComm(work, parts[me])
        largest = max(p.numel() for p in parts)
        send = parts[me].new_empty(largest)
        send[: parts[me].numel()].copy_(parts[me])
        recv = [parts[me].new_empty(largest) for _ in parts]
        work = dist.all_gather(recv, send, group=group, async_op=True)

    def copy_out() -> None:
        for i, p in enumerate(parts):
            if i != me and p.numel() > 0:
                p.copy_(recv[i][: p.numel()])

    return PendingComm(work, parts[me], copy_out)


def reduce_parts(ctx: CommContext, parts: Sequence[torch.Tensor], kind: CommKind, label: str = "",
                 dim: Dim = Dim.SHARD) -> PendingComm:
    """Average every rank's ``parts[i]`` along ``dim`` into index ``i``'s ``parts[i]``, for every ``i`` at once
    (1-D, one dtype, sizes may differ, empty where ``i`` receives nothing): one launch (asynchronously),
    [Note: one launch per boundary]. Only this index's own part is meaningful afterwards; backends may
    overwrite the others'. Counted as one call of the parts' total elements."""
    found = _parts_payload(ctx, parts, kind, dim, label, "reduce_parts")
    if found is None:
        return PendingComm(None, parts[0])
    me, only = found
    if only >= 0:
        return reduce_avg(ctx, parts[only], only, kind, label, dim)
    with record_function(f"dmuon::reduce_scatter[{dim.value}] ({label})"):
        work = dist.reduce_scatter(parts[me], list(parts), op=dist.ReduceOp.AVG, group=ctx.groups[dim],
                                   async_op=True)
    return PendingComm(work, parts[me])


def gather_shares(ctx: CommContext, parts: Sequence[torch.Tensor]) -> None:
    """Every replicate index ``i`` sends ``parts[i]`` (1-D bytes, sizes may differ) and receives every other
    index's in place: one launch, blocking (``step()`` reads the result next). [Note: expert NS across
    replicas] in ``dmuon/optim/routes/sharded.py``."""
    wait(gather_parts(ctx, parts, CommKind.SHARDED_UPDATE, "expert shares", dim=Dim.REPLICATE))


def _gathers_uneven(ctx: CommContext, dim: Dim) -> bool:
    """Whether ``dim``'s backend all-gathers parts of unequal sizes in one launch: NCCL does (its broadcasts,
    grouped); gloo refuses them, and other backends are not assumed to."""
    known = ctx._uneven.get(dim)
    if known is None:
        known = ctx._uneven[dim] = dist.get_backend(ctx.groups[dim]) == "nccl"
    return known


def all_reduce_avg(ctx: CommContext, tensor: torch.Tensor, kind: CommKind, label: str = "",
                   dim: Dim = Dim.WORLD) -> PendingComm:
    """Average ``tensor`` along ``dim``, in place on every rank (asynchronously)."""
    if ctx.size(dim) == 1:
        return PendingComm(None, tensor)
    ctx.counter.record(kind, tensor, dim.value)
    with record_function(f"dmuon::all_reduce[{dim.value}] ({label})"):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=ctx.groups[dim], async_op=True)
    return PendingComm(work, tensor)


def tp_exchange(ctx: CommContext, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                recv_counts: list[int], group: dist.ProcessGroup) -> None:
    """One all-to-all over the "tp" ``group`` ([Note: TP update]): ``send_counts[d]`` elements of ``send`` to tp
    rank ``d``, ``recv_counts[s]`` of ``recv`` from tp rank ``s``; blocking, since Newton-Schulz (or the step)
    needs the result next."""
    me = dist.get_rank(group)
    ctx.counter.record(CommKind.TP_EXCHANGE, send, "tp", numel=send.numel() - send_counts[me])
    with record_function("dmuon::all_to_all[tp]"):
        dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)


def wait(pending: PendingComm) -> torch.Tensor:
    """Finish a collective and return its buffer."""
    if pending.work is not None:
        pending.work.wait()
    if pending.then is not None:
        pending.then()
    return pending.tensor


def _job_group(ctx: CommContext) -> dist.ProcessGroup | None:
    """The group of every rank of the job: dmuon's world group, or under TP and across pipeline stages the
    default group (``None``)."""
    return ctx.groups[Dim.WORLD] if ctx.spans_job else None


def all_reduce_sum(ctx: CommContext, value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor of a few elements over every rank of the job (:attr:`CommContext.spans_job`) and wait (a
    NaN or inf carries through, as in any addition). Not counted: a few bytes (the clip norm)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=_job_group(ctx))
    return value


def all_reduce_max(ctx: CommContext, value: torch.Tensor, *, stage: bool = False) -> torch.Tensor:
    """The elementwise maximum of a few-element tensor over every rank of the job, NaN-propagating like
    ``torch.maximum``: a backend's MAX may drop a NaN (gloo's does), so whether any rank had one travels
    as a flag beside the values. ``stage``: over this rank's pipeline stage only (its data-parallel ranks,
    which hold the same modules: QK-clip's per-head maxima). Returns a new tensor; not counted."""
    if dist.get_world_size() == 1:
        return value
    packed = torch.cat([torch.nan_to_num(value, nan=-math.inf, posinf=math.inf, neginf=-math.inf).reshape(-1),
                        torch.isnan(value).reshape(-1).to(value.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=ctx.groups[Dim.WORLD] if stage else _job_group(ctx))
    n = value.numel()
    return torch.where(packed[n:] > 0, torch.full_like(packed[:n], math.nan), packed[:n]).view_as(value)


def all_gather_default(obj: object) -> list[object]:
    """Every rank's ``obj`` over the default process group: ``dedicate_params``' agreement, before dmuon's
    own groups exist."""
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_object(ctx: CommContext, obj: object) -> list[object]:
    """Gather a small picklable object from every rank of the job (plan checks, checkpoint metadata), in
    global rank order."""
    if dist.get_world_size() == 1:
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_job_group(ctx))
    return out


def broadcast_object(ctx: CommContext, obj: object, src: int) -> object:
    """Send a small picklable object from slot ``src`` to every rank (metadata, never tensors)."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ctx.global_rank(Dim.WORLD, src), group=ctx.groups[Dim.WORLD])
    return box[0]


# --------------------------------------------------------------------------------------------------- #
# State dicts: from global rank 0, and whole tensor-parallel matrices                                  #
# --------------------------------------------------------------------------------------------------- #
def broadcast_from_rank0(ctx: CommContext, tensor: torch.Tensor, kind: CommKind, label: str = "") -> torch.Tensor:
    """Broadcast ``tensor`` in place from global rank 0 to every rank of the job and wait. Counted on
    ``"world"``."""
    if ctx.spans_job:
        return wait(broadcast(ctx, tensor, ctx.global_ranks.index(0), kind, label, dim=Dim.WORLD))
    ctx.counter.record(kind, tensor, Dim.WORLD.value)
    with record_function(f"dmuon::broadcast[world] ({label})"):
        dist.broadcast(tensor, src=0)
    return tensor


def broadcast_object_from_rank0(ctx: CommContext, obj: object) -> object:
    """A small picklable object from global rank 0 to every rank of the job; metadata, not counted, as
    :func:`broadcast_object`."""
    if ctx.spans_job:
        return broadcast_object(ctx, obj, ctx.global_ranks.index(0))
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tp_all_gather(ctx: CommContext, shard: torch.Tensor, dim: int, mesh: DeviceMesh, kind: CommKind,
                  label: str = "") -> torch.Tensor:
    """Every tp rank's ``shard`` concatenated along ``dim`` in the order of the 1-D "tp" ``mesh`` (a
    tensor-parallel matrix whole on each of its tp ranks); blocking. Counted on ``"tp"`` as this rank's shard."""
    group = mesh.get_group()
    parts = [torch.empty_like(shard) for _ in range(mesh.size())]
    ctx.counter.record(kind, shard, "tp")
    with record_function(f"dmuon::all_gather[tp] ({label})"):
        dist.all_gather(parts, shard.contiguous(), group=group)
    order = dist.get_process_group_ranks(group)  # group rank -> global rank; the mesh gives the tp order
    return torch.cat([parts[order.index(int(r))] for r in mesh.mesh.flatten().tolist()], dim=dim)
