"""Make FSDP2's ``fully_shard`` leave dedicated parameters alone.

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
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .runtime.param import DEDICATED_ATTR, is_dedicated
from .runtime.route import is_replicated

__all__ = ["DEDICATED_ATTR", "install_patch", "uninstall_patch", "is_patch_installed", "is_dedicated"]

_HOOK_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_init"
_HOOK_NAME = "_get_managed_states"
_EXPECTED_PARAMS = ("modules", "ignored_params")
_MARK = "__dmuon_wrapped__"


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
