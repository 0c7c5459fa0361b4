"""What the state-dict functions share: draining to a resting state, agreeing across ranks on who passed
a dict and whether it is valid (raising together), and moving full tensors to where they live."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .._fsdp import fsdp_modules
from ..runtime import comm as C
from ..runtime.comm import CommKind
from ..runtime.hooks import DMuonState, get_state

MAX_LISTED = 10


class Mode(enum.Enum):
    ALL = "every rank passed a dict"
    RANK0 = "rank 0 passed the dict, the others {}"


# --------------------------------------------------------------------------------------------------- #
# Shared helpers                                                                                       #
# --------------------------------------------------------------------------------------------------- #
def prepare(model: nn.Module) -> DMuonState:
    """Drain dmuon and FSDP2 so every live tensor is in its resting place (sharded, grads reduced)."""
    state = get_state(model)
    tp = [dp.fqn for dp in state.dedicated() if dp.tp_dim is not None]
    if tp:
        raise NotImplementedError(
            f"dmuon: state dicts of tensor-parallel dedicated params ({tp[0]!r}, ...) are not supported yet "
            "(issue 16: the full and DCP forms over tp are still to come). Nothing was read or changed."
        )
    state.bind_if_needed()
    state.wait_all_reduces()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()
    for m in fsdp_modules(model):
        m.reshard()
    return state


def rank0_coord(state: DMuonState) -> int:
    return state.ctx.global_ranks.index(0)


def detect_mode(state: DMuonState, what: str, has_dict: bool, local_errors: list[str], fingerprint: str) -> Mode:
    """One collective: agree on who passed a dict and whether anyone found a problem; raise together."""
    views = C.all_gather_object(state.ctx, (dist.get_rank(), has_dict, local_errors, fingerprint))
    holders = sorted(r for r, has, _, _ in views if has)
    problems = [f"rank {r}: {e}" for r, _, errs, _ in views for e in errs]
    if not holders:
        raise ValueError(f"dmuon.{what}: every rank passed an empty state dict.")
    if len(holders) == len(views):
        mode = Mode.ALL
        if len({fp for _, _, _, fp in views}) != 1 and not problems:
            problems.append("ranks passed different state dicts; pass the same dict everywhere, or only on rank 0")
    elif holders == [0]:
        mode = Mode.RANK0
    else:
        raise ValueError(
            f"dmuon.{what}: ranks {holders} passed a state dict and the others none; pass the same dict on every "
            "rank, or the dict on rank 0 and {} elsewhere."
        )
    if problems:
        raise ValueError(f"dmuon.{what}: the state dict does not match; nothing was changed.\n" + "\n".join(problems))
    return mode


def listing(label: str, items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED]) + (f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else "")
    return f"{label}: [{shown}]"


def structure_fingerprint(obj: Any) -> str:
    """Keys, shapes and dtypes (not values) of a nested dict of tensors, to compare dicts across ranks."""

    def walk(x: Any) -> Any:
        if isinstance(x, Mapping):
            return sorted((str(k), walk(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), str(x.dtype))
        return repr(x)

    return hashlib.sha256(repr(walk(obj)).encode()).hexdigest()


def bcast_from_rank0(state: DMuonState, value: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype,
                      label: str) -> torch.Tensor:
    """A full tensor that only global rank 0 holds, on every rank (dmuon's group, device buffer)."""
    if dist.get_rank() == 0:
        assert value is not None
        buf = value.detach().to(state.ctx.device, dtype).clone()
    else:
        buf = torch.empty(shape, dtype=dtype, device=state.ctx.device)
    return C.wait(C.broadcast(state.ctx, buf, rank0_coord(state), CommKind.CHECKPOINT, label, dim=C.Dim.WORLD))


def scatter_dtensor(like: DTensor, full: torch.Tensor | None, mode: Mode, state: DMuonState,
                     label: str) -> DTensor:
    """A DTensor laid out like ``like`` from a full tensor held by every rank (ALL) or by rank 0 only."""
    mesh = like.device_mesh
    if mode is Mode.RANK0 and int(mesh.mesh.flatten()[0]) != 0:
        # distribute_tensor reads mesh coordinate 0; if that is not global rank 0, ship the data first
        full = bcast_from_rank0(state, full, like.shape, like.dtype, label)
    elif full is None:
        full = torch.empty(like.shape, dtype=like.dtype)
    device = like.to_local().device
    return distribute_tensor(full.detach().to(device, like.dtype), mesh, like.placements)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_local = a.to_local() if isinstance(a, DTensor) else a
    b_local = b.to_local() if isinstance(b, DTensor) else b
    return a_local.untyped_storage().data_ptr() == b_local.untyped_storage().data_ptr()
