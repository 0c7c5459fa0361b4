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

from ..runtime.hooks import DMuonState
from ..runtime.param import DedicatedParam, laid_out_like, local
from .checksum import CHECKSUM_ATTR, CHECKSUMS_KEY, Item, collect, mismatches, stored
from ._common import (
    Mode,
    bcast_from_owner,
    bcast_from_rank0,
    detect_mode,
    listing,
    prepare,
    rank0_owns,
    same_storage,
    scatter_dtensor,
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
    checksums: bool = True,
) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN. Collective.

    Full (default): complete tensors on every rank (``rank0_only=True``: only rank 0 returns them, the
    others ``{}``), on CPU unless ``cpu_offload=False``; loadable into a plain single-process model.
    ``sharded=True``: for ``torch.distributed.checkpoint``; FSDP2 params as DTensors, each dedicated
    tensor only on its owner, the live tensors themselves (so ``dcp.load`` fills the model in place).
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
    """
    state = prepare(model)
    # param_dtype masters whose compute copy was written directly follow it (as the next step would).
    # Only here: a setter must not, since dcp.load fills the masters in place before set_model_state_dict
    # rounds them into the compute copies.
    state.refresh_masters()
    ctx = state.ctx
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    entries = _model_entries(model, state)
    with torch.no_grad():
        for e in entries:
            mine = e.dp is not None and e.dp.owner == ctx.rank
            if sharded:
                if e.layout is not None and mine:  # (a master shard: as a DTensor too, for its offsets)
                    out[e.key] = laid_out_like(local(e.tensor), e.layout)  # type: ignore[arg-type]
                elif e.kind is not _Kind.DEDICATED or mine:
                    out[e.key] = e.tensor.detach()
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
    sums = collect(ctx, _items(entries), {e.key: e.tensor for e in entries}, tp_rank=tp_rank(state))
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
                      sharded: bool) -> None:
    """Compare the incoming tensors with the checksums the dict carries (where it carries any); raise on
    every rank together. Full dicts: before anything is written. Collective."""
    bad = mismatches(state.ctx, _items(entries), sd, stored(sd, sd.get(CHECKSUMS_KEY)), rank0_only=mode is Mode.RANK0,
                     tp_rank=tp_rank(state))
    if not bad:
        return
    if sharded:
        raise ValueError(
            "dmuon.set_model_state_dict: " + listing("checksums do not match", bad) + ". The checkpoint is corrupted "
            "or torn (the data of one save under the metadata of another); dcp.load already wrote these values "
            "into the model, so load another checkpoint before training on."
        )
    raise ValueError("dmuon.set_model_state_dict: " + listing("checksums do not match", bad)
                     + ". The file is corrupted or mixed from different saves; nothing was changed.")


def _validate_model_sd(entries: list[_Entry], sd: Mapping[str, Any], rank: int) -> list[str]:
    sharded = any(isinstance(v, DTensor) for v in sd.values())
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


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict from :func:`get_model_state_dict` (full or sharded) into the model. Collective.

    Full dicts: pass the same dict on every rank, or the dict on rank 0 and ``{}`` elsewhere; the dict
    may come from another world size (owners take their tensors, FSDP2 shards their slices); a
    tensor-parallel model takes one from any dp x tp layout (dp-only too), each rank of a matrix's owner
    slot its shard. Keys, shapes and dtypes are checked for the whole dict first; on any mismatch every
    rank raises a ``ValueError`` listing missing / unexpected / mis-shaped keys and nothing changes.

    Example::

        sd = torch.load("model.pt") if dist.get_rank() == 0 else {}
        dmuon.set_model_state_dict(model, sd)
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dmuon.set_model_state_dict: expected a mapping, got {type(state_dict).__name__}")
    state = prepare(model)
    ctx = state.ctx
    entries = _model_entries(model, state)
    has = len(state_dict) > 0
    errors = _validate_model_sd(entries, state_dict, ctx.rank) if has else []
    sharded = any(isinstance(v, DTensor) for v in state_dict.values())
    fp = "" if sharded else structure_fingerprint(dict(state_dict))
    mode = detect_mode(state, "set_model_state_dict", has, errors, fp)
    with torch.no_grad():
        _verify_checksums(state, entries, state_dict, mode, sharded)
        for e in entries:
            if e.kind is _Kind.DEDICATED:
                _load_dedicated(state, e, state_dict, mode)
            elif e.kind is _Kind.DTENSOR:
                v = state_dict.get(e.key)
                if isinstance(v, DTensor):
                    if not same_storage(v, e.tensor):
                        e.tensor.copy_(v.redistribute(e.tensor.device_mesh, e.tensor.placements))
                else:
                    e.tensor.copy_(scatter_dtensor(e.tensor, v, mode, state, e.key))  # type: ignore[arg-type]
            else:
                if mode is Mode.ALL:
                    if not same_storage(state_dict[e.key], e.tensor):
                        e.tensor.copy_(state_dict[e.key])
                else:
                    e.tensor.copy_(bcast_from_rank0(state, state_dict.get(e.key), e.tensor.shape,
                                                     e.tensor.dtype, e.key))
    # HSDP: the other rows' holders take the owners' new values now; no stale copy survives anywhere
    state.publish_updates()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()
