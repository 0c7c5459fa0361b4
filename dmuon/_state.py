"""Per-model runtime state and the module / tensor hooks that drive the boundary groups.

Lifecycle of one step (1-D mesh), as driven from here:

1. pre-forward of a boundary: (re)bind parameters if ``to_empty`` replaced them, start the broadcast of
   each owner bucket (``BoundaryGroup.unshard``), start the broadcast of the boundary expected to run
   next (prefetch, see below), then wait for this boundary's own (``wait_for_unshard``). A boundary that
   was prefetched only waits.
2. post-forward: with grad enabled, register a pre-backward hook on the outputs and, under Z3, free the
   non-owner copies; without grad (eval, ``torch.no_grad``), free them since no backward will come.
3. pre-backward (hook on the outputs' gradients): broadcast again if the copies were freed, and prefetch
   the boundary expected to run backward next (Z3).
4. post-accumulate-grad of each dedicated param: hand the local gradient to the group; once all are in,
   reduce each bucket to its owner and free non-owner weights.
5. end of backward (an autograd-engine callback): reduce whatever unused parameters left pending, free
   leftover copies (including a prefetch whose backward never came), average gradients of plain
   replicated parameters.

No step of this reads a tensor on the host (no ``.item()``, no device synchronisation): waits are
``Work.wait()``, which on CUDA/NCCL makes the current stream wait rather than the CPU.

[Note: activation checkpointing]
Non-reentrant checkpointing re-runs forward hooks inside backward. There we only make sure weights are
present and never free them, register more backward hooks, record order or prefetch.

[Note: prefetch]
A *forward pass* is one call of the root module (the model given to ``dedicate_params``) outside
backward. Each pass records the order its boundaries ran in, separately for grad-enabled and no-grad
passes. The next pass of the same kind follows that order with a cursor (``_OrderCursor``): in the
pre-forward of boundary i it starts the broadcast of the boundary the recorded order puts after i,
without waiting. Backward does the same along the reverse of this step's grad-enabled forwards.

* Same order on every rank: the guess depends only on the boundaries' hook history and states, which
  every rank of an SPMD model shares (dmuon already needs each rank to run the same boundaries, since
  every unshard is a collective). So every rank issues the same prefetches in the same order.
* A guess is a hint. A boundary off the recorded path resynchronises the cursor at its position in the
  recorded order (or gets no guess if the order never saw it); a prefetched boundary that does not run
  is released (wait, free) at the end of the pass or of the backward: a wrong guess costs one broadcast
  and memory, never correctness. The first pass of each kind has no recorded order and prefetches
  nothing; a boundary run outside a root call is never prefetched.
* Memory: at most one prefetched boundary is outstanding; the next prefetch is issued only once that
  one's own hook took it over. Under Z3 at most two boundaries hold non-owner copies during forward
  (the running one and the prefetched one; more only with nested boundaries). Only resting groups are
  prefetched (forward: SHARDED, or REDUCING after an accumulation backward; backward: SHARDED with a
  backward pending), so Z2 copies and already-reduced groups are never touched.
* ``prefetch=False`` (``dedicate_params``) turns it off; orders are still recorded.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from . import _collectives as C
from .diagnostics import CommCounter, CommKind
from .group import BoundaryGroup, DedicatedParam, GroupState
from .partition import OwnerPlan

__all__ = ["DMuonState", "get_state", "STATE_ATTR"]

STATE_ATTR = "_dmuon_state"


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """Tensors inside a module output: nested tuples/lists/dicts (HF ``ModelOutput`` is a dict),
    namedtuples and dataclasses."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return found


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _OrderCursor:
    """Follows a running pass along the boundary order a previous pass recorded, to guess what runs next."""

    def __init__(self, guide: Sequence[BoundaryGroup]):
        self.guide = tuple(guide)
        #: Index in ``guide`` of the boundary expected to run next.
        self.pos = 0

    def advance(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """``g`` runs now: move past it; return what the guide puts after it (``None``: no guess).

        Off the recorded path, resynchronise on ``g``'s next occurrence (searching ahead first, then
        from the start); a boundary the guide never saw leaves the cursor where it was."""
        guide, n = self.guide, len(self.guide)
        if self.pos < n and guide[self.pos] is g:
            self.pos += 1
        else:
            found = next((i for i in (*range(self.pos, n), *range(self.pos)) if guide[i] is g), None)
            if found is None:
                return None
            self.pos = found + 1
        return guide[self.pos] if self.pos < n else None


@dataclasses.dataclass(eq=False)
class _ForwardPass:
    """One call of the root module outside backward."""

    grad_enabled: bool
    cursor: _OrderCursor
    #: Boundaries in the order their pre-forward ran (becomes the next pass's guide).
    ran: list[BoundaryGroup] = dataclasses.field(default_factory=list)
    #: The boundary whose broadcast was prefetched and whose own pre-forward has not run yet.
    prefetched: BoundaryGroup | None = None


class DMuonState:
    """Everything ``dedicate_params`` built for one model."""

    def __init__(
        self,
        model: nn.Module,
        ctx: C.CommContext,
        plan: OwnerPlan,
        groups: list[tuple[nn.Module, BoundaryGroup]],
        reshard_after_forward: bool,
        prefetch: bool = True,
    ):
        self.model = model
        self.ctx = ctx
        self.plan = plan
        self.modules_and_groups = groups
        self.groups = [g for _, g in groups]
        self.reshard_after_forward = reshard_after_forward
        self.counter: CommCounter = ctx.counter
        #: False inside ``dmuon.no_sync``: gradients stay local and accumulate.
        self.sync_grads = True
        #: Bumped whenever parameter objects are rebound (``to_empty``); optimizers check it.
        self.generation = 0
        #: Trainable params neither dmuon nor FSDP2 manages; set by ``dmuon.Muon`` (its
        #: ``adamw_replicated`` group), whose gradients are averaged at the end of each backward.
        self.replicated_params: list[nn.Parameter] = []
        #: Issue the next boundary's broadcast early (see [Note: prefetch]). Must be equal on every rank.
        self.prefetch = prefetch
        self._callback_queued = False
        self._handles: list[RemovableHandle] = []
        # Forward prefetch #
        #: Boundary order of the last finished forward pass, per grad mode (``torch.is_grad_enabled()``).
        self._forward_orders: dict[bool, tuple[BoundaryGroup, ...]] = {}
        #: The root call in progress (``None`` outside one), and how deeply the root is nested in itself.
        self._pass: _ForwardPass | None = None
        self._root_depth = 0
        # Backward prefetch #
        #: Boundaries whose pre-backward hook was registered since the last backward, in forward order.
        self._backward_order: list[BoundaryGroup] = []
        #: Built at the first pre-backward from the reverse of ``_backward_order``.
        self._backward_cursor: _OrderCursor | None = None
        #: The boundary prefetched for backward whose own pre-backward has not run yet.
        self._backward_prefetched: BoundaryGroup | None = None

    # ------------------------------------------------------------------ #
    # Introspection                                                        #
    # ------------------------------------------------------------------ #
    def dedicated(self) -> Iterator[DedicatedParam]:
        for g in self.groups:
            yield from g.params

    def rank(self) -> int:
        return self.ctx.rank

    # ------------------------------------------------------------------ #
    # Binding                                                              #
    # ------------------------------------------------------------------ #
    def bind_if_needed(self, *, allow_meta: bool = False) -> None:
        """(Re)bind groups whose parameter objects changed. Raises if still on the meta device."""
        rebound = False
        for g in self.groups:
            if not g.needs_bind():
                continue
            if g.is_meta():
                if allow_meta:
                    continue
                raise RuntimeError(
                    f"dmuon: dedicated params of {g.fqn!r} are still on the meta device; materialise the model "
                    "(e.g. model.to_empty(device=...) and weight init) before running it or building dmuon.Muon."
                )
            g.bind(self._register_param_hooks)
            rebound = True
        if rebound:
            self.generation += 1

    def _register_param_hooks(self, dp: DedicatedParam) -> None:
        p = dp.param
        assert p is not None
        dp.handles.append(p.register_post_accumulate_grad_hook(_weak_hook(self, dp, DMuonState._on_accumulated)))

    def _arm_stash(self, dp: DedicatedParam) -> None:
        """``dp.param.grad`` now holds a reduced gradient: set it aside before a further backward
        accumulates into it (accumulation without ``no_sync``). The hook stays until ``Muon.zero_grad``."""
        if dp.stash_hook is None and dp.param is not None:
            dp.stash_hook = dp.param.register_hook(_weak_hook(self, dp, DMuonState._on_grad))

    def install_hooks(self) -> None:
        self._group_of = {dp: g for g in self.groups for dp in g.params}
        for g in self.groups:
            g.on_grad_reduced = self._arm_stash
        for module, g in self.modules_and_groups:
            self._handles.append(module.register_forward_pre_hook(lambda m, a, g=g: self._pre_forward(g), prepend=True))
            self._handles.append(module.register_forward_hook(lambda m, a, o, g=g: self._post_forward(g, o)))
        # Registered after the boundary hooks: when the root is itself a boundary, the pass opens before
        # and closes after the boundary's own hooks. always_call: an exception in forward closes it too.
        root = self.model
        self._handles.append(root.register_forward_pre_hook(lambda m, a: self._root_pre_forward(), prepend=True))
        self._handles.append(root.register_forward_hook(lambda m, a, o: self._root_post_forward(), always_call=True))

    # ------------------------------------------------------------------ #
    # Hooks                                                                #
    # ------------------------------------------------------------------ #
    def _root_pre_forward(self) -> None:
        if _in_backward():  # the whole model under activation checkpointing: not a new pass
            return
        self._root_depth += 1
        if self._root_depth == 1:
            grad = torch.is_grad_enabled()
            self._pass = _ForwardPass(grad, _OrderCursor(self._forward_orders.get(grad, ())))

    def _root_post_forward(self) -> None:
        if _in_backward():
            return
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth > 0 or self._pass is None:
            return
        p, self._pass = self._pass, None
        if p.prefetched is not None:  # guessed a boundary this pass never ran
            p.prefetched.reshard()
        self._forward_orders[p.grad_enabled] = tuple(p.ran)

    def _pre_forward(self, g: BoundaryGroup) -> None:
        if g.needs_bind():  # to_empty() replaced the params (checked per group: cheap on the hot path)
            self.bind_if_needed()
        if _in_backward():  # activation-checkpoint recomputation
            g.ensure_unsharded(CommKind.BACKWARD_BROADCAST)
            return
        nxt = self._forward_guess(g)
        g.unshard(CommKind.FORWARD_BROADCAST)  # a no-op if it was prefetched
        if nxt is not None:
            self._issue_prefetch(nxt, CommKind.FORWARD_BROADCAST)
            assert self._pass is not None
            self._pass.prefetched = nxt
        g.wait_for_unshard()

    def _forward_guess(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """Record that ``g`` runs; the boundary to prefetch now, if any. Issues nothing."""
        p = self._pass
        if p is None:  # a boundary called outside a root call
            return None
        p.ran.append(g)
        if p.prefetched is g:
            p.prefetched = None
        nxt = p.cursor.advance(g)
        if not self.prefetch or p.prefetched is not None or nxt is None or nxt is g:
            return None
        # forward: a resting group, or one whose last reduce is still in flight (accumulation)
        if nxt.needs_bind() or nxt.state not in (GroupState.SHARDED, GroupState.REDUCING):
            return None
        return nxt

    @staticmethod
    def _issue_prefetch(g: BoundaryGroup, kind: CommKind) -> None:
        # no record_function here: it costs ~tens of us per call on the host-bound hot path, and the
        # collective itself is labelled in _collectives
        g.unshard(kind)

    def _post_forward(self, g: BoundaryGroup, output: Any) -> Any:
        if _in_backward():
            return output
        if not torch.is_grad_enabled():
            if not g.backward_pending:  # no backward will need these copies
                g.reshard()
            return output
        g.backward_pending = True
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors:
            if len(tensors) == 1:  # the usual case: a plain tensor hook, cheaper than the multi-grad machinery
                tensors[0].register_hook(lambda grad, g=g: self._pre_backward(g))
            else:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, g=g: self._pre_backward(g),
                                                              mode="any")
            self._backward_order.append(g)
            if self.reshard_after_forward:
                g.reshard()
        # else: no output we can hook for a pre-backward re-broadcast, so keep the copies until the
        # gradients are reduced (Z2 behaviour for this call) rather than free what backward will read.
        return output

    def _pre_backward(self, g: BoundaryGroup) -> None:
        self._queue_end_of_backward()
        nxt = self._backward_guess(g)
        g.unshard(CommKind.BACKWARD_BROADCAST)  # a no-op under Z2 and if it was prefetched
        if nxt is not None:
            self._issue_prefetch(nxt, CommKind.BACKWARD_BROADCAST)
            self._backward_prefetched = nxt
        g.wait_for_unshard()

    def _backward_guess(self, g: BoundaryGroup) -> BoundaryGroup | None:
        """The boundary expected to run backward after ``g``, if it needs a broadcast now. Issues nothing."""
        if self._backward_cursor is None:
            self._backward_cursor = _OrderCursor(self._backward_order[::-1])
        if self._backward_prefetched is g:
            self._backward_prefetched = None
        nxt = self._backward_cursor.advance(g)
        if not self.prefetch or self._backward_prefetched is not None or nxt is None or nxt is g:
            return None
        # backward: only copies freed after forward (Z3) whose backward is still to come
        if nxt.state is not GroupState.SHARDED or not nxt.backward_pending or nxt.needs_bind():
            return None
        return nxt

    def _on_grad(self, dp: DedicatedParam) -> None:
        """Before autograd accumulates into ``.grad``: set aside a gradient that was already reduced."""
        p = dp.param
        assert p is not None
        if dp.grad_is_reduced:
            if p.grad is not None:
                dp.stashed_grad = p.grad
                p.grad = None
            dp.grad_is_reduced = False

    def _on_accumulated(self, dp: DedicatedParam) -> None:
        self._queue_end_of_backward()
        g = self._group_of[dp]
        p = dp.param
        assert p is not None
        wide = g.main_grad_dtype(dp)
        if not self.sync_grads:
            if wide is not None and p.grad is not None:
                # no_sync with a wider reduce dtype: accumulate there, as FSDP2 does (no bf16 summation)
                dp.unsynced_grad = (p.grad.to(wide) if dp.unsynced_grad is None
                                    else dp.unsynced_grad.add_(p.grad))
                p.grad = None
            return
        local = p.grad
        if dp.unsynced_grad is not None:
            local = dp.unsynced_grad if local is None else dp.unsynced_grad.add_(local)
            dp.unsynced_grad = None
        dp.local_grad = local
        p.grad = None
        if g.all_grads_ready():
            g.reduce_grads()

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._reset_backward_order()
        for g in self.groups:  # also releases a backward prefetch whose backward never came
            if self.sync_grads and any(dp.local_grad is not None for dp in g.params):
                g.reduce_grads()
            elif g.state in (GroupState.UNSHARDING, GroupState.UNSHARDED):
                g.backward_pending = False
                g.reshard()
        if self.sync_grads:
            self.all_reduce_replicated_grads()

    # ------------------------------------------------------------------ #
    # Drains                                                               #
    # ------------------------------------------------------------------ #
    def wait_all_reduces(self) -> None:
        for g in self.groups:
            if self.sync_grads and any(dp.local_grad is not None for dp in g.params):
                g.reduce_grads()
            g.finish_reduce()

    def _reset_backward_order(self) -> None:
        self._backward_order.clear()
        self._backward_cursor = None
        self._backward_prefetched = None

    def refresh_masters(self) -> None:
        """Owners: restart ``param_dtype`` masters whose compute copy was written directly since."""
        for dp in self.dedicated():
            dp.refresh_master()

    def reshard_all(self) -> None:
        """Drop every non-owner copy so the next forward broadcasts the freshly updated weights."""
        self._reset_backward_order()  # forwards that never got a backward (their graphs were dropped)
        for g in self.groups:
            g.finish_reduce()
            g.backward_pending = False
            g.reshard()

    def publish_updates(self) -> None:
        """HSDP: owners start sending updated weights to the other replicate rows' holders (async)."""
        for g in self.groups:
            g.publish()

    def wait_all_replicate_broadcasts(self) -> None:
        """HSDP: finish every pending publish (collective; a no-op on a 1-D mesh)."""
        for g in self.groups:
            g.wait_all_publishes()

    def all_reduce_replicated_grads(self) -> None:
        """Average gradients of trainable params that neither dmuon nor FSDP2 manages (a model, or part of
        one, without ``fully_shard``), like DDP would. One coalesced all-reduce per dtype; a trailing flag
        per param records whether any rank had a gradient, so params nobody touched keep ``grad=None``.

        Host-sync free when every such param has a local gradient (the usual case): the averages are
        copied into the existing ``.grad`` tensors on the device. Only a rank that lacks some gradient
        reads the flags on the host, since whether ``.grad`` becomes a tensor or stays ``None`` is a host
        decision (a zero gradient would still move AdamW's state and apply weight decay).

        The list comes from the optimizer rather than from scanning the model here: while FSDP2 holds a
        module unsharded, its parameters are plain tensors too and must not be mistaken for these."""
        params = self.replicated_params
        if not params or self.ctx.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        dev = self.ctx.device
        for dtype, ps in by_dtype.items():
            had_local = [p.grad is not None for p in ps]
            parts = [
                (p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device))
                for p in ps
            ]
            # all present (the usual case): flags made on the device, no host->device copy; otherwise this
            # rank reads the result on the host below anyway
            flags = (torch.ones(len(ps), dtype=dtype, device=dev) if all(had_local)
                     else torch.tensor(had_local, dtype=dtype).to(dev))
            flat = torch.cat([t.to(dev) for t in parts] + [flags])
            C.wait(C.all_reduce_avg(self.ctx, flat, CommKind.REPLICATED_GRAD_ALL_REDUCE, "replicated grads"))
            total = sum(p.numel() for p in ps)
            # host read only on a rank that lacks a gradient: did any other rank have one?
            others_had = (flat[total:] > 0).tolist() if not all(had_local) else had_local
            off = 0
            for p, has, any_grad in zip(ps, had_local, others_had):
                n = p.numel()
                g = flat[off : off + n].view_as(p)
                off += n
                if has:
                    p.grad.copy_(g)  # type: ignore[union-attr]
                elif any_grad:
                    p.grad = g.to(p.device, copy=True)


def _weak_hook(state: DMuonState, dp: DedicatedParam, method: Callable[[DMuonState, DedicatedParam], None]
               ) -> Callable[[Any], None]:
    """A parameter hook calling ``method(state, dp)`` that holds both weakly.

    torch keeps a parameter's hooks where Python's garbage collector cannot follow them (the tensor is
    also owned from C++), so a hook that referenced the state strongly would close a cycle the collector
    never frees: parameter -> hook -> state -> model -> parameter, keeping every weight, gradient and
    buffer of a dropped model alive (measured: a dropped 1B model left 6.5 GiB allocated).
    """
    state_ref, dp_ref = weakref.ref(state), weakref.ref(dp)

    def hook(_: Any) -> None:
        st, d = state_ref(), dp_ref()
        if st is not None and d is not None:
            method(st, d)

    return hook


def get_state(model: nn.Module) -> DMuonState:
    """The state ``dedicate_params`` attached to ``model``; a clear error if there is none."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"dmuon: {type(model).__name__} has no dedicated params; call dmuon.dedicate_params(model, mesh, ...) "
            "on the root model before fully_shard."
        )
    return state
