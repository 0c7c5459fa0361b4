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
has its values, but while a publish is in flight into them reading them is wrong, and there its class is
:class:`GuardedParameter` (:class:`GuardedDTensor` for tensor parallelism). Under HSDP, after ``step()``
the owner sends the new tensor to the holders of the other replicate rows asynchronously; until it lands
a holder's copy is partly old. The first value op on a guarded param asks its boundary group to wait for
that bucket's publish (``Work.wait()``: a local wait, on CUDA a stream wait, never a collective), which
swaps the bucket's params back to plain, then runs. A read after ``step()`` sees the step, as under
FSDP2; the owner's own params are guarded too, since an in-place write there would race with the send.

Metadata and ``repr`` pass as for unheld parameters; nothing on the forward/backward fast path ever
meets the class, which is plain wherever the module legitimately computes.

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
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .errors import raise_internal

__all__ = ["NotHeldError", "Access", "BoundaryAccess", "UnheldParameter", "UnheldDTensor", "GuardedParameter",
           "GuardedDTensor", "internal", "set_access", "describe", "guard_modules"]

#: Attribute with ``(fqn, owner's global rank)`` on every bound dedicated parameter, for messages.
INFO_ATTR = "_dmuon_info"
#: Attribute with the :class:`BoundaryAccess` of every bound dedicated parameter: what its boundary group
#: answers when a guarded or unheld class meets a value read.
ACCESS_ATTR = "_dmuon_access"

_FIX = ("read it on its owner (dmuon.get_owned_params(model)), gather full values with "
        "dmuon.get_model_state_dict(model), clip with dmuon.clip_grad_norm_(model, max_norm)")


class NotHeldError(RuntimeError):
    """A value of a dedicated parameter was read on a rank that holds no copy of it."""


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


class BoundaryAccess(Protocol):
    """What a guarded or unheld parameter asks its boundary group (``runtime/group.py``) on a value read."""

    #: The hook boundary's module name ("" for the root).
    boundary: str

    def admit(self) -> None:
        """On a holder: wait for what is in flight into the param's bucket (a publish), which makes the bucket's
        params plain. A local wait, never a collective."""
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


def describe(p: torch.Tensor) -> str:
    """``repr`` of an unheld parameter: what it is and where it lives, no values."""
    fqn, owner = getattr(p, INFO_ATTR, ("?", "?"))
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype, device = tuple(p.shape), p.dtype, p.device
    return (f"<dmuon dedicated parameter {fqn!r}, shape={shape}, dtype={dtype}, device={device}: "
            f"held by rank {owner}, not by this rank>")


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


def _check(func: Any, tensors: list[torch.Tensor], as_repr: bool) -> str | None:
    """Raise for an unheld one of ``tensors``, or admit the guarded ones so ``func`` can run. ``as_repr``:
    return the description instead of raising."""
    for p in tensors:
        if isinstance(p, _UNHELD_CLASSES):
            if as_repr:
                return describe(p)
            raise NotHeldError(_message(func, p))
    for p in tensors:
        getattr(p, ACCESS_ATTR).admit()
        if isinstance(p, _GUARD_CLASSES):
            raise_internal(f"dedicated parameter {getattr(p, INFO_ATTR, ('?',))[0]!r} is still guarded after "
                           "its boundary group admitted it")
    return None


def _guard(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``__torch_function__`` of the four classes: metadata through; a value read raises or is admitted."""
    kwargs = kwargs or {}
    if func in _METADATA or _is_internal():
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
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
    into it. See [Note: guarded parameters]."""

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
    #: on holders also outside it when no publish is in flight.
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
