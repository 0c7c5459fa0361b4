"""FSDP2 (``fully_shard``) as dmuon's engine: the skip patch, which modules FSDP2 wrapped, what their policies
cast to, and the engine's answers ([Note: engines] in ``base.py``).

``fully_shard`` decides which parameters it manages by calling the module-level helper
``_fsdp_init._get_managed_states(modules, ignored_params)`` at call time. Wrapping that helper (rather
than the public ``fully_shard`` name) reaches every caller, including code that bound ``fully_shard``
before ``import dmuon`` and libraries such as torchtitan that call it internally.

A dedicated parameter carries ``_dedicated_owner_rank`` (set by :func:`dmuon.dedicate_params`); the
wrapper adds every such parameter to ``ignored_params``, so it stays a plain ``nn.Parameter`` that
dmuon's own hooks manage.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from ..runtime.param import DEDICATED_ATTR, is_dedicated
from ..runtime.route import is_replicated
from .base import Engine

__all__ = ["DEDICATED_ATTR", "FSDP2", "FSDPModule", "install_patch", "uninstall_patch", "is_patch_installed",
           "is_dedicated", "fsdp_modules", "cast_dtypes"]

_HOOK_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_init"
_HOOK_NAME = "_get_managed_states"
_EXPECTED_PARAMS = ("modules", "ignored_params")
_MARK = "__dmuon_wrapped__"


# --------------------------------------------------------------------------------------------------- #
# The skip patch                                                                                       #
# --------------------------------------------------------------------------------------------------- #
def _hook_module() -> Any:
    """Import the private FSDP2 module and check the helper we wrap still looks as expected."""
    try:
        mod = importlib.import_module(_HOOK_MODULE)
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise RuntimeError(
            f"dmuon cannot patch FSDP2 on torch {torch.__version__}: {_HOOK_MODULE} is missing ({e}). "
            "dmuon supports torch>=2.6 with FSDP2 (torch.distributed.fsdp.fully_shard)."
        ) from e
    fn = getattr(mod, _HOOK_NAME, None)
    if fn is None or not callable(fn):
        raise RuntimeError(
            f"dmuon cannot patch FSDP2 on torch {torch.__version__}: {_HOOK_MODULE}.{_HOOK_NAME} "
            "no longer exists, so fully_shard would shard dedicated parameters. "
            "Please report this torch version to dmuon."
        )
    target = getattr(fn, "__wrapped__", fn)
    params = tuple(inspect.signature(target).parameters)
    if params[: len(_EXPECTED_PARAMS)] != _EXPECTED_PARAMS:
        raise RuntimeError(
            f"dmuon cannot patch FSDP2 on torch {torch.__version__}: {_HOOK_MODULE}.{_HOOK_NAME} "
            f"has parameters {params}, expected {_EXPECTED_PARAMS}."
        )
    return mod


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _get_managed_states(
        modules: list[nn.Module], ignored_params: set[nn.Parameter] | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        dedicated = {  # and params routed ADAMW_REPLICATED: both stay whole, outside FSDP2
            p for m in modules for p in m.parameters(recurse=False) if is_dedicated(p) or is_replicated(p)
        }
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return original(modules, ignored_params, *args, **kwargs)

    setattr(_get_managed_states, _MARK, True)
    return _get_managed_states


def install_patch() -> None:
    """Install the FSDP2 skip patch; idempotent. Raises ``RuntimeError`` if torch's internals moved.

    ``import dmuon`` already calls it; call it again after something restored FSDP2's helper.

    Example::

        import dmuon
        dmuon.install_patch()          # no-op when already installed
        assert dmuon.is_patch_installed()
    """
    mod = _hook_module()
    fn = getattr(mod, _HOOK_NAME)
    if getattr(fn, _MARK, False):
        return
    setattr(mod, _HOOK_NAME, _wrap(fn))


def uninstall_patch() -> None:
    """Restore FSDP2's original helper (mainly for tests); a no-op if the patch is not installed.

    Example::

        dmuon.uninstall_patch()        # fully_shard now shards every parameter again
        dmuon.install_patch()
    """
    mod = _hook_module()
    fn = getattr(mod, _HOOK_NAME)
    if getattr(fn, _MARK, False):
        setattr(mod, _HOOK_NAME, fn.__wrapped__)


def is_patch_installed() -> bool:
    """Whether ``fully_shard`` currently skips dedicated parameters.

    Example::

        if not dmuon.is_patch_installed():
            dmuon.install_patch()
    """
    return bool(getattr(getattr(_hook_module(), _HOOK_NAME), _MARK, False))


# --------------------------------------------------------------------------------------------------- #
# What dmuon reads of FSDP2 modules                                                                    #
# --------------------------------------------------------------------------------------------------- #
def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` wrapped (the root included), in module order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def cast_dtypes(model: nn.Module) -> dict[str, torch.dtype] | None:
    """``{module path: dtype}`` for every FSDP2 module whose ``MixedPrecisionPolicy`` casts its forward
    inputs to a ``param_dtype``; ``None`` when this torch's FSDP2 keeps the policy elsewhere (the state
    object and its ``_mp_policy`` are private, so a torch that moved them leaves nothing to check)."""
    out: dict[str, torch.dtype] = {}
    for path, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            policy = m._get_fsdp_state()._mp_policy  # type: ignore[operator]
        except AttributeError:
            return None
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            out[path] = policy.param_dtype
    return out


# --------------------------------------------------------------------------------------------------- #
# The engine                                                                                           #
# --------------------------------------------------------------------------------------------------- #
class FSDP2(Engine):
    """FSDP2: its params are DTensor shards it reduce-scatters itself; the plain params of a model partly wrapped
    are dmuon's to average, as with no engine. ``dmuon.no_sync`` turns its reduce-scatter off; state dicts read
    its modules resharded; ``dmuon.Muon`` refuses a ``MixedPrecisionPolicy`` whose input cast would meet
    dedicated params of another dtype."""

    kind: ClassVar[str] = "fsdp2"
    #: the param group whose ``reduce_grads`` is FSDP2's sync switch (:meth:`accumulation_boundary`), once found
    _switch: Any = None
    _switch_looked_up: bool = False

    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        return bool(fsdp_modules(model))

    @classmethod
    def refuse_taken(cls, model: nn.Module) -> None:
        """Only the named list: ``dedicate_params`` words the error together with its checks of other DTensors."""

    @classmethod
    def sharded_modules(cls, model: nn.Module) -> list[str]:
        """The paths of the modules ``fully_shard`` already wrapped (``"<root>"`` for the root)."""
        return [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]

    @classmethod
    def leave_dedicated(cls, model: nn.Module, fqns: list[str]) -> None:
        install_patch()  # ``fully_shard`` skips every param marked dedicated (``import dmuon`` installed it)

    @contextmanager
    def no_sync(self, *, resume: bool) -> Iterator[None]:
        fsdp = fsdp_modules(self.model)
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(resume, recurse=False)

    def accumulation_boundary(self) -> bool | None:
        """FSDP2's own gradient-sync switch, however it was set: by ``dmuon.no_sync``, by the user's
        ``set_requires_gradient_sync``, or by torch's pipelining schedules, which turn it off before every
        microbatch's backward and on again in their final reduce (``perform_reduce_grad``, outside any
        backward). Following it, the dedicated gradients accumulate locally over the microbatches and are
        reduced once, by the clip or the step that comes next. ``None`` (``no_sync`` alone decides) where no
        FSDP2 module holds params, or this torch keeps the switch elsewhere (its param groups are private)."""
        group = self._sync_switch()
        flag = getattr(group, "reduce_grads", None)
        return flag if isinstance(flag, bool) else None

    def reshard_after_backward(self) -> bool:
        """FSDP2's own setting (``set_reshard_after_backward``; torch's pipelining schedules turn it off for every
        microbatch's backward and on again in their final reduce)."""
        flag = getattr(self._sync_switch(), "reshard_after_backward", True)
        return flag if isinstance(flag, bool) else True

    def _sync_switch(self) -> Any:
        """The first FSDP2 param group (``set_requires_gradient_sync`` writes every one alike); found once."""
        if not self._switch_looked_up:
            self._switch_looked_up = True
            for m in fsdp_modules(self.model):
                try:
                    st = m._get_fsdp_state()  # type: ignore[operator]
                    groups = getattr(st, "_fsdp_param_groups", None)
                    if groups is None:  # earlier torch: one group per module
                        groups = [g] if (g := getattr(st, "_fsdp_param_group", None)) is not None else []
                except AttributeError:
                    groups = []
                if groups:
                    self._switch = groups[0]
                    break
        return self._switch

    def check_optimizer(self) -> None:
        """Refuse dedicated params whose compute dtype differs from the ``MixedPrecisionPolicy.param_dtype`` of
        the FSDP2 module around them: FSDP2 casts that module's inputs, and the first forward would fail in
        ``F.linear`` on mismatched dtypes."""
        policies = cast_dtypes(self.model)
        if policies is None:  # FSDP2 internals moved: nothing to check against
            return
        for dp in self.state.dedicated():
            module_path = dp.fqn.rsplit(".", 1)[0] if "." in dp.fqn else ""
            # the nearest FSDP2 module at or above the param's module decides what its inputs are cast to
            owner = max((path for path in policies if path == "" or module_path == path
                         or module_path.startswith(path + ".")), key=len, default=None)
            if owner is not None and policies[owner] != dp.compute_dtype:
                pd = policies[owner]
                raise ValueError(
                    f"dmuon.Muon: fully_shard({owner or '<root>'!r}, mp_policy=MixedPrecisionPolicy(param_dtype={pd})) "
                    f"casts its inputs to {pd}, but dedicated param {dp.fqn!r} computes in {dp.compute_dtype}, so the "
                    f"forward would fail on mismatched dtypes. Pass dmuon.dedicate_params(..., param_dtype={pd}) (the "
                    f"owners keep the {dp.dtype} values as masters), or convert the dedicated params to {pd} before "
                    "dedicate_params."
                )

    def rest(self) -> None:
        for m in fsdp_modules(self.model):
            m.reshard()
