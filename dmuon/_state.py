"""Per-model runtime state and the module / tensor hooks that drive the boundary groups.

Lifecycle of one step (1-D mesh), as driven from here:

1. pre-forward of a boundary: (re)bind parameters if ``to_empty`` replaced them, then broadcast each
   owner bucket and wait (``BoundaryGroup.ensure_unsharded``).
2. post-forward: with grad enabled, register a pre-backward hook on the outputs and, under Z3, free the
   non-owner copies; without grad (eval, ``torch.no_grad``), free them since no backward will come.
3. pre-backward (hook on the outputs' gradients): broadcast again if the copies were freed.
4. post-accumulate-grad of each dedicated param: hand the local gradient to the group; once all are in,
   reduce each bucket to its owner and free non-owner weights.
5. end of backward (an autograd-engine callback): reduce whatever unused parameters left pending, free
   leftover copies, average gradients of plain replicated parameters.

[Note: activation checkpointing]
Non-reentrant checkpointing re-runs forward hooks inside backward. There we only make sure weights are
present and never free them or register more backward hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
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


class DMuonState:
    """Everything ``dedicate_params`` built for one model."""

    def __init__(
        self,
        model: nn.Module,
        ctx: C.CommContext,
        plan: OwnerPlan,
        groups: list[tuple[nn.Module, BoundaryGroup]],
        reshard_after_forward: bool,
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
        self._callback_queued = False
        self._handles: list[RemovableHandle] = []

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
        group = self._group_of[dp]
        dp.handles.append(p.register_hook(lambda grad, dp=dp: self._on_grad(dp)))
        dp.handles.append(p.register_post_accumulate_grad_hook(lambda param, dp=dp, g=group: self._on_accumulated(dp, g)))

    def install_hooks(self) -> None:
        self._group_of = {dp: g for g in self.groups for dp in g.params}
        for module, g in self.modules_and_groups:
            self._handles.append(module.register_forward_pre_hook(lambda m, a, g=g: self._pre_forward(g), prepend=True))
            self._handles.append(module.register_forward_hook(lambda m, a, o, g=g: self._post_forward(g, o)))

    # ------------------------------------------------------------------ #
    # Hooks                                                                #
    # ------------------------------------------------------------------ #
    def _pre_forward(self, g: BoundaryGroup) -> None:
        if g.needs_bind():  # to_empty() replaced the params (checked per group: cheap on the hot path)
            self.bind_if_needed()
        if _in_backward():  # activation-checkpoint recomputation
            g.ensure_unsharded(CommKind.BACKWARD_BROADCAST)
            return
        g.ensure_unsharded(CommKind.FORWARD_BROADCAST)

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
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, g=g: self._pre_backward(g), mode="any")
            if self.reshard_after_forward:
                g.reshard()
        # else: no output we can hook for a pre-backward re-broadcast, so keep the copies until the
        # gradients are reduced (Z2 behaviour for this call) rather than free what backward will read.
        return output

    def _pre_backward(self, g: BoundaryGroup) -> None:
        self._queue_end_of_backward()
        g.ensure_unsharded(CommKind.BACKWARD_BROADCAST)

    def _on_grad(self, dp: DedicatedParam) -> None:
        """Before autograd accumulates into ``.grad``: set aside a gradient that was already reduced."""
        self._queue_end_of_backward()
        p = dp.param
        assert p is not None
        if dp.grad_is_reduced:
            if p.grad is not None:
                dp.stashed_grad = p.grad
                p.grad = None
            dp.grad_is_reduced = False

    def _on_accumulated(self, dp: DedicatedParam, g: BoundaryGroup) -> None:
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
        for g in self.groups:
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

    def refresh_masters(self) -> None:
        """Owners: restart ``param_dtype`` masters whose compute copy was written directly since."""
        for dp in self.dedicated():
            dp.refresh_master()

    def reshard_all(self) -> None:
        """Drop every non-owner copy so the next forward broadcasts the freshly updated weights."""
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
        one, without ``fully_shard``), like DDP would. One coalesced all-reduce; a trailing flag per param
        records whether any rank had a gradient, so params nobody touched keep ``grad=None``.

        The list comes from the optimizer rather than from scanning the model here: while FSDP2 holds a
        module unsharded, its parameters are plain tensors too and must not be mistaken for these."""
        params = self.replicated_params
        if not params or self.ctx.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            parts = [
                (p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device))
                for p in ps
            ]
            flags = torch.tensor([p.grad is not None for p in ps], dtype=dtype, device=parts[0].device)
            flat = torch.cat(parts + [flags]).to(self.ctx.device)
            C.wait(C.all_reduce_avg(self.ctx, flat, CommKind.REPLICATED_GRAD_ALL_REDUCE, "replicated grads"))
            total = sum(p.numel() for p in ps)
            had_grad = (flat[total:] > 0).tolist()  # one host sync for all flags of this dtype
            off = 0
            for p, any_grad in zip(ps, had_grad):
                n = p.numel()
                if any_grad:
                    g = flat[off : off + n].view_as(p).to(p.device)
                    if p.grad is not None:
                        p.grad.copy_(g)
                    else:
                        p.grad = g.clone()
                off += n


def get_state(model: nn.Module) -> DMuonState:
    """The state ``dedicate_params`` attached to ``model``; a clear error if there is none."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"dmuon: {type(model).__name__} has no dedicated params; call dmuon.dedicate_params(model, mesh, ...) "
            "on the root model before fully_shard."
        )
    return state
