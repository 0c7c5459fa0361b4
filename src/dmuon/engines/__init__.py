"""The engines dmuon trains beside: which one holds a model, and the binding every other part asks.

One module per engine (``fsdp2.py``, ``ddp.py``, ``deepspeed.py``), each a subclass of
:class:`~dmuon.engines.base.Engine`, which is also the answer for a model no engine wraps; [Note: engines] in
``base.py`` lists the questions. The rest of dmuon never asks "is this DDP?": it asks the binding,
``engines.of(model)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..runtime.hooks import DMuonState, get_state
from .base import Engine
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp2 import FSDP2

__all__ = ["Engine", "DDP", "DeepSpeed", "FSDP2", "ENGINES", "detect", "bind", "take_whole", "of", "state_of", "unwrap",
           "check_unchanged", "prepare_for_engines", "register_glue", "activate_glue"]

#: Every engine, most specific first: a wrapper before the modules it holds; :class:`Engine` (none) last.
ENGINES: tuple[type[Engine], ...] = (DDP, DeepSpeed, FSDP2)

#: What installs the glue of the frameworks a script has imported (DeepSpeed's joins ``deepspeed.initialize``):
#: registered by ``dmuon.integrations``, which sits above this package. ``dedicate_params`` installs it, and
#: ``dmuon.Muon``'s build through :func:`activate_glue`, so ``import deepspeed`` before the optimizer is enough.
_GLUE: list[Callable[[], None]] = []


def register_glue(fn: Callable[[], None]) -> None:
    """Add ``fn`` to what :func:`activate_glue` calls (``dmuon.integrations`` registers its activation)."""
    if fn not in _GLUE:
        _GLUE.append(fn)


def activate_glue() -> None:
    """Install the framework glue the script's imports call for (idempotent; cheap when there is none)."""
    for fn in _GLUE:
        fn()


def unwrap(model: nn.Module) -> nn.Module:
    """The module ``dedicate_params`` prepared: ``model`` itself, or the one an engine's wrapper holds."""
    for cls in ENGINES:
        inner = cls.unwrap(model)
        if inner is not model:
            return inner
    return model


def state_of(model: nn.Module) -> DMuonState:
    """The state ``dedicate_params`` attached to ``model`` or to the module an engine's wrapper holds; a clear
    error if there is none."""
    return get_state(unwrap(model))


def detect(model: nn.Module) -> type[Engine]:
    """The engine that trains ``model`` (what the user passed: a wrapper or the model) now."""
    return next((cls for cls in ENGINES if cls.claims(model)), Engine)


def bind(model: nn.Module) -> Engine:
    """Detect the engine of ``model``, store the binding on its state and tell the runtime what it needs of it:
    the plain params dmuon averages, and who decides the accumulation boundary. Call at a resting point
    (FSDP2 modules sharded): ``dmuon.Muon``'s build, or the first forward when no optimizer was built."""
    state = state_of(model)
    engine = detect(model)(model, state)
    state.engine = engine
    state.replicated_params = engine.plain_params()
    state.accumulation_boundary = engine.accumulation_boundary
    state.reshard_after_backward = engine.reshard_after_backward
    return engine


def of(model: nn.Module) -> Engine:
    """The engine of ``model`` (what the user passed) now: the one it shows (a wrapper, FSDP2 modules), else the
    stored binding of an engine the model itself shows no sign of (DeepSpeed), else none. Changes nothing."""
    state = state_of(model)
    cls = detect(model)
    bound = state.engine
    if isinstance(bound, Engine) and (type(bound) is cls or (cls is Engine and bound.bound_only)):
        return bound
    return cls(model, state)


def check_unchanged(engine: Engine) -> None:
    """Until the first step: raise if ``fully_shard`` took the model after ``dmuon.Muon`` was built on it (the
    optimizer then holds the params it replaced)."""
    if type(engine) is Engine and FSDP2.claims(engine.model):
        raise ValueError(
            "dmuon.Muon was built before fully_shard, which has since replaced the model's other params, so "
            "this optimizer holds stale ones. Build it after fully_shard: dmuon.dedicate_params(model, ...) "
            "-> fully_shard(...) -> dmuon.Muon(model, ...)."
        )


def take_whole(model: nn.Module, predicate: Callable[[str, nn.Parameter], bool] | None) -> Callable[[], None]:
    """``dedicate_params``, before its checks: params an engine partitioned at construction (DeepSpeed's
    ``zero.Init``) that ``predicate`` selects, made whole again so dmuon can own them. Returns what puts the
    engine's params back, for a check that fails after this (nothing may change on a refused call)."""
    swaps = [s for cls in ENGINES for s in cls.take_whole(model, predicate)]

    def undo() -> None:
        for module, name, param in swaps:
            module._parameters[name] = param

    return undo


def prepare_for_engines(model: nn.Module, fqns: list[str]) -> None:
    """``dedicate_params``, after every check passed: every engine that may take the model later leaves these
    params to dmuon."""
    for cls in ENGINES:
        cls.leave_dedicated(model, fqns)
