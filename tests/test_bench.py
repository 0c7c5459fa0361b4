"""python -m dmuon.bench: the CPU smoke run of the tiny preset, on one process and under torchrun with 2
ranks (no timing assertions: speed is reported as ratios by the benchmark, not tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))


def _check(out: Path, world: int) -> None:
    res = json.loads((out / "results.json").read_text())
    assert res["world_size"] == world and res["preset"] == "tiny"
    variants = [r["variant"] for r in res["results"]]
    assert variants == ["fsdp_adamw", "naive_fsdp_muon", "torch_muon", "dmuon_z3", "dmuon_z2"]
    for r in res["results"]:
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0, r
    assert res["results"][0]["ratio"] == 1.0
    assert (out / "chart.png").read_bytes()[:8] == PNG_MAGIC


def test_tiny_preset_one_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dmuon.bench", "--preset", "tiny", "--steps", "1", "--warmup", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratios vs fsdp_adamw" in proc.stdout
    _check(tmp_path, 1)


def test_tiny_preset_two_ranks_under_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dmuon.bench", "--preset", "tiny", "--steps", "1", "--warmup", "1",
                           "--ns-backend", "auto", "--ns-coefficients", "polar_express", "--dmuon-wrap", "root",
                           "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(tmp_path, 2)
    res = json.loads((tmp_path / "results.json").read_text())
    assert (res["ns_backend"], res["ns_coefficients"], res["dmuon_wrap"]) == ("auto", "polar_express", "root")
