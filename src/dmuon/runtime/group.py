"""One lifecycle object per hook boundary: the dedicated weights a module (e.g. ``layers.3``) needs.

A :class:`BoundaryGroup` keeps, per owner rank and dtype, one flat *bucket* buffer. Every dedicated
parameter of the bucket is an ``nn.Parameter`` whose ``.data`` is a view into that buffer, so one
transfer fills all of them and freeing the buffer's storage frees all of them, while the parameter
objects (and autograd's saved views of them) stay the same. Every owner's bucket of a boundary moves in one
launch per phase and dtype ([Note: one launch per boundary] in ``dmuon/runtime/comm.py``): the forward
gather, the backward gather (Z3), the gradient reduce, and under HSDP the replicate reduce and publish. Which
collectives carry the shard row's phases (one launch, or node by node: [Note: node layout]) is
``dmuon/runtime/hierarchy.py``'s.

[Note: why the storage is resized instead of swapping ``.data``]
Autograd saves views of a weight for backward. Swapping ``p.data`` would leave the old buffer alive
through those views; resizing the shared storage to 0 bytes really frees it, and resizing it back and
broadcasting into it refills exactly what the saved views read.

[Note: HSDP]
Owners are slots of a (replicate x shard) grid. Every rank of the owner's shard *column* (same shard
index, every replicate row) is a *holder* and keeps the full tensor, so each row gathers it from its
own holder over its shard group. Gradients reduce in two stages: over the shard group to the row's
holder, then over the replicate group to the owner (net divisor: the world size). After ``step()`` the
owners publish the new tensors to the other holders over the replicate group (every owner row's segment of
a bucket in one launch), asynchronously by default; a bucket's next gather first waits for that publish,
and so does the first read of a holder's copy before that ([Note: guarded parameters] in
``dmuon/runtime/guard.py``). A 1-D mesh is the one-row grid: every holder is the owner and the replicate
stages vanish.

[Note: gradients]
The post-accumulate-grad hook hands us the local gradient of a parameter once per backward (also when
the module ran twice or under activation checkpointing). When every parameter of the group has one, the
gradients of each bucket are concatenated and reduced (average) to the bucket's owner, every bucket of the
boundary in one launch; everybody drops the local gradient at once. A gradient the owner already holds
from an earlier reduce (accumulation without ``no_sync``) is set aside before autograd accumulates into it
and added back after the next reduce, so it is never averaged twice. Per matrix, that cycle is
:class:`~dmuon.runtime.param.GradState`:

    EMPTY --(no_sync backward)--> UNSYNCED --(backward outside no_sync)--> READY --(bucket reduce
    issued)--> REDUCING --(reduce done)--> REDUCED on the owner / EMPTY elsewhere

and ``zero_grad`` returns to EMPTY. A matrix still UNSYNCED when a synchronised backward ends (used inside
``no_sync`` only) is handed over then, so a step's gradient is averaged exactly once whatever micro-batch
last used the matrix. Only :class:`~dmuon.runtime.param.DedicatedParam` writes these
fields; this file decides *when* (per bucket), ``dmuon/runtime/hooks.py`` feeds it the autograd events.

[Note: mixed precision]
Three dtypes per dedicated matrix, all fixed by ``dedicate_params``:

* ``dtype``: the parameter's own dtype, what state dicts hold;
* ``compute_dtype``: what the module computes with and what the gathers carry (``param_dtype``, default
  ``dtype``). When it differs, the ``nn.Parameter`` is the compute copy and the owner keeps the value in
  ``dtype`` as ``DedicatedParam.master`` (FSDP2's sharded fp32 parameter vs. its unsharded bf16 one);
* the reduce dtype (``reduce_dtype``, default ``compute_dtype``): local gradients are cast to it before
  the reduce. When it is wider than ``compute_dtype`` the owner's averaged gradient stays in it, as
  ``DedicatedParam.main_grad`` (torch refuses a ``.grad`` whose dtype differs from the
  parameter's), and ``no_sync`` accumulates local gradients in it (as FSDP2 does); otherwise it is cast
  to the parameter's dtype and lands in ``param.grad`` as without mixed precision.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import comm as C
from .comm import CommKind
from .config import RuntimeConfig
from .errors import raise_internal
from .guard import ACCESS_ATTR, INFO_ATTR, Access, TrainingPass, internal, set_access
from .hierarchy import gather_boundary, reduce_boundary
from .param import DedicatedParam, local
from .precision import is_wider

__all__ = ["GroupState", "Bucket", "BoundaryGroup"]


class GroupState(enum.Enum):
    """Which memory is live for the group's dedicated weights."""

    #: Owners hold their tensors; every other rank holds 0 bytes for them. Resting state between steps.
    SHARDED = "sharded"
    #: Broadcasts are in flight into freshly allocated buffers; reading the weights is not yet allowed.
    #: Entered by the boundary's own hook or, earlier, by a prefetch from the boundary that runs before it.
    UNSHARDING = "unsharding"
    #: Every rank holds the full weights (during forward; kept until backward under Z2).
    UNSHARDED = "unsharded"
    #: The gradient reduce is in flight; non-holders already dropped weights and gradients.
    REDUCING = "reducing"


@dataclass(eq=False)
class Bucket:
    """The dedicated params of one boundary whose owners share a shard column (on a 1-D mesh: one
    owner) and a dtype: one part of the boundary's gathers and shard-group reduce. Params are ordered by
    owner row, so each owner's params form one contiguous *segment*: its part of the replicate-group
    collectives."""

    #: Shard index of the holders: the source of the row gathers' part, the target of the row reduce's.
    column: int
    params: list[DedicatedParam]
    offsets: list[int]
    numel: int
    #: Flat buffer the params view into; its storage is 0 bytes on non-holders while sharded.
    flat: torch.Tensor | None = None
    #: World size 1: the local gradients themselves, nothing to average (no concatenation copy).
    pending_local: tuple[list[torch.Tensor], list[DedicatedParam]] | None = None
    #: In-flight publishes of updated weights over the replicate group (holders only). While any is, the
    #: bucket's params are guarded: their first value read waits for it.
    pending_publish: list[C.PendingComm] = field(default_factory=list)
    #: Holders' copies not yet synced from the owners (after a bind or a checkpoint load).
    stale: bool = False

    def buffer(self) -> torch.Tensor:
        """The flat buffer; an internal error before the first bind."""
        if self.flat is None:
            raise_internal(f"bucket of column {self.column} used before it was bound")
        return self.flat  # type: ignore[return-value]

    def nbytes(self) -> int:
        return self.numel * self.buffer().element_size()


def _segments(dps: Sequence[DedicatedParam], shard_size: int) -> list[tuple[int, int, int]]:
    """``(owner_row, start, end)`` element ranges of consecutive params with the same owner row."""
    out: list[tuple[int, int, int]] = []
    off = 0
    for dp in dps:
        row, n = dp.owner // shard_size, dp.shape.numel()
        if out and out[-1][0] == row:
            out[-1] = (row, out[-1][1], off + n)
        else:
            out.append((row, off, off + n))
        off += n
    return out


@dataclass(frozen=True, eq=False)
class _BucketAccess:
    """A bound param's :class:`~dmuon.runtime.guard.BoundaryAccess`: its group, held weakly (the param must not
    keep its model alive: see ``_weak_hook`` in ``dmuon/runtime/hooks.py``), and its bucket's index."""

    group: weakref.ReferenceType[BoundaryGroup]
    index: int
    boundary: str

    def outside_window(self) -> str | None:
        g = self.group()
        return None if g is None else g.outside_window()

    def admit(self) -> None:
        g = self.group()
        if g is not None:
            g.admit(self.index)


class BoundaryGroup:
    """Runtime of one hook boundary. State changes only through the guarded methods below.

    Some methods are *drains*, idempotent by design because several callers may reach them in one step
    (``finish_reduce``, ``wait_all_publishes``, ``reshard`` from SHARDED, ``unshard`` of a prefetched
    group); each says which states it accepts, and any other state raises an internal error naming the
    boundary, the state and the expected ones."""

    # Static #
    fqn: str  # the boundary module's name ("" for the root)
    buckets: list[Bucket]
    params: list[DedicatedParam]
    # Runtime #
    state: GroupState
    #: Grad-enabled forwards whose backward has not finished yet; weights must stay reachable.
    backward_pending: bool
    #: The model's training pass (``DMuonState`` shares its own with every group before the first bind);
    #: read only here, to choose the params' classes.
    training_pass: TrainingPass

    def __init__(self, fqn: str, params: Sequence[DedicatedParam], ctx: C.CommContext, config: RuntimeConfig,
                 training_pass: TrainingPass | None = None):
        self.fqn = fqn
        self.params = list(params)
        self.ctx = ctx
        self.config = config
        S = ctx.shard_size
        # one bucket per (shard column, compute dtype): a boundary may mix dtypes (an fp32 head beside
        # bf16 blocks); a flat buffer holds one. Sorted by column, then dtype name: the same on every rank.
        by_key: dict[tuple[int, str], list[DedicatedParam]] = {}
        for dp in self.params:
            by_key.setdefault((dp.owner % S, str(dp.compute_dtype)), []).append(dp)
        self.buckets = []
        for column, dtype_name in sorted(by_key):
            dps = sorted(by_key[column, dtype_name], key=lambda dp: dp.owner // S)  # stable: plan order in a row
            offsets, total = [], 0
            for dp in dps:
                offsets.append(total)
                total += dp.shape.numel()
            self.buckets.append(Bucket(column, dps, offsets, total))
        self.state = GroupState.SHARDED
        self.backward_pending = False
        self.training_pass = TrainingPass() if training_pass is None else training_pass
        #: Called for each owned param whose ``.grad`` just received a reduced gradient (set by the
        #: model state: it arms the stash hook).
        self.on_grad_reduced: Callable[[DedicatedParam], None] | None = None
        #: the buckets of each compute dtype, in bucket order: one launch each per phase
        self._launches: list[list[Bucket]] = []
        for b in self.buckets:
            same = [ln for ln in self._launches if ln[0].params[0].compute_dtype == b.params[0].compute_dtype]
            if same:
                same[0].append(b)
            else:
                self._launches.append([b])
        self._bound = False
        self._pending_unshard: list[C.PendingComm] = []
        #: the in-flight gradient reduce (stage 1), one launch per reduce dtype, with what each covers: every
        #: bucket's buffer and the params it holds, in buffer order
        self._pending_reduce: list[tuple[C.PendingComm, list[tuple[Bucket, torch.Tensor, list[DedicatedParam]]]]] = []

    def _assert_in(self, op: str, *states: GroupState) -> None:
        if self.state not in states:
            raise_internal(
                f"boundary {self.fqn or '<root>'!r}: {op} in state {self.state.value}, expected "
                + " or ".join(s.value for s in states)
            )

    def is_holder(self, b: Bucket) -> bool:
        """Whether this rank keeps ``b``'s full weights (it sits in the owners' shard column)."""
        return self.ctx.shard_index == b.column

    @staticmethod
    def _parts(size: int, parts: dict[int, torch.Tensor], like: torch.Tensor) -> list[torch.Tensor]:
        """One launch's parts along a dimension of ``size``: ``parts[i]`` at index ``i``, empty elsewhere."""
        return [parts[i] if i in parts else like.new_empty(0) for i in range(size)]

    # ------------------------------------------------------------------ #
    # Binding (parameters <-> bucket buffers)                              #
    # ------------------------------------------------------------------ #
    def is_bound(self) -> bool:
        return self._bound

    def needs_bind(self) -> bool:
        return not self._bound or any(dp.current() is not dp.param for dp in self.params)

    def is_meta(self) -> bool:
        return any(dp.current().is_meta for dp in self.params)

    def bind(self, register_hooks: Callable[[DedicatedParam], None]) -> None:
        """Point every parameter at its bucket buffer; owners copy their values in, others free theirs.

        Called at ``dedicate_params`` time and again whenever the parameter objects were replaced
        (``to_empty`` after meta-device init). Issues no collective.
        """
        if self._bound:
            self._assert_in("rebind", GroupState.SHARDED)
        with torch.no_grad(), internal():
            for i, b in enumerate(self.buckets):
                self._bind_bucket(i, b, register_hooks)
        self.state = GroupState.SHARDED
        self._bound = True
        self.sync_classes()

    def _bind_bucket(self, index: int, b: Bucket, register_hooks: Callable[[DedicatedParam], None]) -> None:
        for dp in b.params:
            dp.adopt_dtype(dp.current())
        dtype = b.params[0].compute_dtype
        flat = torch.empty(b.numel, dtype=dtype, device=self.ctx.device)
        for dp, off in zip(b.params, b.offsets):
            p = dp.current()
            if dp.compute_dtype != dtype:
                raise ValueError(
                    f"dmuon: dedicated param {dp.fqn} of boundary {self.fqn!r} now computes in {dp.compute_dtype}, "
                    f"but dedicate_params saw {dtype}; change dtypes before dedicate_params, not after."
                )
            value = local(p).detach()  # a tensor-parallel param: its shard (``dp.shape`` is the shard's)
            view = flat[off : off + dp.shape.numel()].view(dp.shape)
            if self.is_holder(b):
                view.copy_(value)  # rounds to the compute dtype under param_dtype
            master = value.to(dp.dtype, copy=True) if dp.is_owner and dp.compute_dtype != dp.dtype else None
            dp.bind(p, view, master)
            setattr(p, INFO_ATTR, (dp.fqn, self.ctx.global_rank(C.Dim.WORLD, dp.owner)))
            setattr(p, ACCESS_ATTR, _BucketAccess(weakref.ref(self), index, self.fqn))
            register_hooks(dp)
        if not self.is_holder(b):
            flat.untyped_storage().resize_(0)
        b.flat = flat
        b.pending_publish.clear()
        # other rows' holders may have initialised differently: the owners' values win
        b.stale = self.ctx.replicate_size > 1

    # ------------------------------------------------------------------ #
    # Unshard / reshard                                                    #
    # ------------------------------------------------------------------ #
    def unshard(self, kind: CommKind) -> None:
        """Allocate non-owner buffers and start one gather of every bucket per dtype (SHARDED -> UNSHARDING).

        REDUCING finishes the reduce first; UNSHARDING / UNSHARDED (prefetched, or Z2 copies kept for
        backward) have nothing to issue."""
        if self.state is GroupState.REDUCING:
            self.finish_reduce()
        if self.state in (GroupState.UNSHARDING, GroupState.UNSHARDED):
            return
        self._assert_in("unshard", GroupState.SHARDED)
        for b in self.buckets:
            flat = b.buffer()
            if self.is_holder(b):
                self.sync_holders(b)
            else:
                flat.untyped_storage().resize_(b.nbytes())
        for launch in self._launches if self.ctx.shard_size > 1 else ():  # one shard: every rank holds all
            parts = {b.column: b.buffer() for b in launch}
            self._pending_unshard.append(gather_boundary(self.ctx, parts, kind, self.fqn))
        self.state = GroupState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED (UNSHARDED: already waited for)."""
        if self.state is GroupState.UNSHARDED:
            return
        self._assert_in("wait_for_unshard", GroupState.UNSHARDING)
        for pending in self._pending_unshard:
            C.wait(pending)
        self._pending_unshard.clear()
        self.state = GroupState.UNSHARDED
        self.sync_classes()

    def ensure_unsharded(self, kind: CommKind) -> None:
        """Issue (if not already in flight) and wait: SHARDED/REDUCING/UNSHARDING -> UNSHARDED."""
        self.unshard(kind)
        self.wait_for_unshard()

    def reshard(self) -> None:
        """Free non-owner weight storage (UNSHARDING/UNSHARDED -> SHARDED); owners keep theirs.
        SHARDED: nothing held, nothing to do."""
        if self.state is GroupState.SHARDED:
            return
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()
        self._assert_in("reshard", GroupState.UNSHARDED)
        for b in self.buckets:
            if not self.is_holder(b):
                b.buffer().untyped_storage().resize_(0)
        self.state = GroupState.SHARDED
        self.sync_classes()

    # ------------------------------------------------------------------ #
    # Parameter classes (see the notes in dmuon/runtime/guard.py)         #
    # ------------------------------------------------------------------ #
    def access(self, b: Bucket) -> Access:
        """The class ``b``'s params must have now. Inside the window (UNSHARDED) every rank computes on plain
        params. Outside it a non-holder has 0 bytes ([Note: unheld parameters]); a holder is guarded during
        a training pass and while a publish is in flight into the bucket ([Note: guarded parameters])."""
        if self.state is GroupState.UNSHARDED:
            return Access.OPEN
        if not self.is_holder(b):
            return Access.UNHELD
        if self.training_pass.active or b.pending_publish:
            return Access.GUARDED
        return Access.OPEN

    def sync_classes(self) -> None:
        """Give every param its :meth:`access` class: pointer writes only, called after each change of the
        group's state, a bucket's publishes, or the training pass."""
        for b in self.buckets:
            self._sync_bucket(b)

    def _sync_bucket(self, b: Bucket) -> None:
        access = self.access(b)
        for dp in b.params:
            set_access(dp.bound(), access)

    def outside_window(self) -> str | None:
        """Asked by a guarded or unheld param on a value read: during a training pass, where the model is
        (the same words on every rank; the caller raises); ``None`` outside a pass."""
        if not self.training_pass.active or self.state is GroupState.UNSHARDED:
            return None
        return self.training_pass.where()

    def admit(self, index: int) -> None:
        """A holder's guarded param is read outside a training pass: wait for the publish in flight into its
        bucket (a local ``Work.wait()``, a stream wait on CUDA; no collective), making the bucket plain."""
        self.wait_publish(self.buckets[index])

    # ------------------------------------------------------------------ #
    # HSDP: holders of other replicate rows follow the owner               #
    # ------------------------------------------------------------------ #
    def publish(self) -> None:
        """Owners send updated weights to their column's other holders (async; holders only)."""
        if self.ctx.replicate_size == 1:
            return
        for b in self.buckets:
            if self.is_holder(b):
                self._issue_publish(b)

    def _issue_publish(self, b: Bucket) -> None:
        """One gather of ``b``'s owner rows over the replicate group: each row's owner sends its segment."""
        flat = b.buffer()
        self.wait_publish(b)
        segments = {row: flat[start:end] for row, start, end in _segments(b.params, self.ctx.shard_size)}
        parts = self._parts(self.ctx.replicate_size, segments, flat)
        b.pending_publish.append(C.gather_parts(self.ctx, parts, CommKind.REPLICATE_PUBLISH, self.fqn,
                                                dim=C.Dim.REPLICATE))
        b.stale = False
        self._sync_bucket(b)

    def wait_publish(self, b: Bucket) -> None:
        """Finish ``b``'s publishes in flight (local waits), then unguard its params if nothing else guards them."""
        if not b.pending_publish:
            return
        for pending in b.pending_publish:
            C.wait(pending)
        b.pending_publish.clear()
        self._sync_bucket(b)

    def sync_holders(self, b: Bucket) -> None:
        """Before a holder broadcasts ``b`` in its row: finish (or, if stale, make) the owners' publish."""
        if b.stale:
            self._issue_publish(b)
        self.wait_publish(b)

    def wait_all_publishes(self) -> None:
        """Holders: every pending or owed publish done (collective over each bucket's replicate group)."""
        if self.state is GroupState.REDUCING:
            self.finish_reduce()
        for b in self.buckets:
            if self.is_holder(b):
                self.sync_holders(b)

    # ------------------------------------------------------------------ #
    # Gradients                                                            #
    # ------------------------------------------------------------------ #
    def all_grads_ready(self) -> bool:
        return all(dp.local_grad is not None for dp in self.params)

    def any_grad_ready(self) -> bool:
        return any(dp.local_grad is not None for dp in self.params)

    def main_grad_dtype(self, dp: DedicatedParam) -> torch.dtype | None:
        """The reduce dtype when ``dp``'s gradients are kept in it (wider than its compute dtype), else
        ``None``. See [Note: mixed precision]."""
        rd = self.config.reduce_dtype
        return rd if rd is not None and is_wider(rd, dp.compute_dtype) else None

    def reduce_grads(self) -> None:
        """Start one reduce of every bucket per reduce dtype for the gradients handed over so far; drop local
        copies (-> REDUCING; a reduce still in flight from an earlier backward is finished first).

        Params without a local gradient (unused in this backward) are left out; parameter usage must be
        the same on every rank, as for FSDP2's reduce-scatter.
        """
        if self.state is GroupState.REDUCING:
            self.finish_reduce()
        launches: dict[torch.dtype, list[tuple[Bucket, torch.Tensor, list[DedicatedParam]]]] = {}
        for b in self.buckets:
            ready = [dp for dp in b.params if dp.local_grad is not None]
            if not ready:
                continue
            dtype = self.config.reduce_dtype if self.config.reduce_dtype is not None else b.buffer().dtype
            grads = [dp.take_for_reduce() for dp in ready]
            if self.ctx.world_size == 1:  # a one-rank job: the local gradient is the average
                b.pending_local = ([g.to(dtype) for g in grads], ready)
                continue
            flats = [g.reshape(-1).to(dtype) for g in grads]
            # one param: its own gradient is the buffer (dmuon took it from .grad; nobody else holds it), so
            # no copy; with W ranks a bucket usually holds one matrix, so this is most buckets at scale
            flat_grad = torch.cat(flats) if len(flats) > 1 else flats[0]
            launches.setdefault(dtype, []).append((b, flat_grad, ready))
        for entries in launches.values():  # in bucket order: the same on every rank
            parts = {b.column: g for b, g, _ in entries}
            self._pending_reduce.append((reduce_boundary(self.ctx, parts, CommKind.REDUCE, self.fqn), entries))
        self.backward_pending = False
        self.reshard()
        self.state = GroupState.REDUCING

    def finish_reduce(self) -> None:
        """Wait for the row reduce; holders reduce over the replicate group (HSDP); each owner's params
        get the averaged gradient (REDUCING -> SHARDED). Any other state: nothing in flight."""
        if self.state is not GroupState.REDUCING:
            return
        for b in self.buckets:
            if b.pending_local is not None:
                grads, ready = b.pending_local
                b.pending_local = None
                for dp, grad in zip(ready, grads):
                    self._deliver(dp, grad)
        in_flight, self._pending_reduce = self._pending_reduce, []
        for pending, entries in in_flight:
            C.wait(pending)
            for b, flat_grad, ready in entries:
                self._finish_bucket_reduce(b, flat_grad, ready)
        self.state = GroupState.SHARDED

    def _finish_bucket_reduce(self, b: Bucket, flat_grad: torch.Tensor, ready: list[DedicatedParam]) -> None:
        if not self.is_holder(b):
            for dp in ready:
                dp.release()
            return
        # stage 2: every owner row's segment in one launch over the replicate group
        segments = {row: flat_grad[start:end] for row, start, end in _segments(ready, self.ctx.shard_size)}
        C.wait(C.reduce_parts(self.ctx, self._parts(self.ctx.replicate_size, segments, flat_grad), CommKind.REDUCE,
                              self.fqn, dim=C.Dim.REPLICATE))
        off = 0
        for dp in ready:
            n = dp.shape.numel()
            if dp.is_owner:
                self._deliver(dp, flat_grad[off : off + n].view(dp.shape))
            else:
                dp.release()
            off += n

    def _deliver(self, dp: DedicatedParam, g: torch.Tensor) -> None:
        if dp.deliver(g, self.main_grad_dtype(dp)) and self.on_grad_reduced is not None:
            self.on_grad_reduced(dp)

    # ------------------------------------------------------------------ #
    # Introspection                                                        #
    # ------------------------------------------------------------------ #
    def holds_weight_storage(self) -> bool:
        """Whether this rank currently holds storage for any weight it does not own."""
        return any(
            not self.is_holder(b) and b.flat is not None and b.flat.untyped_storage().nbytes() > 0
            for b in self.buckets
        )

    def __repr__(self) -> str:
        return (f"BoundaryGroup({self.fqn!r}, params={len(self.params)}, buckets={len(self.buckets)}, "
                f"state={self.state.value})")
