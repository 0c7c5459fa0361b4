"""The user-facing entry points run end to end: the custom-loop recipe under torchrun, and the demo.

Both are launched as real subprocesses (their own ranks, their own ports) exactly as a user would, so
a broken CLI, import path or exit code shows up here and not in a user's terminal.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests._asserts import run_script

TIMEOUT_S = 180
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return run_script(args, timeout=TIMEOUT_S)


def test_custom_loop_recipe_runs_under_torchrun() -> None:
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/custom_loop.py"])
    match = re.search(r"custom_loop: OK loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first, (first, last)


def test_demo_runs_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "demo_out"
    proc = _run(["-m", "dmuon.demo", "--steps", "6", "--out", str(out)])
    text = proc.stdout
    assert "dedicated params over 2 ranks" in text, text  # plan.summary_line()
    assert re.search(r"NS cost share", text), text
    # The loss table: a header and rows "step dmuon adamw", including the last step.
    assert re.search(r"step\s+dmuon\s+AdamW", text), text
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$", text, flags=re.MULTILINE)
    assert rows and int(rows[-1][0]) == 6, text
    assert "forward_broadcast" in text and "reduce" in text, text
    png = out / "loss.png"
    assert png.is_file(), text
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_manual_overrides_recipe_runs_under_torchrun() -> None:
    """Accumulation with no_sync, then the seed's save/load round trip into a fresh model."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "examples/manual_overrides.py"])
    match = re.search(r"manual_overrides: OK restored loss (\d+\.\d+) \(original (\d+\.\d+)\)", proc.stdout)
    assert match, proc.stdout
    assert match.group(1) == match.group(2)
    steps = re.findall(r"optimizer step (\d+)", proc.stdout)
    assert steps == ["1", "2", "3", "4"], proc.stdout


def test_ddp_recipe_runs_under_torchrun() -> None:
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/ddp_dmuon.py"])
    match = re.search(r"ddp_dmuon: OK loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(2)) < float(match.group(1))


def test_param_groups_recipe_runs_under_torchrun() -> None:
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/param_groups.py"])
    match = re.search(r"param_groups: OK loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(2)) < float(match.group(1))
    groups = dict(re.findall(r"^group (\w+)\s+(adamw|muon)\s", proc.stdout, flags=re.MULTILINE))
    assert groups == {"no_decay": "adamw", "embed_head": "adamw", "mlp": "muon", "default_muon": "muon",
                      "default_adamw": "adamw"}, proc.stdout


def test_tp_recipe_runs_under_torchrun() -> None:
    """dp=1 x tp=2 on two ranks (tests/test_tp.py covers dp=2 x tp=2 against the oracle)."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/tp_dmuon.py"])
    match = re.search(r"tp_dmuon: OK dp=1 x tp=2, loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(2)) < float(match.group(1))
