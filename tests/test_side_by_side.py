"""scripts/gpu_side_by_side.py: its CPU run on 2 gloo ranks (fsdp_adamw and dmuon; torchtitan's DistMuon is
CUDA only and skipped with its reason), and the pieces of dmuon/tools/side_by_side.py it stands on: the
collective counter, the models, and the agreement check, which passes rounding noise and flags a variant
that is off (no timing assertions: the harness reports speed, it is not tested)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dmuon.tools.side_by_side import (MARGIN, CollectiveCounter, analytic_bound, build_model, matrix_agreement,
                                      summarize_agreement, tolerance)
from tests._asserts import ROOT, child_env


def test_two_gloo_ranks_tiny_preset(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "scripts" / "gpu_side_by_side.py"), "--preset", "tiny",
                           "--variants", "fsdp_adamw,dmuon,torchtitan_distmuon", "--rounds", "1", "--steps", "1",
                           "--warmup", "0", "--agree-steps", "2", "--out", str(tmp_path)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    res = json.loads((tmp_path / "side_by_side.json").read_text())
    assert (res["world_size"], res["preset"], res["dtype"]) == (2, "tiny", "float32")
    assert "CUDA only" in res["skipped"]["torchtitan_distmuon"]
    assert "skipped torchtitan_distmuon: CUDA only" in proc.stdout
    timing = res["timing"]
    assert list(timing) == ["fsdp_adamw", "dmuon"]
    for t in timing.values():
        assert min(t["forward_ms"], t["backward_ms"], t["optimizer_ms"], t["step_ms"]) > 0, t
        assert t["peak_gib"] is None and len(t["bytes_by_rank"]) == 2
    # bytes per rank and step. FSDP2 + AdamW gathers every param (the Muon matrices sit in blocks FSDP2 reshards
    # after forward: gathered twice, 2 P) and reduce-scatters every gradient once. In the dmuon run FSDP2 does the
    # same for the other params, and dmuon moves the Muon matrices, one launch per boundary and phase ([Note: one
    # launch per boundary]): an all-gather of the owners' parts before forward and again before backward (a
    # broadcast where one rank owns the whole boundary) and a reduce-scatter of the gradient parts (a reduce where
    # one rank owns them). gloo's reduce-scatter takes uneven parts, so every gradient byte is counted once in
    # both runs; gloo's all-gather does not, so each part is padded to its boundary's largest: dmuon's gather
    # buffers are W x the largest part, at least its payload 2 P and at most W times it (W = 2 here).
    model, predicate = build_model("tiny", torch.device("cpu"), torch.float32)
    muon_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if predicate(n, p))
    moved, fsdp = timing["dmuon"]["bytes_per_rank"], timing["fsdp_adamw"]["bytes_per_rank"]
    assert set(fsdp) == {"all_gather", "reduce_scatter"} and fsdp["all_gather"] > 2 * muon_bytes, fsdp
    assert set(moved) <= {"all_gather", "broadcast", "reduce_scatter", "reduce"}, moved
    assert moved.get("reduce_scatter", 0) + moved.get("reduce", 0) == fsdp["reduce_scatter"], (moved, fsdp)
    gathered = moved.get("all_gather", 0) + moved.get("broadcast", 0) - (fsdp["all_gather"] - 2 * muon_bytes)
    assert 2 * muon_bytes <= gathered <= 2 * 2 * muon_bytes, (gathered, muon_bytes)
    # the agreement check: dmuon is the reference, its other NS arithmetic the floor, the control is flagged
    agree = res["agreement"]
    assert agree["dmuon"] == {"reference": True}
    floor = agree["noise_floor"]
    assert floor["floor"] and floor["error"] > 0 and "flagged" not in floor
    control = agree["perturbed_dmuon"]
    assert control["flagged"] and control["worst"]["ratio"] > 1 and 0.5 < control["of_update"] < 2, control
    assert {r["name"] for r in control["rows"]} == {n for n, p in model.named_parameters() if predicate(n, p)}
    assert all(r["floor"] == floor_row["error"] for r, floor_row in zip(control["rows"], floor["rows"]))
    text = (tmp_path / "side_by_side.txt").read_text()
    assert "perturbed_dmuon (lr x 2)" in text and "flagged, as it must be" in text and "reference" in text


def _moved(init: torch.Tensor, r: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref = init + U`` with ``||U|| = r ||ref||`` (about), and ``U``."""
    u = torch.randn(init.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    u *= r * init.norm() / u.norm()
    return init + u, u


def test_agreement_passes_rounding_noise_and_flags_twice_the_step():
    w0 = torch.randn(64, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref, u = _moved(w0, 0.08, seed=1)
    moved = float(u.norm() / ref.norm())
    tol = tolerance(moved, torch.bfloat16)
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    near = ref + noise * (0.5 * tol * ref.norm() / noise.norm())
    ok = matrix_agreement("near", w0.bfloat16(), ref.bfloat16(), near.bfloat16())
    assert not ok.ratio > 1 and ok.ratio == pytest.approx(0.5, rel=0.1), ok
    off = matrix_agreement("twice", w0.bfloat16(), ref.bfloat16(), (w0 + 2 * u).bfloat16())
    assert off.ratio > 2 and off.error == pytest.approx(moved, rel=0.05), off
    # a measured floor above the analytic bound is what the tolerance follows ...
    assert tolerance(moved, torch.bfloat16, floor=1.0) == MARGIN * 1.0
    assert matrix_agreement("twice", w0.bfloat16(), ref.bfloat16(), (w0 + 2 * u).bfloat16(), floor=moved).ratio < 1
    # ... and the storage term makes bf16 weights' tolerance wider than fp32's
    assert analytic_bound(moved, torch.bfloat16) > analytic_bound(moved, torch.float32) > 0.03 * moved
    summary = summarize_agreement([ok, off])
    assert summary["flagged"] and summary["worst"]["name"] == "twice" and len(summary["rows"]) == 2
    assert summary["error"] == pytest.approx(math.hypot(ok.diff, off.diff) / math.hypot(ok.norm, off.norm))
    assert not summarize_agreement([ok])["flagged"]


def test_agreement_refuses_what_it_cannot_compare():
    a = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="shapes differ"):
        matrix_agreement("m", a, a, torch.zeros(4, 5))
    with pytest.raises(ValueError, match="unknown preset 'nope'; valid names: tiny"):
        build_model("nope", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="no matrices"):
        summarize_agreement([])
    same = matrix_agreement("still", a, a, a)  # nothing moved, nothing differs
    assert same.ratio == 0.0 and matrix_agreement("moved", a, a, torch.ones(4, 4)).ratio == math.inf


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
def test_collective_counter_counts_each_call_once_by_kind(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        real = dist.broadcast
        with CollectiveCounter() as counter:
            dist.broadcast(torch.zeros(10), src=0)
            dist.all_reduce(torch.zeros(3, dtype=torch.float64))
            out = torch.zeros(4)
            dist.all_gather_into_tensor(out, torch.ones(4))  # torch 2.13: forwards to all_gather_single
            dist.all_gather([torch.zeros(2)], torch.ones(2))
        assert dist.broadcast is real and counter.as_dict() == {
            "all_gather": {"calls": 2, "bytes": 16 + 8}, "all_reduce": {"calls": 1, "bytes": 24},
            "broadcast": {"calls": 1, "bytes": 40}}
        assert out.tolist() == [1.0] * 4  # the real collectives ran
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_every_build_of_a_preset_has_the_same_weights(preset):
    (a, predicate), (b, _) = (build_model(preset, torch.device("cpu"), torch.bfloat16) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    muon = [n for n, p in a.named_parameters() if predicate(n, p)]
    assert muon and not any("router" in n or "embeddings" in n or "lm_head" in n for n in muon)
    assert (preset == "moe-tiny") == any(p.ndim == 3 for n, p in a.named_parameters() if n in muon)
