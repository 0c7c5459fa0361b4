"""NorMuon and cautious weight decay on the dense test model, 2 and 4 gloo ranks, against single-process oracles
written from the papers' formulas (``dmuon/optim/normuon_reference.py``, ``muon_reference.py``).

One job per world size trains: NorMuon under Z3 (saving a full and a DCP checkpoint at step 5 at 2 ranks) and
Z2, NorMuon and Muon with cautious weight decay, and plain Muon; then resumes the 2-rank checkpoint (rank-0 full
dict and DCP) in fresh processes of both sizes. Each run must match its own oracle, and the wrong variants must
miss theirs: plain Muon misses NorMuon's, each run without cautious decay misses the cautious oracle. The misuse
of the new keys raises on every rank before anything is built.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.optim import NorMuonHParams
from tests._asserts import WEIGHT_RTOL, assert_bitwise, assert_close_to, rel_err, worst_weight
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import ADAMW_HP, GLOBAL_BATCH, KJ, MUON_HP, batches, build_model, full_weights, muon_kwargs, \
    projection_predicate
from tests._variants import reference_optimizer

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT = 10, 5
#: decay large enough that the cautious mask moves the weights well past the parity bounds within 10 steps
WD = 0.2
NOR = NorMuonHParams(lr=0.01, weight_decay=WD, ns_coefficients=KJ, ns_backend="direct")
RUNS = {
    "normuon": NOR,
    "normuon_cautious": replace(NOR, cautious_weight_decay=True),
    "muon_cautious": replace(MUON_HP, weight_decay=WD, cautious_weight_decay=True),
    "muon": replace(MUON_HP, weight_decay=WD),
}


# --------------------------------------------------------------------------------------------------- #
# Worker side                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _setup(world: int, hp, *, z3: bool = True, seed: int = 0):
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model(seed).to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    return model, dmuon.Muon(model, **muon_kwargs(hp))


def _train(model, opt, rank: int, world: int, steps: range, save_to: str | None = None) -> list[float]:
    """custom-loop.md's loop on the oracle's global batches; ``save_to``: the checkpoints at ``SAVE_AT``."""
    per, losses = GLOBAL_BATCH // world, []
    for step in steps:
        if step == SAVE_AT and save_to is not None:
            full = dmuon.get_state_dict(model, opt)
            if rank == 0:
                torch.save(full, os.path.join(save_to, "full.pt"))
            dist.barrier()
            dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(save_to, "dcp"))
        tok, tgt = batches(STEPS)[step]
        opt.zero_grad()
        loss = model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return losses


def _run(rank: int, world: int, hp, *, z3: bool = True, save_to: str | None = None) -> dict:
    model, opt = _setup(world, hp, z3=z3)
    losses = _train(model, opt, rank, world, range(STEPS), save_to)
    return {"losses": losses, "weights": full_weights(model)}


def _resume(rank: int, world: int, ckpt: str, form: str) -> dict:
    """A fresh model (another init, to prove the load) from the step-5 checkpoint, trained to the end."""
    model, opt = _setup(world, NOR, seed=123)
    if form == "full":  # rank 0 only
        sd = torch.load(os.path.join(ckpt, "full.pt"), map_location="cpu", weights_only=False) if rank == 0 else {}
        dmuon.set_state_dict(model, opt, sd)
    else:
        target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
        dcp.load(target, checkpoint_id=os.path.join(ckpt, "dcp"))
        dmuon.set_state_dict(model, opt, target)
    losses = _train(model, opt, rank, world, range(SAVE_AT, STEPS))
    return {"losses": losses, "weights": full_weights(model)}


def _misuse(rank: int, world: int) -> dict[str, str | None]:
    model, _ = _setup(world, MUON_HP)
    q = "layers.0.attention.q_proj.weight"
    cases = {
        "unknown_algorithm": dict(algorithm="nor_muon"),
        "unknown_in_group": dict(param_groups=[{"params": [q], "algorithm": "NorMuom"}]),
        "normuon_on_adamw_param": dict(param_groups=[{"params": ["tok_embeddings.weight"], "algorithm": "normuon"}]),
        "normuon_on_norm": dict(param_groups=[{"params": ["norm.weight"], "algorithm": "normuon"}]),
        "normuon_key_in_muon_group": dict(param_groups=[{"params": [q], "beta2": 0.9}]),
        "cautious_in_adamw_group": dict(param_groups=[{"params": ["norm.weight"], "cautious_weight_decay": True}]),
        "contradiction": dict(param_groups=[{"params": [q], "algorithm": "normuon", "use_muon": False}]),
        "bad_beta2": dict(beta2=1.5),
        "on_rank1_only": dict(param_groups=[{"params": [q], "algorithm": "normuon" if rank == 0 else "normun"}]),
    }
    out: dict[str, str | None] = {}
    for case, kwargs in cases.items():
        try:
            dmuon.Muon(model, **{**muon_kwargs(MUON_HP), **kwargs})
            out[case] = None
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


def variants_job(rank: int, world: int, ckpt: str) -> dict:
    out = {name: _run(rank, world, hp, save_to=ckpt if (name == "normuon" and world == 2) else None)
           for name, hp in RUNS.items()}
    out["normuon_z2"] = _run(rank, world, NOR, z3=False)
    out["from_full"] = _resume(rank, world, ckpt, "full")
    out["from_dcp"] = _resume(rank, world, ckpt, "dcp")
    if world == 2:
        out["misuse"] = _misuse(rank, world)
        model, opt = _setup(world, MUON_HP)  # a NorMuon checkpoint into a Muon optimizer
        try:
            sd = torch.load(os.path.join(ckpt, "full.pt"), map_location="cpu", weights_only=False)
            dmuon.set_state_dict(model, opt, sd)
            out["wrong_algorithm"] = None
        except ValueError as e:
            out["wrong_algorithm"] = str(e)
    return out


# --------------------------------------------------------------------------------------------------- #
# Oracles                                                                                              #
# --------------------------------------------------------------------------------------------------- #
@rank_threads()
def oracle(hp, steps: int = STEPS) -> dict:
    """One process: the reference of ``hp``'s algorithm on the projections, torch's AdamW on the rest; the
    per-row second moments at ``SAVE_AT``."""
    model = build_model().to(device())
    named = dict(model.named_parameters())
    muon = {n: p for n, p in named.items() if projection_predicate(n, p)}
    opt_m = reference_optimizer(list(muon.values()), hp)
    opt_a = torch.optim.AdamW([p for n, p in named.items() if n not in muon], **ADAMW_HP.group_entries())
    losses, moments = [], {}
    for step, (tok, tgt) in enumerate(batches(steps)):
        if step == SAVE_AT and hp.ALGORITHM == "normuon":
            moments = {n: opt_m.state[p]["row_second_moment"].clone().cpu() for n, p in muon.items()}
        opt_m.zero_grad()
        opt_a.zero_grad()
        loss = model(tok.to(device()), tgt.to(device())).loss
        loss.backward()
        opt_m.step()
        opt_a.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "moments": moments}


@pytest.fixture(scope="module")
def oracles() -> dict:
    return {name: oracle(hp) for name, hp in RUNS.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("normuon_ckpt"))


@pytest.fixture(scope="module")
def two(ckpt) -> list[dict]:
    return run_distributed(variants_job, 2, ckpt)


@pytest.fixture(scope="module")
def four(ckpt, two) -> list[dict]:  # resumes the 2-rank checkpoint
    return run_distributed(variants_job, 4, ckpt)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request) -> tuple[int, list[dict]]:
    return request.param, request.getfixturevalue("two" if request.param == 2 else "four")


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", list(RUNS))
def test_matches_its_oracle_on_every_rank(runs, oracles, name):
    world, results = runs
    assert_close_to(results[0][name], oracles[name], f"world {world} {name}")
    for rank, res in enumerate(results[1:], start=1):
        assert_bitwise(res[name], results[0][name], f"world {world} {name} rank {rank}")


@pytest.mark.parametrize("wrong, oracle_of", [("muon", "normuon"), ("normuon", "normuon_cautious"),
                                              ("muon", "muon_cautious")])
def test_the_wrong_variant_misses_the_oracle(runs, oracles, wrong, oracle_of):
    world, results = runs
    with pytest.raises(AssertionError):
        assert_close_to(results[0][wrong], oracles[oracle_of], f"world {world} {wrong} vs {oracle_of}'s oracle")


def test_z2_equals_z3_bitwise(runs):
    world, results = runs
    for rank, res in enumerate(results):
        assert_bitwise(res["normuon_z2"], res["normuon"], f"world {world} rank {rank}")


@pytest.mark.parametrize("form", ["from_full", "from_dcp"])
def test_restart_is_bit_identical_and_resumes_across_topologies(runs, form):
    world, results = runs
    r, base = results[0][form], results[0]["normuon"]
    tail = {"losses": base["losses"][SAVE_AT:], "weights": base["weights"]}
    if world == 2:  # the very run that saved
        assert_bitwise(r, tail, f"{form}: restart")
    else:  # saved at 2 ranks, resumed at 4: within the parity bounds of the 4-rank uninterrupted run
        assert_close_to(r, tail, f"{form}: 2 ranks -> 4")


def test_checkpoint_carries_the_second_moment_in_full(ckpt, two, oracles):
    sd = torch.load(os.path.join(ckpt, "full.pt"), map_location="cpu", weights_only=False)["optim"]
    want = oracles["normuon"]["moments"]
    assert want and {g["algorithm"] for g in sd["param_groups"] if g["kind"] == "muon"} == {"normuon"}
    for name, v in want.items():
        got = sd["state"][name]["row_second_moment"]
        assert got.shape == v.shape == (sd["state"][name]["momentum_buffer"].shape[0], 1) and got.dtype == torch.float32
        assert rel_err(got, v) < 1e-2, (name, rel_err(got, v))


def test_a_checkpoint_of_another_algorithm_is_refused(two):
    for res in two:
        assert "algorithm 'normuon' != 'muon'" in res["wrong_algorithm"], res["wrong_algorithm"]


MISUSE = {
    "unknown_algorithm": "ValueError: dmuon.Muon: unknown algorithm 'nor_muon'",
    "unknown_in_group": "unknown algorithm 'NorMuom'; Muon params take ['muon', 'normuon'] (and 'adamw' for the "
                        "others). Did you mean 'normuon'",
    "normuon_on_adamw_param": "algorithm='normuon' but 'tok_embeddings.weight' cannot take NorMuon: it is not "
                              "dedicated",
    "normuon_on_norm": "cannot take NorMuon: it is 1-D",
    "normuon_key_in_muon_group": "unknown key(s) ['beta2'] for a Muon group (beta2 is NorMuon's)",
    "cautious_in_adamw_group": "unknown key(s) ['cautious_weight_decay'] for an AdamW group (cautious_weight_decay is "
                               "Muon's)",
    "contradiction": "use_muon=False contradicts algorithm='normuon'",
    "bad_beta2": "beta2 must be a number in [0, 1), got 1.5",
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_raises_a_clear_error_on_every_rank(two, case):
    for rank, res in enumerate(two):
        got = res["misuse"][case]
        assert got is not None and MISUSE[case] in got, (rank, got)


def test_a_bad_algorithm_on_one_rank_raises_on_every_rank(two):
    assert "unknown algorithm 'normun'" in two[1]["misuse"]["on_rank1_only"]
    assert "param_groups refused on rank 1" in two[0]["misuse"]["on_rank1_only"]


def test_cautious_decay_changes_the_run(two):
    """The switch does something at this scale (else the wrong-variant tests above would prove nothing)."""
    err, key = worst_weight(two[0]["normuon_cautious"]["weights"], two[0]["normuon"]["weights"])
    assert err > 2 * WEIGHT_RTOL, (err, key)  # measured: 1.3e-2 (CPU, torch 2.13)
