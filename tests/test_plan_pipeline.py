"""python -m dmuon.plan --simulate --pp N: stages balanced by layers, 1F1B's bubble (N-1)/(M+N-1) of the pipeline
time, dmuon's per-stage traffic as ``dmuon_schedule`` of the stage's submodel (and the counts
tests/test_pipeline.py measures on the runtime), pp 1 equal to the prediction without a pipeline, and the CLI's
refusals. Pure Python, no torch collectives."""

from __future__ import annotations

import json

import pytest

from dmuon.tools.pipeline import simulate_pipeline_design, stage_gathers, stage_layers, stage_sizes
from dmuon.tools.plan import main as plan_main
from dmuon.tools.presets import PRESETS, projection_specs
from dmuon.tools.schedules import DMUON_COMM, dmuon_schedule, simulate_design
from dmuon.tools.step_model import Scenario, sizes_of

EIGHT_B = PRESETS["llama3-8b"]
DESIGNS = ("fsdp_adamw", "dmuon", "distmuon", "dion")


@pytest.mark.parametrize("world,reshard", [(8, "z3"), (64, "z3"), (16, "z2")])
def test_pp1_is_the_prediction_without_a_pipeline(world, reshard):
    """One stage, one microbatch: the same step to the last bit, for every design under Z3. Under Z2 the pipeline
    model keeps FSDP2's per-layer units gathered after forward (the schedules' setting) where the pipeline-free
    baseline gathers them again, so Z2 compares dmuon only (its FSDP2 part is one root unit)."""
    sc = Scenario(EIGHT_B, world, reshard=reshard)
    for design in DESIGNS if reshard == "z3" else ("dmuon",):
        got, want = simulate_pipeline_design(sc, design, pp=1, microbatches=1), simulate_design(sc, design)
        for key in ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "exposed_ms", "bytes_per_rank", "ns_ms"):
            assert got[key] == want[key], (design, key, got[key], want[key])
        assert got["bubble_ms"] == got["p2p_ms"] == 0.0


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_the_bubble_is_n_minus_1_slots_of_the_slowest_stage(pp, m):
    """1F1B over M microbatches on N stages: M + N - 1 slots of the slowest stage's forward + backward (with an
    activation in and a gradient out), N - 1 of them idle."""
    sc = Scenario(EIGHT_B, 64, batch=16)
    r = simulate_pipeline_design(sc, "dmuon", pp=pp, microbatches=m)
    act = 16 // m * 2048 * 4096 * 2  # sequences a microbatch x seq x hidden x bf16
    assert r["p2p_bytes_per_microbatch"] == act
    slot = (max(s["forward_mb_ms"] for s in r["stages"]) + max(s["backward_mb_ms"] for s in r["stages"])
            + 2 * r["p2p_ms"])
    assert r["bubble_ms"] == pytest.approx((pp - 1) * slot, rel=1e-12)
    assert r["pipeline_ms"] == pytest.approx((m + pp - 1) * slot, rel=1e-12)
    assert r["bubble_ms"] / r["pipeline_ms"] == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    assert r["step_ms"] == pytest.approx(r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] + r["bubble_ms"])
    # more microbatches shrink the bubble (the same step's tokens in more, thinner slots)
    if m < 16:
        more = simulate_pipeline_design(sc, "dmuon", pp=pp, microbatches=2 * m)
        assert more["bubble_ms"] < r["bubble_ms"]


def test_stages_split_the_layers_contiguously_and_balanced():
    assert [list(r) for r in stage_layers(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    sz = sizes_of(EIGHT_B, 2048)
    parts = [stage_sizes(sz, 4, s) for s in range(4)]
    assert sum(p.muon_elements for p in parts) == sz.muon_elements
    assert [p.embed > 0 for p in parts] == [True, False, False, False]
    assert [p.head > 0 for p in parts] == [False, False, False, True]
    assert sum(p.dense_flops for p in parts) == pytest.approx(sz.dense_flops, rel=1e-12)
    assert sum(p.norms for p in parts) == sz.norms


@pytest.mark.parametrize("pp,world", [(2, 4), (4, 64)])
def test_dmuon_stage_traffic_is_dmuon_schedule_of_the_stage_submodel(pp, world):
    """Per stage, dmuon's collectives are ``dmuon_schedule`` of the stage's matrices over its dp group (Z2: one
    broadcast per step); the reduce carries the stage's own projections once per step, one launch a layer."""
    m = 2 * pp
    r = simulate_pipeline_design(Scenario(EIGHT_B, world, reshard="z2", batch=m), "dmuon", pp=pp, microbatches=m)
    sz = sizes_of(EIGHT_B, 2048)
    for st in r["stages"]:
        sub = stage_sizes(sz, pp, st["stage"])
        want = dmuon_schedule(Scenario(EIGHT_B, world // pp, reshard="z2"), slot=0, sizes=sub)
        got = {DMUON_COMM[c["name"]]: {"calls": c["calls"], "bytes": round(c["payload"])}
               for c in st["collectives"] if c["name"] in DMUON_COMM and c["calls"]}
        assert got == want, st["stage"]
        mine = stage_layers(EIGHT_B.layers, pp)[st["stage"]]
        P = sum(s.numel for s in projection_specs(EIGHT_B) if int(s.layer.rsplit(".", 1)[1]) in mine)
        assert want[("reduce", "shard")] == {"calls": len(mine), "bytes": 2 * P}
        assert want[("forward_broadcast", "shard")] == {"calls": len(mine), "bytes": 2 * P}


def test_z3_gathers_what_the_runtime_counts():
    """tests/test_pipeline.py on the runtime, pp 2, M = 2, Z3: 3 P broadcast and P reduced per step on every
    stage; the model's 1F1B order gives M + 1 gathers on every stage."""
    r = simulate_pipeline_design(Scenario(PRESETS["tiny"], 4, batch=2), "dmuon", pp=2, microbatches=2)
    for st in r["stages"]:
        P = 2 * sum(n * k for _, (n, k), _ in stage_sizes(sizes_of(PRESETS["tiny"], 2048), 2, st["stage"]).muon)
        moved = {c["name"]: c["payload"] for c in st["collectives"] if c["name"].startswith("dmuon")}
        assert moved["dmuon forward broadcast"] + moved["dmuon backward broadcast"] == 3 * P
        assert moved["dmuon reduce"] == P
    assert [sum(stage_gathers(4, 8, s, "z3")) for s in range(4)] == [9] * 4
    assert stage_gathers(4, 8, 0, "z2") == (1, 0)


def test_cli_pp_table_json_and_refusals(capsys):
    base = ["--simulate", "--preset", "8b", "--world-size", "64"]
    assert plan_main([*base, "--pp", "4", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "pp 4 x dp 16, 1F1B over 8 microbatches" in out and "3/11 = 27.3% of the pipeline time" in out
    assert plan_main([*base, "--pp", "2", "--batch", "8", "--microbatches", "8", "--json", "--designs", "dmuon"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["pp"] == 2 and info["microbatches"] == 8 and set(info["designs"]) == {"fsdp_adamw", "dmuon"}
    assert info["bubble_fraction"] == pytest.approx(1 / 9) and len(info["designs"]["dmuon"]["stages"]) == 2
    for argv, message in (
            ([*base, "--pp", "3"], "--pp 3 must divide --world-size 64"),
            ([*base, "--pp", "64"], "--pp 64 is more stages than llama3-8b's 32 layers"),
            ([*base, "--pp", "2", "--batch", "3"], "must be a multiple of --microbatches 4"),
            ([*base, "--pp", "0"], "--pp must be a positive int, got 0"),
            ([*base, "--microbatches", "2"], "--microbatches needs --pp of 2 or more"),
            ([*base, "--pp", "2", "--replicas", "2"], "not modelled: the runtime supports neither HSDP"),
            ([*base, "--pp", "2", "--sweep"], "--sweep and --plot are not modelled with --pp"),
            (["--preset", "8b", "--world-size", "64", "--pp", "2"], "are options of --simulate")):
        with pytest.raises(SystemExit) as exc:
            plan_main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err, argv
