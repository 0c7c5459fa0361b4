"""Settings agreed across ranks and empty or contradictory configuration (issue 31, items 4 and 5), on 2 gloo ranks.

Item 4 ([Note: settings agreement] in ``dmuon/optim/groups.py``): a setting that changes the update and differs
between ranks (QK-clip's ``tau``, ``master_dtype``, the constructor's ``lr``, a group's ``weight_decay``, the
head layout QK-clip found, a group added by ``add_param_group``) is refused on every rank naming the setting and
each rank's value, with the model's weights and a trained optimizer's state and groups untouched; the same
value spelled two ways is accepted; a value one rank alone refuses stops both ranks (no rank left waiting).

Item 5: a param group whose ``params`` name nothing is refused naming the group and the model's nearest names,
unless ``allow_empty_groups=True``; ``algorithm="adamw"`` is told where AdamW is chosen instead of being
offered 'adamw'.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import CFG, GLOBAL_BATCH, batches, full_weights, muon_kwargs, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
QCFG = replace(CFG, report_max_logits=True)
ATTN = "layers.0.attention"


def _model() -> TinyLlama:
    """The tiny Llama, reporting its attention maxima (QK-clip can run), its embedding frozen for now (so that
    ``add_param_group`` has something to add)."""
    mesh = init_device_mesh(DEVICE_TYPE, (2,))
    model = TinyLlama(QCFG)
    model.init_weights(0)
    model = model.to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    model.tok_embeddings.weight.requires_grad_(False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, rank: int) -> None:
    tok, tgt = batches(1)[0]
    per = GLOBAL_BATCH // 2
    opt.zero_grad()
    model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss.backward()
    opt.step()


def _snapshot(model, opt) -> tuple[dict, dict, list]:
    state = {id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)} for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return full_weights(model), state, groups


def _same(a: tuple[dict, dict, list], b: tuple[dict, dict, list]) -> bool:
    (wa, sa, ga), (wb, sb, gb) = a, b
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and sa.keys() == sb.keys()
            and all(sa[p].keys() == sb[p].keys() and all(torch.equal(sa[p][k], sb[p][k]) for k in sa[p]) for p in sa)
            and ga == gb)


def _attempt(fn) -> str | None:
    try:
        fn()
        return None
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _differing_heads(model, rank: int):
    """Rank 1 reads one key head for layer 0's attention (a layout that fits its matrices), rank 0 two."""
    if rank == 1:
        model.layers[0].attention.n_kv_heads = 1
    try:
        return dmuon.Muon(model, **muon_kwargs(), qk_clip=dmuon.QKClip(tau=8.0))
    finally:
        model.layers[0].attention.__dict__.pop("n_kv_heads", None)


def agreement_job(rank: int, world: int) -> dict:
    model = _model()
    opt = dmuon.Muon(model, **muon_kwargs(), qk_clip=dmuon.QKClip(tau=8.0),
                     param_groups=[{"name": "attn", "params": [n for n in dmuon.get_dedicated_params(model)
                                                               if ".attention." in n]}])
    _step(model, opt, rank)  # a trained optimizer, with state, whose model the refused builds must not touch
    kw = muon_kwargs()
    cases = {
        "tau": lambda: dmuon.Muon(model, **kw, qk_clip=dmuon.QKClip(tau=100.0 if rank == 0 else 8.0)),
        "qk_clip_on_rank0_only": lambda: dmuon.Muon(model, **kw, qk_clip=dmuon.QKClip() if rank == 0 else None),
        "master_dtype": lambda: dmuon.Muon(model, **kw, master_dtype=torch.float64 if rank == 0 else None),
        "lr": lambda: dmuon.Muon(model, **{**kw, "lr": 0.02 if rank == 0 else 0.01}),
        "group_weight_decay": lambda: dmuon.Muon(model, **kw, param_groups=[
            {"name": "attn", "params": [f"{ATTN}.q_proj.weight"], "weight_decay": 0.1 * rank}]),
        "heads": lambda: _differing_heads(model, rank),
        "add_param_group": lambda: opt.add_param_group({"params": ["tok_embeddings.weight"], "lr": 1e-3 * (rank + 1)}),
    }
    out, unchanged = {}, {}
    for case, fn in cases.items():
        before = _snapshot(model, opt)
        out[case] = _attempt(fn)
        unchanged[case] = _same(before, _snapshot(model, opt))
    # one value, two spellings: agreed
    spelled = _attempt(lambda: dmuon.Muon(model, **{**kw, "adjust_lr_fn": None if rank == 0 else "original",
                                                     "adamw_betas": (0.9, 0.999) if rank == 0 else [0.9, 0.999]}))
    _step(model, opt, rank)  # the first optimizer still trains
    return {"errors": out, "unchanged": unchanged, "spelled": spelled, "groups": len(opt.param_groups)}


def settings_jobs(rank: int, world: int) -> dict:
    """The disagreements, then the empty groups (``empty_job``), in one launch of 2 ranks."""
    return {"agreement": agreement_job(rank, world), "empty": empty_job(rank, world)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(settings_jobs, 2)


@pytest.fixture(scope="module")
def agreement(runs) -> list[dict]:
    return [r["agreement"] for r in runs]


#: each case: what every rank's error names (the setting, then each rank's value as shown)
EXPECTED = {
    "tau": ["the ranks disagree on qk_clip.tau: rank 0: 100.0; rank 1: 8.0", "the same dmuon.QKClip(...)"],
    "qk_clip_on_rank0_only": ["the ranks disagree on qk_clip: rank 0: dmuon.QKClip; rank 1: None"],
    "master_dtype": ["the ranks disagree on master_dtype: rank 0: torch.float64; rank 1: None",
                     "pass the same dmuon.Muon(..., master_dtype=...) on every rank"],
    "lr": ["the ranks disagree on lr: rank 0: 0.02; rank 1: 0.01", "dmuon.Muon(..., lr=...)"],
    "group_weight_decay": ["the ranks disagree on param group 'attn': weight_decay: rank 0: 0.0; rank 1: 0.1",
                           "the same param groups"],
    "heads": [f"the ranks disagree on qk_clip heads of {ATTN!r}: rank 0: ...", "n_heads=4, n_kv_heads=2, head_dim=32",
              "; rank 1: ...", "n_heads=4, n_kv_heads=1, head_dim=32"],
    "add_param_group": ["dmuon.Muon.add_param_group: the ranks disagree on param group 'group",
                        "': lr: rank 0: 0.001; rank 1: 0.002"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_a_setting_that_differs_is_refused_on_every_rank_and_nothing_changes(agreement, case):
    for rank, res in enumerate(agreement):
        got = res["errors"][case]
        assert got is not None and got.startswith("ValueError") and all(t in got for t in EXPECTED[case]), (rank, got)
        assert "Nothing was built or changed" in got, got
        assert res["unchanged"][case], (rank, case)


def test_only_what_differs_is_refused_and_the_optimizer_trains_on(agreement):
    for res in agreement:
        assert res["errors"]["tau"] is not None  # refused ...
        assert res["spelled"] is None, res["spelled"]  # ... but one value spelled two ways agrees
        assert res["groups"] == 4  # 'attn' (one Muon group) + the three defaults: the refused add added nothing


def one_rank_refuses_job(rank: int, world: int) -> dict:
    model = _model()
    kw = muon_kwargs()
    out = {"lr": _attempt(lambda: dmuon.Muon(model, **{**kw, "lr": -1.0 if rank == 1 else 0.02})),
           "master_dtype": _attempt(lambda: dmuon.Muon(model, **kw, master_dtype=torch.int32 if rank == 1 else None))}
    out["still_builds"] = _attempt(lambda: dmuon.Muon(model, **kw))  # and no gather is left half-entered
    return out


def test_a_setting_one_rank_refuses_stops_every_rank():
    # a short timeout: a rank that raised before the agreement would leave the other waiting in it
    r0, r1 = run_distributed(one_rank_refuses_job, 2, pg_timeout=timedelta(seconds=30))
    assert r1["lr"].startswith("ValueError: dmuon.Muon: lr must be"), r1
    assert r0["lr"].startswith("ValueError: dmuon.Muon refused on rank 1: ValueError: dmuon.Muon: lr must be"), r0
    assert r1["master_dtype"].startswith("ValueError: dmuon.Muon: master_dtype must be a floating-point"), r1
    assert "dmuon.Muon refused on rank 1" in r0["master_dtype"], r0
    assert r0["still_builds"] is None and r1["still_builds"] is None


# --------------------------------------------------------------------------------------------------- #
# Item 5: empty or contradictory configuration                                                         #
# --------------------------------------------------------------------------------------------------- #
def empty_job(rank: int, world: int) -> dict:
    model = _model()
    kw = muon_kwargs()
    dedicated = dmuon.get_dedicated_params(model)
    ffn = [n for n in dedicated if ".ffn." in n]  # a filter written for another model's names: matches nothing
    out = {
        "normuon_guide": _attempt(lambda: dmuon.Muon(model, **kw, param_groups=[
            {"params": ffn, "algorithm": "normuon", "lr": 0.01}])),
        "named": _attempt(lambda: dmuon.Muon(model, **kw, param_groups=[{"name": "mlps", "params": ffn}])),
        "adamw_group": _attempt(lambda: dmuon.Muon(model, **kw, param_groups=[{"params": [], "use_muon": False}])),
        "adamw_algorithm": _attempt(lambda: dmuon.Muon(model, **{**kw, "algorithm": "adamw"})),
        "adam_algorithm": _attempt(lambda: dmuon.Muon(model, **{**kw, "algorithm": "Adam"})),
    }
    opt = dmuon.Muon(model, **kw, allow_empty_groups=True,
                     param_groups=[{"name": "ffn", "params": ffn, "algorithm": "normuon"}])
    model.tok_embeddings.weight.requires_grad_(True)
    out["add_empty"] = _attempt(lambda: opt.add_param_group({"params": []}))
    _step(model, opt, rank)
    strict = dmuon.Muon(model, **kw)
    out["add_empty_strict"] = _attempt(lambda: strict.add_param_group({"name": "later", "params": ffn}))
    out["opted_in"] = [(g["name"], g["kind"], len(g["params"])) for g in opt.param_groups]
    return out


@pytest.fixture(scope="module")
def empty(runs) -> list[dict]:
    return [r["empty"] for r in runs]


def test_a_group_that_names_nothing_is_refused_with_the_nearest_names(empty):
    for res in empty:
        got = res["normuon_guide"]
        assert got.startswith("ValueError: dmuon.Muon: param group 0 ('group0'): 'params' names no parameter"), got
        # a NorMuon group: the model's dedicated matrices, one name per pattern
        assert "dedicated matrices include: 'layers.0.attention.q_proj.weight'" in got, got
        assert "'layers.0.mlp.gate_proj.weight'" in got and "norm" not in got.split("include")[1], got
        assert "allow_empty_groups=True" in got, got
        named = res["named"]  # a named group: the names nearest its name
        assert "param group 0 ('mlps')" in named and "names nearest 'mlps': 'layers.0.mlp." in named, named
        assert "non-dedicated params include: 'tok_embeddings.weight'" not in res["adamw_group"]  # frozen
        assert "non-dedicated params include: 'layers.0.attention_norm.weight'" in res["adamw_group"], res
        assert "param group 3 ('later'): 'params' names no parameter" in res["add_empty_strict"], res


def test_allow_empty_groups_keeps_an_empty_group_and_trains(empty):
    for res in empty:
        assert res["opted_in"][0] == ("ffn", "muon", 0), res["opted_in"]
        assert res["add_empty"] is None, res["add_empty"]


def test_adamw_is_not_offered_as_a_muon_algorithm(empty):
    for res in empty:
        for case in ("adamw_algorithm", "adam_algorithm"):
            got = res[case]
            assert got.startswith("ValueError: dmuon.Muon: algorithm=") and "is not a Muon algorithm" in got, got
            assert "Did you mean" not in got and "use_muon': False" in got and "'adamw_owner'" in got, got
