"""The checks the test files share: closeness to the single-process oracle, bit-for-bit equality of two
runs, relative errors, and the environment of a test's child process.

A *run* is what a job returns and the oracle: ``{"losses": [float per step], "weights": {fqn: tensor}}``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

#: The repository root (the checkout the children import dmuon and tests from).
ROOT = Path(__file__).resolve().parent.parent

#: Oracle parity: per-step losses within 1e-4 relative, final weights within 5e-3 (relative Frobenius).
#: Why these: [Note: test scale] in tests/_training.py (the oracle's own floor is an order below).
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 5e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (Frobenius), ``b`` the reference; 0 / 0 counts as 0."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_weight(weights: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """The largest :func:`rel_err` over ``want``'s keys, and its key."""
    return max((rel_err(weights[k], v), k) for k, v in want.items())


def assert_losses_close(got: Sequence[float], want: Sequence[float], what: str, *, rtol: float = LOSS_RTOL) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} losses, expected {len(want)}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), f"{what} step {step}: {g} vs {w} (rtol {rtol})"


def assert_close_to(run: Mapping, ref: Mapping, what: str, *, loss_rtol: float = LOSS_RTOL,
                    weight_rtol: float = WEIGHT_RTOL) -> None:
    """``run`` within the parity bounds of ``ref`` (the oracle, or another run): every loss and every weight."""
    assert_losses_close(run["losses"], ref["losses"], what, rtol=loss_rtol)
    assert set(run["weights"]) >= set(ref["weights"]), f"{what}: missing {set(ref['weights']) - set(run['weights'])}"
    err, key = worst_weight(run["weights"], ref["weights"])
    assert err <= weight_rtol, f"{what}: weight {key} off by {err:.2e} (rtol {weight_rtol})"


def assert_bitwise(a: Mapping, b: Mapping, what: str) -> None:
    """Two runs whose arithmetic is identical by construction: same losses, same weights, bit for bit."""
    assert a["losses"] == b["losses"], f"{what}: losses differ {a['losses']} vs {b['losses']}"
    assert set(a["weights"]) == set(b["weights"]), f"{what}: different weight keys"
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), f"{what}: {k} differs"


def differences(a: object, b: object, where: str = "") -> list[str]:
    """Where two nested dicts / lists of tensors and values differ (tensors bit for bit, dtypes included): what a
    refused load must leave unchanged."""
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(map(str, a)) != sorted(map(str, b)):
            return [f"{where}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        return [] if same else [where]
    return [] if a == b else [where]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process (a script, an example, torchrun): one thread per rank (the
    ranks share the cores), the checkout importable without an install, and CPU/gloo even on a GPU machine
    (two ranks on one GPU fail)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_script(args: list[str], *, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the checkout root in :func:`child_env`; a failure is an ``AssertionError`` with
    both output streams (the tail of stderr), so a crash in the child is a failing test, not a dead suite."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
                             f"--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS``, as a user launches an example."""
    return run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script, *args],
                      timeout=timeout)
