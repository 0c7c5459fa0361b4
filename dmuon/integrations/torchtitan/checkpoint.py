"""DCP checkpoints of a dmuon model in torchtitan: :class:`DMuonModelWrapper` over dmuon's sharded state
dicts, and :class:`DMuonCheckpointManager`, torchtitan's ``CheckpointManager`` that saves the model through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torchtitan.components.checkpointer import CheckpointManager, ModelWrapper
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

import dmuon

from ...checkpoint.checksum import CHECKSUMS_KEY
from ...runtime.guard import internal
from ...runtime.hooks import STATE_ATTR
from ._fused_qkv import _fused_qkv_modules, _merge_fused_qkv, _split_fused_qkv
from .parallelize import _adopt



def _has_dmuon(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


class DMuonModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` over :func:`dmuon.get_model_state_dict` / :func:`dmuon.set_model_state_dict`
    (sharded): FSDP2 DTensors plus each dedicated tensor only on its owner, so DCP writes every dedicated
    matrix once, from the rank that really holds it, and loads into live tensors in place. Fused QKV weights
    are saved in torchtitan's ``wq``/``wk``/``wv`` layout (see [Note: fused QKV])."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        for m in [model] if isinstance(model, nn.Module) else model:
            if _has_dmuon(m):
                _adopt(m)
        super().__init__(model)

    def _get_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model in self.model:
            if _has_dmuon(model):
                sd = dmuon.get_model_state_dict(model, sharded=True)
                _split_fused_qkv(model, sd)
                out.update(sd)
            else:
                out.update(model.state_dict())
        return out

    def state_dict(self) -> dict[str, Any]:
        # Recomputed on every call: the split QKV tensors are copies and must reflect the current weights.
        self.cached_state_dict = self._get_state_dict()
        return self.cached_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model in self.model:
            if _has_dmuon(model):
                live = dmuon.get_model_state_dict(model, sharded=True, checksums=False)
                # the checkpoint dict also carries optimizer / scheduler / dataloader entries
                ours = {k: state_dict[k] for k in self._keys_of(model, live) if k in state_dict}
                _merge_fused_qkv(model, ours, like=live)
                dmuon.set_model_state_dict(model, ours)
            else:
                model.load_state_dict(state_dict, strict=False)
        self.cached_state_dict = self._get_state_dict()

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
    old metadata over new data; the model's checksums (``_dmuon_checksums``, [Note: checkpoint
    checksums]) make ``set_model_state_dict`` refuse that mix. The flat optimizer layout of
    :class:`DMuonOptimizersContainer` carries no checksums.

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
