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

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = ["NotHeldError", "UnheldParameter", "UnheldDTensor", "internal", "set_held", "describe", "guard_modules"]

#: Attribute with ``(fqn, owner's global rank)`` on every bound dedicated parameter, for messages.
INFO_ATTR = "_dmuon_info"

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


def _first_unheld(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, (UnheldParameter, UnheldDTensor)):
            return a
        if isinstance(a, (list, tuple)):
            hit = _first_unheld(a)
            if hit is not None:
                return hit
    return None


def _message(func: Any, p: torch.Tensor | None) -> str:
    fqn, owner = getattr(p, INFO_ATTR, ("?", "?")) if p is not None else ("?", "?")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return (f"dmuon: {_op_name(func)} on dedicated parameter {fqn!r}, which rank {rank} does not hold "
            f"outside dmuon's forward and backward (its owner is rank {owner}); {_FIX}. Inside a forward "
            "this means the matrix is used outside its hook boundary: give dedicate_params a boundary that "
            "encloses every use.")


def _refuse_values(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The guard of both unheld classes: metadata through, ``repr`` described, anything else refused."""
    kwargs = kwargs or {}
    if func in _METADATA or _is_internal():
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch.Tensor.__repr__ or (func is torch.Tensor.__format__ and args[1:] == ("",)):
        return describe(args[0])
    raise NotHeldError(_message(func, _first_unheld(args)))


class UnheldParameter(nn.Parameter):
    """A dedicated parameter on a rank that holds no copy of it right now. See [Note: unheld parameters]."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _refuse_values(func, args, kwargs)


class UnheldDTensor(DTensor):
    """A tensor-parallel dedicated parameter (an ``nn.Parameter`` whose class is ``DTensor``) whose local shard
    this rank does not hold right now: the same guard as :class:`UnheldParameter`. Methods that read values,
    ``full_tensor()``, ``redistribute()``, ``to_local()``, run torch functions on it and are refused."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _refuse_values(func, args, kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # DTensor's own formats the empty local shard
        return describe(self)

    # DTensor's methods that read the local shard in Python, not through a torch function (an
    # autograd.Function's apply bypasses __torch_function__): a collective on 0 bytes of storage crashes
    def full_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.full_tensor, args, kwargs)

    def redistribute(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.redistribute, args, kwargs)

    def to_local(self, *args: Any, **kwargs: Any) -> Any:
        return self._guarded(DTensor.to_local, args, kwargs)

    def _guarded(self, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        if _is_internal():
            return method(self, *args, **kwargs)
        raise NotHeldError(_message(method, self))


def set_held(p: nn.Parameter, held: bool) -> None:
    """Mark ``p`` as holding its values (plain ``nn.Parameter`` / ``DTensor``) or not (:class:`UnheldParameter`
    / :class:`UnheldDTensor`).

    Only those exact classes are switched; another subclass is left alone."""
    cls = type(p)
    if held and cls in (UnheldParameter, UnheldDTensor):
        p.__class__ = nn.Parameter if cls is UnheldParameter else DTensor
    elif not held and cls is nn.Parameter:
        p.__class__ = UnheldParameter
    elif not held and cls is DTensor:
        p.__class__ = UnheldDTensor


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
