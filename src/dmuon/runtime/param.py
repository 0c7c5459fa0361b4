"""The per-matrix record: one :class:`DedicatedParam` per dedicated weight, the only writer of its
gradient and master fields.

Every change of a dedicated matrix's gradient goes through a method here that checks the
:class:`GradState` it starts from and sets the one it leaves, so an out-of-order call from a hook, the
optimizer or a checkpoint function fails loudly (naming the matrix and both states) instead of silently
dropping or double-counting a gradient. See [Note: gradients] in ``dmuon/runtime/group.py`` for the
cycle these states follow, and [Note: master weights] in ``dmuon/runtime/precision.py`` for the master.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .blocks import Blocks
from .errors import raise_internal
from .precision import refresh_master_
from .route import Route

__all__ = ["DEDICATED_ATTR", "is_dedicated", "local", "laid_out_like", "splits_dim0_only", "GradState",
           "DedicatedParam"]

#: Attribute that marks a parameter as dedicated; its value is the owner's slot in dmuon's grid of ranks
#: (the mesh rank on a 1-D mesh). FSDP2's patch (``dmuon/engines/fsdp2.py``) skips every parameter carrying it.
DEDICATED_ATTR = "_dedicated_owner_rank"


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor dmuon's buffers hold for ``t``: a tensor-parallel DTensor's local shard, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[union-attr]


def laid_out_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, this rank's part, laid out like ``like``: where ``like`` is a tensor-parallel DTensor, a DTensor
    aliasing ``t`` with ``like``'s mesh, placements and global shape (a ``.grad``, a param's new local shard,
    a momentum buffer for DCP, which then records its global offsets); else ``t`` itself."""
    if not isinstance(like, DTensor):
        return t
    return DTensor.from_local(t.detach(), like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def splits_dim0_only(p: DTensor) -> bool:
    """Whether every placement of ``p`` splits dim 0 or replicates, so each rank's part of a batch of matrices
    is whole matrices: expert parallelism's ``Shard(0)``, FSDP2's ``Shard(0)`` and its strided shard of dim 0
    over an expert-parallel param (``_StridedShard``, which torch 2.13 does not count as a ``Shard``)."""
    from torch.distributed.tensor import Replicate, Shard

    def dim0(pl: object) -> bool:
        strided = type(pl).__name__ == "_StridedShard"
        return isinstance(pl, Replicate) or ((isinstance(pl, Shard) or strided) and getattr(pl, "dim", None) == 0)

    return all(dim0(pl) for pl in p.placements)


def is_dedicated(param: torch.Tensor) -> bool:
    """Whether ``param`` was selected by :func:`dmuon.dedicate_params`."""
    return getattr(param, DEDICATED_ATTR, None) is not None


class GradState(enum.Enum):
    """Where this rank's newest gradient of one dedicated matrix is.

    An owner in ``EMPTY``, ``UNSYNCED``, ``READY`` or ``REDUCING`` may also *carry* an averaged gradient of
    an earlier backward of the same step (accumulation without ``no_sync``): ``stashed_grad``, or
    ``main_grad`` in a wider reduce dtype. The next delivery adds it, so it is averaged exactly once.
    """

    #: No gradient of this step on this rank (after bind, ``zero_grad``, or a reduce this rank does not own).
    EMPTY = "empty"
    #: Inside ``no_sync``: the local gradient accumulates here (``param.grad``, or ``unsynced_grad``
    #: when the reduce dtype is wider).
    UNSYNCED = "unsynced"
    #: The local gradient was handed to the boundary group (``local_grad``); its reduce is not issued yet.
    READY = "ready"
    #: The local gradient is in a bucket's in-flight reduce.
    REDUCING = "reducing"
    #: Owner: the averaged gradient is delivered (``param.grad``, or ``main_grad`` when wider).
    REDUCED = "reduced"


@dataclass(eq=False)
class DedicatedParam:
    """One dedicated parameter (a matrix or a batch of them, e.g. experts; with ``Route.ADAMW_OWNER`` any
    non-scalar param). The parameter is re-resolved by module and name, never held by identity only,
    because ``module.to_empty()`` (meta-device init) replaces ``Parameter`` objects."""

    # Static #
    fqn: str
    module: nn.Module
    name: str
    #: The owner's slot ``replicate_index * shard_size + shard_index`` (the mesh rank on a 1-D mesh).
    owner: int
    shape: torch.Size
    #: The parameter's own dtype: what state dicts hold and :attr:`master` is kept in (set again at bind).
    dtype: torch.dtype
    #: ``dedicate_params(param_dtype=...)`` where it differs from ``dtype``: what the module computes with.
    param_dtype: torch.dtype | None = None
    #: Whether this rank is the owner (fixed: the plan never changes).
    is_owner: bool = False
    #: ``Route.MUON`` or ``Route.ADAMW_OWNER``: which algorithm the owner runs on it.
    route: Route = Route.MUON
    #: Tensor parallelism: the dimension of the full matrix split over "tp" (``shape`` is then this rank's
    #: shard and :attr:`full_shape` the matrix's); ``None`` without TP.
    tp_dim: int | None = None
    full_shape: torch.Size | None = None
    #: ``Route.MUON``: the matrices Muon orthogonalises, of the full shape ([Note: matrix blocks] in
    #: ``dmuon/runtime/blocks.py``); ``None`` for ``Route.ADAMW_OWNER``.
    blocks: Blocks | None = None

    # Runtime (written only by the methods below) #
    #: The parameter object currently bound to a bucket (``None`` until the first bind).
    param: nn.Parameter | None = None
    grad_state: GradState = GradState.EMPTY
    #: ``READY``: the local gradient waiting for the group's reduce.
    local_grad: torch.Tensor | None = None
    #: Owner, narrow reduce dtype: an averaged gradient set aside while autograd accumulates a fresh one.
    stashed_grad: torch.Tensor | None = None
    #: Owner, reduce dtype wider than the compute dtype: the averaged gradient, in place of ``param.grad``
    #: (torch refuses a ``.grad`` whose dtype differs from the parameter's).
    main_grad: torch.Tensor | None = None
    #: ``UNSYNCED`` with a wider reduce dtype: the local gradient summed in that dtype.
    unsynced_grad: torch.Tensor | None = None
    #: Owner, when ``compute_dtype != dtype``: the value in ``dtype``; the parameter is its rounded compute
    #: copy. See [Note: mixed precision] in ``dmuon/runtime/group.py``.
    master: torch.Tensor | None = None
    #: ``param._version`` when the owner's master (either kind) and the param last agreed; ``None``:
    #: unknown, compare them (see ``refresh_master_``).
    seen_version: int | None = None
    handles: list[RemovableHandle] = field(default_factory=list)
    #: Owner only: the tensor hook that sets a reduced gradient aside before autograd accumulates into
    #: it. Registered only while there is such a gradient, so an ordinary backward runs no
    #: per-parameter pre-hook at all.
    stash_hook: RemovableHandle | None = None

    # ------------------------------------------------------------------ #
    # Introspection                                                        #
    # ------------------------------------------------------------------ #
    def current(self) -> nn.Parameter:
        """The parameter the module holds now (a new object after ``to_empty``)."""
        return self.module._parameters[self.name]  # type: ignore[return-value]

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the module computes with and broadcasts carry."""
        return self.param_dtype if self.param_dtype is not None else self.dtype

    def bound(self) -> nn.Parameter:
        """The bound parameter; an internal error before the first bind."""
        if self.param is None:
            raise_internal(f"dedicated param {self.fqn!r} used before it was bound to its bucket")
        return self.param  # type: ignore[return-value]

    def reduced_grad(self) -> torch.Tensor | None:
        """The owner's gradient wherever it lives (:attr:`main_grad` or ``param.grad``)."""
        if self.main_grad is not None:
            return self.main_grad
        return None if self.param is None else local(self.param.grad)

    def _expect(self, op: str, *states: GradState) -> None:
        if self.grad_state not in states:
            raise_internal(
                f"dedicated param {self.fqn!r}: {op} in gradient state {self.grad_state.value}, expected "
                + " or ".join(s.value for s in states)
            )

    # ------------------------------------------------------------------ #
    # Binding                                                              #
    # ------------------------------------------------------------------ #
    def adopt_dtype(self, p: nn.Parameter) -> None:
        """Take ``p``'s dtype as the param's own, unless ``p`` is a compute copy from an earlier bind
        (re-created by ``to_empty``, it is already in ``param_dtype``)."""
        if self.param_dtype is None or p.dtype != self.param_dtype:
            self.dtype = p.dtype

    def bind(self, p: nn.Parameter, view: torch.Tensor, master: torch.Tensor | None) -> None:
        """Point ``p`` at its slice ``view`` of the bucket buffer; forget every gradient and hook (-> EMPTY).

        The caller (``BoundaryGroup.bind``) has copied the value into ``view`` where this rank holds it."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.disarm_stash()
        if isinstance(p, DTensor):  # tensor parallel: the local shard lives in the bucket (``.data`` would not alias)
            if p.dtype != view.dtype:  # param_dtype: the wrapper's dtype follows its new local shard's
                p.data = laid_out_like(view, p)
            p._local_tensor = view
        else:
            p.data = view
        setattr(p, DEDICATED_ATTR, self.owner)
        self.param = p
        self.master = master
        self.seen_version = None
        self.local_grad = self.stashed_grad = self.main_grad = self.unsynced_grad = None
        self.grad_state = GradState.EMPTY

    def add_handle(self, handle: RemovableHandle) -> None:
        self.handles.append(handle)

    def arm_stash(self, handle: RemovableHandle) -> None:
        """Owner, after a narrow delivery: keep the tensor pre-hook that calls :meth:`stash_reduced`
        (registered by the caller only while :attr:`stash_hook` is ``None``)."""
        if self.stash_hook is not None:
            handle.remove()
            raise_internal(f"dedicated param {self.fqn!r}: stash hook armed twice")
        self.stash_hook = handle

    def disarm_stash(self) -> None:
        if self.stash_hook is not None:
            self.stash_hook.remove()
            self.stash_hook = None

    # ------------------------------------------------------------------ #
    # Gradient cycle                                                       #
    # ------------------------------------------------------------------ #
    def stash_reduced(self) -> None:
        """Before autograd accumulates into ``param.grad``: set an averaged gradient aside (REDUCED ->
        EMPTY, carrying it), so the fresh local gradient is reduced alone and the average is added after.
        Any other state holds no averaged gradient in ``param.grad``: nothing to do."""
        if self.grad_state is not GradState.REDUCED:
            return
        p = self.bound()
        if p.grad is not None:
            self.stashed_grad = local(p.grad)
            p.grad = None
        self.grad_state = GradState.EMPTY

    def accumulate_unsynced(self, wide: torch.dtype | None) -> None:
        """Post-accumulate hook inside ``no_sync`` (-> UNSYNCED). With a wider reduce dtype the local
        gradient moves into :attr:`unsynced_grad` and is summed there (as FSDP2 does)."""
        self._expect_local_source("no_sync accumulation", wide)
        p = self.bound()
        if wide is not None and p.grad is not None:
            g = local(p.grad)
            self.unsynced_grad = g.to(wide) if self.unsynced_grad is None else self.unsynced_grad.add_(g)  # type: ignore[union-attr]
            p.grad = None
        self.grad_state = GradState.UNSYNCED

    def adopt_assigned(self, wide: torch.dtype | None) -> None:
        """A gradient some code assigned to ``param.grad`` without autograd's accumulation, so no hook ran:
        torch's zero-bubble schedules write each weight pass's gradient so ([Note: zero-bubble passes] in
        ``dmuon/runtime/guard.py``). In ``EMPTY`` (where ``param.grad`` is otherwise ``None``) or, with a wider
        reduce dtype, ``UNSYNCED``, it is this rank's local gradient: taken in as if accumulated inside
        ``no_sync`` (-> UNSYNCED), so the closing reduce averages it once."""
        p = self.param
        if p is None or not (self.grad_state is GradState.EMPTY
                             or (self.grad_state is GradState.UNSYNCED and wide is not None)):
            return
        with torch._C.DisableTorchFunctionSubclass():  # a metadata read: no guard on the step's path
            assigned = p.grad is not None
        if assigned:
            self.accumulate_unsynced(wide)

    def hand_over(self, wide: torch.dtype | None) -> None:
        """Post-accumulate hook outside ``no_sync``: this backward's local gradient (plus what ``no_sync``
        summed) goes to :attr:`local_grad` for the group's reduce; ``param.grad`` is cleared (-> READY)."""
        self._expect_local_source("hand-over to the reduce", wide)
        p = self.bound()
        mine = local(p.grad)
        if self.unsynced_grad is not None:
            mine = self.unsynced_grad if mine is None else self.unsynced_grad.add_(mine)
            self.unsynced_grad = None
        if mine is None:
            raise_internal(f"dedicated param {self.fqn!r}: post-accumulate hook ran without a gradient")
        self.local_grad = mine
        p.grad = None
        self.grad_state = GradState.READY

    def _expect_local_source(self, op: str, wide: torch.dtype | None) -> None:
        # REDUCED is a valid start only where the average lives in main_grad: in param.grad the stash
        # hook must have moved it away before autograd accumulated into it.
        if self.grad_state is GradState.REDUCED and wide is None:
            self._expect(op + " (the averaged gradient was not set aside)", GradState.EMPTY, GradState.UNSYNCED)
        self._expect(op, GradState.EMPTY, GradState.UNSYNCED, GradState.REDUCED)

    def take_for_reduce(self) -> torch.Tensor:
        """The group issues the bucket's reduce with this local gradient (READY -> REDUCING)."""
        self._expect("reduce", GradState.READY)
        mine, self.local_grad = self.local_grad, None
        self.grad_state = GradState.REDUCING
        return mine  # type: ignore[return-value]

    def deliver(self, g: torch.Tensor, wide: torch.dtype | None) -> bool:
        """Owner: the averaged gradient ``g`` arrived (REDUCING -> REDUCED). Added to what this step
        already carries; in :attr:`main_grad` when ``wide``, else in ``param.grad``. Returns whether the
        caller must arm the stash hook (the average sits in ``param.grad``)."""
        self._expect("delivery of the averaged gradient", GradState.REDUCING)
        p = self.bound()
        if wide is not None:
            self.main_grad = g if self.main_grad is None else self.main_grad.add_(g)
        else:
            g = g.to(p.dtype)
            if self.stashed_grad is not None:
                g = self.stashed_grad.add_(g)
                self.stashed_grad = None
            p.grad = laid_out_like(g, p)
        self.grad_state = GradState.REDUCED
        return wide is None

    def release(self) -> None:
        """A rank that does not own the matrix is done with its part of the reduce (REDUCING -> EMPTY)."""
        self._expect("release after the reduce", GradState.REDUCING)
        self.grad_state = GradState.EMPTY

    def clear(self, *, set_to_none: bool) -> None:
        """``Muon.zero_grad``, after ``torch.optim.Optimizer.zero_grad`` cleared (or zeroed) the owner's
        ``param.grad``: drop local and carried gradients (and ``param.grad`` itself with ``set_to_none``). An in-flight reduce must be finished first.
        With ``set_to_none=False`` a delivered average stays REDUCED as zeros, as torch keeps zero grads."""
        self._expect("zero_grad", GradState.EMPTY, GradState.UNSYNCED, GradState.READY, GradState.REDUCED)
        p = self.param
        if p is not None and (set_to_none or not self.is_owner):
            p.grad = None  # non-owners: a local no_sync gradient, never stepped, dropped either way
        self.local_grad = self.stashed_grad = self.unsynced_grad = None
        if set_to_none or self.main_grad is None:
            self.main_grad = None
        else:
            self.main_grad.zero_()
        has_grad = p is not None and p.grad is not None
        if self.grad_state is GradState.REDUCED and (has_grad or self.main_grad is not None):
            pass  # zeroed in place: still the (zero) average
        elif has_grad:
            self.grad_state = GradState.UNSYNCED  # owner inside no_sync, its local sum zeroed in place
        else:
            self.grad_state = GradState.EMPTY
        if not has_grad:
            self.disarm_stash()  # nothing to set aside before the next backward: no per-parameter hook in it

    # ------------------------------------------------------------------ #
    # Masters                                                              #
    # ------------------------------------------------------------------ #
    def refresh_master(self, master: torch.Tensor | None = None) -> None:
        """Owner: restart ``master`` (default :attr:`master`; ``dmuon.Muon`` passes its ``master_dtype``
        state) from the parameter if something else wrote the parameter.

        See [Note: master weights] in ``dmuon/runtime/precision.py``."""
        master = self.master if master is None else master
        if master is not None and self.param is not None:
            self.seen_version = refresh_master_(master, local(self.param), self.seen_version)

    def write_back(self, master: torch.Tensor | None = None) -> None:
        """Owner: round ``master`` (default :attr:`master`) into the parameter, the compute copy the next
        forward broadcasts."""
        master = self.master if master is None else master
        if master is not None and self.param is not None:
            value = local(self.param)  # a tensor-parallel param: its shard (the master is the shard's)
            with torch.no_grad():
                value.copy_(master)
            self.seen_version = value._version

    def master_made_from_param(self) -> None:
        """Owner: a master was just copied from the parameter, so the two agree now."""
        self.seen_version = local(self.bound())._version

    def forget_master_version(self) -> None:
        """New masters were loaded (optimizer state dicts): compare them with the parameter at the next step."""
        self.seen_version = None
