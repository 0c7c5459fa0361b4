"""DeepSpeed ZeRO stage 3 with dmuon (issue 34; [Note: DeepSpeed ZeRO-3] in
``dmuon/integrations/deepspeed/_zero3.py``): the dedicated params stay out of ZeRO-3's partitioning, hooks and
optimizer. On 2 and 4 gloo ranks, accumulation 1 and 2, DeepSpeed's ``gradient_clipping`` off and on, training
matches single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` (DeepSpeed's norm equals torch's over every
gradient), also for a model built under ``deepspeed.zero.Init`` (every param partitioned at construction); runs
where ZeRO-3 also averaged (partitioned) or stepped the dedicated params miss it.
``engine.save_checkpoint`` / ``load_checkpoint`` restart bit-identically, and the 2-rank checkpoint is refused on
4 ranks, on every rank, before anything changes. ``dmuon.get_model_state_dict`` gathers ZeRO-3's params and
``set_model_state_dict`` writes them back, ``engine.save_16bit_model`` writes the whole model; dmuon's full
optimizer dict (ZeRO-3's sub-groups' AdamW state gathered) loads into another engine bit for bit. One launch per
world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._asserts import assert_bitwise, assert_close_to, worst_weight
from tests._deepspeed import Run, build, build_zero_init, reduce_again, result, setup, step_too, train
from tests._dist import run_distributed
from tests._training import train_oracle

pytest.importorskip("deepspeed")

STEPS = 3
MAX_NORM = 0.5  # below the test model's gradient norms, so clipping really happens
RUNS = {2: [Run(3, 1, MAX_NORM)], 4: [Run(3, 2, MAX_NORM)]}  # accumulation 2 at 2 ranks: the restart
#: ZeRO-3 also averaging the dedicated gradients (what its reduce-scatter of a partitioned param does) or stepping
#: them with its AdamW
WRONG = [Run(3, 1, MAX_NORM, wrong="reduce"), Run(3, 1, wrong="step")]
#: DeepSpeed's norm against torch's on one process (the runs drift apart by bf16 rounding in NS; 7e-5 measured)
NORM_RTOL = 1e-3
RESTART = Run(3, 2, MAX_NORM)
#: what makes engine.save_16bit_model (zero3_save_16bit_model) write the whole model at stage 3
SAVE_16BIT = {"stage3_gather_16bit_weights_on_model_save": True}
#: the model built under deepspeed.zero.Init (every param partitioned at construction)
ZERO_INIT = Run(3, 2, MAX_NORM)


def _runs(rank: int, world: int, runs: list[Run]) -> dict:
    out = {}
    for run in runs:
        engine, model, opt = build(world, run)
        hook = {"reduce": lambda: reduce_again(model, world), "step": lambda: step_too(model, opt)}.get(run.wrong)
        out[run.name] = result(model, train(engine, model, rank, world, run, range(STEPS), hook and hook()))
    return out


def two_rank_job(rank: int, world: int, ckpt: str) -> dict:
    """The parity and wrong runs, then ZeRO-3 with accumulation and clipping: 2 steps, ``save_checkpoint``, 2 more;
    dmuon's model dict of that, set into a fresh engine; that engine loads the checkpoint and trains the same 2
    again. dmuon's full state dict of that engine, set into the fresh engine, reads back the same."""
    import dmuon

    setup(rank)
    out = _runs(rank, world, RUNS[world] + WRONG)
    engine, model, _, partitioned, kept = build_zero_init(world, ZERO_INIT)
    out["zero_init"] = result(model, train(engine, model, rank, world, ZERO_INIT, range(STEPS)))
    out["zero_init"]["partitioned"] = partitioned
    out["zero_init"]["refusal_kept_params"] = kept
    engine, model, opt = build(world, RESTART, zero_optimization={"stage": 3, **SAVE_16BIT})
    head = train(engine, model, rank, world, RESTART, range(2))
    engine.save_checkpoint(ckpt, tag="step2")
    tail = train(engine, model, rank, world, RESTART, range(2, 4))
    out["whole"] = result(model, {"losses": head["losses"] + tail["losses"]})
    full = dmuon.get_state_dict(model, opt)  # ZeRO-3's params, and its sub-groups' AdamW state, gathered whole
    sd = full["model"]
    out["model_sd"] = {k: v for k, v in sd.items()}
    engine.save_16bit_model(ckpt, "model16.bin")  # DeepSpeed's consolidated ZeRO-3 save (rank 0 writes)
    dist.barrier()
    out["model16"] = torch.load(f"{ckpt}/model16.bin", map_location="cpu", weights_only=False)
    engine, model, opt = build(world, RESTART)
    dmuon.set_state_dict(model, opt, full)  # into a fresh engine: ZeRO-3's slices and the owners' matrices
    out["set"] = result(model, {"losses": []})["weights"]
    again_sd = dmuon.get_optimizer_state_dict(model, opt)
    out["optim_differs"] = [f"{n}.{k}" for n, st in full["optim"]["state"].items() for k, v in st.items()
                            if not torch.equal(torch.as_tensor(again_sd["state"][n][k]), torch.as_tensor(v))]
    out["optim_keys"] = sorted(full["optim"]["state"])
    engine.load_checkpoint(ckpt, tag="step2")
    again = train(engine, model, rank, world, RESTART, range(2, 4))
    out["resumed"] = result(model, {"losses": head["losses"] + again["losses"]})
    return out


def four_rank_job(rank: int, world: int, ckpt: str) -> dict:
    """The 2-rank checkpoint refused before anything changes (every weight, gathered, as it was; the engine then
    trains like the oracle); then a model built under ``zero.Init`` trains like the oracle at 4 ranks too."""
    setup(rank)
    run = RUNS[world][0]
    engine, model, _ = build(world, run)
    before = result(model, {})["weights"]
    try:
        engine.load_checkpoint(ckpt, tag="step2")
        refused = ""
    except ValueError as e:
        refused = str(e)
    unchanged = [k for k, v in result(model, {})["weights"].items() if not torch.equal(v, before[k])]
    trained = result(model, train(engine, model, rank, world, run, range(STEPS)))
    engine, model, _, partitioned, _ = build_zero_init(world, ZERO_INIT)  # zero.Init at 4 ranks too
    zero_init = result(model, train(engine, model, rank, world, ZERO_INIT, range(STEPS)))
    zero_init["partitioned"] = partitioned
    return {run.name: trained, "refused": refused, "changed": unchanged, "zero_init": zero_init}


def _norm_error(run: dict, oracle: dict) -> float:
    return max(abs(a - b) / b for a, b in zip(run["norms"], oracle["norms"]))


def _check_parity(results: list[dict], runs: list[Run], oracles: dict, world: int) -> None:
    for run in runs:
        got = [r[run.name] for r in results]
        for r in got[1:]:  # every rank gathers the same params ZeRO-3 trains
            for name, t in r["local"].items():
                assert torch.equal(t, got[0]["local"][name]), (run.name, name)
        assert_close_to(got[0], oracles[run.clip], f"{world} ranks, {run.name}")
        if run.clip:
            assert _norm_error(got[0], oracles[run.clip]) <= NORM_RTOL, (run.name, got[0]["norms"])


def test_zero3_matches_the_oracle_restarts_and_refuses_another_world_size(tmp_path):
    ckpt = str(tmp_path)
    oracles = {0.0: train_oracle(STEPS), MAX_NORM: train_oracle(STEPS, max_norm=MAX_NORM)}
    results = run_distributed(two_rank_job, 2, ckpt)
    _check_parity(results, RUNS[2], oracles, 2)
    for run in WRONG:
        got, oracle = results[0][run.name], oracles[run.clip]
        losses = max(abs(a - b) / b for a, b in zip(got["losses"], oracle["losses"]))
        weights, _ = worst_weight(got["weights"], oracle["weights"])
        norms = _norm_error(got, oracle) if run.clip else 0.0
        print(f"{run.name}: losses {losses:.1e}, weights {weights:.1e}, norms {norms:.1e}")
        assert losses > 1e-4 or weights > 5e-3 or norms > NORM_RTOL, (run.name, losses, weights, norms)
    for r in results:
        assert_bitwise(r["resumed"], r["whole"], "ZeRO-3 restart")
    assert_close_to(results[0]["whole"], train_oracle(4, max_norm=MAX_NORM), "2 ranks, accumulation 2, clipping")
    for r in results:  # dmuon's model dict: every weight whole, and it loads into another engine bit for bit
        assert r["model_sd"].keys() == r["whole"]["weights"].keys()
        for k, v in r["whole"]["weights"].items():
            assert torch.equal(r["model_sd"][k], v) and torch.equal(r["set"][k], v), k
            assert torch.equal(r["model16"][k], v), k
        assert r["optim_keys"] == sorted(r["whole"]["weights"]), r["optim_keys"]  # every param's state
        assert r["optim_differs"] == [], r["optim_differs"]  # dmuon's full dicts round-trip bit for bit at ZeRO-3
    got = results[0]["zero_init"]
    assert got["partitioned"] == len(got["weights"]), "zero.Init did not partition every param"
    assert all(r["zero_init"]["refusal_kept_params"] for r in results), "a refused dedicate_params swapped params"
    assert_close_to(got, oracles[MAX_NORM], "2 ranks, zero.Init")
    assert _norm_error(got, oracles[MAX_NORM]) <= NORM_RTOL, got["norms"]
    tail = run_distributed(four_rank_job, 4, ckpt)
    _check_parity(tail, RUNS[4], oracles, 4)
    got = tail[0]["zero_init"]
    assert got["partitioned"] == len(got["weights"]), "zero.Init did not partition every param"
    assert_close_to(got, oracles[MAX_NORM], "4 ranks, zero.Init")
    assert _norm_error(got, oracles[MAX_NORM]) <= NORM_RTOL, got["norms"]
    for r in tail:
        assert "saved on 2 data-parallel ranks and this job has 4" in r["refused"], r["refused"]
        assert r["changed"] == [], r["changed"]
