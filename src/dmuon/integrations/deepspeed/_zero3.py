"""ZeRO stage 3: the dedicated params stay out of ZeRO-3's partitioning, its fetch / release hooks and its optimizer.

[Note: DeepSpeed ZeRO-3]
ZeRO-3 owns every param of the module it is given: ``DeepSpeedZeRoOffload._convert_to_zero_parameters`` partitions
each param that has no ``ds_id`` (``is_zero_param``), and its per-module hooks gather a module's params
(``module.named_parameters(recurse=False)``) before the module runs and free them after; each step ends in
``release_and_reset_all``, which frees every param of the model and checks that none is left whole. DeepSpeed has no
switch to leave a param out (``ds_persist`` params are partitioned too, and freed at each step), and its only
public way to hold a param whole, ``GatheredParameters``, gathers it on *every* rank. So dmuon keeps its params out
the way ZeRO-3 itself tells its own params apart, by their ``ds_*`` attributes, in two places:

* while ``DeepSpeedEngine.__init__`` runs, each dedicated param is taken out of its module's ``_parameters`` (and
  put back, in its place, afterwards): ZeRO-3 converts, counts, marks persistent and hooks only the params it can
  see, and its optimizer gets the facade's groups (the other params) only;
* afterwards each dedicated param carries the marks of a ZeRO-3 param that is whole and persistent
  (``ds_status`` AVAILABLE, ``ds_persist``, ``is_external_param``, a ``ds_id`` below ZeRO's, the same on every
  rank): the per-module hooks then neither gather nor free it, and ZeRO's ``__getitem__`` hands it out as it is.
  dmuon's own hooks broadcast it from its owner before its boundary runs and reduce its gradient after, as under
  FSDP2.

One method of ZeRO-3's ``DeepSpeedZeRoOffload`` changes on that one object: ``partition_all_parameters`` (at every
step) calls each param's ``partition`` and then requires it NOT_AVAILABLE; a dedicated param's ``partition`` only
marks it so, and the call marks it AVAILABLE again once ZeRO's checks passed. Nothing is freed: dmuon drops
non-owner copies itself.

ZeRO-3's optimizer joins dmuon's step as ZeRO-1/2's does ([Note: DeepSpeed step] in ``_drive.py``), through four
methods of that object: ``step`` (``dmuon.Muon.apply_update`` with ZeRO's step inside it, then the owners'
gradients unscaled and clipped by ZeRO's own factor), ``_get_norm_groups`` (one more group: the dedicated
gradients' norm, summed over their owners, so the clip factor and ``engine.get_global_grad_norm()`` are the whole
model's), ``has_overflow`` (fp16: an inf / NaN in a dedicated gradient too) and ``zero_grad`` (the dedicated
gradients as well, except the call ZeRO-3 makes inside its own step, before dmuon's update has run).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.nn as nn

from ...optim import Muon
from ...runtime.hooks import DMuonState
from ._norms import owned_grads, owned_overflow, owned_squared_norm

__all__ = ["Zero3", "hidden"]


def _places(state: DMuonState) -> dict[nn.Module, list[str]]:
    """Each module that holds a dedicated param directly, with the names it holds them under."""
    ids = {id(dp.bound()) for dp in state.dedicated()}
    out: dict[nn.Module, list[str]] = {}
    for m in state.model.modules():
        names = [k for k, p in m._parameters.items() if p is not None and id(p) in ids]
        if names:
            out[m] = names
    return out


class _Hiding(dict):
    """A module's ``_parameters`` whose iteration leaves the dedicated entries out, while lookups by name (dmuon's
    own, ``module.weight``) still find them: what every walk over a module's params (``named_parameters``,
    ``Module._apply``, ZeRO-3's conversion and its ``_inject_parameters``) reads."""

    def __init__(self, items: Any, hide: set[str]) -> None:
        super().__init__(items)
        self.hide = hide

    def keys(self) -> Any:  # type: ignore[override]
        return [k for k in super().keys() if k not in self.hide]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def items(self) -> Any:  # type: ignore[override]
        return [(k, v) for k, v in super().items() if k not in self.hide]

    def values(self) -> Any:  # type: ignore[override]
        return [v for _, v in self.items()]


@contextmanager
def hidden(state: DMuonState) -> Iterator[None]:
    """While the block runs, walks over the model's params do not meet the dedicated ones; then each module's
    dict (ZeRO-3 puts its own ``ZeROOrderedDict`` in place of every module's) holds them again, each in its place."""
    saved = {}
    for m, names in _places(state).items():
        saved[m] = (m._parameters, list(dict.items(m._parameters)))
        m._parameters = _Hiding(m._parameters, set(names))
    try:
        yield
    finally:
        for m, (before, items) in saved.items():
            now = m._parameters
            if isinstance(now, _Hiding):  # nobody replaced it: the original dict, as it was
                m._parameters = before
                continue
            order = [k for k, _ in items]
            merged = [(k, now[k] if k in now else v) for k, v in items]
            merged += [(k, v) for k, v in now.items() if k not in order]
            now.clear()
            now.update(merged)


class Zero3:
    """What changes on ZeRO-3's objects for one dmuon model ([Note: DeepSpeed ZeRO-3])."""

    #: what is replaced on ZeRO-3's optimizer object (``install`` checks they exist)
    ZERO_METHODS: ClassVar[tuple[str, ...]] = ("step", "_get_norm_groups", "has_overflow", "zero_grad")
    #: what is replaced on its ``DeepSpeedZeRoOffload`` (``zero.parameter_offload``)
    OFFLOAD_METHODS: ClassVar[tuple[str, ...]] = ("partition_all_parameters",)

    def __init__(self, state: DMuonState, muon: Muon, engine: Any, before_step: Any) -> None:
        self.state, self.muon, self.engine = state, muon, engine
        self.before_step = before_step  # dmuon's groups follow a config scheduler
        self.in_step = False
        #: the dedicated gradients' norm of this step (one of ZeRO's norm groups), ``None`` before the norm
        self.norm: torch.Tensor | None = None

    def attach(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.available = ZeroParamStatus.AVAILABLE
        for i, dp in enumerate(self.state.dedicated()):
            _mark(dp.bound(), dp.fqn, -1 - i, ZeroParamStatus)
        zero = self.engine.optimizer
        for name, method in (("step", self._step), ("_get_norm_groups", self._norm_groups),
                             ("has_overflow", self._has_overflow), ("zero_grad", self._zero_grad)):
            setattr(zero, name, _bound(method, getattr(zero, name)))
        offload = zero.parameter_offload
        offload.partition_all_parameters = _bound(self._release_all, offload.partition_all_parameters)

    # ------------------------------------------------------------------ #
    # ZeRO-3's parameter offload                                                #
    # ------------------------------------------------------------------ #
    def _release_all(self, original: Any) -> None:
        """ZeRO's release of every param (its checks included); the dedicated ones whole again afterwards."""
        original()
        for dp in self.state.dedicated():
            dp.bound().ds_status = self.available

    # ------------------------------------------------------------------ #
    # ZeRO-3's optimizer                                                   #
    # ------------------------------------------------------------------ #
    @torch.no_grad()
    def _step(self, original: Any, closure: Any = None) -> None:
        self.before_step()
        self.muon.apply_update(engine_step=lambda: self._engine_step(original))

    def _engine_step(self, zero_step: Any) -> bool:
        """ZeRO-3's own step, then (unless it overflowed) the owners' gradients unscaled and clipped by the factor
        its ``unscale_and_clip_grads`` used; whether dmuon's part of the step runs."""
        zero = self.engine.optimizer
        self.norm = None
        self.in_step = True
        try:
            zero_step()
        finally:
            self.in_step = False
        if zero.overflow:  # ZeRO skipped the step; the engine's zero_grad drops ours too
            return False
        grads = owned_grads(self.state)
        combined = zero.loss_scale
        if zero.clip_grad > 0.0:  # ZeRO-3's unscale_and_clip_grads, on the same norm
            clip = (torch.as_tensor(zero._global_grad_norm) + 1e-6) / zero.clip_grad
            combined = torch.clamp(clip, min=1.0) * zero.loss_scale
        for g in grads:
            g.mul_(1.0 / combined)
        return True

    def _norm_groups(self, original: Any) -> list[Any]:
        """ZeRO-3's norm of each of its groups, and the dedicated gradients' (each counted once, on its owner)."""
        theirs = list(original())
        self.norm = owned_squared_norm(self.state).sqrt()
        device = next((n.device for n in theirs if isinstance(n, torch.Tensor)), self.norm.device)
        return [*theirs, self.norm.to(device)]

    def _has_overflow(self, original: Any, partition_gradients: bool = True) -> bool:
        theirs = original(partition_gradients)
        return owned_overflow(self.state) or bool(theirs)  # every rank reaches the all-reduce

    def _zero_grad(self, original: Any, set_to_none: bool = True) -> None:
        original(set_to_none)
        if self.in_step:  # ZeRO-3 clears its own gradients inside its step, before dmuon's update reads ours
            return
        self.state.finish_reduces()
        self.state.clear_grads(set_to_none=set_to_none)


def _mark(p: nn.Parameter, fqn: str, ds_id: int, status: Any) -> None:
    """``p`` as ZeRO-3 sees a whole, persistent param that it never gathers or frees ([Note: DeepSpeed ZeRO-3])."""
    p.ds_id = ds_id
    p.ds_status = status.AVAILABLE
    p.ds_persist = True
    p.ds_active_sub_modules = set()
    p.is_external_param = True  # the per-module release (and its data swap) skips it
    p.ds_tensor = None
    p.ds_secondary_tensor = None
    p.nvme_swapper = None
    p.ds_shape = p.shape
    p.ds_numel = math.prod(p.shape)  # trainable, so DeepSpeed's save does not take it for a frozen param

    def partition(*args: Any, **kwargs: Any) -> None:
        p.ds_status = status.NOT_AVAILABLE  # for release_and_reset_all's check; Zero3._release_all undoes it

    def all_gather(*args: Any, **kwargs: Any) -> None:  # what GatheredParameters calls on its first param
        raise ValueError(
            f"dmuon: deepspeed.zero.GatheredParameters over dmuon's dedicated param {fqn!r}: "
            "it is whole on its owner and never partitioned by ZeRO-3. Gather only the params ZeRO-3 partitioned "
            "(those with a ds_tensor), or read the whole model with dmuon.get_model_state_dict(model)")

    p.partition = partition
    p.all_gather = all_gather
    p.partition_numel = lambda: 0
    p.ds_summary = lambda **_: f"dmuon dedicated param (ds_id {ds_id}, status {p.ds_status}, whole on its owner)"


def _bound(method: Any, original: Any) -> Any:
    """``method`` with the object's own bound method first: what replaces it on the instance."""
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(original, *args, **kwargs)

    return call
