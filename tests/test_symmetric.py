"""dmuon.optim._symmetric: the half-tile kernel for symmetric products, run on CPU through Triton's interpreter.

The kernel computes only the tiles on and above the diagonal and mirrors them, so what can go wrong is the
tile bookkeeping: ragged last tiles in ``m`` and ``k``, the mirrored store, the ``beta D`` epilogue, the
second operand ``Z`` and the batch offset. Each is checked against float64 ``torch`` on fp32 inputs (the interpreter multiplies in the
input dtype, so its fp16/bf16 results say nothing about the GPU's fp32 accumulation; the GPU accuracy is
measured by ``scripts/gpu_symmetric_kernel.py --ns`` and recorded in docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests._asserts import ROOT, child_env


_PROBE = r"""
import json, torch
from dmuon.optim._symmetric import symmetric_product
g = torch.Generator().manual_seed(0)
out = {}
for B, m, k in [(2, 200, 96), (1, 130, 300), (3, 128, 64)]:
    Y = torch.randn(B, m, k, generator=g)
    D = torch.randn(B, m, m, generator=g)
    D = D + D.mT
    exact = torch.bmm(Y.double(), Y.double().mT)
    for name, got, want in (("yyt", symmetric_product(Y), exact),
                            ("axpy", symmetric_product(Y, D, alpha=0.5, beta=-1.5), 0.5 * exact - 1.5 * D.double())):
        out[f"{name} {B}x{m}x{k}"] = ((got.double() - want).norm() / want.norm()).item()
# commuting symmetric factors (polynomials in one symmetric S), as the Gram form's P Q and A P P
S = torch.randn(2, 150, 150, generator=g, dtype=torch.float64)
S = (S + S.mT) / 30
P, Q = S @ S, 2 * S + S @ S @ S
got = symmetric_product(P.float(), Z=Q.float())
out["commuting 2x150x150"] = ((got.double() - P @ Q).norm() / (P @ Q).norm()).item()
empty = symmetric_product(torch.randn(0, 5, 3))
out["empty_shape"] = list(empty.shape)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["2x200x96", "1x130x300", "3x128x64"])
@pytest.mark.parametrize("kind", ["yyt", "axpy"])
def test_matches_float64_product(interpreted, kind, case):
    # ragged tiles in m (200, 130) and k (96, 300), exactly one tile (128), batches of 1-3
    assert interpreted[f"{kind} {case}"] < 1e-6, interpreted


def test_product_of_commuting_symmetric_matrices(interpreted):
    assert interpreted["commuting 2x150x150"] < 1e-6, interpreted


def test_empty_batch(interpreted):
    assert interpreted["empty_shape"] == [0, 5, 5]


def test_used_only_where_it_wins(monkeypatch):
    pytest.importorskip("triton")
    from dmuon.optim import _symmetric
    from dmuon.optim.newton_schulz import _use_symmetric

    big = torch.zeros(1, 2048, 2048, dtype=torch.bfloat16)
    assert not _symmetric.usable(big)  # CUDA only
    monkeypatch.setattr(_symmetric, "usable", lambda Y: True)  # as on a GPU
    assert _use_symmetric(big, "auto")
    assert not _use_symmetric(big, "direct") and not _use_symmetric(big, "gram")  # only "auto" opts in


def test_bad_shapes_are_rejected():
    pytest.importorskip("triton")
    from dmuon.optim._symmetric import symmetric_product

    with pytest.raises(ValueError, match="batch, m, k"):
        symmetric_product(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="batch, m, m"):
        symmetric_product(torch.zeros(1, 4, 3), torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="Z must match Y"):
        symmetric_product(torch.zeros(1, 4, 3), Z=torch.zeros(1, 4, 4))
