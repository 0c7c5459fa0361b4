"""Per-model runtime state (:class:`DMuonState`) and the module / tensor hooks that drive the boundary groups.

Lifecycle of one step (1-D mesh), as driven from here:

1. pre-forward of a boundary: (re)bind parameters if ``to_empty`` replaced them, start the gather of
   every owner's bucket, one launch ([Note: one launch per boundary] in ``dmuon/runtime/comm.py``;
   ``BoundaryGroup.unshard``), start the gather of the boundary expected to run next (prefetch, see
   below), then wait for this boundary's own (``wait_for_unshard``). A boundary that was prefetched only
   waits.
2. post-forward: with grad enabled, register a pre-backward hook on the outputs and, under Z3, free the
   non-owner copies; without grad (eval, ``torch.no_grad``), free them since no backward will come.
3. pre-backward (hook on the outputs' gradients): broadcast again if the copies were freed, and prefetch
   the boundary expected to run backward next (Z3).
4. post-accumulate-grad of each dedicated param: hand the local gradient to the group; once all are in,
   reduce every bucket to its owner in one launch and free non-owner weights.
5. end of backward (an autograd-engine callback): reduce whatever unused parameters left pending, free
   leftover copies (including a prefetch whose backward never came), finish the reduces (each owner's
   ``.grad`` holds the average when ``backward()`` returns), average gradients of plain replicated
   parameters.

No step of this reads a tensor on the host (no ``.item()``, no device synchronisation): waits are
``Work.wait()``, which on CUDA/NCCL makes the current stream wait rather than the CPU.

[Note: activation checkpointing]
Non-reentrant checkpointing re-runs forward hooks inside backward. There we only make sure weights are
present and never free them, register more backward hooks, record order or prefetch.

See [Note: prefetch] in ``dmuon/runtime/prefetch.py`` for how the next boundary is guessed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from . import comm as C
from .blocks import Blocks
from .comm import CommKind
from .config import RuntimeConfig
from .group import BoundaryGroup, GroupState
from .guard import TrainingPass, guard_modules, in_backward
from .param import DedicatedParam, GradState
from .prefetch import Prefetcher
from .replicated import all_reduce_replicated_grads
from .topology import Topology

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


class DMuonState:
    """Everything ``dedicate_params`` built for one model: its groups, settings and hooks."""

    def __init__(self, model: nn.Module, ctx: C.CommContext, config: RuntimeConfig,
                 groups: list[tuple[nn.Module, BoundaryGroup]], *, topology: Topology | None = None):
        self.model = model
        self.ctx = ctx
        #: The job's pipeline stages and this model's ([Note: pipeline stages] in ``topology.py``); one stage
        #: of dmuon's grid when not given.
        self.topology = topology if topology is not None else Topology((tuple(sorted(ctx.global_ranks)),), 0)
        #: The settings of ``dedicate_params``, the one copy every part reads.
        self.config = config
        self.modules_and_groups = groups
        self.groups = [g for _, g in groups]
        #: False inside ``dmuon.no_sync``: gradients stay local and accumulate.
        self.sync_grads = True
        #: The engine binding (``dmuon/engines``): what trains the other params. The runtime reads only the
        #: two answers below, which the binding sets; ``None`` until something binds (``dmuon.Muon``, the
        #: first forward through :attr:`bind_engine`, ``deepspeed.initialize``).
        self.engine: Any = None
        #: Set by the binding where the engine decides the accumulation boundary itself (DeepSpeed): whether
        #: the running backward closes the window (``None``: no opinion, ``no_sync`` decides).
        self.accumulation_boundary: Callable[[], bool | None] = _no_opinion
        #: Set by the binding: whether a backward that kept its gradients local frees the copies it gathered
        #: (``False`` where the engine keeps its own gathered for the next microbatch: FSDP2 under torch's
        #: pipelining schedules; then the next forward or backward of the group broadcasts nothing).
        self.reshard_after_backward: Callable[[], bool] = _reshard
        #: Set by ``dedicate_params``: binds the engine at the first forward when nothing bound it before, so
        #: plain params are averaged whether or not an optimizer was built.
        self.bind_engine: Callable[[], Any] | None = None
        #: Bumped whenever parameter objects are rebound (``to_empty``); optimizers check it.
        self.generation = 0
        #: Trainable params neither dmuon nor the engine manages, whose gradients are averaged at the end of
        #: each backward; set by the engine binding (its ``plain_params``).
        self.replicated_params: list[nn.Parameter] = []
        #: The "tp" mesh of tensor-parallel dedicated params (``dedicate_params`` sets it), or ``None``.
        self.tp_mesh: Any = None
        #: ``dedicate_params``' owner layout, ``"flat"`` or ``"node"`` ([Note: node layout] in ``hierarchy.py``);
        #: ``dmuon.diagnostics.summarize`` shows it.
        self.layout = "flat" if ctx.node_size is None else "node"
        #: ``Route.MUON_SHARDED`` params by FQN, with their matrices (``dedicate_params`` sets it): Muon runs
        #: on the engine's shards of them, not on an owner ([Note: routes] in ``dmuon/runtime/route.py``).
        self.sharded_muon: dict[str, Blocks] = {}
        self.prefetcher = Prefetcher(config.prefetch)
        #: The training pass the hooks below drive; every group reads it to choose its params' classes
        #: ([Note: boundary windows] in ``dmuon/runtime/guard.py``). Wired in before the first bind.
        self.training_pass = TrainingPass()
        for g in self.groups:
            g.training_pass = self.training_pass
        self._group_of = {dp: g for g in self.groups for dp in g.params}
        self._callback_queued = False
        self._handles: list[RemovableHandle] = []
        self._undo_guards: list[Callable[[], None]] = []
        _LIVE.add(self)

    # ------------------------------------------------------------------ #
    # Introspection                                                        #
    # ------------------------------------------------------------------ #
    def dedicated(self) -> Iterator[DedicatedParam]:
        for g in self.groups:
            yield from g.params

    def owned(self) -> Iterator[DedicatedParam]:
        return (dp for dp in self.dedicated() if dp.is_owner)

    def rank(self) -> int:
        return self.ctx.rank

    def syncing(self) -> bool:
        """Whether a backward now averages gradients: outside ``no_sync``, and where the engine decides the
        accumulation boundary (DeepSpeed), at the boundary."""
        return self.sync_grads and self.accumulation_boundary() is not False

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
        p = dp.bound()
        if dp.tp_dim is not None:  # before accumulation: the gradient in the weight's own layout
            dp.add_handle(p.register_hook(_placed_like(p)))
        dp.add_handle(p.register_post_accumulate_grad_hook(_weak_hook(self, dp, DMuonState._on_accumulated)))

    def _arm_stash(self, dp: DedicatedParam) -> None:
        """``dp.param.grad`` now holds a reduced gradient: set it aside before a further backward
        accumulates into it (accumulation without ``no_sync``). The hook stays until ``Muon.zero_grad``."""
        if dp.stash_hook is None:
            dp.arm_stash(dp.bound().register_hook(_weak_hook(self, dp, DMuonState._on_grad)))

    def install_module_guards(self) -> None:
        """``state_dict`` / ``load_state_dict`` / ``to`` on every module with a dedicated parameter at or
        below it. See [Note: module guards] in ``dmuon/runtime/guard.py``."""
        paths: dict[str, None] = {}
        for dp in self.dedicated():
            parts = dp.fqn.split(".")[:-1]
            for i in range(len(parts), -1, -1):
                paths.setdefault(".".join(parts[:i]))
        self._undo_guards = guard_modules([self.model.get_submodule(p) for p in paths], self.check_conversion)

    def check_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Refuse (on every rank alike) a ``Module._apply`` that would move or cast a bound dedicated
        parameter; it would leave dmuon's buffers behind. Materialising a meta model passes."""
        if any(not g.is_bound() or g.is_meta() for g in self.groups):
            return
        for dtype in sorted({dp.compute_dtype for dp in self.dedicated()}, key=str):
            probe = torch.empty(0, dtype=dtype, device=self.ctx.device)
            with torch.no_grad():
                out = fn(probe)
            if not isinstance(out, torch.Tensor) or (out.dtype, out.device) != (probe.dtype, probe.device):
                got = f"{out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else repr(out)
                raise RuntimeError(
                    f"dmuon: a module conversion (model.to / .cuda / .float / ...) would turn dedicated "
                    f"parameters of {dtype} on {probe.device} into {got}, after dedicate_params bound them to "
                    "dmuon's buffers. Move and cast the model before dedicate_params (for a compute dtype use "
                    "dedicate_params(param_dtype=...)); nothing was changed."
                )

    def install_hooks(self) -> None:
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
    # Module hooks                                                         #
    # ------------------------------------------------------------------ #
    def _root_pre_forward(self) -> None:
        if in_backward():  # the whole model under activation checkpointing: not a new pass
            return
        if self.engine is None and self.bind_engine is not None:  # no optimizer bound it: a resting point
            self.bind_engine()
        self.prefetcher.open_pass(torch.is_grad_enabled())
        if self.training_pass.open_root():
            self._sync_classes()

    def _root_post_forward(self) -> None:
        if in_backward():
            return
        unused = self.prefetcher.close_pass()
        if unused is not None:  # guessed a boundary this pass never ran
            unused.reshard()
        if self.training_pass.close_root(torch.is_grad_enabled()):
            self._sync_classes()

    def _sync_classes(self) -> None:
        """The training pass opened or closed: every group re-sorts its params' classes (pointer writes)."""
        for g in self.groups:
            g.sync_classes()

    def end_pass(self) -> None:
        """Forwards whose backward never came are over (``step()``, the state-dict drains): owners read
        their matrices freely again. See [Note: boundary windows] in ``dmuon/runtime/guard.py``."""
        if self.training_pass.settle():
            self._sync_classes()

    def _pre_forward(self, g: BoundaryGroup) -> None:
        if g.needs_bind():  # to_empty() replaced the params (checked per group: cheap on the hot path)
            self.bind_if_needed()
        if in_backward():  # activation-checkpoint recomputation
            g.ensure_unsharded(CommKind.BACKWARD_BROADCAST)
            return
        if self.training_pass.enter(g.fqn):  # a boundary called outside the root's forward
            self._sync_classes()
        nxt = self.prefetcher.forward_guess(g)
        g.unshard(CommKind.FORWARD_BROADCAST)  # a no-op if it was prefetched
        if nxt is not None:
            # no record_function here: it costs ~tens of us per call on the host-bound hot path, and the
            # collective itself is labelled in comm.py
            nxt.unshard(CommKind.FORWARD_BROADCAST)
            self.prefetcher.forward_prefetched(nxt)
        g.wait_for_unshard()

    def _post_forward(self, g: BoundaryGroup, output: Any) -> Any:
        if in_backward():
            return output
        grad = torch.is_grad_enabled()
        if self.training_pass.leave(g.fqn, grad):  # the pass of a boundary called alone ends (no grad)
            self._sync_classes()
        if not grad:
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
            self.prefetcher.record_backward(g)
            if self.config.reshard_after_forward:
                g.reshard()
        # else: no output we can hook for a pre-backward re-broadcast, so keep the copies until the
        # gradients are reduced (Z2 behaviour for this call) rather than free what backward will read.
        return output

    # ------------------------------------------------------------------ #
    # Autograd hooks                                                       #
    # ------------------------------------------------------------------ #
    def _pre_backward(self, g: BoundaryGroup) -> None:
        self._queue_end_of_backward()
        nxt = self.prefetcher.backward_guess(g)
        g.unshard(CommKind.BACKWARD_BROADCAST)  # a no-op under Z2 and if it was prefetched
        if nxt is not None:
            nxt.unshard(CommKind.BACKWARD_BROADCAST)
            self.prefetcher.backward_prefetched(nxt)
        g.wait_for_unshard()

    def _on_grad(self, dp: DedicatedParam) -> None:
        """Before autograd accumulates into ``.grad``: set aside a gradient that was already reduced."""
        dp.stash_reduced()

    def _on_accumulated(self, dp: DedicatedParam) -> None:
        self._queue_end_of_backward()
        g = self._group_of[dp]
        wide = g.main_grad_dtype(dp)
        if not self.syncing():
            dp.accumulate_unsynced(wide)
            return
        dp.hand_over(wide)
        if g.all_grads_ready():
            g.reduce_grads()

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        # The backward ran: no user code can read a weight before this returns, so the pass closes first
        # and the deliveries and reshards below work on plain params (no guard dispatch on the way).
        self.end_pass()
        self.prefetcher.reset_backward()
        sync = self.syncing()
        keep = not sync and not self.reshard_after_backward()  # the engine keeps its weights for the next microbatch
        for g in self.groups:  # also releases a backward prefetch whose backward never came
            if sync:
                self._hand_over_unsynced(g)
            if sync and g.any_grad_ready():
                g.reduce_grads()
            elif g.state is GroupState.UNSHARDING or (g.state is GroupState.UNSHARDED and not keep):
                g.backward_pending = False
                g.reshard()
        if sync:
            # When backward() returns, each owner's .grad holds the average, as under FSDP2 and DDP. A
            # wait orders the device stream (NCCL) and reads nothing on the host.
            self.finish_reduces()
            all_reduce_replicated_grads(self.ctx, self.replicated_params)

    def _hand_over_unsynced(self, g: BoundaryGroup, *, adopt: bool = False) -> None:
        """A matrix that accumulated under ``no_sync`` but got no gradient in this (synchronised) backward
        still owes its reduce: hand its sum over now, so every gradient of the step is averaged exactly
        once, as FSDP2 does for its own params. Usage is the same on every rank, so every rank finds the
        same matrices here and issues the same reduces. ``adopt`` (the drain before a step or clip): also
        gradients a zero-bubble weight pass assigned ([Note: zero-bubble passes] in ``guard.py``)."""
        for dp in g.params:
            if adopt:  # a zero-bubble weight pass's gradient: no hook saw it
                dp.adopt_assigned(g.main_grad_dtype(dp))
            if dp.grad_state is GradState.UNSYNCED:
                dp.hand_over(g.main_grad_dtype(dp))

    # ------------------------------------------------------------------ #
    # Drains                                                               #
    # ------------------------------------------------------------------ #
    def wait_all_reduces(self) -> None:
        """Issue what is handed over or still unsynced (outside ``no_sync``) and finish every reduce in
        flight. (Unsynced sums are normally handed over at the end of the backward that closes the
        accumulation; this catches a closing backward that ran none of dmuon's hooks.)"""
        sync = self.syncing()
        for g in self.groups:
            if sync:
                self._hand_over_unsynced(g, adopt=True)
                if g.any_grad_ready():
                    g.reduce_grads()
            g.finish_reduce()

    def finish_reduces(self) -> None:
        """Finish the reduces already in flight, issuing none."""
        for g in self.groups:
            g.finish_reduce()

    def refresh_masters(self) -> None:
        """Owners: restart ``param_dtype`` masters whose compute copy was written directly since."""
        for dp in self.owned():
            dp.refresh_master()

    def run_step(self, update: Callable[[], None], *, wait_publish: bool) -> None:
        """The optimizer step's one drive of the runtime: every gradient reduce finished (a forward whose
        backward never came closes its pass, so owners update their matrices all the same), ``update()``,
        then the updates go out (HSDP publishes, waited for where ``wait_publish``) and every non-holder copy
        is dropped so the next forward broadcasts the new weights."""
        self.wait_all_reduces()
        self.end_pass()
        update()
        self.publish_updates()
        if wait_publish:
            self.wait_all_replicate_broadcasts()
        self.reshard_all()

    def reshard_all(self) -> None:
        """Drop every non-owner copy so the next forward broadcasts the freshly updated weights."""
        self.prefetcher.reset_backward()  # forwards that never got a backward (their graphs were dropped)
        self.end_pass()
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

    def clear_grads(self, *, set_to_none: bool) -> None:
        """``Muon.zero_grad``, after :meth:`finish_reduces` (a reduce still in flight would otherwise land in
        ``.grad`` afterwards; ``DedicatedParam.clear`` refuses REDUCING): drop every dedicated gradient."""
        for dp in self.dedicated():
            dp.clear(set_to_none=set_to_none)


def _no_opinion() -> None:
    """The accumulation boundary of an engine that leaves it to ``no_sync``."""
    return None


def _reshard() -> bool:
    """Copies gathered for an accumulation step's backward are freed when it ends (no engine bound yet)."""
    return True


def _placed_like(p: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook giving a tensor-parallel weight's gradient the weight's placements. Some TP plans
    hand a weight a full-size ``Partial`` gradient over "tp" (torchtitan's rowwise ``wo`` / ``w2`` without
    sequence parallelism); FSDP2 redistributes its own params' gradients, and dmuon reduces the local shard,
    so the sum over "tp" and the slice (one reduce-scatter) happen here, before anything reads it."""
    mesh, placements = p.device_mesh, tuple(p.placements)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            return grad.redistribute(mesh, placements)
        return grad

    return hook


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


#: Every model state alive in this process (for the routing of torch's clip functions, ``dmuon/clip.py``).
_LIVE: weakref.WeakSet[DMuonState] = weakref.WeakSet()


def live_states() -> list[DMuonState]:
    """The dmuon model states alive in this process."""
    return list(_LIVE)


def get_state(model: nn.Module) -> DMuonState:
    """The state ``dedicate_params`` attached to ``model`` (the module itself; ``dmuon.engines.state_of`` looks
    through an engine's wrapper first); a clear error if there is none."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"dmuon: {type(model).__name__} has no dedicated params; call dmuon.dedicate_params(model, mesh, ...) "
            "on the root model before fully_shard."
        )
    return state
