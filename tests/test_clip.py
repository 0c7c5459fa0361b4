"""dmuon.clip_grad_norm_: the global norm over dedicated (owner-held), FSDP2 DTensor and plain gradients
equals torch.nn.utils.clip_grad_norm_ on one process, on every rank, 1-D and HSDP, and clipped training
still matches the oracle."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.bench import make_mesh
from tests._asserts import WEIGHT_RTOL, rel_err
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, full_weights, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS = 4
MAX_NORM = 0.5  # below the gradient norms of this model, so clipping really happens


def _oracle() -> dict:
    model = build_model().to(device())
    muon = [p for n, p in model.named_parameters() if projection_predicate(n, p)]
    other = [p for n, p in model.named_parameters() if not projection_predicate(n, p)]
    om = torch.optim.Muon(muon, lr=0.01, weight_decay=0.01, ns_coefficients=KJ)
    oa = torch.optim.AdamW(other, lr=1e-3)
    norms, losses, inf_norms = [], [], []
    for tok, tgt in batches(STEPS):
        om.zero_grad()
        oa.zero_grad()
        loss = model(tok.to(device()), tgt.to(device())).loss
        loss.backward()
        inf_norms.append(max(p.grad.abs().max().item() for p in model.parameters()))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        om.step()
        oa.step()
        losses.append(loss.item())
    return {"norms": norms, "losses": losses, "inf_norms": inf_norms,
            "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def clip_job(rank: int, world: int, layout: str, via: str) -> dict:
    """``via="torch"``: clip with ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` as an
    unchanged script would (``import dmuon`` routes it; see [Note: torch's clip on a dmuon model])."""
    mesh = make_mesh(DEVICE_TYPE, world, replicate=2 if layout == "hsdp" else 1)
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    if layout != "plain":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3)
    per = GLOBAL_BATCH // world
    norms, inf_norms, losses = [], [], []
    for tok, tgt in batches(STEPS):
        opt.zero_grad()
        lo, hi = rank * per, (rank + 1) * per
        loss = model(tok[lo:hi].to(device()), tgt[lo:hi].to(device())).loss
        loss.backward()
        # the infinity norm first, with a bound it never reaches, so it clips nothing
        if via == "torch":
            inf_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=float("inf")).item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        else:
            inf_norms.append(dmuon.clip_grad_norm_(model, 1e9, norm_type=float("inf")).item())
            norms.append(dmuon.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        logged = loss.detach().clone()
        torch.distributed.all_reduce(logged, op=torch.distributed.ReduceOp.AVG)
        losses.append(logged.item())
    return {"norms": norms, "inf_norms": inf_norms, "losses": losses, "weights": full_weights(model)}


@pytest.fixture(scope="module")
def oracle() -> dict:
    return _oracle()


#: the 2-rank clipped trainings of ``two_ranks``: (layout, via)
TWO_RANK_CLIPS = (("fsdp", "dmuon"), ("plain", "dmuon"), ("fsdp", "torch"))


def two_rank_jobs(rank: int, world: int) -> dict:
    """Every 2-rank run of this file, in one launch: the clipped trainings, then the poisoned gradients."""
    out = {(layout, via): clip_job(rank, world, layout, via) for layout, via in TWO_RANK_CLIPS}
    out.update({bad: nonfinite_job(rank, world, bad) for bad in ("nan", "inf")})
    out["nan_weights"] = nan_weights_job(rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(two_rank_jobs, 2)


@pytest.mark.parametrize("world, layout, via", [(2, "fsdp", "dmuon"), (2, "plain", "dmuon"), (4, "hsdp", "dmuon"),
                                               (2, "fsdp", "torch")])
def test_norm_equals_single_process_norm_on_every_rank(oracle, two_ranks, world, layout, via):
    results = [r[layout, via] for r in two_ranks] if world == 2 else run_distributed(clip_job, world, layout, via)
    assert oracle["norms"][0] > MAX_NORM, "the test must actually clip"
    for rank, r in enumerate(results):
        assert r["norms"] == results[0]["norms"], f"rank {rank} sees another norm"
        # step 0 has identical weights, so the norm must match to float rounding
        assert abs(r["norms"][0] - oracle["norms"][0]) <= 1e-5 * oracle["norms"][0], (r["norms"][0], oracle["norms"][0])
        assert abs(r["inf_norms"][0] - oracle["inf_norms"][0]) <= 1e-5 * oracle["inf_norms"][0]
        for step, (got, want) in enumerate(zip(r["norms"], oracle["norms"])):
            assert abs(got - want) / want <= 1e-3, f"{layout} step {step}: {got} vs {want}"
        for step, (got, want) in enumerate(zip(r["losses"], oracle["losses"])):
            assert abs(got - want) / want <= 1e-4, f"{layout} step {step}: {got} vs {want}"
        for k, want in oracle["weights"].items():
            assert rel_err(r["weights"][k], want) <= WEIGHT_RTOL, k


def _poisonable(rank: int, world: int):
    """The model (root FSDP2) and ``poison(bad)``: fresh gradients of one batch, then ``bad`` in one element
    of the first matrix rank 1 owns, nowhere else; returns that matrix's name."""
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01)
    tok, tgt = batches(1)[0]
    per = GLOBAL_BATCH // world
    target = sorted(dmuon.get_owned_params(model, rank=1))[0]

    def poison(bad: str) -> str:
        opt.zero_grad()
        model(tok[rank * per:(rank + 1) * per].to(device()),
              tgt[rank * per:(rank + 1) * per].to(device())).loss.backward()
        if rank == 1:
            dmuon.get_owned_grads(model)[target].view(-1)[0] = float(bad)
        return target

    return model, opt, poison


def nonfinite_job(rank: int, world: int, bad: str) -> dict:
    """A NaN (or inf) in one gradient element of a matrix rank 1 owns, nowhere else. Each measurement gets
    fresh gradients: clipping by an infinite norm scales by 0, which turns an inf into a NaN (torch too)."""
    model, _, poison = _poisonable(rank, world)
    out = {}
    for norm_type in (2.0, float("inf")):
        poison(bad)
        out[norm_type] = dmuon.clip_grad_norm_(model, 1e9, norm_type=norm_type).item()
    poison(bad)
    try:
        dmuon.clip_grad_norm_(model, 1.0, error_if_nonfinite=True, norm_type=float("inf"))
        out["raised"] = ""
    except RuntimeError as e:
        out["raised"] = str(e)
    return out


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_nonfinite_gradient_on_one_rank_reaches_every_rank(two_ranks, bad):
    """torch.nn.utils.clip_grad_norm_ returns NaN (inf) for such a gradient, for every norm type; gloo's MAX
    alone would drop the NaN, so the infinity norm carries it as a flag."""
    def torch_norm(norm_type: float) -> float:
        return torch.nn.utils.get_total_norm([torch.tensor([1.0, 2.0]), torch.tensor([float(bad)])],
                                             norm_type=norm_type).item()

    results = [r[bad] for r in two_ranks]
    for rank, r in enumerate(results):
        for norm_type in (2.0, float("inf")):
            got, want = r[norm_type], torch_norm(norm_type)
            assert (got != got and want != want) or got == want, (rank, norm_type, got, want)
        assert "total norm" in r["raised"], (rank, r["raised"])


def nan_weights_job(rank: int, world: int) -> dict:
    """What a NaN gradient (one element of a matrix rank 1 owns) does to the weights after one step:
    without clipping, with clipping, and with ``error_if_nonfinite=True`` (the step skipped)."""
    out = {}
    for case in ("no_clip", "clip", "error_if_nonfinite"):
        model, opt, poison = _poisonable(rank, world)
        poisoned = poison("nan")
        if case == "clip":
            dmuon.clip_grad_norm_(model, 1.0)
        if case == "error_if_nonfinite":
            try:
                dmuon.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
            except RuntimeError:
                opt.zero_grad()  # what a training loop does with the error: skip this step
        opt.step()
        w = full_weights(model)
        out[case] = {"poisoned": poisoned, "nan": sorted(k for k, v in w.items() if torch.isnan(v).any()),
                     "all": sorted(w)}
    return out


def test_what_a_nan_gradient_does_to_the_weights(two_ranks):
    """As documented in README (Gradient clipping): without clipping only the matrix with the NaN gradient
    turns NaN; clipping by the NaN norm turns every trained weight NaN, on every rank (torch's clip does the
    same on one process); error_if_nonfinite=True raises on every rank before anything is scaled, so the
    step can be skipped and nothing turns NaN."""
    for rank, r in enumerate(r["nan_weights"] for r in two_ranks):
        assert r["no_clip"]["nan"] == [r["no_clip"]["poisoned"]], (rank, r["no_clip"])
        assert r["clip"]["nan"] == r["clip"]["all"], (rank, sorted(set(r["clip"]["all"]) - set(r["clip"]["nan"])))
        assert r["error_if_nonfinite"]["nan"] == [], (rank, r["error_if_nonfinite"])
