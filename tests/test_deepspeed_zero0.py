"""DeepSpeed ZeRO stage 0 with dmuon (issue 34; [Note: DeepSpeed stage 0] in
``dmuon/integrations/deepspeed/_stage0.py``): on 2 and 4 gloo ranks, accumulation 1 and 2, DeepSpeed's
``gradient_clipping`` off and on, training matches single-process ``torch.optim.Muon`` + ``torch.optim.AdamW``
(DeepSpeed's norm equals torch's over every gradient); the run where the dedicated gradients are averaged once
more (what DeepSpeed's own stage-0 all-reduce does to every param it sees) misses. ``engine.save_checkpoint`` /
``load_checkpoint`` restart bit-identically, with every owner's Muon state in the one file rank 0 writes; dmuon's
full state dicts carry a stage-0 run from 2 ranks to 4; a 2-rank checkpoint is refused on 4 ranks, on every rank,
before anything changes."""

from __future__ import annotations

import pytest
import torch

from tests._asserts import assert_bitwise, assert_close_to, worst_weight
from tests._deepspeed import Run, build, reduce_again, result, setup, train
from tests._dist import run_distributed
from tests._training import full_weights, train_oracle

pytest.importorskip("deepspeed")

STEPS = 3
MAX_NORM = 0.5  # below the test model's gradient norms, so clipping really happens
RUNS = {2: [Run(0, 1, MAX_NORM), Run(0, 2)], 4: [Run(0, 2, MAX_NORM), Run(0, 1)]}
WRONG = Run(0, 1, MAX_NORM, wrong="reduce")
#: DeepSpeed's norm against torch's on one process (the runs drift apart by bf16 rounding in NS; 2e-5 measured)
NORM_RTOL = 1e-3


def parity_job(rank: int, world: int, runs: list[Run]) -> dict:
    setup(rank)
    out = {}
    for run in runs:
        engine, model, _ = build(world, run)
        hook = reduce_again(model, world) if run.wrong == "reduce" else None
        out[run.name] = result(model, train(engine, model, rank, world, run, range(STEPS), hook))
    return out


def _norm_error(run: dict, oracle: dict) -> float:
    return max(abs(a - b) / b for a, b in zip(run["norms"], oracle["norms"]))


@pytest.mark.parametrize("world", [2, 4])
def test_zero0_matches_the_oracle(world):
    runs = RUNS[world] + ([WRONG] if world == 2 else [])
    results = run_distributed(parity_job, world, runs)
    oracles = {0.0: train_oracle(STEPS), MAX_NORM: train_oracle(STEPS, max_norm=MAX_NORM)}
    for run in RUNS[world]:
        got = [r[run.name] for r in results]
        for r in got[1:]:  # every rank holds the same copy of each param DeepSpeed trains
            for name, t in r["local"].items():
                assert torch.equal(t, got[0]["local"][name]), (run.name, name)
        assert_close_to(got[0], oracles[run.clip], f"{world} ranks, {run.name}")
        if run.clip:
            assert _norm_error(got[0], oracles[run.clip]) <= NORM_RTOL, (run.name, got[0]["norms"])
    if world == 2:  # averaged twice, the dedicated gradients halve: the norm, so the clip factor, moves
        got, oracle = results[0][WRONG.name], oracles[MAX_NORM]
        weights, _ = worst_weight(got["weights"], oracle["weights"])
        print(f"{WRONG.name}: norms {_norm_error(got, oracle):.1e}, weights {weights:.1e}")
        assert _norm_error(got, oracle) > NORM_RTOL or weights > 5e-3


def restart_job(rank: int, world: int, ckpt: str) -> dict:
    """Stage 0, accumulation 2, clipping: 2 steps, ``save_checkpoint``, 2 more; a fresh engine loads and
    trains the same 2 again. Then the saved file, and dmuon's full dicts of step 2 for the 4-rank resume."""
    import dmuon

    setup(rank)
    run = Run(0, 2, MAX_NORM)
    engine, model, _ = build(world, run)
    head = train(engine, model, rank, world, run, range(2))
    engine.save_checkpoint(ckpt, tag="step2")
    tail = train(engine, model, rank, world, run, range(2, 4))
    whole = result(model, {"losses": head["losses"] + tail["losses"]})
    engine, model, opt = build(world, run)
    engine.load_checkpoint(ckpt, tag="step2")
    sd = dmuon.get_state_dict(model, opt)
    if rank == 0:
        torch.save(sd, f"{ckpt}/full.pt")
    again = train(engine, model, rank, world, run, range(2, 4))
    saved = torch.load(f"{ckpt}/step2/mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    parts = saved["optimizer"]["dmuon"]["parts"]
    return {"whole": whole, "resumed": result(model, {"losses": head["losses"] + again["losses"]}),
            "head": head["losses"], "parts": [(p["rank"], sorted(p["state"])) for p in parts]}


def resume_job(rank: int, world: int, ckpt: str) -> dict:
    """4 ranks: the 2-rank ``save_checkpoint`` is refused before anything changes; dmuon's full dicts load."""
    import dmuon

    setup(rank)
    run = Run(0, 2, MAX_NORM)
    engine, model, opt = build(world, run)
    before = full_weights(model)
    try:
        engine.load_checkpoint(ckpt, tag="step2")
        refused = ""
    except ValueError as e:
        refused = str(e)
    unchanged = all(torch.equal(t, before[n]) for n, t in full_weights(model).items())
    sd = torch.load(f"{ckpt}/full.pt", map_location="cpu", weights_only=False) if rank == 0 else {}
    dmuon.set_state_dict(model, opt, sd)
    return {"refused": refused, "unchanged": unchanged,
            **result(model, train(engine, model, rank, world, run, range(2, 4)))}


def test_zero0_restart_is_bit_identical_and_resumes_on_another_world_size(tmp_path):
    ckpt = str(tmp_path)
    results = run_distributed(restart_job, 2, ckpt)
    for r in results:
        assert_bitwise(r["resumed"], r["whole"], "stage 0 restart")
    owned = [sorted(n for n in results[0]["whole"]["weights"] if "proj" in n)]
    parts = results[0]["parts"]
    assert [rk for rk, _ in parts] == [0, 1], parts  # rank 0's file holds both owners' Muon state
    assert sorted(n for _, names in parts for n in names) == owned[0], parts
    tail = run_distributed(resume_job, 4, ckpt)
    oracle = train_oracle(4, max_norm=MAX_NORM)
    for r in tail:
        assert "saved on 2 data-parallel ranks and this job has 4" in r["refused"], r["refused"]
        assert r["unchanged"]
        assert_close_to({"losses": results[0]["head"] + r["losses"], "weights": r["weights"]}, oracle,
                        "stage 0, 2 ranks -> 4 ranks")
