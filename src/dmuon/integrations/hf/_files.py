"""The files of a Trainer checkpoint: their names, and the weights of a ``save_pretrained`` directory."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (single or sharded, safetensors or ``.bin``), on CPU."""
    import safetensors.torch

    def index_files(index: str) -> list[str]:
        with open(os.path.join(directory, index), encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))

    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_NAME)):
        return safetensors.torch.load_file(os.path.join(directory, SAFE_WEIGHTS_NAME), device="cpu")
    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)):
        out: dict[str, torch.Tensor] = {}
        for name in index_files(SAFE_WEIGHTS_INDEX_NAME):
            out.update(safetensors.torch.load_file(os.path.join(directory, name), device="cpu"))
        return out
    if os.path.isfile(os.path.join(directory, WEIGHTS_NAME)):
        return torch.load(os.path.join(directory, WEIGHTS_NAME), map_location="cpu", weights_only=True)
    if os.path.isfile(os.path.join(directory, WEIGHTS_INDEX_NAME)):
        out = {}
        for name in index_files(WEIGHTS_INDEX_NAME):
            out.update(torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True))
        return out
    raise FileNotFoundError(f"no model weights ({SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or an index) in {directory!r}")


def _fill_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the keys ``save_pretrained`` dropped because they alias another (tied embeddings)."""
    aliases: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():  # the objects only; no data is read
        aliases.setdefault(id(t), []).append(key)
    for keys in aliases.values():
        present = [k for k in keys if k in sd]
        for k in keys:
            if present and k not in sd:
                sd[k] = sd[present[0]]
    return sd


def save_replacing(obj: object, path: str) -> None:
    """``torch.save`` to a temporary name beside ``path``, then rename over it: a crash while writing leaves
    the previous file whole (``os.replace`` is atomic within one file system)."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
