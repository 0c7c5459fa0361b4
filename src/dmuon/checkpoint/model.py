"""Model state dicts: full (topology-free) or sharded (for DCP). See ``dmuon/checkpoint/__init__.py``."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import engines
from ..runtime.hooks import DMuonState
from ..runtime.param import DedicatedParam, laid_out_like, local
from .checksum import CHECKSUM_ATTR, CHECKSUMS_KEY, Item, collect, mismatches, stored
from ._common import (
    Mode,
    aliases,
    any_rank,
    bcast_from_owner,
    bcast_from_rank0,
    copy_into_dtensor,
    detect_mode,
    listing,
    prepare,
    rank0_owns,
    refuse_full_under_stages,
    same_storage,
    scatter_dtensor,
    stage_copy,
    stage_problem,
    structure_fingerprint,
    tp_local,
    tp_rank,
)

__all__ = ["get_model_state_dict", "set_model_state_dict"]


class _Kind(enum.Enum):
    DEDICATED = "dedicated"  # full tensor on its owner (a TP matrix: its shard), 0-byte placeholder elsewhere
    DTENSOR = "dtensor"  # FSDP2 shard
    PLAIN = "plain"  # replicated parameter or buffer


@dataclass
class _Entry:
    key: str
    tensor: torch.Tensor  # the live parameter / buffer / state tensor (a dedicated param's master if any)
    kind: _Kind
    dp: DedicatedParam | None = None
    #: a tensor-parallel matrix: its live DTensor over "tp" (``tensor`` is that or this rank's master shard)
    layout: DTensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype state dicts hold: a dedicated param's own dtype even where it is a compute copy."""
        return self.dp.dtype if self.dp is not None else self.tensor.dtype

    @property
    def shape(self) -> torch.Size:
        """The shape state dicts hold: a TP matrix's whole shape."""
        return self.layout.shape if self.layout is not None else self.tensor.shape


def _model_entries(model: nn.Module, state: DMuonState) -> list[_Entry]:
    dedicated = {id(dp.current()): dp for dp in state.dedicated()}
    entries = []
    for key, t in state.model.state_dict(keep_vars=True).items():  # the module a DDP wrapper holds
        if id(t) in dedicated:
            dp = dedicated[id(t)]
            layout = t if dp.tp_dim is not None else None
            entries.append(_Entry(key, dp.master if dp.master is not None else t, _Kind.DEDICATED, dp, layout))
        elif isinstance(t, DTensor):
            entries.append(_Entry(key, t, _Kind.DTENSOR))
        else:
            entries.append(_Entry(key, t, _Kind.PLAIN))
    return entries


def get_model_state_dict(
    model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = False, sharded: bool = False,
    checksums: bool = True, staged: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN. Collective.

    Full (default): complete tensors on every rank (``rank0_only=True``: only rank 0 returns them, the
    others ``{}``), on CPU unless ``cpu_offload=False``; loadable into a plain single-process model.
    ``sharded=True``: for ``torch.distributed.checkpoint``; FSDP2 params as DTensors, each dedicated
    tensor only on its owner, the live tensors themselves (what ``dcp.save`` reads; nothing is copied).
    ``sharded=True, staged=True``: the target for ``dcp.load``: the same dict made of copies (on the CPU
    unless ``cpu_offload=False``, then beside the live tensors), so that ``dcp.load`` changes nothing and
    :func:`set_model_state_dict` writes the model only once the checkpoint passed its checks (see
    [Note: staged loads]). Full dicts are copies anyway; ``staged`` changes nothing for them.
    Tensor parallelism: a TP matrix is whole in full dicts (its shards gathered over "tp"), and in
    sharded dicts the live DTensor over "tp" on each rank of the owner's dp slot; both load into any
    other dp x tp layout, dp-only included.

    Each tensor's checksum travels with it (full: a ``_dmuon_checksum`` attribute that ``torch.save`` /
    ``torch.load`` keep; sharded: one extra ``"_dmuon_checksums"`` entry), and
    :func:`set_model_state_dict` refuses values that do not match: a flipped byte, a torn save.
    ``checksums=False`` leaves them out (a sharded dict to ``dcp.load`` a checkpoint written without
    dmuon, which has no such entry).

    Example::

        model_sd = dmuon.get_model_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(model_sd, "model.pt")   # or safetensors.torch.save_file(model_sd, ...)

        target = dmuon.get_model_state_dict(model, sharded=True, staged=True)
        dcp.load({"model": target}, checkpoint_id="ckpt/")
        dmuon.set_model_state_dict(model, target)   # refused (nothing changed) or loaded
    """
    state = engines.state_of(model)
    refuse_full_under_stages(state, "get_model_state_dict", sharded=sharded)
    state = prepare(model)
    # param_dtype masters whose compute copy was written directly follow it (as the next step would).
    # Only here: a setter must not, since dcp.load fills the masters in place before set_model_state_dict
    # rounds them into the compute copies.
    state.refresh_masters()
    ctx = state.ctx
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    with engines.of(model).full_params():  # ZeRO-3's params whole while read
        entries = _model_entries(model, state)
        with torch.no_grad():
            for e in entries:
                mine = e.dp is not None and e.dp.owner == ctx.rank
                if sharded:
                    if e.layout is not None and mine:  # (a master shard: as a DTensor too, for its offsets)
                        live = laid_out_like(local(e.tensor), e.layout)  # type: ignore[arg-type]
                    elif e.kind is not _Kind.DEDICATED or mine:
                        live = e.tensor.detach()
                    else:
                        continue
                    out[e.key] = stage_copy(live, cpu_offload) if staged else live
                    continue
                if e.kind is _Kind.DEDICATED:
                    assert e.dp is not None
                    live = local(e.tensor)  # a TP matrix: this tp index's shard
                    value = bcast_from_owner(state, e.dp, live, live.shape, e.dtype, e.key)  # type: ignore[arg-type]
                elif e.kind is _Kind.DTENSOR:
                    value = e.tensor.detach().full_tensor()
                    if same_storage(value, e.tensor):  # one shard is the whole tensor: do not hand out the live one
                        value = value.clone()
                else:
                    value = e.tensor.detach().clone()
                if keep:
                    out[e.key] = value.cpu() if cpu_offload else value
        if not checksums:
            return out
        sums = collect(ctx, _items(entries), {e.key: e.tensor for e in entries}, tp_rank=tp_rank(state),
                       pipelined=state.topology.pipelined)
        if sharded:
            out[CHECKSUMS_KEY] = sums
        else:
            for key, value in out.items():
                setattr(value, CHECKSUM_ATTR, sums[key])
        return out


def _items(entries: list[_Entry]) -> list[Item]:
    """Dedicated tensors count on their owner (a TP matrix through its live DTensor as the layout),
    everything else through the live tensor's layout."""
    out = []
    for e in entries:
        if e.kind is _Kind.DEDICATED and e.dp is not None:
            out.append(Item(e.key, e.dp.owner, e.layout))
        else:
            out.append(Item(e.key, None, e.tensor))
    return out


def _verify_checksums(state: DMuonState, entries: list[_Entry], sd: Mapping[str, Any], mode: Mode,
                      sharded: bool, what: str) -> None:
    """Compare the incoming tensors with the checksums the dict carries (where it carries any); raise on
    every rank together, before anything is written. Collective (one more all-reduce to word the error)."""
    bad = mismatches(state.ctx, _items(entries), sd, stored(sd, sd.get(CHECKSUMS_KEY)), rank0_only=mode is Mode.RANK0,
                     tp_rank=tp_rank(state), pipelined=state.topology.pipelined)
    if not bad:
        return
    bad_list = listing("checksums do not match", bad)
    if not sharded:
        raise ValueError(f"dmuon.{what}: {bad_list}. The file is corrupted or mixed from different saves; nothing "
                         "was changed.")
    live = {e.key: e.tensor for e in entries}
    if any_rank(state, any(aliases(v, live.get(k)) for k, v in sd.items())):
        raise ValueError(
            f"dmuon.{what}: {bad_list}. The checkpoint is corrupted or torn (the data of one save under the metadata "
            "of another). dcp.load already wrote these values into the model, since its dict held the live tensors: "
            "load another checkpoint before training on, and build the dict for dcp.load with staged=True so that "
            "a refused checkpoint changes nothing."
        )
    raise ValueError(f"dmuon.{what}: {bad_list}. The checkpoint is corrupted or torn (the data of one save under the "
                     "metadata of another); nothing was changed.")


def _sharded(entries: list[_Entry], sd: Mapping[str, Any], rank: int) -> bool:
    """Whether ``sd`` is a sharded (DCP) dict: it holds DTensors (FSDP2's), or, where the engine keeps every
    param whole (DDP, DeepSpeed), it holds exactly the dedicated tensors this rank owns (a full dict holds them
    all). Local."""
    if any(isinstance(v, DTensor) for v in sd.values()):
        return True
    if any(e.kind is _Kind.DTENSOR for e in entries):
        return False
    others = [e.key for e in entries if e.kind is _Kind.DEDICATED and e.dp is not None and e.dp.owner != rank]
    mine = [e.key for e in entries if e.kind is _Kind.DEDICATED and e.dp is not None and e.dp.owner == rank]
    return bool(others) and not any(k in sd for k in others) and all(k in sd for k in mine)


def _validate_model_sd(entries: list[_Entry], sd: Mapping[str, Any], rank: int) -> list[str]:
    sharded = _sharded(entries, sd, rank)
    expected = {
        e.key: e for e in entries
        if not (sharded and e.kind is _Kind.DEDICATED and e.dp is not None and e.dp.owner != rank)
    }
    missing = [k for k in expected if k not in sd]
    unexpected = [str(k) for k in sd if k not in expected and k != CHECKSUMS_KEY]
    shapes, dtypes = [], []
    for k, e in expected.items():
        if k not in sd:
            continue
        v = sd[k]
        if not isinstance(v, torch.Tensor):
            shapes.append(f"{k} (not a tensor: {type(v).__name__})")
        elif tuple(v.shape) != tuple(e.shape):
            shapes.append(f"{k} {tuple(v.shape)} != {tuple(e.shape)}")
        elif v.dtype != e.dtype:
            dtypes.append(f"{k} {v.dtype} != {e.dtype}")
    errors = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("wrong shapes", shapes), ("wrong dtypes", dtypes)):
        if items:
            errors.append(listing(label, items))
    return ["; ".join(errors)] if errors else []


def _load_dedicated(state: DMuonState, e: _Entry, sd: Mapping[str, Any], mode: Mode) -> None:
    """A dedicated tensor's incoming value into its owner (a TP matrix: each owner-slot tp rank takes its
    shard). Rank-0 mode: broadcast from rank 0 unless rank 0 is the owner. Collective in rank-0 mode."""
    dp = e.dp
    assert dp is not None
    mine = dp.owner == state.ctx.rank
    if mode is Mode.ALL:
        if not mine:
            return  # (a sharded dict holds it on its owners only)
        value = sd[e.key]
    elif rank0_owns(state, dp.owner):
        value = sd.get(e.key)
    else:
        value = bcast_from_rank0(state, sd.get(e.key), e.shape, e.dtype, e.key)
    if not mine:
        return
    if e.layout is not None:
        target = local(e.tensor)
        value = tp_local(value, e.layout)  # type: ignore[arg-type]
    else:
        target = e.tensor
    if not same_storage(value, target):  # type: ignore[arg-type]
        target.copy_(value)  # type: ignore[arg-type]
    dp.write_back()  # param_dtype: round the loaded master into the compute copy


@dataclass(frozen=True)
class ModelLoad:
    """A model dict that passed every check of :func:`check_model_sd`: what :func:`apply_model_sd` writes."""

    state: DMuonState
    entries: list[_Entry]
    sd: Mapping[str, Any]
    mode: Mode


def check_model_sd(model: nn.Module, state_dict: Mapping[str, Any], *, what: str = "set_model_state_dict",
                   problems: tuple[str, ...] = ()) -> ModelLoad:
    """Everything :func:`set_model_state_dict` checks before it writes: the dict against the model on each
    rank, one gather in which every rank agrees on the mode and the verdict (raising together), then the
    checksums. ``problems``: this rank's findings about the dict from the caller (a combined dict without
    its ``"model"`` entry), reported in the same gather. Collective; changes nothing."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dmuon.{what}: expected a mapping, got {type(state_dict).__name__}")
    state = prepare(model)
    with engines.of(model).full_params():  # ZeRO-3's params whole: their shapes, and their values' checksums
        entries = _model_entries(model, state)
        has = len(state_dict) > 0 or bool(problems)
        errors = list(problems) or (_validate_model_sd(entries, state_dict, state.ctx.rank) if has else [])
        sharded = _sharded(entries, state_dict, state.ctx.rank)
        errors += stage_problem(state, sharded=sharded) if has and not errors else []
        fp = "" if sharded else structure_fingerprint(dict(state_dict))
        mode = detect_mode(state, what, has, errors, fp)
        if mode is Mode.RANK0:  # (agreed: under stages every rank raises)
            refuse_full_under_stages(state, what, sharded=False)
        with torch.no_grad():
            _verify_checksums(state, entries, state_dict, mode, sharded, what)
    return ModelLoad(state, entries, state_dict, mode)


def apply_model_sd(load: ModelLoad) -> None:
    """Write a checked dict into the live tensors (each from its place in the dict: a staged copy, a full
    tensor, rank 0's broadcast), then publish the owners' new values. Collective in rank-0 mode and HSDP."""
    state, sd, mode = load.state, load.sd, load.mode
    with engines.of(state.model).full_params(write=True), torch.no_grad():  # ZeRO-3: written whole, partitioned
        for e in load.entries:
            if e.kind is _Kind.DEDICATED:
                _load_dedicated(state, e, sd, mode)
            elif e.kind is _Kind.DTENSOR:
                v = sd.get(e.key)
                if isinstance(v, DTensor):
                    copy_into_dtensor(e.tensor, v)  # type: ignore[arg-type]
                else:
                    e.tensor.copy_(scatter_dtensor(e.tensor, v, mode, state, e.key))  # type: ignore[arg-type]
            elif mode is Mode.ALL:
                if not same_storage(sd[e.key], e.tensor):
                    e.tensor.copy_(sd[e.key])
            else:
                e.tensor.copy_(bcast_from_rank0(state, sd.get(e.key), e.tensor.shape, e.tensor.dtype, e.key))
    # HSDP: the other rows' holders take the owners' new values now; no stale copy survives anywhere
    state.publish_updates()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()
    engines.of(state.model).after_model_load()  # an engine's own copies of its params (DeepSpeed's fp32 masters)


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict from :func:`get_model_state_dict` (full or sharded) into the model. Collective.

    Full dicts: pass the same dict on every rank, or the dict on rank 0 and ``{}`` elsewhere; the dict
    may come from another world size (owners take their tensors, FSDP2 shards their slices); a
    tensor-parallel model takes one from any dp x tp layout (dp-only too), each rank of a matrix's owner
    slot its shard. Keys, shapes, dtypes and checksums are checked for the whole dict first; on any
    mismatch every rank raises a ``ValueError`` listing missing / unexpected / mis-shaped keys or the
    tensors whose checksums differ, and nothing changes. Sharded dicts: load the ``staged=True`` dict that
    ``dcp.load`` filled; with the live tensors as its target, ``dcp.load`` itself would have written them
    before any check. To load a model and its optimizer as one unit, see :func:`dmuon.set_state_dict`.

    Example::

        sd = torch.load("model.pt") if dist.get_rank() == 0 else {}
        dmuon.set_model_state_dict(model, sd)
    """
    apply_model_sd(check_model_sd(model, state_dict))
