"""dmuon's part of each rank's ZeRO file: what ``engine.save_checkpoint`` writes there, and what a load checks of it
before anything changes.

Each rank's ZeRO file holds the state of the matrices that rank owns (the facade's optimizer state dict carries it
under :data:`STATE_KEY`): the owner plan of the whole job, the rank that wrote it, the hyperparameters of dmuon's
own groups, each owned matrix's Muon state by FQN, and each of those tensors' checksum (``C`` of [Note: checkpoint
checksums], over the whole tensor, which its owner holds), since ``torch.load`` checks nothing it reads. ZeRO
stage 0 writes no ZeRO files: its one optimizer dict (in the model file rank 0 writes) holds every rank's part,
gathered at ``engine.save_checkpoint``, and each rank loads its own (:func:`part_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...checkpoint.checksum import checksum_part
from ...optim import Muon
from ...runtime.hooks import DMuonState

__all__ = ["ENGINE_KINDS", "STATE_KEY", "engine_groups", "own_groups", "owned_part", "part_of", "part_problems",
           "plan_of"]

#: dmuon.Muon's group kinds whose params DeepSpeed trains (the rest are dedicated: dmuon's)
ENGINE_KINDS = ("adamw", "adamw_replicated")
#: the key of dmuon's part in the facade's (so each rank's ZeRO file's) optimizer state dict
STATE_KEY = "dmuon"


def engine_groups(muon: Muon) -> list[dict[str, Any]]:
    """The group dicts of ``muon`` that ZeRO steps (and saves): those of the params DeepSpeed trains."""
    return [g for g in muon.param_groups if g["kind"] in ENGINE_KINDS and g["params"]]


def own_groups(muon: Muon) -> list[dict[str, Any]]:
    """The other group dicts, whose hyperparameters dmuon's part carries (an empty AdamW group too: a scheduler
    scales it all the same). Once attached, the groups handed to ZeRO as built: ZeRO-3 empties their ``params``
    between its steps and saves."""
    drive = getattr(muon, "_deepspeed_drive", None)
    theirs = {id(g) for g in (drive.shared if drive is not None else engine_groups(muon))}
    return [g for g in muon.param_groups if id(g) not in theirs]


def plan_of(state: DMuonState) -> dict[str, int]:
    """Every dedicated matrix's owner rank, by FQN: the same on every rank."""
    return {dp.fqn: dp.owner for dp in state.dedicated()}


def _checksum(t: torch.Tensor) -> int:
    return int(checksum_part(t))


def owned_part(state: DMuonState, muon: Muon) -> dict[str, Any]:
    """This rank's owned Muon state, the hyperparameters of dmuon's own groups, and what a load checks them by."""
    st = {dp.fqn: dict(muon.state[dp.param]) for dp in state.owned() if muon.state.get(dp.param)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in own_groups(muon)]
    with torch.no_grad():
        sums = {fqn: {k: _checksum(v) for k, v in entry.items() if isinstance(v, torch.Tensor)}
                for fqn, entry in st.items()}
    return {"plan": plan_of(state), "rank": state.ctx.rank, "state": st, "groups": groups, "checksums": sums}


def part_of(saved: Any, rank: int) -> Any:
    """This rank's part of what a file holds under :data:`STATE_KEY`: the part itself (a ZeRO file, one per rank),
    or, at ZeRO stage 0, this rank's entry of every rank's parts (the one model file holds them all)."""
    if isinstance(saved, Mapping) and isinstance(saved.get("parts"), list):
        parts = saved["parts"]
        return parts[rank] if rank < len(parts) else None
    return saved


def part_problems(part: Any, state: DMuonState, muon: Muon, path: str) -> list[str]:
    """What keeps this rank's saved part (read from ``path``) from loading here, each with its fix; ``[]``: it
    loads. Reads only this rank's tensors; no collective."""
    if not isinstance(part, Mapping) or not {"plan", "state", "groups"} <= set(part):
        return [f"{path} has no dmuon part (saved without dmuon?); load the model alone with "
                "engine.load_checkpoint(..., load_module_only=True)"]
    if not {"rank", "checksums"} <= set(part):
        return [f"{path} was saved by an earlier dmuon, without checksums; load the model alone "
                "(load_module_only=True), or resume through dmuon's full state dicts"]
    plan = plan_of(state)
    if part["plan"] != plan:
        saved = 1 + max(part["plan"].values(), default=0)
        return [f"{path} was saved with another owner plan (the saved plan uses {saved} ranks, this job "
                f"{state.ctx.world_size}; or another model), so each rank's file holds other matrices' Muon state. "
                "Resume through dmuon's full state dicts instead: dmuon.get_state_dict / set_state_dict "
                "(docs/guides/deepspeed.md)"]
    out = []
    if part["rank"] != state.ctx.rank:
        out.append(f"{path} holds rank {part['rank']}'s Muon state, but this is rank {state.ctx.rank}: put each "
                   "rank's file back under its own name")
    mine = own_groups(muon)
    if len(part["groups"]) != len(mine):
        out.append(f"{path} has {len(part['groups'])} dmuon param groups, this optimizer {len(mine)}: build "
                   "dmuon.Muon with the param_groups it was saved with")
    owned = {dp.fqn for dp in state.owned()}
    foreign = sorted(set(part["state"]) - owned)
    if foreign:
        out.append(f"{path} holds Muon state of {foreign[:3]}, which this rank does not own")
    bad = []
    with torch.no_grad():
        for fqn, sums in part["checksums"].items():
            entry = part["state"].get(fqn, {})
            bad += [f"{fqn}.{k}" for k, want in sums.items()
                    if not isinstance(entry.get(k), torch.Tensor) or _checksum(entry[k]) != want]
    if bad:
        out.append(f"{path}: the checksums of {bad[:5]}{' ...' if len(bad) > 5 else ''} do not match what was "
                   "saved (a damaged or partly overwritten file); load an intact checkpoint")
    return out
