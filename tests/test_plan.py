"""python -m dmuon.plan: the planner CLI reports the same owners dedicate_params would pick, with memory
and traffic that follow from them; it reads HF config.json files and rejects bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dmuon.partition import assign_owners
from dmuon.tools.plan import make_plan, shape_from_hf_config
from dmuon.tools.presets import projection_specs
from tests._asserts import ROOT, child_env


def test_cli_json_for_llama3_8b_at_64_ranks():
    out = subprocess.run([sys.executable, "-m", "dmuon.plan", "--preset", "llama3-8b", "--world-size", "64", "--json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    info = json.loads(out)
    assert info["world_size"] == 64 and len(info["per_rank"]) == 64
    assert info["imbalance"] == pytest.approx(assign_owners(projection_specs("llama3-8b"), 64).imbalance)
    assert 1.05 <= info["imbalance"] <= 1.06
    assert sum(r["numel"] for r in info["per_rank"]) == info["dedicated_elements"]
    assert sum(r["params"] for r in info["per_rank"]) == 224


def test_memory_and_traffic_follow_the_plan():
    info = make_plan("llama3.2-1b", world_size=8, dtype="bf16")
    P = info["dedicated_elements"]
    for r in info["per_rank"]:
        assert r["persistent_bytes"] == 2 * r["numel"] * 2  # weight + momentum, 2 bytes each
        assert r["peak_transient_bytes_z2"] == (P - r["numel"]) * 2
        assert r["peak_transient_bytes_z3"] < r["peak_transient_bytes_z2"]
    assert info["elements_moved_per_rank_per_step"]["z3"] == {"forward_broadcast": P, "backward_broadcast": P, "reduce": P}
    assert info["elements_moved_per_rank_per_step"]["z2"]["backward_broadcast"] == 0
    hsdp = make_plan("llama3.2-1b", world_size=8, replicas=2)
    # under HSDP both rows of a column hold the column's tensors
    assert hsdp["per_rank"][0]["persistent_bytes"] == (hsdp["per_rank"][0]["numel"] * 2 + hsdp["per_rank"][4]["numel"]) * 2


def test_hf_config_json(tmp_path):
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 64, "model_type": "llama"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    shape = shape_from_hf_config(str(path))
    assert make_plan(shape, 16)["dedicated_elements"] == make_plan("llama3.2-1b", 16)["dedicated_elements"]
    table = subprocess.run([sys.executable, "-m", "dmuon.plan", "--config", str(path), "--world-size", "4"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "NS-cost imbalance" in table and "owned GiB" in table


def test_bad_input_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="replicas"):
        make_plan("llama3-8b", world_size=8, replicas=3)
    with pytest.raises(ValueError, match="dtype"):
        make_plan("llama3-8b", world_size=8, dtype="int8")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        shape_from_hf_config(str(bad))
    proc = subprocess.run([sys.executable, "-m", "dmuon.plan", "--preset", "nope", "--world-size", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_per_param_lists_every_matrix_with_the_owner_dedicate_params_would_pick():
    info = make_plan("llama3.2-1b", world_size=8)
    owners = assign_owners(projection_specs("llama3.2-1b"), 8).owners
    assert {p["fqn"]: p["owner"] for p in info["per_param"]} == owners
    out = subprocess.run([sys.executable, "-m", "dmuon.plan", "--preset", "llama3.2-1b", "--world-size", "8",
                          "--per-param"], capture_output=True, text=True, check=True, cwd=ROOT, env=child_env()).stdout
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("owner")) + 1
    listed = {line.split()[-1]: int(line.split()[0]) for line in lines[start:]}
    assert listed == owners
