"""DCP checkpoints of a dmuon model in torchtitan: :class:`DMuonModelWrapper` over dmuon's sharded state
dicts, and :class:`DMuonCheckpointManager`, torchtitan's ``CheckpointManager`` that saves the model through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import CheckpointManager, ModelWrapper
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

import dmuon

from ...checkpoint.checksum import CHECKSUMS_KEY
from ...checkpoint.combined import part_key
from ...checkpoint.model import apply_model_sd, check_model_sd
from ...runtime.guard import internal
from ...runtime.hooks import STATE_ATTR
from ._fused_qkv import _fused_qkv_modules, _merge_fused_qkv, _split_fused_qkv
from .optimizer import DMuonOptimizersContainer
from .parallelize import _adopt


def _has_dmuon(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


@contextmanager
def _staged(*parts: Any) -> Iterator[None]:
    """While a checkpoint loads: the state dicts of dmuon's model wrapper and optimizer container are staged
    copies, the targets ``dcp.load`` fills ([Note: staged loads])."""
    ours = [p for p in parts if isinstance(p, (DMuonModelWrapper, DMuonOptimizersContainer))]
    for p in ours:
        p._staged = True
    try:
        yield
    finally:
        for p in ours:
            p._staged = False


class _Deferred(Stateful):
    """A ``Stateful`` entry of a load (LR schedulers, dataloader, train state, the optimizer container) that
    ``dcp.load`` fills without applying: the loaded dict is kept, and handed over by :meth:`apply` only once
    dmuon has accepted the model and optimizer, so a refused checkpoint changes none of them either."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict

    def apply(self) -> None:
        if self.loaded is not None:
            self.obj.load_state_dict(self.loaded)


class DMuonModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` over :func:`dmuon.get_model_state_dict` / :func:`dmuon.set_model_state_dict`
    (sharded): FSDP2 DTensors plus each dedicated tensor only on its owner, so DCP writes every dedicated
    matrix once, from the rank that really holds it, and loads into live tensors in place. Fused QKV weights
    are saved in torchtitan's ``wq``/``wk``/``wv`` layout (see [Note: fused QKV])."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        for m in [model] if isinstance(model, nn.Module) else model:
            if _has_dmuon(m):
                _adopt(m)
        #: set by DMuonCheckpointManager while it loads: state_dict() gives staged copies ([Note: staged loads])
        self._staged = False
        super().__init__(model)

    def _get_state_dict(self, staged: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model in self.model:
            if _has_dmuon(model):
                sd = dmuon.get_model_state_dict(model, sharded=True, staged=staged)
                _split_fused_qkv(model, sd)
                out.update(sd)
            else:
                out.update(model.state_dict())
        return out

    def state_dict(self) -> dict[str, Any]:
        # Recomputed on every call: the split QKV tensors are copies and must reflect the current weights.
        if self._staged:  # a load's target: copies, not the model's state (the cache stays as it is)
            return self._get_state_dict(staged=True)
        self.cached_state_dict = self._get_state_dict()
        return self.cached_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_with(state_dict)

    def _load_with(self, state_dict: dict[str, Any], optimizers: DMuonOptimizersContainer | None = None,
                   optim_sd: dict[str, Any] | None = None) -> bool:
        """The model parts' entries of a loaded checkpoint dict into the models; with ``optimizers`` and its
        loaded flat dict, the models it was built for and their optimizers as one unit (``dmuon.set_state_dict``
        over the parts: every part's halves checked before any is written). Whether the optimizer was loaded.
        Collective."""
        ours: list[tuple[nn.Module, dict[str, Any]]] = []
        for model in self.model:
            if _has_dmuon(model):
                live = dmuon.get_model_state_dict(model, sharded=True, checksums=False)
                # the checkpoint dict also carries optimizer / scheduler / dataloader entries
                part = {k: state_dict[k] for k in self._keys_of(model, live) if k in state_dict}
                _merge_fused_qkv(model, part, like=live)
                ours.append((model, part))
        paired = (optimizers is not None and optim_sd is not None and bool(ours)
                  and [m for m, _ in ours] == list(optimizers.model_parts))
        if paired:
            dmuon.set_state_dict([m for m, _ in ours], list(optimizers.optimizers), {  # type: ignore[union-attr]
                part_key(k): {"model": sd, "optim": optimizers.nested_state_dict(optim_sd, part=k)}  # type: ignore[union-attr]
                for k, (_, sd) in enumerate(ours)})
        else:  # every part checked before any is written, as above
            for load in [check_model_sd(m, sd, what="DMuonCheckpointManager.load") for m, sd in ours]:
                apply_model_sd(load)
        for model in self.model:
            if not _has_dmuon(model):
                model.load_state_dict(state_dict, strict=False)
        self.cached_state_dict = self._get_state_dict()
        return paired

    @staticmethod
    def _keys_of(model: nn.Module, live: dict[str, Any]) -> list[str]:
        """This rank's checkpoint keys for ``model``, whose sharded dict is ``live`` (no tensor data is read)."""
        keys = dict.fromkeys(live)
        keys[CHECKSUMS_KEY] = None
        for prefix, _ in _fused_qkv_modules(model):
            for param in ("weight", "bias"):
                fused = f"{prefix}wqkv.{param}"
                if fused in keys:
                    del keys[fused]
                    keys.update(dict.fromkeys(f"{prefix}{w}.{param}" for w in ("wq", "wk", "wv")))
        return list(keys)


class DMuonCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` that saves and restores the model through
    :class:`DMuonModelWrapper` (the optimizer container's own ``state_dict`` already goes through dmuon).

    A crash mid-save keeps the previous checkpoint without a rename of ours: every save is its own
    ``step-N`` folder, DCP writes ``.metadata`` last (a temporary name, then a rename), and torchtitan
    loads only folders that have one. A save into a folder that already holds a checkpoint can leave
    old metadata over new data; the checksums of the model and of the optimizer container
    (``_dmuon_checksums``, [Note: checkpoint checksums]) make the load refuse that mix, or a changed byte.

    A refused checkpoint changes nothing: ``dcp.load`` fills staged copies ([Note: staged loads]), the
    model and the optimizer are checked together and written only once both pass
    (``dmuon.set_state_dict``), and the other ``Stateful`` entries (LR schedulers, dataloader, train state)
    are handed their loaded state only after that. On a refusal ``load`` raises the ``ValueError`` on every
    rank.

    Example::

        checkpointer = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=100).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=out_dir)
        checkpointer.load()                 # latest step, if any
        ...
        checkpointer.save(step)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            for name in ("last_save_in_hf", "initial_load_in_hf"):
                if getattr(self, name):
                    raise ValueError(
                        f"DMuonCheckpointManager.Config: {name}=True is not supported (the HF adapters expect every "
                        "tensor on every rank); use dmuon.get_model_state_dict / set_model_state_dict for full tensors."
                    )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        for m in model_parts:  # before the stock ModelWrapper reads model.state_dict() once
            if _has_dmuon(m):
                _adopt(m)
        with internal():  # the stock ModelWrapper it builds reads model.state_dict() once; replaced below
            super().__init__(
                config, dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                lr_schedulers=lr_schedulers, states=states, sd_adapter=sd_adapter, base_folder=base_folder,
            )
        if self.enable:
            self.states[MODEL] = DMuonModelWrapper(model_parts)

    def _load(self, step: int = -1) -> bool:
        with _staged(self.states.get(MODEL), self.states.get(OPTIMIZER)):
            return super()._load(step)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's ``dcp_load`` (DCP format; HF loads are refused by the config), with nothing applied
        before dmuon accepted the checkpoint: ``Stateful`` entries are filled by ``dcp.load`` but loaded
        into their objects afterwards (:class:`_Deferred`), the model and the optimizer container as one
        unit. Collective."""
        wrapper = self.states.get(MODEL)
        if from_hf or not isinstance(wrapper, DMuonModelWrapper):
            super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
            return
        deferred = {k: _Deferred(v) for k, v in state_dict.items() if isinstance(v, Stateful)}
        target = {**state_dict, **deferred}
        dcp.load(target, checkpoint_id=checkpoint_id)
        optim = deferred.pop(OPTIMIZER, None)
        container = optim.obj if optim is not None and isinstance(optim.obj, DMuonOptimizersContainer) else None
        if not wrapper._load_with(target, container, optim.loaded if optim is not None else None) and optim:
            optim.apply()
        for entry in deferred.values():
            entry.apply()
