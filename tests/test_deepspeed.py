"""DeepSpeed ZeRO-1/2 with dmuon (issue 26): ``deepspeed.initialize(model=model, optimizer=dmuon.Muon(model, ...))``
on 2 and 4 gloo ranks trains like single-process ``torch.optim.Muon`` + ``torch.optim.AdamW``: ZeRO stage 1 and 2,
accumulation 1 and 2, DeepSpeed's ``gradient_clipping`` off and on (its norm equals torch's over every gradient,
the dedicated ones included); the ranks' copies of ZeRO's params agree; runs where DeepSpeed also averaged or
stepped the dedicated params miss the oracle. An inf in a dedicated gradient skips the whole step."""

from __future__ import annotations

import math

import pytest
import torch

from tests._asserts import assert_close_to, worst_weight
from tests._deepspeed import Run, build, reduce_again, result, setup, step_too, train
from tests._dist import run_distributed
from tests._training import train_oracle

pytest.importorskip("deepspeed")

STEPS = 5
MAX_NORM = 0.5  # below the gradient norms of the test model, so clipping really happens
#: Every (stage, accumulation, clipping) combination once per world size, the complement at the other one.
RUNS = {
    2: [Run(1, 1), Run(1, 2, MAX_NORM), Run(2, 1, MAX_NORM), Run(2, 2)],
    4: [Run(1, 1, MAX_NORM), Run(1, 2), Run(2, 1), Run(2, 2, MAX_NORM)],
}
#: DeepSpeed's norm against torch's on one process (the runs drift apart by bf16 rounding in NS; 1e-4 measured)
NORM_RTOL = 1e-3
WRONG = [Run(2, 1, MAX_NORM, wrong="reduce"), Run(1, 1, wrong="step")]


def parity_job(rank: int, world: int, runs: list[Run]) -> dict:
    setup(rank)
    out = {}
    for run in runs:
        engine, model, opt = build(world, run)
        hook = {"reduce": lambda: reduce_again(model, world), "step": lambda: step_too(model, opt)}.get(run.wrong)
        out[run.name] = result(model, train(engine, model, rank, world, run, range(STEPS), hook and hook()))
    return out


@pytest.fixture(scope="module")
def oracles() -> dict[float, dict]:
    return {0.0: train_oracle(STEPS), MAX_NORM: train_oracle(STEPS, max_norm=MAX_NORM)}


def _norm_error(run: dict, oracle: dict) -> float:
    return max(abs(a - b) / b for a, b in zip(run["norms"], oracle["norms"]))


@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_the_oracle(oracles, world):
    runs = RUNS[world] + (WRONG if world == 2 else [])
    results = run_distributed(parity_job, world, runs)
    for run in RUNS[world]:
        got = [r[run.name] for r in results]
        oracle = oracles[run.clip]
        for r in got[1:]:  # every rank holds the same copy of each param ZeRO trains
            for name, t in r["local"].items():
                assert torch.equal(t, got[0]["local"][name]), (run.name, name)
        assert_close_to(got[0], oracle, f"{world} ranks, {run.name}")
        if run.clip:
            assert _norm_error(got[0], oracle) <= NORM_RTOL, (run.name, got[0]["norms"], oracle["norms"])
    for run in WRONG if world == 2 else []:
        got, oracle = results[0][run.name], oracles[run.clip]
        losses = max(abs(a - b) / b for a, b in zip(got["losses"], oracle["losses"]))
        weights, _ = worst_weight(got["weights"], oracle["weights"])
        norms = _norm_error(got, oracle) if run.clip else 0.0
        print(f"{run.name}: losses {losses:.1e}, weights {weights:.1e}, norms {norms:.1e}")
        # averaged twice, the dedicated gradients shrink: Muon and Adam do not care, the norm (so the clip) does
        assert losses > 1e-4 or weights > 5e-3 or norms > NORM_RTOL, (run.name, losses, weights, norms)


def overflow_job(rank: int, world: int, fp16: bool) -> dict:
    """An inf in one dedicated gradient (every rank's, so its owner's average) at step 1 of 3: the whole step is
    skipped, ZeRO's params and the dedicated ones alike; the steps around it apply. fp32: DeepSpeed's norm
    (which counts the dedicated gradients) is inf. fp16 (a static loss scale, so only the inf overflows):
    ZeRO's overflow check, which counts them too."""
    import deepspeed
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh

    from tests._deepspeed import config
    from tests._training import build_model, full_weights, muon_kwargs, projection_predicate

    setup(rank)
    run = Run(2, 1, MAX_NORM)
    torch.manual_seed(0)
    model = build_model().to(torch.float16 if fp16 else torch.float32)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False)
    opt = dmuon.Muon(model, **muon_kwargs(), master_dtype=torch.float32 if fp16 else None)
    extra = {"fp16": {"enabled": True, "loss_scale": 128.0}} if fp16 else {}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(
        world, stage=run.stage, accum=run.accum, clip=run.clip, **extra))
    changed, skipped, state = [], [], []
    for step in range(3):
        before = full_weights(model)
        handle = model.layers[0].attention.q_proj.weight.register_hook(lambda g: g * math.inf) if step == 1 else None
        train(engine, model, rank, world, run, range(step, step + 1))
        if handle is not None:
            handle.remove()
        after = full_weights(model)
        changed.append(sorted(n for n in after if not torch.equal(before[n], after[n])))
        skipped.append(engine.skipped_steps)
        state.append([v.double().sum().item() for st in opt.state.values() for v in st.values()])
    return {"changed": changed, "skipped": skipped, "names": sorted(after), "state": state}


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_an_inf_in_a_dedicated_gradient_skips_the_whole_step(fp16):
    for r in run_distributed(overflow_job, 2, fp16):
        assert r["skipped"] == [0, 1, 1], r["skipped"]
        assert r["changed"][1] == [], r["changed"][1]  # nothing moved, dedicated or ZeRO's
        assert r["changed"][0] == r["changed"][2] == r["names"]
        assert r["state"][1] == r["state"][0] != r["state"][2], "the skipped step changed dmuon's Muon state"


def _refused(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def misuse_job(rank: int, world: int) -> dict:
    """Each misuse raises on every rank before anything changes: afterwards a proper run of the same model and
    optimizer trains exactly like a fresh one."""
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh

    from tests._deepspeed import config
    from tests._training import build_model, muon_kwargs, projection_predicate

    deepspeed = setup(rank)
    run = Run(2, 1)
    model = build_model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False)
    opt = dmuon.Muon(model, **muon_kwargs())
    init = deepspeed.initialize
    out = {
        "zero3_offload": _refused(lambda: init(model=model, optimizer=opt, config=config(
            world, stage=3, accum=1, zero_optimization={"stage": 3, "offload_optimizer": {
                "device": "nvme", "nvme_path": "/nonexistent"}}))),
        "zero0_bf16": _refused(lambda: init(model=model, optimizer=opt, config=config(world, stage=0, accum=1,
                                                                                       bf16={"enabled": True}))),
        "adamw": _refused(lambda: init(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                       config=config(world, stage=2, accum=1))),
        "config_optimizer": _refused(lambda: init(model=model, config=config(
            world, stage=2, accum=1, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))),
        "bf16": _refused(lambda: init(model=model, optimizer=opt, config=config(world, stage=2, accum=1,
                                                                                bf16={"enabled": True}))),
    }
    engine, _, _, _ = init(model=model, optimizer=opt, config=config(world, stage=2, accum=1))
    out["losses"] = train(engine, model, rank, world, run, range(2))["losses"]
    out["no_sync"] = _refused(lambda: dmuon.no_sync(model).__enter__())
    out["clip"] = _refused(lambda: dmuon.clip_grad_norm_(model, 1.0))
    out["muon_step"] = _refused(opt.step)
    mesh = init_device_mesh("cpu", (world,))
    out["again"] = _refused(lambda: dmuon.dedicate_params(model, mesh, projection_predicate))
    plain = build_model()  # dedicate_params after deepspeed.initialize
    engine2, _, _, _ = init(model=plain, optimizer=torch.optim.AdamW(plain.parameters()),
                            config=config(world, stage=1, accum=1))
    out["dedicate_after"] = _refused(lambda: dmuon.dedicate_params(plain, mesh, projection_predicate))
    out["dedicate_engine"] = _refused(lambda: dmuon.dedicate_params(engine2, mesh, projection_predicate))
    fresh_engine, fresh, _ = build(world, run)
    out["fresh_losses"] = train(fresh_engine, fresh, rank, world, run, range(2))["losses"]
    return out


MISUSE = {
    "zero3_offload": "zero_optimization.offload_optimizer.device 'nvme' is not supported",
    "zero0_bf16": "ZeRO stage 0 in torch.bfloat16 runs DeepSpeed's FP16_UnfusedOptimizer",
    "adamw": "is inside a DeepSpeed optimizer group (optimizer=AdamW)",
    "config_optimizer": "is inside a DeepSpeed optimizer group (the config's 'optimizer' section",
    "bf16": "cast the model before dmuon.dedicate_params",
    "no_sync": "the DeepSpeed engine decides when gradients are averaged",
    "clip": "DeepSpeed clips itself",
    "muon_step": "engine.step() after engine.backward(loss)",
    "again": "already called on this model",
    "dedicate_after": "must run before deepspeed.initialize",
    "dedicate_engine": "must run before deepspeed.initialize",
}


def test_misuse_raises_on_every_rank_and_changes_nothing():
    results = run_distributed(misuse_job, 2)
    for r in results:
        for case, words in MISUSE.items():
            assert words in r[case], (case, r[case])
        assert r["losses"] == r["fresh_losses"], "a refused deepspeed.initialize changed the model or the optimizer"
    assert results[0]["zero3_offload"] == results[1]["zero3_offload"]
