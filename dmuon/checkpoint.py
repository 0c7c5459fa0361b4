"""State dicts for models and optimizers prepared by dmuon: full (topology-free) or sharded (for DCP).

*Full* dicts hold complete tensors keyed by the model's own FQNs, exactly what a single-process
``model.state_dict()`` would give, so they load into a plain model, save with ``torch.save`` or
safetensors, and restore on any number of ranks with any owner assignment. *Sharded* dicts
(``sharded=True``) are for ``torch.distributed.checkpoint``: FSDP2 params as DTensors, each dedicated
tensor only on its owner, nothing gathered to one rank.

Every function here is collective (call it on all ranks), drains pending dmuon work first and issues
the same collectives in the same order on every rank. The setters validate the whole input before
changing anything; on any mismatch every rank raises the same ``ValueError``.

Mixed precision: a dedicated param given a ``param_dtype`` by ``dedicate_params`` appears in model dicts
with its owner's master value in its own dtype (as FSDP2's ``MixedPrecisionPolicy`` keeps fp32 sharded
params), and loading writes the master and rounds it into the compute copy. ``dmuon.Muon(master_dtype=...)``
masters are optimizer state (``"master"``, beside ``momentum_buffer``, both in the master dtype).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from . import _collectives as C
from ._state import DMuonState, get_state
from .accumulate import _fsdp_modules
from .diagnostics import CommKind
from .group import DedicatedParam

__all__ = [
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
]

_MAX_LISTED = 10


class _Kind(enum.Enum):
    DEDICATED = "dedicated"  # full tensor on its owner, 0-byte placeholder elsewhere
    DTENSOR = "dtensor"  # FSDP2 shard
    PLAIN = "plain"  # replicated parameter or buffer


@dataclass
class _Entry:
    key: str
    tensor: torch.Tensor  # the live parameter / buffer / state tensor (a dedicated param's master if any)
    kind: _Kind
    dp: DedicatedParam | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype state dicts hold: a dedicated param's own dtype even where it is a compute copy."""
        return self.dp.dtype if self.dp is not None else self.tensor.dtype


class _Mode(enum.Enum):
    ALL = "every rank passed a dict"
    RANK0 = "rank 0 passed the dict, the others {}"


# --------------------------------------------------------------------------------------------------- #
# Shared helpers                                                                                       #
# --------------------------------------------------------------------------------------------------- #
def _prepare(model: nn.Module) -> DMuonState:
    """Drain dmuon and FSDP2 so every live tensor is in its resting place (sharded, grads reduced)."""
    state = get_state(model)
    state.bind_if_needed()
    state.wait_all_reduces()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()
    for m in _fsdp_modules(model):
        m.reshard()  # type: ignore[operator]
    return state


def _model_entries(model: nn.Module, state: DMuonState) -> list[_Entry]:
    dedicated = {id(dp.current()): dp for dp in state.dedicated()}
    entries = []
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in dedicated:
            dp = dedicated[id(t)]
            entries.append(_Entry(key, dp.master if dp.master is not None else t, _Kind.DEDICATED, dp))
        elif isinstance(t, DTensor):
            entries.append(_Entry(key, t, _Kind.DTENSOR))
        else:
            entries.append(_Entry(key, t, _Kind.PLAIN))
    return entries


def _rank0_coord(state: DMuonState) -> int:
    return state.ctx.global_ranks.index(0)


def _detect_mode(state: DMuonState, what: str, has_dict: bool, local_errors: list[str], fingerprint: str) -> _Mode:
    """One collective: agree on who passed a dict and whether anyone found a problem; raise together."""
    views = C.all_gather_object(state.ctx, (dist.get_rank(), has_dict, local_errors, fingerprint))
    holders = sorted(r for r, has, _, _ in views if has)
    problems = [f"rank {r}: {e}" for r, _, errs, _ in views for e in errs]
    if not holders:
        raise ValueError(f"dmuon.{what}: every rank passed an empty state dict.")
    if len(holders) == len(views):
        mode = _Mode.ALL
        if len({fp for _, _, _, fp in views}) != 1 and not problems:
            problems.append("ranks passed different state dicts; pass the same dict everywhere, or only on rank 0")
    elif holders == [0]:
        mode = _Mode.RANK0
    else:
        raise ValueError(
            f"dmuon.{what}: ranks {holders} passed a state dict and the others none; pass the same dict on every "
            "rank, or the dict on rank 0 and {} elsewhere."
        )
    if problems:
        raise ValueError(f"dmuon.{what}: the state dict does not match; nothing was changed.\n" + "\n".join(problems))
    return mode


def _listing(label: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED]) + (f", ... ({len(items)} in all)" if len(items) > _MAX_LISTED else "")
    return f"{label}: [{shown}]"


def _structure_fingerprint(obj: Any) -> str:
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


def _bcast_from_rank0(state: DMuonState, value: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype,
                      label: str) -> torch.Tensor:
    """A full tensor that only global rank 0 holds, on every rank (dmuon's group, device buffer)."""
    if dist.get_rank() == 0:
        assert value is not None
        buf = value.detach().to(state.ctx.device, dtype).clone()
    else:
        buf = torch.empty(shape, dtype=dtype, device=state.ctx.device)
    return C.wait(C.broadcast(state.ctx, buf, _rank0_coord(state), CommKind.CHECKPOINT, label, dim=C.Dim.WORLD))


def _scatter_dtensor(like: DTensor, full: torch.Tensor | None, mode: _Mode, state: DMuonState,
                     label: str) -> DTensor:
    """A DTensor laid out like ``like`` from a full tensor held by every rank (ALL) or by rank 0 only."""
    mesh = like.device_mesh
    if mode is _Mode.RANK0 and int(mesh.mesh.flatten()[0]) != 0:
        # distribute_tensor reads mesh coordinate 0; if that is not global rank 0, ship the data first
        full = _bcast_from_rank0(state, full, like.shape, like.dtype, label)
    elif full is None:
        full = torch.empty(like.shape, dtype=like.dtype)
    device = like.to_local().device
    return distribute_tensor(full.detach().to(device, like.dtype), mesh, like.placements)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_local = a.to_local() if isinstance(a, DTensor) else a
    b_local = b.to_local() if isinstance(b, DTensor) else b
    return a_local.untyped_storage().data_ptr() == b_local.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------------------- #
# Model                                                                                                #
# --------------------------------------------------------------------------------------------------- #
def get_model_state_dict(
    model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = False, sharded: bool = False
) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN. Collective.

    Full (default): complete tensors on every rank (``rank0_only=True``: only rank 0 returns them, the
    others ``{}``), on CPU unless ``cpu_offload=False``; loadable into a plain single-process model.
    ``sharded=True``: for ``torch.distributed.checkpoint``; FSDP2 params as DTensors, each dedicated
    tensor only on its owner, the live tensors themselves (so ``dcp.load`` fills the model in place).

    Example::

        model_sd = dmuon.get_model_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(model_sd, "model.pt")   # or safetensors.torch.save_file(model_sd, ...)
    """
    state = _prepare(model)
    # param_dtype masters whose compute copy was written directly follow it (as the next step would).
    # Only here: a setter must not, since dcp.load fills the masters in place before set_model_state_dict
    # rounds them into the compute copies.
    state.refresh_masters()
    ctx = state.ctx
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for e in _model_entries(model, state):
            mine = e.dp is not None and e.dp.owner == ctx.rank
            if sharded:
                if e.kind is not _Kind.DEDICATED or mine:
                    out[e.key] = e.tensor.detach()
                continue
            if e.kind is _Kind.DEDICATED:
                assert e.dp is not None
                buf = (e.tensor.detach().clone() if mine
                       else torch.empty(e.tensor.shape, dtype=e.dtype, device=ctx.device))
                value = C.wait(C.broadcast(ctx, buf, e.dp.owner, CommKind.CHECKPOINT, e.key, dim=C.Dim.WORLD))
            elif e.kind is _Kind.DTENSOR:
                value = e.tensor.detach().full_tensor()
                if _same_storage(value, e.tensor):  # one shard is the whole tensor: do not hand out the live one
                    value = value.clone()
            else:
                value = e.tensor.detach().clone()
            if keep:
                out[e.key] = value.cpu() if cpu_offload else value
    return out


def _validate_model_sd(entries: list[_Entry], sd: Mapping[str, Any], rank: int) -> list[str]:
    sharded = any(isinstance(v, DTensor) for v in sd.values())
    expected = {
        e.key: e for e in entries
        if not (sharded and e.kind is _Kind.DEDICATED and e.dp is not None and e.dp.owner != rank)
    }
    missing = [k for k in expected if k not in sd]
    unexpected = [str(k) for k in sd if k not in expected]
    shapes, dtypes = [], []
    for k, e in expected.items():
        if k not in sd:
            continue
        v = sd[k]
        if not isinstance(v, torch.Tensor):
            shapes.append(f"{k} (not a tensor: {type(v).__name__})")
        elif tuple(v.shape) != tuple(e.tensor.shape):
            shapes.append(f"{k} {tuple(v.shape)} != {tuple(e.tensor.shape)}")
        elif v.dtype != e.dtype:
            dtypes.append(f"{k} {v.dtype} != {e.dtype}")
    errors = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("wrong shapes", shapes), ("wrong dtypes", dtypes)):
        if items:
            errors.append(_listing(label, items))
    return ["; ".join(errors)] if errors else []


def set_model_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict from :func:`get_model_state_dict` (full or sharded) into the model. Collective.

    Full dicts: pass the same dict on every rank, or the dict on rank 0 and ``{}`` elsewhere; the dict
    may come from another world size (owners take their tensors, FSDP2 shards their slices).
    Keys, shapes and dtypes are checked for the whole dict first; on any mismatch every rank raises a
    ``ValueError`` listing missing / unexpected / mis-shaped keys and nothing changes.

    Example::

        sd = torch.load("model.pt") if dist.get_rank() == 0 else {}
        dmuon.set_model_state_dict(model, sd)
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dmuon.set_model_state_dict: expected a mapping, got {type(state_dict).__name__}")
    state = _prepare(model)
    ctx = state.ctx
    entries = _model_entries(model, state)
    has = len(state_dict) > 0
    errors = _validate_model_sd(entries, state_dict, ctx.rank) if has else []
    sharded = any(isinstance(v, DTensor) for v in state_dict.values())
    fp = "" if sharded else _structure_fingerprint(dict(state_dict))
    mode = _detect_mode(state, "set_model_state_dict", has, errors, fp)
    with torch.no_grad():
        for e in entries:
            mine = e.dp is not None and e.dp.owner == ctx.rank
            if e.kind is _Kind.DEDICATED:
                assert e.dp is not None
                if mode is _Mode.ALL:
                    if mine and not _same_storage(state_dict[e.key], e.tensor):
                        e.tensor.copy_(state_dict[e.key])
                elif e.dp.owner == _rank0_coord(state):
                    if mine:
                        e.tensor.copy_(state_dict[e.key])
                else:
                    full = _bcast_from_rank0(state, state_dict.get(e.key), e.tensor.shape, e.dtype, e.key)
                    if mine:
                        e.tensor.copy_(full)
                if mine:
                    e.dp.write_back()  # param_dtype: round the loaded master into the compute copy
            elif e.kind is _Kind.DTENSOR:
                v = state_dict.get(e.key)
                if isinstance(v, DTensor):
                    if not _same_storage(v, e.tensor):
                        e.tensor.copy_(v.redistribute(e.tensor.device_mesh, e.tensor.placements))
                else:
                    e.tensor.copy_(_scatter_dtensor(e.tensor, v, mode, state, e.key))  # type: ignore[arg-type]
            else:
                if mode is _Mode.ALL:
                    if not _same_storage(state_dict[e.key], e.tensor):
                        e.tensor.copy_(state_dict[e.key])
                else:
                    e.tensor.copy_(_bcast_from_rank0(state, state_dict.get(e.key), e.tensor.shape,
                                                     e.tensor.dtype, e.key))
    # HSDP: the other rows' holders take the owners' new values now; no stale copy survives anywhere
    state.publish_updates()
    state.wait_all_replicate_broadcasts()
    state.reshard_all()


# --------------------------------------------------------------------------------------------------- #
# Optimizer                                                                                            #
# --------------------------------------------------------------------------------------------------- #
def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> DMuonState:
    from .optim import Muon

    if not isinstance(optimizer, Muon):
        raise TypeError(f"dmuon optimizer state dicts need a dmuon.Muon, got {type(optimizer).__name__}")
    state = get_state(model)
    if optimizer._dmuon_state is not state:
        raise ValueError("dmuon: this optimizer was built for a different model.")
    return state


def _group_names(optimizer: Any, state: DMuonState) -> list[list[str]]:
    """Global param names per group: the Muon group lists every dedicated FQN, not just owned ones."""
    return [
        [dp.fqn for dp in state.dedicated()] if g["kind"] == "muon" else list(g["param_names"])
        for g in optimizer.param_groups
    ]


def _adamw_params(optimizer: Any) -> list[tuple[str, nn.Parameter, dict]]:
    return [
        (name, p, g)
        for g in optimizer.param_groups if g["kind"] != "muon"
        for p, name in zip(g["params"], g["param_names"])
    ]


def _materialise_state(optimizer: Any, state: DMuonState) -> None:
    """Create the zero state a first step would create, so sharded dicts have the same keys before and
    after training starts (DCP loads into existing tensors). Mathematically a no-op."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for dp in state.dedicated():
        if dp.owner == state.ctx.rank and "momentum_buffer" not in optimizer.state[dp.param]:
            optimizer._update_target(dp)  # creates a master_dtype master from the param, as a first step does
            optimizer.state[dp.param]["momentum_buffer"] = torch.zeros_like(
                dp.param, dtype=optimizer.update_dtype(dp), memory_format=torch.preserve_format)
    for _, p, g in _adamw_params(optimizer):
        st = optimizer.state[p]
        if len(st) == 0:
            on_device = g.get("fused") or g.get("capturable")
            st["step"] = torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if g.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def get_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, cpu_offload: bool = True, rank0_only: bool = False,
    sharded: bool = False,
) -> dict[str, Any]:
    """``{"state": {fqn: {name: tensor}}, "param_groups": [...]}`` keyed by FQN. Collective.

    Full (default): Muon momenta and AdamW moments as complete tensors, AdamW ``step``, and each group's
    hyperparameters (so a scheduler's ``lr`` survives) with the global ``param_names``. ``sharded=True``:
    for DCP; live tensors, AdamW moments as DTensors, each Muon momentum only on its owner.

    Example::

        optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
        if dist.get_rank() == 0:
            torch.save(optim_sd, "optim.pt")
    """
    state = _check_optimizer(model, optimizer)
    _prepare(model)
    ctx = state.ctx
    if sharded:
        _materialise_state(optimizer, state)
    opt: Any = optimizer
    owned_meta = {
        dp.fqn: [(k, tuple(v.shape), v.dtype) for k, v in sorted(opt.state[dp.param].items())]
        for dp in state.dedicated()
        if dp.owner == ctx.rank and opt.state.get(dp.param)
    }
    adamw_present = [name for name, p, _ in _adamw_params(opt) if opt.state.get(p)]
    views = C.all_gather_object(ctx, (owned_meta, adamw_present))
    if any(present != views[0][1] for _, present in views):
        raise RuntimeError("dmuon.get_optimizer_state_dict: ranks disagree on which AdamW params have state.")
    muon_meta: dict[str, list] = {}
    for meta, _ in views:
        muon_meta.update(meta)

    def finish(t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if cpu_offload else t

    out_state: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for dp in state.dedicated():
            if dp.fqn not in muon_meta:
                continue
            mine = dp.owner == ctx.rank
            if sharded:
                if mine:
                    out_state[dp.fqn] = dict(opt.state[dp.param])
                continue
            entry = {}
            for k, shape, dtype in muon_meta[dp.fqn]:
                buf = (opt.state[dp.param][k].detach().clone() if mine
                       else torch.empty(shape, dtype=dtype, device=ctx.device))
                entry[k] = finish(C.wait(C.broadcast(ctx, buf, dp.owner, CommKind.CHECKPOINT, f"{dp.fqn}.{k}",
                                                     dim=C.Dim.WORLD)))
            out_state[dp.fqn] = entry
        for name, p, _ in _adamw_params(opt):
            st = opt.state.get(p)
            if not st:
                continue
            if sharded:
                out_state[name] = dict(st)
                continue
            entry = {}
            for k in sorted(st):
                v = st[k]
                if isinstance(v, DTensor):
                    full = v.full_tensor()
                    entry[k] = finish(full.clone() if _same_storage(full, v) else full)
                elif isinstance(v, torch.Tensor):
                    entry[k] = finish(v.detach().clone())
                else:
                    entry[k] = v
            out_state[name] = entry
    groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "param_names": names}
        for g, names in zip(opt.param_groups, _group_names(opt, state))
    ]
    if rank0_only and not sharded and dist.get_rank() != 0:
        return {}
    return {"state": out_state, "param_groups": groups}


def _validate_optim_sd(opt: Any, state: DMuonState, sd: Any) -> list[str]:
    if not isinstance(sd, Mapping) or set(sd) != {"state", "param_groups"}:
        keys = sorted(map(str, sd)) if isinstance(sd, Mapping) else type(sd).__name__
        return [f"expected a dict with 'state' and 'param_groups', got {keys}"]
    groups, st = sd["param_groups"], sd["state"]
    expected_names = _group_names(opt, state)
    if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
        return [f"expected {len(opt.param_groups)} param groups, got {len(groups) if isinstance(groups, (list, tuple)) else groups!r}"]
    errors = []
    for i, (g, mine, names) in enumerate(zip(groups, opt.param_groups, expected_names)):
        if not isinstance(g, Mapping) or g.get("kind") != mine["kind"]:
            errors.append(f"param group {i}: kind {g.get('kind') if isinstance(g, Mapping) else g!r} != {mine['kind']!r}")
            continue
        got = list(g.get("param_names", []))
        missing = [n for n in names if n not in set(got)]
        unexpected = [n for n in got if n not in set(names)]
        if missing:
            errors.append(f"param group {i} ({mine['kind']}): " + _listing("missing params", missing))
        if unexpected:
            errors.append(f"param group {i} ({mine['kind']}): " + _listing("unexpected params", unexpected))
    if errors:
        return ["; ".join(errors)]
    full_shape = {dp.fqn: tuple(dp.shape) for dp in state.dedicated()}
    full_shape.update({name: tuple(p.shape) for name, p, _ in _adamw_params(opt)})
    dtype_of = {name: p.dtype for name, p, _ in _adamw_params(opt)}
    muon_dps = {dp.fqn: dp for dp in state.dedicated()}
    bad = []
    if not isinstance(st, Mapping):
        return [f"'state' must be a dict, got {type(st).__name__}"]
    unexpected_state = [str(k) for k in st if k not in full_shape]
    if unexpected_state:
        bad.append(_listing("state for unknown params", unexpected_state))
    for name, entry in st.items():
        if name not in full_shape:
            continue
        if not isinstance(entry, Mapping):
            bad.append(f"state of {name} is a {type(entry).__name__}, not a dict")
            continue
        dp = muon_dps.get(name)
        allowed = None if dp is None else _muon_state_dtypes(opt, dp)
        for k, v in entry.items():
            want = allowed.get(k) if allowed is not None else dtype_of[name]
            if allowed is not None and k not in allowed:
                hint = "; build dmuon.Muon with the master_dtype it was saved with" if k == "master" else ""
                bad.append(f"{name}.{k} (Muon state holds only {' and '.join(sorted(allowed))}{hint})")
            elif isinstance(v, torch.Tensor) and k != "step" and tuple(v.shape) != full_shape[name]:
                bad.append(f"{name}.{k} shape {tuple(v.shape)} != {full_shape[name]}")
            elif isinstance(v, torch.Tensor) and k != "step" and v.dtype != want:
                bad.append(f"{name}.{k} dtype {v.dtype} != {want}")
            elif k == "step" and (not isinstance(v, (torch.Tensor, int, float)) or
                                  (isinstance(v, torch.Tensor) and v.numel() != 1)):
                bad.append(f"{name}.step must be a scalar")
    return ["; ".join(bad)] if bad else []


def _muon_state_dtypes(opt: Any, dp: DedicatedParam) -> dict[str, torch.dtype]:
    """The Muon state keys ``dp`` may have and their dtypes (rank-independent)."""
    out = {"momentum_buffer": opt.update_dtype(dp)}
    master = opt.state_master_dtype(dp)
    if master is not None:
        out["master"] = master
    return out


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a dict from :func:`get_optimizer_state_dict` (full or sharded, any world size). Collective.

    Replaces the optimizer's state and param-group hyperparameters. Same rules as
    :func:`set_model_state_dict`: same dict everywhere or rank 0 only; validated first (a dict from a
    different model is named as such), then applied, or nothing changes.

    Example::

        ckpt = torch.load("checkpoint.pt", map_location="cpu")
        dmuon.set_model_state_dict(model, ckpt["model"])
        dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    """
    state = _check_optimizer(model, optimizer)
    _prepare(model)
    opt: Any = optimizer
    ctx = state.ctx
    has = isinstance(state_dict, Mapping) and len(state_dict) > 0
    errors = _validate_optim_sd(opt, state, state_dict) if has else []
    is_sharded = has and not errors and any(
        isinstance(v, DTensor) for e in state_dict["state"].values() for v in e.values()
    )
    fp = "" if (is_sharded or not has or errors) else _structure_fingerprint(
        {k: v for k, v in state_dict["state"].items() if k not in set(_group_names(opt, state)[0])}
    )
    mode = _detect_mode(state, "set_optimizer_state_dict", has, errors, fp)
    if mode is _Mode.RANK0:
        # everybody needs the structure and the hyperparameters; tensors follow one by one
        meta = C.broadcast_object(ctx, None if dist.get_rank() != 0 else (
            [{k: v for k, v in g.items()} for g in state_dict["param_groups"]],
            {n: {k: ((tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else ("value", v))
                 for k, v in e.items()} for n, e in state_dict["state"].items()},
        ), _rank0_coord(state))
        groups, structure = meta  # type: ignore[misc]
        local_state = state_dict["state"] if dist.get_rank() == 0 else {}
    else:
        groups = state_dict["param_groups"]
        structure = None
        local_state = state_dict["state"]

    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    with torch.no_grad():
        # Muon momenta go to the (possibly new) owners
        for dp in state.dedicated():
            mine = dp.owner == ctx.rank
            assert dp.param is not None
            if mode is _Mode.ALL:
                if mine and dp.fqn in local_state:
                    dtypes = _muon_state_dtypes(opt, dp)
                    new_state[dp.param] = {k: v.detach().to(dp.param.device, dtypes[k]).clone()
                                           for k, v in local_state[dp.fqn].items()}
                continue
            assert structure is not None
            for k, (shape, dtype, _) in sorted(structure.get(dp.fqn, {}).items()):
                v = local_state.get(dp.fqn, {}).get(k)
                if dp.owner == _rank0_coord(state):
                    full = v
                else:
                    full = _bcast_from_rank0(state, v, torch.Size(shape), dtype, f"{dp.fqn}.{k}")
                if mine:
                    new_state.setdefault(dp.param, {})[k] = full.detach().to(
                        dp.param.device, _muon_state_dtypes(opt, dp)[k]).clone()
        # AdamW: DTensor moments are re-sharded for this topology; scalars and plain tensors copied
        for name, p, g in _adamw_params(opt):
            if mode is _Mode.ALL:
                entry_keys = sorted(local_state.get(name, {}))
            else:
                entry_keys = sorted(structure.get(name, {}))  # type: ignore[union-attr]
            if not entry_keys:
                continue
            st: dict[str, Any] = {}
            for k in entry_keys:
                v = local_state.get(name, {}).get(k)
                spec = structure[name][k] if structure is not None else None
                if spec is not None and spec[0] == "value":
                    st[k] = spec[1]
                    continue
                if mode is _Mode.ALL and not isinstance(v, torch.Tensor):
                    st[k] = v
                    continue
                if k == "step":
                    on_device = g.get("fused") or g.get("capturable")
                    if mode is _Mode.RANK0:
                        v = _bcast_from_rank0(state, v, torch.Size(spec[0]), spec[1], f"{name}.step")
                    st[k] = v.detach().to(p.device if on_device else "cpu").clone()
                elif isinstance(p, DTensor):
                    if isinstance(v, DTensor):
                        st[k] = v if v.placements == p.placements else v.redistribute(p.device_mesh, p.placements)
                    else:
                        st[k] = _scatter_dtensor(p, v, mode, state, f"{name}.{k}")
                else:
                    if mode is _Mode.RANK0:
                        v = _bcast_from_rank0(state, v, torch.Size(spec[0]), spec[1], f"{name}.{k}")
                    st[k] = v.detach().to(p.device).clone()
            new_state[p] = st
        for g, src in zip(opt.param_groups, groups):
            for k, v in src.items():
                if k not in ("params", "param_names"):
                    g[k] = v
        opt.state.clear()
        opt.state.update(new_state)
        for dp in state.dedicated():
            dp.seen_version = None  # new masters: compare them with the params once at the next step
