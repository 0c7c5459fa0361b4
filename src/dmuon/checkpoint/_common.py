"""What the state-dict functions share: draining to a resting state, agreeing across ranks on who passed
a dict and whether it is valid (raising together), and moving full tensors to where they live.

[Note: tensor-parallel state dicts]
Under tensor parallelism dmuon's ``ctx`` is one data-parallel row (HSDP x TP: one replicate x shard
grid) per tp index, so its "world" is not every rank. Everything that must involve every rank goes over the default group instead: the agreement
on the mode (:func:`detect_mode`), rank 0's tensors and metadata in rank-0 mode (:func:`bcast_from_rank0`,
:func:`bcast_object_from_rank0`; rank 0's own row is never enough) and the checksums' sums. A TP matrix
is whole in full dicts (:func:`bcast_from_owner`: each row broadcasts its owner's shard, then
``comm.tp_all_gather`` concatenates the shards over "tp" along ``tp_dim``: the same bytes a dp-only run
saves) and sliced on load (:func:`tp_slice`); in sharded dicts each owner-slot tp rank gives its shard as
a DTensor over "tp" (``runtime.param.laid_out_like``), whose chunk offsets DCP records, so any other dp x tp layout
reads what it needs. Momentum buffers of TP matrices are per shard like the weights and follow the same paths.

[Note: pipeline state dicts]
Under pipeline parallelism ([Note: pipeline stages] in ``runtime/topology.py``) each stage holds other
params, each with the full model's FQN. A sharded dict is then this stage's part of the checkpoint: its
tensors, the checksums of its keys ([Note: checksums across pipeline stages] in ``checksum.py``), and
``param_groups`` whose ``param_names`` list the whole job's params (every stage's, in stage order), so
that every stage saves the same groups (DCP keeps one copy) and a load with another pp degree finds the
names it expects. ``dcp.save`` writes every stage's keys into one checkpoint, and ``dcp.load`` reads
into any other pp x dp layout what its stages hold. What concerns one stage's params (the owners' metadata,
the dicts' structure) is compared within the stage; the verdicts (:func:`detect_mode`, the checksums'
mismatches) are agreed over the job, so every rank raises together before anything changes. Full dicts
and rank-0 dicts are refused under stages (:func:`refuse_full_under_stages`)."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .. import engines
from ..runtime import comm as C
from ..runtime.comm import CommKind
from ..runtime.hooks import DMuonState
from ..runtime.param import DedicatedParam

MAX_LISTED = 10


class Mode(enum.Enum):
    ALL = "every rank passed a dict"
    RANK0 = "rank 0 passed the dict, the others {}"


# --------------------------------------------------------------------------------------------------- #
# Shared helpers                                                                                       #
# --------------------------------------------------------------------------------------------------- #
def prepare(model: nn.Module) -> DMuonState:
    """Drain dmuon and the engine so every live tensor is in its resting place (sharded, grads reduced)."""
    state = engines.state_of(model)
    state.bind_if_needed()
    state.wait_all_reduces()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()
    engines.of(model).rest()
    return state


def rank0_owns(state: DMuonState, owner: int) -> bool:
    """Whether global rank 0 is slot ``owner`` of every rank's row, so a rank-0 dict needs no broadcast
    for it. Never under TP: the owner's other tp ranks are in other rows (which do not hold rank 0)."""
    return state.tp_mesh is None and owner == state.ctx.global_ranks.index(0)


def tp_rank(state: DMuonState) -> int | None:
    """This rank's tp index, ``None`` without tensor parallelism."""
    return None if state.tp_mesh is None else state.tp_mesh.get_local_rank()


def gather_views(state: DMuonState, obj: object) -> list[object]:
    """Every rank's ``obj``: dmuon's world, or under TP the default group (every row)."""
    return C.all_gather_object(state.ctx, obj)


def detect_mode(state: DMuonState, what: str, has_dict: bool, local_errors: list[str], fingerprint: str) -> Mode:
    """One collective: agree on who passed a dict and whether anyone found a problem; raise together."""
    views = gather_views(state, (dist.get_rank(), has_dict, local_errors, fingerprint))
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


def stage_views(state: DMuonState, views: list[object]) -> list[object]:
    """The views of this rank's pipeline stage out of every rank's (:func:`gather_views`, in global rank
    order under stages); all of them without pipeline parallelism. See [Note: pipeline state dicts]."""
    if not state.topology.pipelined:
        return views
    return [views[r] for r in state.topology.stage_ranks]


def refuse_full_under_stages(state: DMuonState, what: str, *, sharded: bool) -> None:
    """Raise where this call needs a full or rank-0 dict under pipeline stages: only sharded (DCP) dicts are
    supported there. Decided from the job's topology and the call's own options, alike on every rank that
    passes the same options (the setters agree on it first: :func:`stage_problem`). See
    [Note: pipeline state dicts]."""
    if state.topology.pipelined and not sharded:
        raise ValueError(
            f"dmuon.{what}: full state dicts are not supported under pipeline stages yet "
            f"({len(state.topology.stages)} stages, each holding other params); save with "
            "dcp.save(dmuon.get_state_dict(model, optimizer, sharded=True), ...) and load into "
            "dmuon.get_state_dict(model, optimizer, sharded=True, staged=True) with dcp.load, then "
            "dmuon.set_state_dict."
        )


def stage_problem(state: DMuonState, *, sharded: bool) -> list[str]:
    """This rank's finding about an incoming dict under pipeline stages (a full one), for the setters'
    agreement, so every rank raises together."""
    if not state.topology.pipelined or sharded:
        return []
    return ["a full state dict, which pipeline stages do not take yet: load a sharded one "
            "(dmuon.get_state_dict(model, optimizer, sharded=True, staged=True), then dcp.load)"]


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
    """A full tensor that only global rank 0 holds, on every rank (dmuon's group, or under TP the default
    group: [Note: tensor-parallel state dicts]; device buffer)."""
    if dist.get_rank() == 0:
        assert value is not None
        buf = value.detach().to(state.ctx.device, dtype).clone()
    else:
        buf = torch.empty(shape, dtype=dtype, device=state.ctx.device)
    return C.broadcast_from_rank0(state.ctx, buf, CommKind.CHECKPOINT, label)


def bcast_from_owner(state: DMuonState, dp: DedicatedParam, value: torch.Tensor | None, shape: torch.Size,
                     dtype: torch.dtype, label: str) -> torch.Tensor:
    """A dedicated tensor whole on every rank from its owner's ``value`` (a TP matrix's: this tp index's
    shard; not read elsewhere, where a buffer of ``shape`` and ``dtype`` receives it): one broadcast over
    dmuon's world (each tp index's row moves its own shard), then under TP the shards gathered over "tp"
    along ``tp_dim``. A copy on every rank (device buffer). Collective."""
    ctx = state.ctx
    if dp.owner == ctx.rank:
        assert value is not None
        buf = value.detach().to(ctx.device, copy=True)  # (AdamW's step lives on the CPU)
    else:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
    full = C.wait(C.broadcast(ctx, buf, dp.owner, CommKind.CHECKPOINT, label, dim=C.Dim.WORLD))
    if dp.tp_dim is None:
        return full
    return C.tp_all_gather(ctx, full, dp.tp_dim, state.tp_mesh, CommKind.CHECKPOINT, label)


def bcast_object_from_rank0(state: DMuonState, obj: object) -> object:
    """A small picklable object from global rank 0 to every rank (rank-0 mode's metadata)."""
    return C.broadcast_object_from_rank0(state.ctx, obj)


def scatter_dtensor(like: DTensor, full: torch.Tensor | None, mode: Mode, state: DMuonState,
                     label: str, dtype: torch.dtype | None = None) -> DTensor:
    """A DTensor laid out like ``like`` (in ``dtype``, default ``like``'s) from a full tensor held by every rank
    (ALL) or by rank 0 only."""
    mesh = like.device_mesh
    dtype = like.dtype if dtype is None else dtype
    if mode is Mode.RANK0 and (state.tp_mesh is not None or int(mesh.mesh.flatten()[0]) != 0):
        # distribute_tensor reads mesh coordinate 0; if that is not global rank 0, ship the data first
        # (under TP on every rank: the rows whose mesh starts at rank 0 take part in the broadcast too)
        full = bcast_from_rank0(state, full, like.shape, dtype, label)
    elif full is None:
        full = torch.empty(like.shape, dtype=dtype)
    device = like.to_local().device
    return distribute_tensor(full.detach().to(device, dtype), mesh, like.placements)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_local = a.to_local() if isinstance(a, DTensor) else a
    b_local = b.to_local() if isinstance(b, DTensor) else b
    return a_local.untyped_storage().data_ptr() == b_local.untyped_storage().data_ptr()


def aliases(value: Any, live: torch.Tensor | None) -> bool:
    """Whether an incoming ``value`` is the live tensor ``live`` itself (shares its storage): a sharded dict
    built without ``staged=True``, which ``dcp.load`` wrote into. Empty tensors never count."""
    return (isinstance(value, torch.Tensor) and live is not None and value.numel() > 0
            and same_storage(value, live))


def any_rank(state: DMuonState, flag: bool) -> bool:
    """Whether ``flag`` holds on some rank of the job. Collective: one all-reduce of one element."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=state.ctx.device)
    return bool(C.all_reduce_sum(state.ctx, value).item())


# --------------------------------------------------------------------------------------------------- #
# Staged sharded dicts: see [Note: staged loads]                                                       #
# --------------------------------------------------------------------------------------------------- #
# [Note: staged loads]
# ``dcp.load`` writes into the tensors of the dict it is given. A sharded dict of the live tensors (what a
# save wants: DCP reads them, nothing is copied) would let it overwrite the model and the optimizer before
# ``set_*_state_dict`` can compare the checksums, so a refused checkpoint would already have replaced the
# job's state. ``staged=True`` gives copies instead: the same keys, shapes, dtypes and DTensor layouts,
# values and checksums of the live state (so the dict is also a consistent snapshot, and a key that a
# partial load skips keeps its current value). ``dcp.load`` fills the copies; the setters validate, agree
# across ranks, verify the checksums and only then copy into the live tensors (the model) or build the new
# state from them (the optimizer, which replaces its state tensors in any case). A refused checkpoint leaves
# everything as it was.
#
# Where the copies live is the caller's choice, through the getters' ``cpu_offload`` (as with
# ``torch.distributed.checkpoint.state_dict.StateDictOptions(cpu_offload=...)``): on the CPU by default,
# which costs no device memory (one host copy of this rank's share of the state; the checksums still run on
# the device, one tensor at a time), or beside the live tensors with ``cpu_offload=False``, which costs a
# second device copy of this rank's share until the dict is dropped. Saves are unaffected: their dict is
# still the live tensors (``staged=False``, the default), and ``dcp.save`` copies nothing more than before.
#
# Treating a checkpoint as one unit needs both halves checked before either is written:
# :func:`dmuon.set_state_dict` (``combined.py``) checks the model and the optimizer dicts, then writes both;
# ``set_model_state_dict`` followed by ``set_optimizer_state_dict`` would have written the model already
# when the optimizer half is refused.
def stage_copy(t: torch.Tensor, cpu: bool) -> torch.Tensor:
    """A copy of the live tensor ``t`` for a staged sharded dict: a DTensor keeps its mesh, placements and
    global shape with its local shard copied (as torch's own CPU offload of DTensors does); on the CPU
    where ``cpu``, else beside ``t``. See [Note: staged loads]."""
    t = t.detach()
    return t.to("cpu", copy=True) if cpu else t.clone()


def copy_into_dtensor(live: DTensor, value: DTensor) -> None:
    """Copy an incoming DTensor (a staged copy, possibly on the CPU, or one from another layout) into the
    live DTensor ``live``: shard to shard where the layouts agree (no collective), else re-laid-out first
    (on ``live``'s device)."""
    if value.placements != live.placements or value.device_mesh != live.device_mesh:
        if value.to_local().device != live.to_local().device:
            value = value.to(live.to_local().device)
        value = value.redistribute(live.device_mesh, live.placements)
    if not same_storage(value, live):  # (the live tensor itself: a dict built without staged=True)
        live.to_local().copy_(value.to_local())


# --------------------------------------------------------------------------------------------------- #
# Tensor-parallel matrices: see [Note: tensor-parallel state dicts]                                    #
# --------------------------------------------------------------------------------------------------- #
def tp_slice(like: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's block of a whole matrix laid out as the TP DTensor ``like`` (its own chunk offsets)."""
    (chunk,) = like.__create_chunk_list__()
    out = full
    for d, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
        out = out.narrow(d, int(off), int(size))
    return out


def tp_local(v: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's shard from an incoming value for a TP matrix: a DTensor (a sharded dict: its local
    tensor, re-laid-out when the placements differ) or a whole matrix (a full dict: this rank's slice)."""
    if isinstance(v, DTensor):
        if v.placements != like.placements:
            v = v.redistribute(v.device_mesh, like.placements)
        return v.to_local()
    return tp_slice(like, v)
