"""Ordinary PyTorch calls on a dmuon model work or raise; they never read memory that is not there.

[Note: unheld parameters]
Outside its boundary's forward/backward window a rank that is not a holder keeps a dedicated parameter
with 0 bytes of storage (see [Note: why the storage is resized instead of swapping ``.data``] in
``dmuon/runtime/group.py``). Kernels do not check storage bounds, so ``p.norm()`` on it would read freed
memory (a segfault on CPU, an illegal access on CUDA). While its storage is empty, the parameter's class
is :class:`UnheldParameter`, an ``nn.Parameter`` subclass whose ``__torch_function__`` lets metadata
through (shape, dtype, device, ``.grad``, hooks, ``repr``) and refuses anything that reads values with
a :class:`NotHeldError` naming the parameter, its owner and the dmuon function to use instead.

The class is swapped (``p.__class__``, a pointer write) when the storage comes and goes, not kept for
good: a plain ``nn.Parameter`` takes torch's fast path in every op, so the module's forward and backward
on held weights pay nothing, and owners never carry the subclass at all. The parameter objects stay the
same, so autograd's saved views, hooks and optimizer references are untouched.

[Note: guarded parameters]
A rank that *holds* a dedicated parameter (its owner; under HSDP every rank of the owner's shard column)
has its values, but two situations make reading them wrong, and there its class is
:class:`GuardedParameter` (:class:`GuardedDTensor` for tensor parallelism):

* *a publish in flight* (HSDP): after ``step()`` the owner sends the new tensor to the holders of the
  other replicate rows asynchronously; until it lands a holder's copy is partly old. The first value op
  on a guarded param asks its boundary group to wait for that bucket's publish (``Work.wait()``: a local
  wait, on CUDA a stream wait, never a collective), which swaps the bucket's params back to plain, then
  runs. A read after ``step()`` sees the step, as under FSDP2; the owner's own params are guarded too,
  since an in-place write there would race with the send;
* *a training pass, outside the boundary's window*: see [Note: boundary windows]. The first value op
  raises :class:`OutsideBoundaryError`.

Metadata and ``repr`` pass as for unheld parameters; nothing on the forward/backward fast path ever
meets the class, which is plain wherever the module legitimately computes.

[Note: boundary windows]
A dedicated matrix is present on every rank only inside its boundary's *window* (the group is
UNSHARDED: the boundary's forward, its backward, and under Z2 from forward to backward). Non-holders hold
nothing outside it and raise; if the owner and the holders computed on, they would wait in the next
collective for the ranks that raised, until the process-group timeout. No collective can tell them, so
every rank decides alone by one rule that depends only on what every rank shares (the hooks that ran and
the group states): during a *training pass* (:class:`TrainingPass`: from the root's (or a boundary's)
pre-forward until the end of that pass's backward, or the end of the forward when grad is disabled,
or ``step()`` when the backward never comes), a value read of a dedicated parameter outside its window
raises :class:`OutsideBoundaryError` with the same message on every rank: holders' params are guarded
there and non-holders' unheld ones raise the pass error instead of :class:`NotHeldError`. Outside a pass
holders read freely (the optimizer step, ``dmuon.get_owned_params`` between steps, checkpoints).

[Note: zero-bubble passes]
torch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) split each microbatch's backward into an *input* pass (``torch.autograd.grad`` to the
stage's inputs) and a later *weight* pass (``torch.autograd.grad`` from the saved intermediates to the
weights' accumulators, the result written to ``param.grad`` by assignment). Three things follow for dmuon:

* before either pass torch takes ``p.view_as(p)`` of every parameter, wherever the window stands, only to
  reach its gradient accumulator: that self-view reads nothing and passes the guard (the view carries the
  parameter's class, so reading it later raises, or is admitted, on every rank as reading the parameter);
* the input pass runs the pre-backward hooks (a Z3 boundary broadcasts again) and ends as any backward
  inside ``no_sync`` does: the copies stay for the weight pass, as FSDP2's do
  (``set_reshard_after_backward(False)``). Under Z3 a later microbatch's forward frees them again, as FSDP2
  frees its own: a weight pass then reads only activations and output gradients (a linear layer's weight
  gradient needs no weight), so no broadcast is added per microbatch; a module whose weight gradient reads
  the weight itself needs Z2;
* the weight pass runs no hook at all (its gradients are assigned, not accumulated): the closing reduce
  (``optimizer.step()`` / ``clip_grad_norm_``) takes an assigned ``param.grad`` in as this rank's
  ``no_sync`` gradient (``DedicatedParam.adopt_assigned``), so each is averaged once per step.

[Note: module guards]
Three module calls would otherwise go wrong on some ranks only, so they are refused on every rank alike
(the decision depends only on the model's structure, which every rank shares):

* ``state_dict()`` (values): it would detach unheld parameters; ``dmuon.get_model_state_dict`` gathers
  them. ``state_dict(keep_vars=True)`` only lists the parameter objects and stays allowed;
* ``load_state_dict()``: unheld parameters have nowhere to copy into; ``dmuon.set_model_state_dict``;
* ``to()`` / ``cuda()`` / ``float()``… that would move or cast dedicated parameters: each module with a
  dedicated parameter below it gets an instance ``_apply`` that checks the conversion on an empty probe
  first. Conversions that leave dedicated parameters as they are (``model.to(its own device)``), and
  ``to_empty`` of a model still on the meta device, pass.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any, NoReturn, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .errors import raise_internal

__all__ = ["NotHeldError", "OutsideBoundaryError", "TrainingPass", "Access", "BoundaryAccess", "UnheldParameter",
           "UnheldDTensor", "GuardedParameter", "GuardedDTensor", "internal", "in_backward", "set_access", "describe",
           "guard_modules"]

#: Attribute with ``(fqn, owner's global rank)`` on every bound dedicated parameter, for messages.
INFO_ATTR = "_dmuon_info"
#: Attribute with the :class:`BoundaryAccess` of every bound dedicated parameter: what its boundary group
#: answers when a guarded or unheld class meets a value read.
ACCESS_ATTR = "_dmuon_access"

#: Marks a self-view (:func:`_self_view`) that carries its parameter's guard class.
_SELF_VIEW_ATTR = "_dmuon_self_view"

_FIX = ("read it on its owner (dmuon.get_owned_params(model)), gather full values with "
        "dmuon.get_model_state_dict(model), clip with dmuon.clip_grad_norm_(model, max_norm)")


class NotHeldError(RuntimeError):
    """A value of a dedicated parameter was read on a rank that holds no copy of it."""


class OutsideBoundaryError(NotHeldError):
    """A dedicated parameter was read during a training pass outside its hook boundary's window. Raised on
    every rank alike, the owner's too, so that none goes on to wait in a collective for the others. See
    [Note: boundary windows].

    Example::

        loss = model(batch).loss + 1e-4 * model.layers[0].mlp.up_proj.weight.pow(2).sum()  # raises here
        # fix: give dedicate_params a hook boundary that encloses every use of the matrix, or regularise
        # inside the module's forward
    """


_tls = threading.local()


@contextmanager
def internal() -> Iterator[None]:
    """dmuon's own code handling unheld parameters (rebinding, buffer management): nothing refused."""
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        yield
    finally:
        _tls.depth -= 1


def _is_internal() -> bool:
    return getattr(_tls, "depth", 0) > 0


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (non-reentrant activation
    checkpointing re-runs forward hooks there)."""
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------- #
# The training pass (see [Note: boundary windows])                         #
# ---------------------------------------------------------------------- #
class TrainingPass:
    """Whether one model is in a training pass, and where. See [Note: boundary windows].

    Written only by the model state's hooks (``dmuon/runtime/hooks.py``); boundary groups read :attr:`active`
    to choose their params' classes, messages read :meth:`where`. Every hook that drives it runs on every
    rank alike, so every rank sees the same pass. Each change returns whether :attr:`active` flipped (the
    caller then re-sorts every group's classes). Lenient on purpose: a module's post-forward may run without
    its pre-forward (a hook before it raised), and a boundary whose forward raised never leaves."""

    #: A pass is open: a value read outside a boundary's window raises on every rank. Plain attribute, read
    #: at every class change.
    active: bool

    def __init__(self) -> None:
        #: Nesting depth of the root module's forward (outside backward).
        self._root_depth = 0
        #: Boundaries whose forward runs now (outside backward), innermost last.
        self._running: list[str] = []
        #: A grad-enabled forward returned and no backward (nor ``step()``) has closed it yet.
        self._owed = False
        self.active = False

    def _flipped(self) -> bool:
        now = self._root_depth > 0 or bool(self._running) or self._owed
        flipped, self.active = now != self.active, now
        return flipped

    def open_root(self) -> bool:
        """The root module's pre-forward (outside backward)."""
        if self._root_depth == 0:
            self._running.clear()  # boundaries whose forward raised never left
        self._root_depth += 1
        return self._flipped()

    def close_root(self, grad_enabled: bool) -> bool:
        """The root module's post-forward (outside backward; also after an exception). With grad enabled the
        pass stays open until the backward ends."""
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth == 0:
            self._running.clear()
        self._owed = self._owed or grad_enabled
        return self._flipped()

    def enter(self, boundary: str) -> bool:
        """A boundary's pre-forward (outside backward). Outside a root call this opens the pass itself."""
        self._running.append(boundary)
        return self._flipped()

    def leave(self, boundary: str, grad_enabled: bool) -> bool:
        """A boundary's post-forward (outside backward)."""
        if boundary in self._running:  # the innermost, unless a boundary inside it raised
            last = len(self._running) - 1 - self._running[::-1].index(boundary)
            del self._running[last:]
        self._owed = self._owed or grad_enabled
        return self._flipped()

    def settle(self) -> bool:
        """The backward ended (the end-of-backward callback), or ``step()`` / a state-dict drain dropped
        forwards whose backward never came."""
        self._owed = False
        return self._flipped()

    def where(self) -> str:
        """Where the model is, for messages: the same words on every rank."""
        if in_backward():
            return "during the backward"
        if self._running:
            return f"in the forward of hook boundary {self._running[-1] or '<root>'!r}"
        if self._root_depth:
            return "in the model's forward (in no hook boundary)"
        return "after the model's forward, before its backward finished"


class BoundaryAccess(Protocol):
    """What a guarded or unheld parameter asks its boundary group (``runtime/group.py``) on a value read."""

    #: The hook boundary's module name ("" for the root).
    boundary: str

    def outside_window(self) -> str | None:
        """During a training pass, :meth:`TrainingPass.where`; ``None`` outside one."""
        ...

    def admit(self) -> None:
        """Outside a pass, on a holder: wait for what is in flight into the param's bucket (a publish), which
        makes the bucket's params plain. A local wait, never a collective."""
        ...


# ---------------------------------------------------------------------- #
# The guard shared by the four classes                                     #
# ---------------------------------------------------------------------- #
def _metadata_functions() -> frozenset[Any]:
    """Tensor attributes and methods that read no values (each looked up, so a torch build lacking one
    simply leaves it out)."""
    T = torch.Tensor
    getters = ("shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
               "_version", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
               "is_nested", "is_mps", "is_xpu", "itemsize", "nbytes", "output_nr", "_backward_hooks",
               "_post_accumulate_grad_hooks", "names", "_base")
    setters = ("requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
               "is_contiguous", "stride", "storage_offset", "get_device", "requires_grad_", "register_hook",
               "register_post_accumulate_grad_hook", "retain_grad", "__hash__", "__len__", "data_ptr",
               "untyped_storage", "is_inference", "_is_view", "is_shared", "is_signed", "_typed_storage")
    out: set[Any] = set()
    for name in getters:
        if hasattr(T, name):
            out.add(getattr(T, name).__get__)
    for name in setters:
        if hasattr(getattr(T, name, None), "__set__"):
            out.add(getattr(T, name).__set__)
    for name in methods:
        if hasattr(T, name):
            out.add(getattr(T, name))
    return frozenset(out)


_METADATA = _metadata_functions()


def describe(p: torch.Tensor, outside: tuple[str, str] | None = None) -> str:
    """``repr`` of a parameter that cannot be read here: what it is and where it lives, no values. ``outside``:
    (boundary, where) during a training pass, the same text on every rank."""
    fqn, owner = getattr(p, INFO_ATTR, ("?", "?"))
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = tuple(p.shape), p.dtype, p.device
    state = (f"outside its hook boundary {outside[0] or '<root>'!r} ({outside[1]})" if outside is not None
             else f"held by rank {owner}, not by this rank")
    return f"<dmuon dedicated parameter {fqn!r}, shape={shape}, dtype={dtype}, device={device}: {state}>"


def _op_name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__") and owner is not None:
        return f"{'reading' if name == '__get__' else 'setting'} .{getattr(owner, '__name__', '?')}"
    return name


def _dedicated_in(args: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The guarded and unheld tensors among ``args`` (lists and tuples searched), in order."""
    for a in args:
        if isinstance(a, _GUARD_CLASSES):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            _dedicated_in(a, found)
    return found


def _message(func: Any, p: torch.Tensor | None) -> str:
    fqn, owner = getattr(p, INFO_ATTR, ("?", "?")) if p is not None else ("?", "?")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return (f"dmuon: {_op_name(func)} on dedicated parameter {fqn!r}, which rank {rank} does not hold "
            f"outside dmuon's forward and backward (its owner is rank {owner}); {_FIX}. Inside a forward "
            "this means the matrix is used outside its hook boundary: give dedicate_params a boundary that "
            "encloses every use.")


def _raise_outside(func: Any, p: torch.Tensor, boundary: str, where: str) -> NoReturn:
    fqn = getattr(p, INFO_ATTR, ("?",))[0]  # not the owner's rank: under TP it differs per tp index
    raise OutsideBoundaryError(
        f"dmuon: {_op_name(func)} on dedicated parameter {fqn!r} {where}, outside the window of its hook "
        f"boundary {boundary or '<root>'!r}. Outside that window only its owner holds it (under HSDP: the "
        "owner's shard column), so every rank raises this error, the owner too, instead of computing on and "
        "waiting for the others in the next collective. Use the matrix inside its boundary: give "
        "dedicate_params a hook_boundary_predicate whose module encloses every use, or "
        "reshard_after_forward=False to keep it from the forward to the backward (e.g. a loss term on it). A "
        "grad-enabled forward keeps the pass open until its backward or optimizer.step(): run evaluation "
        "forwards under torch.no_grad()."
    )


def _check(func: Any, tensors: list[torch.Tensor], as_repr: bool) -> str | None:
    """Raise for ``tensors`` (during a pass: the first one outside its window decides, the same one on every
    rank; else an unheld one), or admit the guarded ones so ``func`` can run. ``as_repr``: return the
    description instead of raising."""
    for p in tensors:
        access: BoundaryAccess | None = getattr(p, ACCESS_ATTR, None)
        where = None if access is None else access.outside_window()
        if where is not None:
            if as_repr:
                return describe(p, (access.boundary, where))  # type: ignore[union-attr]
            _raise_outside(func, p, access.boundary, where)  # type: ignore[union-attr]
    for p in tensors:
        if isinstance(p, _UNHELD_CLASSES):
            if as_repr:
                return describe(p)
            raise NotHeldError(_message(func, p))
    for p in tensors:
        getattr(p, ACCESS_ATTR).admit()
        if getattr(p, _SELF_VIEW_ATTR, False):  # a self-view admitted with its parameter: a plain tensor now
            p.__class__ = torch.Tensor
        if isinstance(p, _GUARD_CLASSES):
            raise_internal(f"dedicated parameter {getattr(p, INFO_ATTR, ('?',))[0]!r} is still guarded after "
                           "its boundary group admitted it")
    return None


def _self_view(p: torch.Tensor) -> torch.Tensor:
    """``p.view_as(p)``, which reads no values: torch's pipelining takes one of every parameter to reach its
    gradient accumulator (``_get_grad_fn_or_grad_acc`` before a zero-bubble schedule's input and weight
    passes), wherever the boundary's window stands. See [Note: zero-bubble passes]. The view keeps ``p``'s
    class and labels, so reading it later raises (or is admitted) on every rank as reading ``p`` would."""
    with torch._C.DisableTorchFunctionSubclass():
        view = torch.Tensor.view_as(p, p)
    view.__class__ = type(p)
    for attr in (INFO_ATTR, ACCESS_ATTR):
        if hasattr(p, attr):
            setattr(view, attr, getattr(p, attr))
    setattr(view, _SELF_VIEW_ATTR, True)
    return view


def _guard(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``__torch_function__`` of the four classes: metadata through; a value read raises or is admitted."""
    kwargs = kwargs or {}
    if func in _METADATA or _is_internal():
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch.Tensor.view_as and len(args) == 2 and args[0] is args[1] and not kwargs \
            and isinstance(args[0], (UnheldParameter, GuardedParameter)):
        return _self_view(args[0])
    as_repr = func is torch.Tensor.__repr__ or (func is torch.Tensor.__format__ and args[1:] == ("",))
    described = _check(func, _dedicated_in((*args, *kwargs.values()), []), as_repr)
    if described is not None:
        return described
    return func(*args, **kwargs)  # every guarded one is plain now: torch's own path


class UnheldParameter(nn.Parameter):
    """A dedicated parameter on a rank that holds no copy of it right now. See [Note: unheld parameters]."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guard(func, args, kwargs)


class GuardedParameter(nn.Parameter):
    """A dedicated parameter this rank holds whose values must not be read as they are: a publish is in flight
    into it, or a training pass is outside its boundary's window. See [Note: guarded parameters]."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guard(func, args, kwargs)


class _DTensorGuard:
    """The guard for tensor-parallel dedicated parameters (``nn.Parameter`` s whose class is ``DTensor``).
    DTensor's ``full_tensor()``, ``redistribute()``, ``to_local()`` and ``repr`` reach the local shard in
    Python, not through a torch function (an autograd.Function's apply bypasses ``__torch_function__``), so
    they are guarded here too: on 0 bytes of storage a collective crashes."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guard(func, args, kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        me: Any = self
        described = None if _is_internal() else _check(torch.Tensor.__repr__, [me], as_repr=True)
        return described if described is not None else DTensor.__repr__(me, tensor_contents=tensor_contents)

    def full_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.full_tensor, args, kwargs)

    def redistribute(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.redistribute, args, kwargs)

    def to_local(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.to_local, args, kwargs)

    def _guarded(self, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        me: Any = self
        if not _is_internal():
            _check(method, [me], as_repr=False)
        return method(me, *args, **kwargs)


class UnheldDTensor(_DTensorGuard, DTensor):
    """A tensor-parallel dedicated parameter whose local shard this rank does not hold right now: the guard of
    :class:`UnheldParameter`."""


class GuardedDTensor(_DTensorGuard, DTensor):
    """A tensor-parallel dedicated parameter this rank holds, guarded like :class:`GuardedParameter`."""


_UNHELD_CLASSES = (UnheldParameter, UnheldDTensor)
_GUARD_CLASSES = (UnheldParameter, UnheldDTensor, GuardedParameter, GuardedDTensor)


class Access(enum.Enum):
    """What a dedicated parameter's class lets through."""

    #: Plain ``nn.Parameter`` / ``DTensor``: torch's fast path. Inside the boundary's window on every rank;
    #: on holders also outside a training pass when no publish is in flight.
    OPEN = "open"
    #: :class:`GuardedParameter` / :class:`GuardedDTensor`: held; the first value read waits or raises.
    GUARDED = "guarded"
    #: :class:`UnheldParameter` / :class:`UnheldDTensor`: 0 bytes here; every value read raises.
    UNHELD = "unheld"


_PARAM_CLASSES = {Access.OPEN: nn.Parameter, Access.GUARDED: GuardedParameter, Access.UNHELD: UnheldParameter}
_DTENSOR_CLASSES = {Access.OPEN: DTensor, Access.GUARDED: GuardedDTensor, Access.UNHELD: UnheldDTensor}
_PARAM_SET = frozenset(_PARAM_CLASSES.values())
_DTENSOR_SET = frozenset(_DTENSOR_CLASSES.values())


def set_access(p: nn.Parameter, access: Access) -> None:
    """Give ``p`` the class of ``access``: one pointer write, none if it has it already. Only dmuon's six
    classes are switched; another subclass is left alone."""
    cls = type(p)
    table = _PARAM_CLASSES if cls in _PARAM_SET else _DTENSOR_CLASSES if cls in _DTENSOR_SET else None
    if table is not None and cls is not table[access]:
        p.__class__ = table[access]


# ---------------------------------------------------------------------- #
# Module guards (see [Note: module guards])                                #
# ---------------------------------------------------------------------- #
def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if keep_vars or _is_internal():
        return
    raise NotHeldError(
        f"dmuon: {type(module).__name__}.state_dict() (at {prefix or '<root>'!r}) on a model with dedicated "
        "parameters: each rank holds only the matrices it owns, so the values are not all here. Use "
        "sd = dmuon.get_model_state_dict(model) (collective; full tensors, loadable into a plain model) "
        "or dmuon.get_model_state_dict(model, sharded=True) for torch.distributed.checkpoint."
    )


def _refuse_load(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    if _is_internal():
        return
    raise NotHeldError(
        f"dmuon: {type(module).__name__}.load_state_dict() (at {prefix or '<root>'!r}) on a model with "
        "dedicated parameters: ranks that do not own a matrix have nowhere to copy it. Use "
        "dmuon.set_model_state_dict(model, sd) (collective), with a full or a sharded state dict."
    )


def _guarded_apply(check: Callable[[Callable[[torch.Tensor], torch.Tensor]], None]) -> Callable[..., Any]:
    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        check(fn)
        with internal():
            return type(self)._apply(self, fn, *args, **kwargs)  # the class's (FSDP2's, if sharded)

    return _apply


def guard_modules(modules: list[nn.Module], check_apply: Callable[[Callable[[torch.Tensor], torch.Tensor]], None]
                  ) -> list[Callable[[], None]]:
    """Install the module guards on ``modules`` (every module with a dedicated parameter at or below it,
    the ones holding one directly first). Returns the undo functions."""
    undo: list[Callable[[], None]] = []
    apply = _guarded_apply(check_apply)
    for m in modules:
        handles: list[RemovableHandle] = [m.register_state_dict_pre_hook(_refuse_state_dict),
                                          m.register_load_state_dict_pre_hook(_refuse_load)]
        m.__dict__["_apply"] = MethodType(apply, m)
        undo.append(lambda m=m, hs=handles: (m.__dict__.pop("_apply", None), [h.remove() for h in hs]))
    return undo
