"""Optimizer state dicts: Muon momenta (and masters) from their owners, AdamW moments and steps, and every
param group's hyperparameters. See ``dmuon/checkpoint/__init__.py``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..optim import Muon
from ..optim.rules import PER_ROW_KEYS, UpdateRule, rule_of
from ..optim import routes
from ..engines import Engine
from ..engines import state_of as get_state
from ..runtime import comm as C
from ..runtime.comm import CommKind
from ..runtime.hooks import DMuonState
from ..runtime.param import DedicatedParam, laid_out_like
from ..runtime.route import Route
from .checksum import CHECKSUM_ATTR, CHECKSUMS_KEY, Item, collect, mismatches, stored
from ._common import (
    Mode,
    aliases,
    any_rank,
    bcast_from_owner,
    bcast_from_rank0,
    bcast_object_from_rank0,
    detect_mode,
    gather_views,
    listing,
    prepare,
    rank0_owns,
    refuse_full_under_stages,
    same_storage,
    scatter_dtensor,
    stage_copy,
    stage_problem,
    stage_views,
    structure_fingerprint,
    tp_local,
    tp_rank,
)

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict"]


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> DMuonState:
    if not isinstance(optimizer, Muon):
        raise TypeError(f"dmuon optimizer state dicts need a dmuon.Muon, got {type(optimizer).__name__}")
    state = get_state(model)
    if optimizer.runtime is not state:
        raise ValueError("dmuon: this optimizer was built for a different model.")
    optimizer.check_engine()
    return state


def _group_names(optimizer: Any, state: DMuonState) -> list[list[str]]:
    """Global param names per group: a Muon group lists every FQN it holds on any rank, not just owned ones;
    under pipeline stages every stage's, in stage order ([Note: pipeline state dicts]; collective there, on
    every rank alike, which also checks that the stages' groups can share one ``param_groups``)."""
    names = [list(n) for n in optimizer.group_fqns()]
    if not state.topology.pipelined:
        return names
    settings = repr([sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "param_names"))
                     for g in optimizer.param_groups])
    views: list[Any] = _each_stage(state, gather_views(state, (names, settings)))
    if len({s for _, s in views}) != 1:
        raise ValueError(
            f"dmuon: the pipeline stages' dmuon.Muon param groups differ in number or settings ({len(views)} "
            "stages); a DCP checkpoint keeps one copy of param_groups for the whole job, so build every stage's "
            "optimizer with the same groups and hyperparameters."
        )
    out: list[list[str]] = [[] for _ in names]
    for stage_names, _ in views:
        for i, group in enumerate(stage_names):
            out[i] += [n for n in group if n not in set(out[i])]
    return out


def _each_stage(state: DMuonState, views: list[Any]) -> list[Any]:
    """The view of each pipeline stage's first rank, in stage order, out of every rank's (global rank order)."""
    return [views[ranks[0]] for ranks in state.topology.stages]


#: groups of dedicated params: their state lives on the owner only (``adamw_owned``: AdamW on the owner)
_OWNER_KINDS = ("muon", "adamw_owned")


def _engine(optimizer: Any) -> Engine:
    """The engine binding of the optimizer's model (``dmuon.Muon`` binds one when it is built)."""
    bound = optimizer.runtime.engine
    return bound if isinstance(bound, Engine) else Engine(optimizer.runtime.model, optimizer.runtime)


def _every_rank_params(optimizer: Any) -> list[tuple[str, nn.Parameter, dict]]:
    """The params every rank keeps state for, with their groups: AdamW's (FSDP2 shards and plain params: the
    engine's, [Note: engines]) and the Muon params of a route whose state is not on an owner (the engine's
    shards, laid out like the param: [Note: route strategies])."""
    engine = _engine(optimizer)
    out: list[tuple[str, nn.Parameter, dict]] = []
    for g in optimizer.param_groups:
        if g["kind"] == "muon":  # (no owned params passed: only the routes without an owner)
            out += [(m.name, m.param, g) for route, ms in routes.members(g, optimizer.runtime, owned={})
                    if not route.on_owner for m in ms]
        elif g["kind"] not in _OWNER_KINDS:
            out += engine.group_params(optimizer, g)
    return out


def _every_rank_state(optimizer: Any) -> dict[str, tuple[nn.Parameter, dict[str, Any]]]:
    """``{fqn: (param, state)}`` of the every-rank params that have state, read through the engine (under
    DeepSpeed gathered from ZeRO's slices: collective, every rank the same params in the same order)."""
    engine = _engine(optimizer)
    out = {}
    for name, p, g in _every_rank_params(optimizer):
        st = engine.optimizer_state(optimizer, p, g)
        if st:
            out[name] = (p, st)
    return out


def _every_rank_route(group: dict) -> routes.RouteStrategy | None:
    """The Muon route of an every-rank param of ``group`` (the engine's shards); ``None`` for AdamW's."""
    return routes.SHARDED if group["kind"] == "muon" else None


def _state_dtypes(opt: Any, name: str, p: torch.Tensor, group: dict) -> dict[str, torch.dtype] | None:
    """The state keys and dtypes of an every-rank param that Muon updates (its route's: the update rule's state,
    and a ``master_dtype`` master); ``None`` for AdamW's (its moments take the param's dtype)."""
    route = _every_rank_route(group)
    return None if route is None else route.state_dtypes(routes.Member(name, p, None), rule_of(group),
                                                         master_dtype=opt.master_dtype)


def _rules(opt: Any) -> dict[str, UpdateRule]:
    """The update rule of every Muon param, by FQN (every rank's, from the group layout)."""
    return {n: rule_of(g) for g, names in zip(opt.param_groups, opt.group_fqns()) if g["kind"] == "muon"
            for n in names}


def _layout(dp: DedicatedParam, key: str) -> torch.Tensor | None:
    """What state ``key`` of a dedicated ``dp`` is laid out like, as its route says ([Note: route strategies]):
    a tensor-parallel matrix's shards are the param's (gathered over "tp" in full dicts, sliced on loads);
    ``None``: whole on the owner (a TP matrix's per-row state too, the same on every tp rank)."""
    return routes.of(dp).laid_out_like(routes.Member(dp.fqn, dp.bound(), dp), key)


def _state_shape(full_shape: tuple[int, ...], key: str) -> tuple[int, ...]:
    """The full shape of state ``key`` of a param of ``full_shape`` (a per-row one: one value per row)."""
    return (*full_shape[:-1], 1) if key in PER_ROW_KEYS else full_shape


def get_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, cpu_offload: bool = True, rank0_only: bool = False,
    sharded: bool = False, staged: bool = False,
) -> dict[str, Any]:
    """``{"state": {fqn: {name: tensor}}, "param_groups": [...]}`` keyed by FQN. Collective.

    Full (default): Muon momenta and AdamW moments as complete tensors, AdamW ``step``, and each group's
    hyperparameters (so a scheduler's ``lr`` survives) with the global ``param_names``. ``sharded=True``:
    for DCP; live tensors, AdamW moments as DTensors, each Muon momentum only on its owner.
    ``sharded=True, staged=True``: the target for ``dcp.load``, made of copies (on the CPU unless
    ``cpu_offload=False``), so that the optimizer changes only once :func:`set_optimizer_state_dict` has
    checked the checkpoint (see [Note: staged loads]).
    Tensor parallelism: a TP matrix's momentum is whole in full dicts (gathered over "tp", as a dp-only
    run saves it) and, in sharded dicts, a DTensor over "tp" aliasing each owner-slot rank's shard.

    Example::

        optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
        if dist.get_rank() == 0:
            torch.save(optim_sd, "optim.pt")
    """
    state = _check_optimizer(model, optimizer)
    refuse_full_under_stages(state, "get_optimizer_state_dict", sharded=sharded)
    prepare(model)
    ctx = state.ctx
    if sharded:
        optimizer.materialise_state()
        _engine(optimizer).materialise_state(optimizer)  # (DeepSpeed's ZeRO keeps its AdamW state itself)
    opt: Any = optimizer
    owned_meta = {
        dp.fqn: [(k, tuple(v.shape), v.dtype) for k, v in sorted(opt.state[dp.param].items())]
        for dp in state.dedicated()
        if dp.owner == ctx.rank and opt.state.get(dp.param)
    }
    every = _every_rank_state(opt)
    adamw_present = list(every)
    # TP: every row, so all raise together; pipeline stages: compared within this rank's stage
    views = stage_views(state, gather_views(state, (owned_meta, adamw_present)))
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
                    st = {k: v if (like := _layout(dp, k)) is None else laid_out_like(v, like)
                          for k, v in opt.state[dp.param].items()}
                    out_state[dp.fqn] = {k: stage_copy(v, cpu_offload) for k, v in st.items()} if staged else st
                continue
            out_state[dp.fqn] = {
                k: finish((_bcast_whole if _layout(dp, k) is None else bcast_from_owner)(
                    state, dp, opt.state[dp.param][k] if mine else None, torch.Size(shape), dtype, f"{dp.fqn}.{k}"))
                for k, shape, dtype in muon_meta[dp.fqn]
            }
        for name, (p, st) in every.items():
            if sharded:
                out_state[name] = {k: stage_copy(v, cpu_offload) if staged and isinstance(v, torch.Tensor) else v
                                   for k, v in st.items()}
                continue
            entry = {}
            for k in sorted(st):
                v = st[k]
                if isinstance(v, DTensor):
                    full = v.full_tensor()
                    entry[k] = finish(full.clone() if same_storage(full, v) else full)
                elif isinstance(v, torch.Tensor):
                    entry[k] = finish(v.detach().clone())
                else:
                    entry[k] = v
            out_state[name] = entry
    groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "param_names": names}
        for g, names in zip(opt.param_groups, _group_names(opt, state))
    ]
    sums = _state_checksums(opt, state, muon_meta, every)
    if rank0_only and not sharded and dist.get_rank() != 0:
        return {}
    if sharded:
        return {"state": out_state, "param_groups": groups, CHECKSUMS_KEY: sums}
    for name, entry in out_state.items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                setattr(v, CHECKSUM_ATTR, sums[f"{name}.{k}"])
    return {"state": out_state, "param_groups": groups}


def _state_checksums(opt: Any, state: DMuonState, muon_meta: dict[str, list],
                     every: dict[str, tuple[nn.Parameter, dict[str, Any]]]) -> dict[str, int]:
    """The checksum of every state tensor (``"fqn.name"``) from the live state. Collective."""
    ctx = state.ctx
    items, live = [], {}
    for dp in state.dedicated():
        for k, _, _ in muon_meta.get(dp.fqn, []):
            items.append(_item(dp, f"{dp.fqn}.{k}"))
            if dp.owner == ctx.rank:
                live[f"{dp.fqn}.{k}"] = opt.state[dp.param][k]
    for name, (p, st) in every.items():
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                items.append(Item(f"{name}.{k}", None, p))
                live[f"{name}.{k}"] = v
    return collect(ctx, items, live, tp_rank=tp_rank(state), pipelined=state.topology.pipelined)


def _item(dp: DedicatedParam, key: str) -> Item:
    """A dedicated param's state tensor counts on its owner (a TP matrix's per shard, laid out like it; its
    per-row state, whole on each tp rank, on tp index 0)."""
    return Item(key, dp.owner, _layout(dp, key.rsplit(".", 1)[1]))


def _bcast_whole(state: DMuonState, dp: DedicatedParam, value: torch.Tensor | None, shape: torch.Size,
                 dtype: torch.dtype, label: str) -> torch.Tensor:
    """A state tensor the owner keeps whole, on every rank from its owner (under TP each tp index's row moves
    its own copy, the same on all: nothing to gather over "tp"). Collective."""
    ctx = state.ctx
    buf = value.detach().to(ctx.device, copy=True) if dp.owner == ctx.rank else torch.empty(shape, dtype=dtype,
                                                                                         device=ctx.device)
    return C.wait(C.broadcast(ctx, buf, dp.owner, CommKind.CHECKPOINT, label, dim=C.Dim.WORLD))


def _validate_optim_sd(opt: Any, state: DMuonState, sd: Any, expected_names: list[list[str]]) -> list[str]:
    if not isinstance(sd, Mapping) or set(sd) - {CHECKSUMS_KEY} != {"state", "param_groups"}:
        keys = sorted(map(str, sd)) if isinstance(sd, Mapping) else type(sd).__name__
        return [f"expected a dict with 'state' and 'param_groups', got {keys}"]
    groups, st = sd["param_groups"], sd["state"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
        return [f"expected {len(opt.param_groups)} param groups, got {len(groups) if isinstance(groups, (list, tuple)) else groups!r}"]
    errors = []
    for i, (g, mine, names) in enumerate(zip(groups, opt.param_groups, expected_names)):
        if not isinstance(g, Mapping) or g.get("kind") != mine["kind"]:
            errors.append(f"param group {i}: kind {g.get('kind') if isinstance(g, Mapping) else g!r} != {mine['kind']!r}")
            continue
        if mine["kind"] == "muon" and g.get("algorithm", "muon") != mine["algorithm"]:
            errors.append(f"param group {i} ({mine['name']!r}): algorithm {g.get('algorithm', 'muon')!r} != "
                          f"{mine['algorithm']!r}; build dmuon.Muon with the algorithm it was saved with, or set the "
                          "dict's 'algorithm' and drop the state keys the new one does not keep")
            continue
        got = list(g.get("param_names", []))
        missing = [n for n in names if n not in set(got)]
        unexpected = [n for n in got if n not in set(names)]
        if missing:
            errors.append(f"param group {i} ({mine['kind']}): " + listing("missing params", missing))
        if unexpected:
            errors.append(f"param group {i} ({mine['kind']}): " + listing("unexpected params", unexpected))
    if errors:
        return ["; ".join(errors)]
    full_shape = {dp.fqn: tuple(dp.full_shape or dp.shape) for dp in state.dedicated()}  # TP: the matrix's
    full_shape.update({name: _engine(opt).param_shape(p) for name, p, _ in _every_rank_params(opt)})
    dtype_of = {name: _engine(opt).state_dtype(p) for name, p, _ in _every_rank_params(opt)}
    every_rank_muon = {name: _state_dtypes(opt, name, p, g) for name, p, g in _every_rank_params(opt)}
    rules = _rules(opt)
    muon_dps = {dp.fqn: dp for dp in state.dedicated()}
    bad = []
    if not isinstance(st, Mapping):
        return [f"'state' must be a dict, got {type(st).__name__}"]
    unexpected_state = [str(k) for k in st if k not in full_shape]
    if unexpected_state:
        bad.append(listing("state for unknown params", unexpected_state))
    for name, entry in st.items():
        if name not in full_shape:
            continue
        if not isinstance(entry, Mapping):
            bad.append(f"state of {name} is a {type(entry).__name__}, not a dict")
            continue
        dp = muon_dps.get(name)
        allowed = every_rank_muon.get(name) if dp is None else _muon_state_dtypes(opt, dp, rules)
        for k, v in entry.items():
            want = allowed.get(k) if allowed is not None else dtype_of[name]
            if allowed is not None and k not in allowed:
                hint = "; build dmuon.Muon with the master_dtype it was saved with" if k == "master" else ""
                if k == "master" and dp is not None and dp.tp_dim is not None:
                    hint = ("; tensor-parallel matrices keep no master_dtype master yet: drop the 'master' "
                            "entries to load the rest (the weights then go on from the model dict's values)")
                bad.append(f"{name}.{k} (Muon state holds only {' and '.join(sorted(allowed))}{hint})")
            elif isinstance(v, torch.Tensor) and k != "step" and tuple(v.shape) != _state_shape(full_shape[name], k):
                bad.append(f"{name}.{k} shape {tuple(v.shape)} != {_state_shape(full_shape[name], k)}")
            elif isinstance(v, torch.Tensor) and k != "step" and v.dtype != want:
                bad.append(f"{name}.{k} dtype {v.dtype} != {want}")
            elif k == "step" and (not isinstance(v, (torch.Tensor, int, float)) or
                                  (isinstance(v, torch.Tensor) and v.numel() != 1)):
                bad.append(f"{name}.step must be a scalar")
    return ["; ".join(bad)] if bad else []


def _muon_state_dtypes(opt: Any, dp: DedicatedParam, rules: dict[str, UpdateRule] | None = None
                       ) -> dict[str, torch.dtype]:
    """The state keys a dedicated ``dp`` may have on its owner and their dtypes (rank-independent): its update
    rule's (``rules``: :func:`_rules`, computed here if not given), or AdamW's for an ``adamw_owner`` param."""
    if dp.route is Route.ADAMW_OWNER:
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {"step": scalar, "exp_avg": dp.dtype, "exp_avg_sq": dp.dtype}
    rule = (rules if rules is not None else _rules(opt))[dp.fqn]
    return routes.of(dp).state_dtypes(routes.Member(dp.fqn, dp.bound(), dp), rule, master_dtype=opt.master_dtype)


@dataclass(frozen=True)
class OptimLoad:
    """An optimizer dict that passed every check of :func:`check_optim_sd`: what :func:`apply_optim_sd`
    builds the new state from."""

    opt: Muon
    state: DMuonState
    mode: Mode
    groups: list[dict]
    structure: dict | None
    local_state: Mapping[str, Any]


def check_optim_sd(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Any, *,
                   what: str = "set_optimizer_state_dict") -> OptimLoad:
    """Everything :func:`set_optimizer_state_dict` checks before it changes the optimizer: the dict on each
    rank, one gather in which every rank agrees (raising together), then the checksums. Collective; changes
    nothing."""
    state = _check_optimizer(model, optimizer)
    prepare(model)
    mode = _agree(optimizer, state, state_dict, what)
    groups, structure, local_state = _sources(state, state_dict, mode)
    _verify_checksums(optimizer, state, state_dict, mode, structure, local_state, what)
    return OptimLoad(optimizer, state, mode, groups, structure, local_state)


def apply_optim_sd(load: OptimLoad) -> None:
    """Replace the optimizer's state and hyperparameters with a checked dict's (new tensors, placed for this
    topology). Collective in rank-0 mode."""
    with torch.no_grad():
        new_state = _muon_state_to_load(load.opt, load.state, load.mode, load.structure, load.local_state)
        every = _adamw_state_to_load(load.opt, load.state, load.mode, load.structure, load.local_state)
        new_state.update(_engine(load.opt).load_optimizer_state(load.opt, every))  # under DeepSpeed: into ZeRO
    load.opt.replace_state(new_state, load.groups)


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a dict from :func:`get_optimizer_state_dict` (full or sharded, any world size). Collective.

    Replaces the optimizer's state and param-group hyperparameters. Same rules as
    :func:`set_model_state_dict`: same dict everywhere or rank 0 only; validated first (a dict from a
    different model is named as such), checksums compared, then applied, or nothing changes. Sharded
    dicts: load the ``staged=True`` dict that ``dcp.load`` filled. To load a model and its optimizer as one
    unit, see :func:`dmuon.set_state_dict`.

    Example::

        ckpt = torch.load("checkpoint.pt", map_location="cpu")
        dmuon.set_model_state_dict(model, ckpt["model"])
        dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    """
    apply_optim_sd(check_optim_sd(model, optimizer, state_dict))


def _verify_checksums(opt: Muon, state: DMuonState, sd: Mapping[str, Any], mode: Mode, structure: dict | None,
                      local_state: Mapping[str, Any], what: str) -> None:
    """Compare the incoming state tensors with the checksums the dict carries (where it carries any); raise
    on every rank together, before the optimizer changes. Collective (one more all-reduce to word the error)."""
    rules = _rules(opt)
    items = [_item(dp, f"{dp.fqn}.{k}") for dp in state.dedicated() for k in sorted(_muon_state_dtypes(opt, dp, rules))]
    for name, p, _ in _every_rank_params(opt):
        keys = (structure or {}).get(name, {}) if mode is Mode.RANK0 else local_state.get(name, {})
        items += [Item(f"{name}.{k}", None, p) for k in sorted(keys)]
    values = {f"{n}.{k}": v for n, e in local_state.items() if isinstance(e, Mapping) for k, v in e.items()}
    table = sd.get(CHECKSUMS_KEY) if isinstance(sd, Mapping) else None
    bad = mismatches(state.ctx, items, values, stored(values, table), rank0_only=mode is Mode.RANK0,
                     tp_rank=tp_rank(state), pipelined=state.topology.pipelined)
    if not bad:
        return
    bad_list = listing("checksums do not match", bad)
    if any_rank(state, mode is Mode.ALL and _aliases_live_state(opt, state, local_state)):
        raise ValueError(
            f"dmuon.{what}: {bad_list}. The checkpoint is corrupted or mixed from different saves. dcp.load already "
            "wrote these values into the optimizer's state, since its dict held the live tensors: load another "
            "checkpoint before training on, and build the dict for dcp.load with staged=True so that a refused "
            "checkpoint changes nothing."
        )
    raise ValueError(f"dmuon.{what}: {bad_list}. The checkpoint is corrupted or mixed from different saves; nothing "
                     "was changed.")


def _aliases_live_state(opt: Muon, state: DMuonState, local_state: Mapping[str, Any]) -> bool:
    """Whether some incoming tensor is the optimizer's own live state tensor (a sharded dict built without
    ``staged=True``)."""
    params = {dp.fqn: dp.param for dp in state.dedicated() if dp.is_owner}
    params.update({name: p for name, p, _ in _every_rank_params(opt)})
    for name, entry in local_state.items():
        live = opt.state.get(params[name], {}) if name in params else {}
        if isinstance(entry, Mapping) and any(aliases(v, live.get(k)) for k, v in entry.items()):
            return True
    return False


def _agree(opt: Muon, state: DMuonState, state_dict: Any, what: str) -> Mode:
    """Validate locally, then agree with every rank on the mode (or raise together)."""
    has = isinstance(state_dict, Mapping) and len(state_dict) > 0
    names = _group_names(opt, state)  # (collective under pipeline stages: every rank, before any validation)
    errors = _validate_optim_sd(opt, state, state_dict, names) if has else []
    is_sharded = has and not errors and any(
        isinstance(v, DTensor) for e in state_dict["state"].values() for v in e.values()
    )
    errors += stage_problem(state, sharded=is_sharded) if has and not errors else []
    dedicated = {dp.fqn for dp in state.dedicated()}
    fp = "" if (is_sharded or not has or errors) else structure_fingerprint(
        {k: v for k, v in state_dict["state"].items() if k not in dedicated}
    )
    mode = detect_mode(state, what, has, errors, fp)
    if mode is Mode.RANK0:  # (agreed: under stages every rank raises)
        refuse_full_under_stages(state, what, sharded=False)
    return mode


def _sources(state: DMuonState, state_dict: Any, mode: Mode) -> tuple[list[dict], dict | None, Mapping[str, Any]]:
    """The param groups, the structure (rank-0 mode: what rank 0 holds, sent to everybody; tensors follow
    one by one) and this rank's view of the state."""
    if mode is not Mode.RANK0:
        return state_dict["param_groups"], None, state_dict["state"]
    meta = bcast_object_from_rank0(state, None if dist.get_rank() != 0 else (
        [{k: v for k, v in g.items()} for g in state_dict["param_groups"]],
        {n: {k: ((tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else ("value", v))
             for k, v in e.items()} for n, e in state_dict["state"].items()},
    ))
    groups, structure = meta  # type: ignore[misc]
    return groups, structure, (state_dict["state"] if dist.get_rank() == 0 else {})


def _muon_state_to_load(opt: Muon, state: DMuonState, mode: Mode, structure: dict | None,
                        local_state: Mapping[str, Any]) -> dict[nn.Parameter, dict[str, Any]]:
    """Muon momenta (and masters), and AdamW state of ``adamw_owner`` params, for the (possibly new) owners."""
    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    group_of = {id(p): g for g in opt.param_groups if g["kind"] == "adamw_owned" for p in g["params"]}

    def place(p: nn.Parameter, k: str, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return v.detach().to(_state_device(p, group_of.get(id(p), {}), k), dtype, copy=True)

    rules = _rules(opt)
    for dp in state.dedicated():
        p = dp.bound()
        if mode is Mode.ALL:
            if dp.is_owner and dp.fqn in local_state:
                dtypes = _muon_state_dtypes(opt, dp, rules)
                new_state[p] = {k: place(p, k, _shard(dp, v, k), dtypes[k]) for k, v in local_state[dp.fqn].items()}
            continue
        for k, (shape, dtype, _) in sorted(structure.get(dp.fqn, {}).items()):  # type: ignore[union-attr]
            v = local_state.get(dp.fqn, {}).get(k)
            if rank0_owns(state, dp.owner):
                full = v
            else:
                full = bcast_from_rank0(state, v, torch.Size(shape), dtype, f"{dp.fqn}.{k}")
            if dp.is_owner:
                new_state.setdefault(p, {})[k] = place(p, k, _shard(dp, full, k), _muon_state_dtypes(opt, dp, rules)[k])
    return new_state


def _state_device(p: torch.Tensor, group: Mapping[str, Any], key: str) -> torch.device:
    """Where torch's AdamW keeps state ``key`` of ``p``: ``step`` on the CPU unless the group is fused or
    capturable, everything else on the param's device."""
    on_device = key != "step" or group.get("fused") or group.get("capturable")
    return p.device if on_device else torch.device("cpu")


def _shard(dp: DedicatedParam, v: Any, key: str) -> Any:
    """What the owner keeps of an incoming state tensor ``key``: a TP matrix's shard, anything else (a TP
    matrix's per-row state too) whole (its route's layout)."""
    like = _layout(dp, key)
    if like is None or not isinstance(v, torch.Tensor):
        return v
    return tp_local(v, like)  # type: ignore[arg-type]


def _adamw_state_to_load(opt: Muon, state: DMuonState, mode: Mode, structure: dict | None,
                         local_state: Mapping[str, Any]) -> dict[nn.Parameter, dict[str, Any]]:
    """AdamW: DTensor moments re-sharded for this topology; scalars and plain tensors copied."""
    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    for name, p, g in _every_rank_params(opt):
        source = local_state.get(name, {}) if mode is Mode.ALL else structure.get(name, {})  # type: ignore[union-attr]
        if not source:
            continue
        st: dict[str, Any] = {}
        for k in sorted(source):
            v = local_state.get(name, {}).get(k)
            spec = structure[name][k] if structure is not None else None
            if spec is not None and spec[0] == "value":
                st[k] = spec[1]
            elif mode is Mode.ALL and not isinstance(v, torch.Tensor):
                st[k] = v
            elif k == "step":
                if mode is Mode.RANK0:
                    v = bcast_from_rank0(state, v, torch.Size(spec[0]), spec[1], f"{name}.step")  # type: ignore[index]
                st[k] = v.detach().to(_state_device(p, g, k), copy=True)
            elif isinstance(p, DTensor):
                dtype = (_state_dtypes(opt, name, p, g) or {}).get(k)  # a Muon master / momentum may be wider
                route = _every_rank_route(g)  # a Muon route's layout (NorMuon's second moment: [E, m, 1])
                like = p if route is None else route.laid_out_like(routes.Member(name, p, None), k)
                if isinstance(v, DTensor):
                    st[k] = _adopt_dtensor(v, like)
                else:
                    st[k] = scatter_dtensor(like, v, mode, state, f"{name}.{k}", dtype)
            else:
                if mode is Mode.RANK0:
                    v = bcast_from_rank0(state, v, torch.Size(spec[0]), spec[1], f"{name}.{k}")  # type: ignore[index]
                st[k] = v.detach().to(p.device, copy=True)
        new_state[p] = st
    return new_state


def _adopt_dtensor(v: DTensor, p: DTensor) -> DTensor:
    """An incoming AdamW moment as ``p``'s state: the DTensor itself where it is laid out like ``p`` and on
    its device (the live tensor of a sharded dict, or a staged copy on the device), else moved to ``p``'s
    device (a staged copy on the CPU) and re-laid-out."""
    device = p.to_local().device
    if v.to_local().device != device:
        v = v.to(device)
    return v if v.placements == p.placements else v.redistribute(p.device_mesh, p.placements)
