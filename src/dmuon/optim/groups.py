"""User param groups for ``dmuon.Muon``: resolving them against the model and checking them.

Users pass groups the ``torch.optim`` way (Keller Jordan's ``MuonWithAuxAdam`` convention for the
algorithm)::

    dmuon.Muon(model, lr=0.02, param_groups=[
        {"params": [model.tok_embeddings.weight, "lm_head.weight"], "use_muon": False, "lr": 3e-3,
         "weight_decay": 0.0},
        {"params": [n for n, _ in model.named_parameters() if "norm" in n], "weight_decay": 0.0},
        {"params": [n for n in dmuon.get_dedicated_params(model) if "mlp" in n], "lr": 0.01},
    ])

Each entry of ``"params"`` is a parameter of the model (as it is now, after ``fully_shard``), a
``(name, param)`` pair as ``named_parameters()`` yields, or an FQN. What no group names goes to the
constructor's defaults: Muon for the dedicated matrices, AdamW for the rest.

[Note: group layout] ``Muon.param_groups`` are real torch groups, but torch's foreach kernels refuse a
list that mixes DTensors with plain tensors, and a Muon group holds only the matrices this rank owns.
So each user group becomes one internal group (``kind="muon"``: the matrices this rank owns and the
params Muon updates on the engine's shards, [Note: Muon on the engine's shards] in ``routes/sharded.py``; Muon
steps param by param, so the mix is no trouble, and the layout does not depend on the route, which may
differ between world sizes) or two (``"adamw"``: FSDP2 shards, ``"adamw_replicated"``: plain params),
every internal group carrying the user group's ``name``; then come the default groups. Without user groups that is the layout dmuon always had
(``muon``, ``adamw``, ``adamw_replicated``). The layout is decided from the global picture (every
dedicated FQN, not only the owned ones), so it is the same on every rank, and checkpoints match groups
by index and FQN.

[Note: settings agreement] Every matrix is updated once, on its owner, for every rank; plain params are
updated by every rank on its own copy. So a setting that changes the update and differs between ranks
raises nothing by itself: each owner applies its own value and the job trains on as a mixture (QK-clip's
``tau=100`` on rank 0 and ``8`` on rank 1 clipped each owner's heads by its own tau). ``dmuon.Muon``'s
build therefore puts every such setting into the one gather it runs anyway for the param groups
(:func:`settings_view`, QK-clip's ``agreement_view``, :func:`groups_view`): the constructor's Muon-family
and AdamW values (normalised as the records hold them, so ``adjust_lr_fn=None`` and ``"original"`` agree),
``algorithm``, ``master_dtype``, AdamW's ``foreach`` / ``fused`` kernels (a replicated plain param is
stepped on every rank, and kernels round differently), QK-clip's ``tau`` and ``alpha`` and the head
layouts it resolved, then each group's name, params, algorithm and values. :func:`agree` raises on every
rank, naming the first setting that differs and each rank's value, before anything is built;
``add_param_group`` compares its group the same way. Under pipeline parallelism the stages hold different
params, so the groups and head layouts are compared within each stage and the rest over every rank
([Note: pipeline stages] in ``dmuon/runtime/topology.py``). Not compared: ``replicate_async`` (results are the
same either way) and QK-clip's ``log``. Nothing is compared per step: a scheduler changes ``lr`` by the
same rule from the same state on every rank; a per-step gather would tax every step for the one case it
could catch (a loop that edits a group on some ranks only).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import engines
from ..runtime.hooks import STATE_ATTR, DMuonState
from ..runtime.precision import check_float_dtype
from .rules import ADAMW, RULES, Algorithm, muon_record
from .update import AdamWHParams, MuonHParams

__all__ = ["ResolvedGroup", "resolve_groups", "canonical_name", "DEFAULT_GROUP_NAMES", "check_settings",
           "settings_view", "groups_view", "agree"]

#: The ``name`` of the groups that take whatever no user group names.
DEFAULT_GROUP_NAMES = {True: "default_muon", False: "default_adamw"}
_SPEC_KEYS = ("params", "use_muon", "algorithm", "name")


def canonical_name(fqn: str) -> str:
    """The FQN as ``model.state_dict()`` spells it (activation-checkpoint and ``torch.compile`` wrappers
    insert a segment into ``named_parameters`` only)."""
    return fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@dataclass(frozen=True, slots=True)
class ResolvedGroup:
    """One user group after resolution: global FQNs in the model's order, validated hyperparameters."""

    name: str
    use_muon: bool
    fqns: tuple[str, ...]
    hparams: MuonHParams | AdamWHParams

    def entries(self) -> dict[str, Any]:
        """The torch param-group keys besides ``params`` / ``param_names`` / ``kind``."""
        return {"name": self.name, **self.hparams.group_entries()}


class _Model:
    """What resolution needs to know about the model: every param by FQN and by identity."""

    def __init__(self, model: nn.Module, dedicated: Iterable[str], owner_adamw: Iterable[str]):
        self.by_name: dict[str, nn.Parameter] = {}
        self.name_of: dict[int, str] = {}
        for raw, p in model.named_parameters(remove_duplicate=False):
            self.name_of.setdefault(id(p), canonical_name(raw))  # tied: the first name
            self.by_name[raw] = p
            self.by_name[canonical_name(raw)] = p
        self.order = {name: i for i, name in enumerate(dict.fromkeys(self.name_of.values()))}
        #: dedicated for Muon, and dedicated for AdamW on the owner (``Route.ADAMW_OWNER``)
        self.dedicated, self.owner_adamw = set(dedicated), set(owner_adamw)
        #: the Muon params split into column blocks, with their matrices ([Note: matrix blocks])
        state: DMuonState | None = getattr(model, STATE_ATTR, None)
        layouts = {} if state is None else {**{dp.fqn: dp.blocks for dp in state.dedicated()}, **state.sharded_muon}
        self.columns = {canonical_name(n): b.describe() for n, b in layouts.items() if b is not None and b.columns}

    def lookup(self, item: object, where: str) -> str:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[1]  # torch's named-parameter form: identity decides
        if isinstance(item, str):
            p = self.by_name.get(item)
            if p is None and item.startswith("module."):  # an engine wrapper's spelling (DDP, DeepSpeed hold the model as .module)
                p = self.by_name.get(item.removeprefix("module."))
            if p is None:
                close = difflib.get_close_matches(item, list(self.by_name), n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(f"{where}: the model has no parameter named {item!r}.{hint}")
            return self.name_of[id(p)]
        if isinstance(item, torch.Tensor):
            name = self.name_of.get(id(item))
            if name is None:
                raise ValueError(
                    f"{where}: a {tuple(item.shape)} tensor that is not a parameter of this model. fully_shard "
                    "replaces the parameters it shards with new DTensor objects, so collect the groups after "
                    "fully_shard (or name the parameters by FQN)."
                )
            return name
        raise TypeError(f"{where}: params entries must be parameters, (name, param) pairs or FQNs, "
                        f"got {type(item).__name__}")


def _params_of(spec: Mapping[str, Any], where: str) -> list[object]:
    if "params" not in spec:
        raise ValueError(f"{where}: a param group needs a 'params' entry")
    items = spec["params"]
    if isinstance(items, (torch.Tensor, str)):
        return [items]
    if isinstance(items, Mapping) or not isinstance(items, Iterable):
        raise TypeError(f"{where}: 'params' must be a parameter, an FQN or an iterable of them, "
                        f"got {type(items).__name__}")
    return list(items)


def _hparams(spec: Mapping[str, Any], algorithm: str, defaults: Mapping[str, Any], where: str
             ) -> MuonHParams | AdamWHParams:
    """The group's record: ``algorithm``'s keys from ``spec`` over ``defaults`` (the constructor's values)."""
    cls: type[MuonHParams] | type[AdamWHParams] = (AdamWHParams if algorithm == ADAMW else
                                                   RULES[Algorithm(algorithm)].hparams)
    allowed = cls.names()
    unknown = sorted(k for k in spec if k not in _SPEC_KEYS and k not in allowed)
    if unknown:
        by_owner: dict[str, list[str]] = {}
        for k in unknown:  # whose key it is: Muon's (every Muon-family record has it), NorMuon's, AdamW's
            owner = next((a for a, names in _OWNERS if k in names), None)
            if owner is not None:
                by_owner.setdefault(owner, []).append(k)
        hint = "".join(f" ({', '.join(ks)} {'is' if len(ks) == 1 else 'are'} {owner}'s)" for owner, ks in by_owner.items())
        raise ValueError(f"{where}: unknown key(s) {unknown} for {_GROUP[algorithm]}{hint}; allowed: "
                         f"{list(_SPEC_KEYS) + list(allowed)}")
    values = {**defaults, **{k: spec[k] for k in allowed if k in spec}}
    try:
        if algorithm == ADAMW:
            return AdamWHParams(**{k: v for k, v in values.items() if k in allowed})
        return muon_record(algorithm, values, where)
    except (TypeError, ValueError) as e:
        msg = str(e).removeprefix("dmuon.Muon: ")
        raise ValueError(f"{where}: {msg if algorithm != ADAMW else msg.replace('adamw_', '')}") from None


_TITLE = {"muon": "Muon", "normuon": "NorMuon", ADAMW: "AdamW"}
_GROUP = {"muon": "a Muon group", "normuon": "a NorMuon group (algorithm='normuon')", ADAMW: "an AdamW group"}
_OWNERS = [("Muon", MuonHParams.names()), ("NorMuon", RULES[Algorithm.NORMUON].hparams.names()),
           ("AdamW", AdamWHParams.names())]


def _said_algorithm(spec: Mapping[str, Any], where: str) -> str | None:
    """The group's ``algorithm`` as given (checked, canonical spelling), or ``None``."""
    if "algorithm" not in spec:
        return None
    value = spec["algorithm"]
    if isinstance(value, str) and value.lower() == ADAMW:
        return ADAMW
    return Algorithm.parse(value, where, adamw_ok=True).value


def _algorithm(spec: Mapping[str, Any], fqns: Sequence[str], model: _Model, where: str, default: str) -> str:
    """The group's algorithm: ``algorithm`` / ``use_muon`` as given, or from the params (all dedicated: the
    constructor's ``default``; none: AdamW); then checked against the params."""
    dedicated = [n for n in fqns if n in model.dedicated]
    others = [n for n in fqns if n not in model.dedicated]
    use_muon, said = spec.get("use_muon"), _said_algorithm(spec, where)
    if use_muon is not None and not isinstance(use_muon, bool):
        raise TypeError(f"{where}: 'use_muon' must be True or False, got {use_muon!r}")
    if use_muon is not None and said is not None and use_muon != (said != ADAMW):
        raise ValueError(f"{where}: use_muon={use_muon} contradicts algorithm={said!r}; give one of them")
    if said is None and use_muon is None:
        if dedicated and others:
            raise ValueError(
                f"{where}: mixes dedicated matrices ({dedicated[0]!r}, ...) with other params ({others[0]!r}, ...) "
                "and says no 'use_muon'. Muon and AdamW read 'lr' and 'weight_decay' differently, so split it "
                "into a Muon group and an AdamW group."
            )
        return default if dedicated else ADAMW
    algorithm = said if said is not None else default if use_muon else ADAMW
    flag = f"algorithm={algorithm!r}" if said is not None else f"use_muon={use_muon}"
    if algorithm != ADAMW and others:
        p = model.by_name[others[0]]
        why = ("dmuon.dedicate_params(route=...) routed it 'adamw_owner'" if others[0] in model.owner_adamw else
               f"it is {p.ndim}-D; {_TITLE[algorithm]} updates matrices only" if p.ndim < 2 else
               f"it is not dedicated ({_TITLE[algorithm]} needs the whole matrix on one owner) and so routed to "
               "AdamW: select it in dmuon.dedicate_params(predicate=...)")
        raise ValueError(f"{where}: {flag} but {others[0]!r} cannot take {_TITLE[algorithm]}: {why}.")
    if algorithm == ADAMW and dedicated:
        raise ValueError(
            f"{where}: {flag} but {dedicated[0]!r} is dedicated: its owner updates it with Muon. Put it "
            "in a Muon group, or leave it out of dmuon.dedicate_params(predicate=...) to train it with AdamW."
        )
    return algorithm


def _check_blocks(algorithm: str, fqns: Sequence[str], model: _Model, where: str) -> None:
    """Refuse an algorithm for the column-blocked params it cannot update (NorMuon's per-row state)."""
    if algorithm == ADAMW or RULES[Algorithm.parse(algorithm)].column_blocks:
        return
    cols = [n for n in fqns if n in model.columns]
    if cols:
        raise ValueError(
            f"{where}: algorithm={algorithm!r} cannot update {cols[0]!r}, whose blocks split its columns "
            f"({model.columns[cols[0]]}): NorMuon keeps one second moment per row of a param, and each column block "
            "needs its own. Put the column-blocked params in a param group with algorithm='muon', or declare "
            "their blocks along the rows."
        )


def _nearest(spec: Mapping[str, Any], name: str | None, model: _Model) -> str:
    """For a group whose ``params`` name nothing: the model's names nearest the group's ``name``
    (by a segment of the FQN), else a few of the names of the kind the group asks for (dedicated matrices
    for a Muon group, the others for an AdamW group, any trainable param otherwise)."""
    algorithm, use_muon = spec.get("algorithm"), spec.get("use_muon")
    wants = (None if algorithm is None and use_muon is None else  # the group's kind, if it says one
             use_muon is not False and str(algorithm).lower() != ADAMW)
    names = [n for n in model.order if model.by_name[n].requires_grad and
             (wants is None or (n in model.dedicated) == wants)]
    picks: list[str] = []
    if name:  # the segments of the FQNs that say something (not 'layers' or 'weight', in most of them)
        count: dict[str, int] = {}
        for n in names:
            for seg in set(n.split(".")):
                count[seg] = count.get(seg, 0) + 1
        segments = [seg for seg, k in count.items() if not seg.isdigit() and 2 * k <= len(names)]
        for seg in difflib.get_close_matches(name, segments, n=3, cutoff=0.6):
            picks.append(next(n for n in names if seg in n.split(".")))
    kind = {None: "trainable params", True: "dedicated matrices", False: "non-dedicated params"}[wants]
    said = f"names nearest {name!r}" if picks else f"{kind} include"
    if not picks:  # the first name of each pattern (layer numbers aside)
        first: dict[str, str] = {}
        for n in names:
            first.setdefault(re.sub(r"\.\d+\.", ".N.", n), n)
        picks = list(first.values())[:5]
    return f"The model's {said}: {', '.join(map(repr, picks)) or 'none'}"


def resolve_groups(model: nn.Module, specs: Sequence[Mapping[str, Any]] | None, *, dedicated: Iterable[str],
                   owner_adamw: Iterable[str] = (), muon_defaults: MuonHParams, adamw_defaults: AdamWHParams,
                   taken: Iterable[str] = (), first_index: int = 0, with_defaults: bool = True,
                   muon_values: Mapping[str, Any] | None = None, allow_empty: bool = False
                   ) -> list[ResolvedGroup]:
    """Resolve and check user groups; append the default groups (``with_defaults``) for every trainable
    param no group names. ``dedicated``: the FQNs on Muon, ``owner_adamw``: the dedicated ones an owner
    steps with AdamW. ``taken``: FQNs that earlier groups already hold, ``first_index``: the number
    of the first group in errors and default names (both for ``add_param_group``). ``muon_defaults``: the
    record of the default algorithm; ``muon_values``: the constructor's values of every Muon-family key
    (a group of another algorithm takes its defaults from there; default: ``muon_defaults``').
    ``allow_empty``: accept a group whose ``params`` name nothing (else it raises, naming the nearest names).
    Deterministic: every rank that passes the same groups gets the same answer, or the same error."""
    m = _Model(model, dedicated, owner_adamw)
    if specs is None:
        specs = []
    if isinstance(specs, Mapping) or not isinstance(specs, Sequence):
        raise TypeError(f"dmuon.Muon: param_groups must be a list of dicts, got {type(specs).__name__}")
    owner_of = {name: "an existing param group" for name in taken}
    out = []
    for i, spec in enumerate(specs, start=first_index):
        where = f"dmuon.Muon: param group {i}"
        if not isinstance(spec, Mapping):
            raise TypeError(f"{where}: expected a dict, got {type(spec).__name__}")
        name = spec.get("name", f"group{i}")
        if not isinstance(name, str) or name in DEFAULT_GROUP_NAMES.values():
            raise ValueError(f"{where}: 'name' must be a str other than {sorted(DEFAULT_GROUP_NAMES.values())}, "
                             f"got {name!r}")
        where = f"{where} ({name!r})"
        fqns = []
        for item in _params_of(spec, where):
            fqn = m.lookup(item, where)
            if fqn in owner_of:
                raise ValueError(f"{where}: {fqn!r} is already in {owner_of[fqn]}; a parameter can be in one "
                                 "group only")
            owner_of[fqn] = f"param group {i} ({name!r})"
            fqns.append(fqn)
        if not fqns and not allow_empty:
            nearest = _nearest(spec, name if "name" in spec else None, m)
            raise ValueError(f"{where}: 'params' names no parameter, so this group would hold nothing and its params "
                             f"would train with the defaults, silently. {nearest}. Check the filter that built the "
                             "list, or pass dmuon.Muon(..., allow_empty_groups=True) to keep an empty group on purpose "
                             "(a group list shared between models).")
        algorithm = _algorithm(spec, fqns, m, where, muon_defaults.ALGORITHM)
        _check_blocks(algorithm, fqns, m, where)
        hp = _hparams(spec, algorithm, adamw_defaults.group_entries() if algorithm == ADAMW else
                      (muon_values if muon_values is not None else muon_defaults.group_entries()), where)
        out.append(ResolvedGroup(name, algorithm != ADAMW, tuple(sorted(fqns, key=m.order.__getitem__)), hp))
    if len({g.name for g in out}) != len(out):
        raise ValueError("dmuon.Muon: two param groups have the same 'name'")
    if with_defaults:
        rest = [n for n, p in ((n, m.by_name[n]) for n in m.order) if n not in owner_of and p.requires_grad]
        for use_muon, hp in ((True, muon_defaults), (False, adamw_defaults)):
            fqns = tuple(n for n in rest if (n in m.dedicated) == use_muon)
            if use_muon:
                _check_blocks(hp.ALGORITHM, fqns, m, "dmuon.Muon")
            out.append(ResolvedGroup(DEFAULT_GROUP_NAMES[use_muon], use_muon, fqns, hp))
    return out


def torch_groups(group: ResolvedGroup, params: Mapping[str, nn.Parameter], owned: set[str],
                 owner_adamw: set[str] = frozenset(), sharded: set[str] = frozenset()
                 ) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The internal torch groups of one resolved group ([Note: group layout]), each with its global FQNs:
    Muon → the matrices this rank owns, and (only where the group has any) the params on the engine's
    shards (``sharded``); AdamW → FSDP2 shards, plain params, and (only where the group has any) the
    ``adamw_owner`` params this rank owns."""
    def entry(kind: str, names: list[str], everyone: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
        return (dict(params=[params[n] for n in names], param_names=names, kind=kind, **group.entries()),
                tuple(everyone))

    if group.use_muon:
        return [entry("muon", [n for n in group.fqns if n in owned or n in sharded], group.fqns)]
    plain = [n for n in group.fqns if n not in owner_adamw]
    out = [entry(kind, names, names) for kind, names in (
        ("adamw", [n for n in plain if isinstance(params[n], DTensor)]),
        ("adamw_replicated", [n for n in plain if not isinstance(params[n], DTensor)]))]
    everyone = [n for n in group.fqns if n in owner_adamw]
    if everyone:
        out.append(entry("adamw_owned", [n for n in everyone if n in owned], everyone))
    return out


# --------------------------------------------------------------------------------------------------- #
# Settings every rank must share ([Note: settings agreement])                                          #
# --------------------------------------------------------------------------------------------------- #
#: a label's value on a rank that has no such setting (another group list, QK-clip off)
_ABSENT = "(none)"


def check_settings(model: nn.Module, values: Mapping[str, Any], settings: Mapping[str, Any]
                   ) -> tuple[DMuonState, tuple[MuonHParams, AdamWHParams, dict[str, object]] | Exception]:
    """``dmuon.Muon``'s own checks, local: the model's dmuon state, and what :func:`_records` returned (the
    default records and the view to agree on) or raised. A bad value is for the caller to raise in its gather,
    so that every rank raises; here only where the model was never dedicated (no gather possible, and the
    value is the error to show)."""
    try:
        checked: Any = _records(values, settings)
    except (TypeError, ValueError) as e:
        checked = e
    try:
        return engines.state_of(model), checked
    except ValueError:
        if isinstance(checked, Exception):
            raise checked from None
        raise


def _records(values: Mapping[str, Any], settings: Mapping[str, Any]
             ) -> tuple[MuonHParams, AdamWHParams, dict[str, object]]:
    """``values`` (every Muon-family value, checked whichever algorithm the groups take) and ``settings``
    (``algorithm``, ``adamw_*``, ``master_dtype``): the default Muon and AdamW records and what every rank
    must agree on (:func:`settings_view`)."""
    every = muon_record(Algorithm.NORMUON.value, values)  # NorMuon's record holds every Muon-family key
    muon_hp = muon_record(settings["algorithm"], values)
    adamw_hp = AdamWHParams(**{k: settings[f"adamw_{k}"] for k in AdamWHParams.names()})
    check_float_dtype("dmuon.Muon: master_dtype", settings["master_dtype"])
    return muon_hp, adamw_hp, settings_view(every, muon_hp, adamw_hp, settings)


def settings_view(every: MuonHParams, muon: MuonHParams, adamw: AdamWHParams, settings: Mapping[str, Any]
                  ) -> dict[str, object]:
    """The constructor's settings that change the update, by keyword, as the records hold them (normalised)."""
    view: dict[str, object] = {k: repr(v) for k, v in every.group_entries().items() if k != "algorithm"}
    view["algorithm"] = repr(muon.ALGORITHM)
    view.update({f"adamw_{k}": repr(v) for k, v in adamw.group_entries().items()})
    view.update({k: repr(settings[k]) for k in ("adamw_foreach", "adamw_fused", "master_dtype")})
    return view


def groups_view(groups: Sequence[ResolvedGroup]) -> dict[str, object]:
    """Each resolved group's name, params (global FQNs) and values, by group."""
    view: dict[str, object] = {"param group names": repr([g.name for g in groups])}
    for g in groups:
        view[f"param group {g.name!r}: params"] = g.fqns
        view.update({f"param group {g.name!r}: {k}": repr(v) for k, v in g.entries().items() if k != "name"})
    return view


def _show(value: object, common: int) -> str:
    """One rank's value; a long one from a little before ``common``, where the ranks' values start to differ."""
    if isinstance(value, tuple):  # a group's params
        return repr(list(value)) if len(value) <= 3 else f"{len(value)} params ({value[0]!r}, ...)"
    text = str(value)
    if len(text) <= 120:
        return text
    start = max(0, common - 40)
    return f"{'...' if start else ''}{text[start:start + 120]}{'...' if start + 120 < len(text) else ''}"


def _fix(label: str, where: str) -> str:
    if label.startswith("qk_clip heads"):
        return ("the same model on every rank (its attention's head attributes), or the same "
                "dmuon.QKClip(heads=[...])")
    if label.startswith("qk_clip"):
        return "the same dmuon.QKClip(...)"
    if label.startswith("param group"):
        return ("the same param groups (build them from names and shapes, nothing that depends on the rank)"
                if where == "dmuon.Muon" else "the same group")
    return f"the same dmuon.Muon(..., {label}=...)"


#: labels that concern a stage's own params: compared within each pipeline stage, the rest over the job
_STAGE_LABELS = ("param group", "qk_clip heads")


def agree(views: Sequence[tuple[str, str | None, Mapping[str, object]]], where: str, *,
          stage_of_rank: Sequence[int] | None = None) -> None:
    """Raise on every rank where any rank refused (``views[r]``: the stage that refused and its error, or
    ``None``, and its view) or the ranks' views differ ([Note: settings agreement]). Pure: the caller
    gathers ``views``. ``stage_of_rank``: each rank's pipeline stage, where the job has several; the param
    groups and head layouts (a stage's own params) are then compared within each stage, everything else over
    every rank ([Note: pipeline stages] in ``dmuon/runtime/topology.py``)."""
    for rank, (stage, err, _) in enumerate(views):
        if err is not None:
            raise ValueError(f"{stage} refused on rank {rank}: {err}")
    stages = stage_of_rank if stage_of_rank is not None else [0] * len(views)
    for label in dict.fromkeys(k for _, _, view in views for k in view):
        values = [view.get(label, _ABSENT) for _, _, view in views]
        if not label.startswith(_STAGE_LABELS):
            _compare(label, dict(enumerate(values)), where)
            continue
        for s in sorted(set(stages)):
            _compare(label, {r: v for r, v in enumerate(values) if stages[r] == s}, where)


def _compare(label: str, by_rank: Mapping[int, object], where: str) -> None:
    """Raise naming ``label`` and each rank's value unless every rank of ``by_rank`` has the same one."""
    values = list(by_rank.values())
    if all(v == values[0] for v in values):
        return
    texts = [str(v) for v in values]
    common = next((i for i, chars in enumerate(zip(*texts)) if len(set(chars)) > 1), min(map(len, texts)))
    by_value: dict[str, list[int]] = {}
    for rank, v in by_rank.items():
        by_value.setdefault(_show(v, common), []).append(rank)
    shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}" for v, r in by_value.items())
    if all(isinstance(v, tuple) for v in values):  # which param makes the difference
        name = next(n for v in values for n in v if not all(n in w for w in values))  # type: ignore[union-attr]
        holders = [r for r, v in by_rank.items() if name in v]  # type: ignore[operator]
        shown += f" ({name!r} only on rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))})"
    raise ValueError(
        f"{where}: the ranks disagree on {label}: {shown}. Each matrix is updated once, on its owner, for every "
        f"rank, so a setting that changes the update must be the same everywhere: pass {_fix(label, where)} "
        "on every rank. Nothing was built or changed."
    )
