"""python -m dmuon.bench: the CPU smoke run of the tiny preset, on one process and under torchrun with 2
ranks as a 2 x 1 HSDP grid (no timing assertions: speed is reported as ratios by the benchmark, not tested)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmuon.tools import bench
from tests._asserts import ROOT, child_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check(out: Path, world: int) -> None:
    res = json.loads((out / "results.json").read_text())
    assert res["world_size"] == world and res["preset"] == "tiny"
    variants = [r["variant"] for r in res["results"]]
    assert variants == ["fsdp_adamw", "naive_fsdp_muon", "torch_muon", "dmuon_z3", "dmuon_z2"]
    for r in res["results"]:
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0 and r["e2e_ms"] > 0, r
    assert res["results"][0]["ratio"] == 1.0 and res["results"][0]["e2e_ratio"] == 1.0
    for r in res["results"]:  # each ratio's quartiles over the rounds bracket its median
        assert r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"], r
    assert (out / "chart.png").read_bytes()[:8] == PNG_MAGIC


# --warmup 0 in both runs: the e2e step after the timed one is already a second step, and
# CI time matters more than a warm first sample here.


def test_tiny_preset_one_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dmuon.bench", "--preset", "tiny", "--steps", "1", "--warmup", "0",
                           "--rounds", "2", "--out", str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratios vs fsdp_adamw, median of 2 rounds" in proc.stdout
    # round 2 runs the variants in an order rotated by one
    order = [line.split("] ")[1].split(" ...")[0] for line in proc.stdout.splitlines() if line.startswith("[round ")]
    assert order[:5] == list(bench.VARIANTS) and order[5:] == list(bench.VARIANTS[1:]) + [bench.VARIANTS[0]], order
    _check(tmp_path, 1)
    assert json.loads((tmp_path / "results.json").read_text())["rounds"] == 2
    # it names what it wrote, and says that a 1-rank CPU run is no speed measurement
    assert f"wrote {tmp_path / 'results.json'} and {tmp_path / 'chart.png'}" in proc.stdout, proc.stdout
    assert "note: a smoke run, whose ratios say nothing about speed" in proc.stdout, proc.stdout
    assert "on 1 rank nothing is sharded" in proc.stdout.replace("\n      ", " "), proc.stdout


def test_tiny_preset_two_ranks_under_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dmuon.bench", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--rounds", "1",
                           "--ns-backend", "auto", "--ns-coefficients", "polar_express", "--dmuon-wrap", "root",
                           "--replicate", "2", "--replicate-async", "off",
                           "--out", str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HSDP 2 x 1, replicate async off" in proc.stdout
    _check(tmp_path, 2)
    res = json.loads((tmp_path / "results.json").read_text())
    assert (res["ns_backend"], res["ns_coefficients"], res["dmuon_wrap"]) == ("auto", "polar_express", "root")
    assert (res["replicate"], res["replicate_async"]) == (2, "off")


@pytest.mark.parametrize("world, replicate, message", [(4, 3, "does not divide the world size 4"),
                                                        (1, 0, "must be at least 1")])
def test_replicate_must_split_the_world(monkeypatch, capsys, world, replicate, message):
    """A bad --replicate is a usage error before any process group or mesh exists (in-process: no run)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--replicate", str(replicate)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_help_is_plain_text_and_names_every_variant_and_preset(capsys):
    """Every option says what it does; valid presets and variants are listed; no RST markup (nor in the demo's)."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in (*bench.VARIANTS, *bench.BENCH_PRESETS, "8b=llama3-8b"):
        assert name in text, (name, text)
    parser, _ = bench._parse_args([])
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented
    from dmuon.tools import demo

    with pytest.raises(SystemExit):
        demo._parse_args(["--help"])
    text += capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text and ":class:" not in text, text


def test_help_gives_every_default():
    """An option with a default says what it is, in bench, plan and demo alike."""
    from dmuon.tools import demo, plan

    silent = [(parser.prog, a.option_strings[0], a.default)
              for parser in (bench._parse_args([])[0], plan._parser(), demo._parser()) for a in parser._actions
              if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) and "default" not in a.help]
    assert not silent, silent


def test_chart_shows_each_ratio_and_its_quartiles(tmp_path, monkeypatch):
    """chart.png carries what the table has: per variant its ratio and quartiles over the rounds."""
    from matplotlib.figure import Figure

    labels = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: labels.extend(
        t.get_text() for ax in fig.axes for t in ax.texts))
    results = [bench.Timing("fsdp_adamw", 1.0, 2.0, 1.0, 4.0, None), bench.Timing("dmuon_z3", 1.0, 2.0, 2.0, 5.0, None)]
    spread = {"fsdp_adamw": (1.0, 1.0, 1.0), "dmuon_z3": (1.1, 1.25, 1.4)}
    bench._chart(results, spread, "fsdp_adamw", 3, str(tmp_path / "chart.png"), "title")
    assert labels == ["1.00x\n[1.00-1.00]", "1.25x\n[1.10-1.40]"], labels


def test_presets_are_named_as_in_plan_and_short_names_still_work():
    from dmuon.tools.presets import PRESETS

    assert set(bench.BENCH_PRESETS) == set(PRESETS)  # one naming for plan and bench
    assert bench._parse_args(["--preset", "8b"])[1].preset == "llama3-8b"
    assert bench.BENCH_PRESETS["1b"] == bench.BENCH_PRESETS["llama3.2-1b"]  # scripts that index it by the old key
    with pytest.raises(SystemExit):
        bench._parse_args(["--preset", "9b"])
