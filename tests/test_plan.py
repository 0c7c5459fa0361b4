"""python -m dmuon.plan: the planner CLI reports the same owners dedicate_params would pick, with memory
and traffic that follow from them; it reads HF config.json files and rejects bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from dmuon.partition import _count, assign_owners
from dmuon.tools.plan import _parser, make_plan, shape_from_hf_config
from dmuon.tools.plan import main as plan_main
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


# --------------------------------------------------------------------------- the CLI as a newcomer meets it


def test_help_is_plain_text_with_every_option_explained(capsys):
    with pytest.raises(SystemExit) as exc:
        plan_main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text and ":class:" not in text, text
    for name in ("125m", "llama3.2-1b", "llama3.2-3b", "llama3-8b", "8b=llama3-8b", "{bf16,fp16,fp32}"):
        assert name in text, (name, text)
    undocumented = [a.option_strings for a in _parser()._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented


def test_short_preset_names_are_the_same_presets_without_a_warning(capsys):
    assert plan_main(["--preset", "8b", "--world-size", "8", "--json"]) == 0
    short = capsys.readouterr()
    assert plan_main(["--preset", "llama3-8b", "--world-size", "8", "--json"]) == 0
    assert json.loads(short.out) == json.loads(capsys.readouterr().out)
    assert short.err == ""
    assert make_plan("1b", 4)["dedicated_elements"] == make_plan("llama3.2-1b", 4)["dedicated_elements"]


def test_more_ranks_than_matrices_is_said_with_what_it_costs(capsys):
    assert plan_main(["--preset", "llama3-8b", "--world-size", "1000"]) == 0
    out, err = capsys.readouterr()
    assert "warning: 1000 ranks but only 224 dedicated matrices: 776 ranks own none" in err, err
    assert "floor of the Muon step's time" in err and "1/1000 = 0.10%" in err, err
    assert "776 ranks own none" in out  # the summary line says it too
    assert plan_main(["--preset", "llama3-8b", "--world-size", "1000", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["warnings"]) == 1 and "776 ranks own none" in info["warnings"][0]
    assert plan_main(["--preset", "llama3-8b", "--world-size", "224", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_summary_counts_in_human_units(capsys):
    assert plan_main(["--preset", "llama3-8b", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    # 6,979,321,856 dedicated elements = 13 GiB in bf16; 872M per rank at 8 ranks
    assert "224 projection matrices, 6.98G elements (13.00 GiB in bf16), 8 ranks" in out, out
    assert "elements 872M..872M" in out and re.search(r"^0-7\s+8\s+28\s+872M\s", out, flags=re.MULTILINE), out
    # three significant digits everywhere, trailing zeros kept: 14.0G next to 20.9G, not 14G
    assert "Z3 20.9G elements (39.00 GiB), Z2 14.0G (26.00 GiB)" in out, out
    assert not re.search(r"\d{1,3}(,\d{3}){2,}", out), out  # no raw 6,979,321,856 left
    assert [_count(n) for n in (999, 1000, 12_600, 999_999, 6_979_321_856, 13_958_643_712)] == [
        "999", "1.00K", "12.6K", "1.00M", "6.98G", "14.0G"]
    assert "over 1 rank," in assign_owners(projection_specs("tiny"), 1).summary_line()  # not "1 ranks"
    assert "1 rank owns none" in assign_owners(projection_specs("tiny"), 15).summary_line()


def test_a_512_rank_plan_fits_a_screen(capsys):
    """One row per distinct line, with its ranks: llama3-8b at 512 ranks is 4 rows, not 512 (flat; 7 node by node)."""
    assert plan_main(["--preset", "llama3-8b", "--world-size", "512", "--layout", "flat"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) + len(err.splitlines()) <= 40, out + err
    rows = re.findall(r"^([\d,.-]+)\s+(\d+)\s+(\d+)\s+\S+\s+[\d.]+%", out, flags=re.MULTILINE)
    assert sum(int(n) for _, n, _ in rows) == 512 and len(rows) <= 8, out
    assert rows[0][0] == "0-95" and rows[-1][:2] == ("224-511", "288"), rows
    assert plan_main(["--preset", "llama3-8b", "--world-size", "512"]) == 0  # "auto": the node layout
    out, err = capsys.readouterr()
    assert "layout 'node'" in out and len(out.splitlines()) + len(err.splitlines()) <= 40, out + err
    assert plan_main(["--preset", "llama3-8b", "--world-size", "512", "--per-rank"]) == 0
    assert len(re.findall(r"^\d+\s+1\s+\d", capsys.readouterr().out, flags=re.MULTILINE)) == 512


def test_tiny_is_a_preset_of_both_tools_with_the_bench_models_shapes(capsys):
    """The README lists ``tiny`` for plan and bench: the shapes plan assumes are the bench model's."""
    from dmuon.tools.bench import _model

    assert plan_main(["--preset", "tiny", "--world-size", "2"]) == 0
    assert "tiny: 14 projection matrices" in capsys.readouterr().out
    model = _model("tiny", torch.device("cpu"), torch.float32)
    built = sorted(tuple(p.shape) for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n)
    assert built == sorted(s.shape for s in projection_specs("tiny"))


def test_piped_into_head_ends_quietly():
    """``python -m dmuon.plan ... | head``: the reader goes away; no BrokenPipeError traceback, exit code 0."""
    proc = subprocess.Popen([sys.executable, "-m", "dmuon.plan", "--preset", "llama3-8b", "--world-size", "4096",
                             "--per-rank"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=child_env())
    assert proc.stdout.readline().startswith(b"llama3-8b")  # 4096 rows: far more than a pipe buffer holds
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
