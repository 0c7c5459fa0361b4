"""The files of a Trainer checkpoint: their names, the weights of a ``save_pretrained`` directory, and which
sets of files make a checkpoint that can be resumed."""

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


def load_file(path: str) -> object:
    """``torch.load`` of a checkpoint file onto the CPU (tensors and plain containers only); an unreadable file
    (cut short, overwritten) raises an error that names it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"cannot read {path!r} ({type(e).__name__}: {e})") from e


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


def refuse_torn(directory: str, *, has_optimizer: bool, has_scheduler: bool, optimizer_state: bool) -> None:
    """Raise where a checkpoint holds one of ``optimizer.pt`` and ``scheduler.pt`` without the other and the
    optimizer state is to be resumed: a torn or partly copied save, which Trainer would resume with Muon's
    momentum and AdamW's moments (or the schedule) started afresh. Call it with rank 0's findings on every
    rank, before anything is loaded, so every rank raises together and nothing changes."""
    if not optimizer_state or has_optimizer == has_scheduler:
        return
    present, absent = (OPTIMIZER_NAME, SCHEDULER_NAME) if has_optimizer else (SCHEDULER_NAME, OPTIMIZER_NAME)
    lost = "the learning-rate schedule" if has_optimizer else "Muon's momentum and AdamW's moments"
    raise ValueError(
        f"dmuon: the checkpoint {directory!r} has {present} but no {absent} (a torn or partly copied save); "
        f"resuming from it would restart {lost} from scratch. Nothing was changed. Resume from a complete "
        "checkpoint, or, to resume without optimizer state on purpose (the weights, and the schedule where "
        f"{SCHEDULER_NAME} is there), call trainer.train(resume_from_checkpoint=..., resume_optimizer_state=False)."
    )
