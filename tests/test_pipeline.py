"""Pipeline parallelism: every rank holds one stage, dedicated over its stage's ``mesh["dp"]``, trained by torch's
own ``PipelineStage`` and schedules (1F1B, GPipe; interleaved 1F1B and looped BFS with two stage modules per rank,
four virtual stages), against the whole model on one process (``torch.optim.Muon`` + ``torch.optim.AdamW``). Two
jobs: pp 2 x dp 1 (2 ranks) and pp 2 x dp 2 (4 ranks), each running every scenario on one process group; the
misuse cases run inside the 4-rank job.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.pipelining
import torch.nn as nn

import dmuon
from dmuon.tools.models import projection_predicate
from tests._asserts import WEIGHT_RTOL, assert_bitwise, assert_close_to, rel_err, worst_weight
from tests._dist import run_distributed
from tests._pipeline import (CFG_V, LAYERS, MULTI, Scenario, Stage, build_model, build_stage, lm_loss, logits_of, merge,
                             oracle, pipeline_job)
from tests._training import CFG, GLOBAL_BATCH, batches, full_weights

STEPS = 3
#: below every stage's own gradient norm and the total (7.2-7.5 over these steps): every step clips
MAX_NORM = 1.0
SCENARIOS = [Scenario("1f1b", steps=STEPS), Scenario("1f1b_z2", reshard_after_forward=False, steps=STEPS),
             Scenario("gpipe", schedule="gpipe", steps=STEPS), Scenario("interleaved", "interleaved", steps=STEPS),
             Scenario("interleaved_z2", "interleaved", reshard_after_forward=False, steps=STEPS)]
#: torchtitan's clip call: torch's clip over the parameters of both stage modules
TORCH_CLIP = [Scenario("interleaved_torch_clip", "interleaved", max_norm=MAX_NORM, torch_clip=True, steps=STEPS),
              Scenario("interleaved_qk", "interleaved", qk_clip=True, steps=STEPS)]
#: torch's zero-bubble schedules (each backward split into an input and a later weight pass), two stage modules
#: per rank; DualPipeV wants at least as many microbatches as stages (four), where this torch has it
HAS_DUALPIPEV = hasattr(torch.distributed.pipelining, "ScheduleDualPipeV")
ZB_PP2DP1 = [Scenario("zb", "zb", steps=STEPS)] + (
    [Scenario("dualpipev", "dualpipev", microbatches=4, steps=STEPS)] if HAS_DUALPIPEV else [])
ZB_PP2DP2 = [Scenario("zb", "zb", steps=STEPS), Scenario("zb_z2", "zb", reshard_after_forward=False, steps=STEPS),
             Scenario("zbv", "zbv", steps=STEPS)]
EXTRA = [Scenario("clip", max_norm=MAX_NORM, steps=STEPS), Scenario("accum", accum=2, steps=STEPS),
         Scenario("looped_bfs", "looped_bfs", steps=STEPS),
         Scenario("interleaved_clip", "interleaved", max_norm=MAX_NORM, steps=STEPS),
         Scenario("interleaved_accum", "interleaved", accum=2, steps=STEPS),
         Scenario("qk", qk_clip=True, steps=STEPS),
         Scenario("interleaved_summary", "interleaved", summary=True, steps=1)]


def _unchanged(model: nn.Module) -> bool:
    """Nothing dmuon does happened to ``model``: no state, no param marked or emptied."""
    return (getattr(model, "_dmuon_state", None) is None
            and not any(hasattr(p, "_dedicated_owner_rank") or p.untyped_storage().nbytes() == 0
                        for p in model.parameters()))


def misuse_cases(mesh) -> dict:
    """Each misuse attempted on every rank: ``(error type, message, model unchanged)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    out = {}

    def attempt(case: str, fn, *, shard_first: bool = False) -> None:
        stage = Stage(build_model(), LAYERS[pp_rank], first=pp_rank == 0, last=pp_rank == pp - 1)
        if shard_first:  # the last stage only: wrapped before dedicate_params
            fully_shard(stage, mesh=mesh["dp"])
        try:
            fn(stage)
        except Exception as e:  # noqa: BLE001 - recorded and checked by the test
            out[case] = (type(e).__name__, str(e), shard_first or _unchanged(stage))
        else:
            out[case] = ("no error", "", False)

    attempt("pp_mesh", lambda s: dmuon.dedicate_params(s, mesh["pp"], projection_predicate))
    world = init_device_mesh("cpu", (mesh.size(),))
    attempt("world_mesh", lambda s: dmuon.dedicate_params(s, world, projection_predicate))
    attempt("after_fully_shard", lambda s: dmuon.dedicate_params(s, mesh["dp"], projection_predicate),
            shard_first=pp_rank == pp - 1)
    out["qk_silent_stage"] = _qk_step_with_one_silent_stage(mesh)
    out["self_view"] = _self_view_read_outside_window(mesh)
    return {"misuse": out}


def _self_view_read_outside_window(mesh) -> tuple[str, str, bool]:
    """``p.view_as(p)`` (torch's zero-bubble passes take one of every param) passes after a Z3 forward, outside
    the window, on owner and non-owner alike; reading the view raises on every rank, as reading ``p`` does."""
    pp_rank = mesh["pp"].get_local_rank()
    model, _ = build_stage(mesh)
    tok = batches(1)[0][0][:1]
    model(tok if pp_rank == 0 else torch.zeros(1, tok.shape[1], CFG.dim))  # the pass stays open for the backward
    p = dict(model.named_parameters())[sorted(dmuon.get_dedicated_params(model))[0]]
    try:
        view = p.view_as(p)
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test: the view itself must pass
        return f"view_as raised {type(e).__name__}", str(e), False
    try:
        view.sum()
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test
        return type(e).__name__, str(e), True
    return "no error", "", False


def _qk_step_with_one_silent_stage(mesh) -> tuple[str, str, bool]:
    """QK-clip on both stages, but only stage 0's attention reports (stage 1 runs plain SDPA): the step is
    refused on every rank of both stages, with no weight changed."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model, opt = build_stage(mesh, qk_clip=True)
    if pp_rank == 1:
        for layer in model.layers.values():
            layer.attention.cfg = replace(layer.attention.cfg, report_max_logits=False)
    pipe = PipelineStage(model, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=2, loss_fn=lm_loss)
    tok, tgt = batches(1)[0]
    per = GLOBAL_BATCH // mesh["dp"].size()
    tok, tgt = tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]
    schedule.step(tok) if pp_rank == 0 else schedule.step(target=tgt, losses=[])
    before = full_weights(model)
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - recorded and checked by the test
        after = full_weights(model)
        return type(e).__name__, str(e), all(torch.equal(v, after[k]) for k, v in before.items())
    return "no error", "", False


@pytest.fixture(scope="module")
def pp2dp1() -> list[dict]:
    return run_distributed(pipeline_job, 2, 2, SCENARIOS + TORCH_CLIP + ZB_PP2DP1)


@pytest.fixture(scope="module")
def pp2dp2() -> list[dict]:
    return run_distributed(pipeline_job, 4, 2, SCENARIOS + EXTRA + ZB_PP2DP2, misuse_cases)


@pytest.fixture(scope="module")
def ref() -> dict:
    return oracle(STEPS)


@pytest.fixture(scope="module")
def ref_v() -> dict:
    """The oracle of the schedules with several stages per rank (four layers)."""
    return oracle(STEPS, cfg=CFG_V)


def _job(request, name: str) -> list[dict]:
    return request.getfixturevalue(name)


@pytest.mark.parametrize("job, schedule", [(j, s) for j in ("pp2dp1", "pp2dp2") for s in ("1f1b", "gpipe", "interleaved", "zb")]
                         + [("pp2dp2", "looped_bfs"), ("pp2dp2", "zbv")]
                         + [pytest.param("pp2dp1", "dualpipev", marks=pytest.mark.skipif(
                             not HAS_DUALPIPEV, reason="this torch has no ScheduleDualPipeV"))])
def test_parity_with_single_process_muon(request, job, schedule):
    run = merge(_job(request, job), schedule)
    ref = request.getfixturevalue("ref_v" if schedule in MULTI else "ref")
    assert_close_to(run, ref, f"{job} {schedule}")
    err = rel_err(logits_of(run["weights"], CFG_V if schedule in MULTI else CFG), ref["logits"])
    assert err <= WEIGHT_RTOL, f"{job} {schedule}: logits off by {err:.2e}"


@pytest.mark.parametrize("job, schedule", [(j, s) for j in ("pp2dp1", "pp2dp2") for s in ("1f1b", "interleaved")]
                         + [("pp2dp2", "zb")])
def test_z2_equals_z3_bit_for_bit(request, job, schedule):
    results = _job(request, job)
    assert_bitwise(merge(results, f"{schedule}_z2"), merge(results, schedule), f"{job} {schedule} Z2 vs Z3")


def test_one_reduce_per_step_and_broadcasts_no_more_than_fsdp2(pp2dp2):
    """The dedicated gradients accumulate over the microbatches (FSDP2's sync switch, which the schedule turns
    off) and are reduced once per step: P elements, where one reduce per microbatch would be 2 P. Under Z2 the
    weights are broadcast once per step (the schedule keeps FSDP2's gathered between microbatches; step 0 adds
    the schedule's metadata pass); under Z3 once per microbatch and pass, at most (FSDP2 gathers as often). With
    two stage modules per rank (interleaved 1F1B, looped BFS) the counts and P add both modules': the same
    bounds, each module's weights broadcast no more often than under 1F1B. The zero-bubble schedules too: their
    weight passes assign the gradients torch computes later, and still one reduce of P closes the step."""
    for r in pp2dp2:
        for name in ("1f1b", "1f1b_z2", "gpipe", "clip", "accum", "interleaved", "interleaved_z2", "looped_bfs",
                     "interleaved_clip", "interleaved_accum", "zb", "zb_z2", "zbv"):
            run = r[name]
            P = run["P"]
            for step, (reduced, _, fwd, bwd) in enumerate(run["reduces"]):
                assert reduced == P, f"{name} step {step}: reduced {reduced} elements, P = {P}"
                if name.endswith("_z2") and step > 0:
                    assert (fwd, bwd) == (P, 0), f"{name} step {step}: broadcast {fwd} + {bwd}, P = {P}"
                if name in ("1f1b", "gpipe", "interleaved", "looped_bfs", "zb", "zbv") and step > 0:
                    assert fwd + bwd == 3 * P, f"{name} step {step}: broadcast {fwd} + {bwd}, P = {P}"


@pytest.mark.parametrize("job, name", [("pp2dp2", "clip"), ("pp2dp2", "interleaved_clip"),
                                       ("pp2dp1", "interleaved_torch_clip")])
def test_clip_over_every_stage(request, job, name):
    """One total norm over every stage's FSDP2 shards and dedicated gradients (with two stage modules per rank:
    one ``dmuon.clip_grad_norm_`` over both), the same on every rank, as torch's on the whole model; what
    clipping leaves has the norm max_norm. Each stage clipping by its own norm (or each rank's stage module
    apart: stages 0-1 and 2-3 by their own norms) is the wrong variant: it leaves about sqrt(2) max_norm, and
    moves the weights less than the bounds can see (Muon and AdamW barely feel a gradient's scale), so the
    clipped norm is what tells it apart."""
    results = _job(request, job)
    cfg = CFG_V if name.startswith("interleaved") else CFG
    run = merge(results, name)
    want = oracle(STEPS, max_norm=MAX_NORM, cfg=cfg)
    wrong = oracle(STEPS, max_norm=MAX_NORM, per_stage_clip=True, cfg=cfg)
    assert len(run["norms"]) == STEPS
    for r in results:  # every rank of every stage saw the same norms
        assert (r[name]["norms"], r[name]["clipped"]) == (run["norms"], run["clipped"])
    for step in range(STEPS):
        got, exp = run["norms"][step], want["norms"][step]
        assert abs(got - exp) <= 1e-4 * exp, f"step {step}: norm {got} vs {exp}"
        got, exp, bad = run["clipped"][step], want["clipped"][step], wrong["clipped"][step]
        assert abs(got - exp) <= 1e-4 * exp, f"step {step}: clipped to {got}, torch clips to {exp}"
        assert abs(got - bad) > 0.3 * exp, f"step {step}: per-stage clipping ({bad}) not told apart from {got}"
    assert_close_to(run, want, name)


@pytest.mark.parametrize("name", ["accum", "interleaved_accum"])
def test_accumulation_over_schedule_steps(request, pp2dp2, name):
    ref = request.getfixturevalue("ref_v" if name == "interleaved_accum" else "ref")
    assert_close_to(merge(pp2dp2, name), ref, f"{name}: two schedule steps per optimizer step")


@pytest.mark.parametrize("case, needle", [
    ("pp_mesh", "not mesh['pp']"),
    ("world_mesh", "hold different params"),
    ("after_fully_shard", "before fully_shard"),
    ("qk_silent_stage", "no attention module reported"),
    ("self_view", "outside the window of its hook boundary"),
])
def test_misuse_refused_on_every_rank(pp2dp2, case, needle):
    for rank, r in enumerate(pp2dp2):
        kind, message, unchanged = r["misuse"][case]
        want = {"qk_silent_stage": "RuntimeError", "self_view": "OutsideBoundaryError"}.get(case, "ValueError")
        assert kind == want, f"rank {rank} {case}: {kind}: {message}"
        assert needle in message, f"rank {rank} {case}: {message!r} does not mention {needle!r}"
        assert unchanged, f"rank {rank} {case}: the model changed although the call failed"


@pytest.mark.parametrize("job, name", [("pp2dp2", "qk"), ("pp2dp1", "interleaved_qk")])
def test_qk_clip_per_stage(request, job, name):
    """QK-clip under stages: each stage gathers its own attention modules' maxima (over its data-parallel
    ranks) and clips their heads; query head 0 of every layer starts far above tau, so at the first step every
    stage clips one head per layer it holds (torch's shape-inference forward on empty tensors reports nothing:
    [Note: pipeline shape inference]), and the run matches a single process clipping by hand after each step."""
    results = _job(request, job)
    cfg = CFG_V if name.startswith("interleaved") else CFG
    ref = oracle(STEPS, cfg=cfg, qk_clip=True)
    assert_close_to(merge(results, name), ref, name)
    seen: set[str] = set()
    for r in results:
        for clipped, modules in r[name]["qk"][0]:  # each stage module: its own layers' attention, head 0 clipped
            assert modules and clipped == len(modules), (r[name]["pp_rank"], modules, clipped)
            seen.update(modules)
    assert seen == {f"layers.{i}.attention" for i in range(cfg.n_layers)}, seen


def test_diagnostics_summarize_each_stage(pp2dp2):
    """``dmuon.diagnostics.summarize`` on each stage module (two per rank: called once per module, in the same
    order on every rank) gathers every rank's row over the job: each row names its rank's stage and owns only
    that stage's matrices, the owners of one stage cover its matrices once, and the reduce each row expects (its
    stage's P) is what the step measured."""
    runs = [r["interleaved_summary"] for r in pp2dp2]
    for k in range(len(runs[0]["summaries"])):  # the k-th stage module of every rank
        rows = [run["summaries"][k]["ranks"] for run in runs]
        assert all(r == rows[0] for r in rows), f"module {k}: the ranks gathered different rows"
        by_stage: dict[int, list[str]] = {}
        for row in rows[0]:
            by_stage.setdefault(row["stage"], []).extend(p["fqn"] for p in row["owned"])
            assert row["expected"]["reduce"] == row["measured"]["reduce"] > 0, row
        assert len(by_stage) == 2, f"module {k}: stages {sorted(by_stage)}"
        assert str(dmuon.diagnostics.Summary(rows[0])).split()[1] == "stage"  # the table's stage column
        owned = sorted(f for fqns in by_stage.values() for f in fqns)
        assert len(owned) == len(set(owned)), f"module {k}: a matrix owned twice"
        for row in rows[0]:  # a row's matrices are its rank's own stage module's
            mine = set(runs[row["rank"]]["dedicated"])
            assert {p["fqn"] for p in row["owned"]} <= mine, (row["rank"], row["owned"])


def test_zero_bubble_weight_pass_counts(pp2dp2, ref_v):
    """The zero-bubble schedules' weight pass assigns ``param.grad`` where no hook runs. Missing those gradients
    (the wrong variant: every projection but the first stage's, whose weight pass is a full backward, left
    unmoved) is told apart by the weight bound: the run is within WEIGHT_RTOL of the oracle, so a distance over
    twice that from the variant puts the variant past the bound (the triangle inequality)."""
    run = merge(pp2dp2, "zb")
    wrong = oracle(STEPS, cfg=CFG_V, drop_weight_pass=True)
    err, key = worst_weight(run["weights"], wrong["weights"])
    assert err > 2 * WEIGHT_RTOL, f"the run is within {err:.2e} ({key}) of dropping the weight pass"
    assert worst_weight(run["weights"], ref_v["weights"])[0] <= WEIGHT_RTOL
