"""The user-facing entry points run end to end: the recipes under torchrun and as plain ``python``, and the demo.

They are launched as real subprocesses (their own ranks, their own ports) exactly as a user would, so
a broken CLI, import path or exit code shows up here and not in a user's terminal; and none of them may
leave a file in the checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._asserts import ROOT, child_env, run_script

TIMEOUT_S = 180
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


#: what Python and pytest themselves leave behind; anything else new in the checkout came from an example
_CACHES = ("__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".egg-info", ".git", ".venv")


def _checkout_files() -> set[str]:
    files = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.endswith(_CACHES)]
        files.update(os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames)
    return files


@pytest.fixture(autouse=True, scope="module")
def _no_new_files_in_the_checkout() -> Iterator[None]:
    """Examples write to temporary folders (or where told), never into the checkout they run from."""
    before = _checkout_files()
    yield
    new = sorted(_checkout_files() - before)
    assert not new, f"examples left files in the checkout: {new[:20]}"


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return run_script(args, timeout=TIMEOUT_S)


def test_plain_python_starts_its_own_ranks() -> None:
    """``python examples/custom_loop.py`` without torchrun: no "RANK expected", 2 CPU ranks via torchrun."""
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "examples/custom_loop.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    assert ("custom_loop.py: no RANK in the environment, so starting 2 local ranks on CPU (gloo):\n"
            "  torchrun --standalone --nproc_per_node 2 examples/custom_loop.py") in proc.stdout, proc.stdout
    assert len(re.findall(r"^dmuon: 14 dedicated params over 2 ranks", proc.stdout, re.M)) == 1, proc.stdout  # rank 0
    match = re.search(r"custom_loop: OK loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the last 3\), -(\d+)% \(needs -20%\); "
                      r"per-step losses against one process with torch.optim.Muon \+ AdamW: worst step (\S+) "
                      r"\(bound 3e-04\)", proc.stdout)
    assert match and int(match.group(3)) >= 20 and float(match.group(4)) <= 3e-4, proc.stdout


def test_demo_runs_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "demo_out"
    proc = _run(["-m", "dmuon.demo", "--steps", "6", "--out", str(out)])
    text = proc.stdout
    # plan.summary_line(), once: the demo passes verbose=False and prints it in its own table
    assert text.count("dedicated params over 2 ranks") == 1, text
    assert re.search(r"NS cost share", text), text
    # The loss table: a header and rows "step dmuon adamw", including the last step.
    assert re.search(r"step\s+dmuon\s+AdamW", text), text
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s*$", text, flags=re.MULTILINE)
    assert rows and int(rows[-1][0]) == 6, text
    assert "forward_broadcast" in text and "reduce" in text, text
    # stdout is a pipe here, as in a CI log: progress as plain lines (every 5th step and the last), no \r bar
    assert "\r" not in text and re.findall(r"^  step\s+(\d+)/6 ", text, flags=re.MULTILINE) == ["5", "6"], text
    png = out / "loss.png"
    assert png.is_file(), text
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_manual_overrides_recipe_runs_under_torchrun() -> None:
    """Accumulation with no_sync, then the checkpoints guide's save/load round trip into a fresh model."""
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
    # one row per named group with the lr as configured (not the warm-up's first value), params over all ranks
    rows = re.findall(r"^  (\w+)\s+(adamw|muon)\s+(\S+)\s+(\S+)\s+(\d+)$", proc.stdout, flags=re.MULTILINE)
    assert {name: (algo, float(lr), int(n)) for name, algo, lr, _, n in rows} == {
        "no_decay": ("adamw", 1e-3, 5), "embed_head": ("adamw", 3e-3, 2), "mlp": ("muon", 0.01, 6),
        "default_muon": ("muon", 0.02, 8)}, proc.stdout
    assert "(no params left for default_adamw" in proc.stdout, proc.stdout


def test_an_ok_means_the_loss_fell_by_a_margin() -> None:
    """"last loss below the first" passed a torchtitan --tp 2 run whose loss rose from 7.22 to 7.65 at its
    last step (and had barely learned); every example's verdict is dmuon.tools.verdict's margin instead."""
    from dmuon.tools.verdict import loss_fell, within

    that_run = [8.0039, 8.0406, 7.8143, 7.5131, 7.6732, 7.5964, 7.2186, 7.6462]
    assert not loss_fell(that_run, by=0.1)[0]
    assert loss_fell([4.27, 3.9, 3.4, 3.0, 2.7, 2.5], by=0.2) == (
        True, "loss 4.2700 -> 2.7333 (mean of the last 3), -36% (needs -20%)")
    assert not loss_fell([4.0], by=0.1)[0]
    assert within([1.0, 2.0], [1.0, 2.0002], rtol=1e-4) == (True, "worst step 1.0e-04 (bound 1e-04)")
    assert not within([1.0, 2.1], [1.0, 2.0], rtol=1e-4)[0]
    weak = [p.name for p in sorted((ROOT / "examples").glob("*.py")) if "losses[-1] < losses[0]" in p.read_text()]
    assert not weak, weak


def test_tp_recipe_runs_under_torchrun() -> None:
    """dp=1 x tp=2 on two ranks (tests/test_tp.py covers dp=2 x tp=2 against the oracle)."""
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/tp_dmuon.py"])
    match = re.search(r"tp_dmuon: OK dp=1 x tp=2, loss (\d+\.\d+) -> (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(2)) < float(match.group(1))


def test_moe_recipe_runs_as_plain_python() -> None:
    """examples/moe_dmuon.py: a HF Qwen3-MoE with learned routing, its experts on FSDP2's shards (2 of 4 per rank),
    the loss down by its margin, and ``save_pretrained`` of the trained model reloading to the same loss."""
    pytest.importorskip("transformers")
    proc = _run(["examples/moe_dmuon.py"])
    assert "starting 2 local ranks" in proc.stdout, proc.stdout
    assert ("model.layers.0.mlp.experts.gate_up_proj [4x192x128]: Muon on FSDP2's shards of the expert dim "
            "(rank 0: experts 0..1, rank 1: experts 2..3)") in proc.stdout, proc.stdout
    match = re.search(r"moe_dmuon \(shards\): OK loss (\d+\.\d+) -> (\d+\.\d+) \(mean of the last 3\), -(\d+)% "
                      r"\(needs -20%\); reloaded from save_pretrained: loss (\d+\.\d+) vs (\d+\.\d+)", proc.stdout)
    assert match and int(match.group(3)) >= 20, proc.stdout


def test_normuon_qkclip_recipe_runs_as_plain_python() -> None:
    """NorMuon + cautious decay + QK-clip: the loss falls, heads are clipped, and the run matches one process
    with the paper-formula NorMuon and the clip by hand (docs/guides/qk-clip.md)."""
    proc = _run(["examples/normuon_qkclip.py"])
    match = re.search(r"normuon_qkclip: OK loss \S+ -> \S+ \(mean of the last 3\), -(\d+)% \(needs -20%\); QK-clip "
                      r"clipped (\d+) heads over 10 steps; per-step losses against one process \(NorMuon reference "
                      r"\+ hand clip\): worst step (\S+) \(bound 3e-04\)", proc.stdout)
    assert match and int(match.group(1)) >= 20 and int(match.group(2)) > 0 and float(match.group(3)) <= 3e-4, \
        proc.stdout


def test_deepspeed_recipe_runs_as_plain_python() -> None:
    """ZeRO-2 with accumulation and clipping on 2 CPU ranks, and its save_checkpoint / load_checkpoint round trip."""
    pytest.importorskip("deepspeed")
    proc = _run(["examples/deepspeed_dmuon.py"])
    match = re.search(r"deepspeed_dmuon: OK ZeRO-2, loss (\d+\.\d+) -> (\d+\.\d+).*restored engine matches", proc.stdout)
    assert match, proc.stdout
