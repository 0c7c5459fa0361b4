"""Gradient accumulation with dmuon.no_sync: 4 micro-batches (3 inside no_sync, the last outside) equal
one step on the whole batch, under Z3 and Z2, and nothing but weights travels inside no_sync."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import projection_predicate
from tests._asserts import assert_bitwise, assert_close_to, rel_err
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import (
    ADAMW_HP,
    CFG4,
    GLOBAL_BATCH,
    KJ,
    MUON_HP,
    RoutedLlama,
    RunOptions,
    batches,
    full_weights,
    muon_kwargs,
    train_dmuon,
)

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS = 10
ACCUM = 4


def accumulation_job(rank: int, world: int) -> dict:
    out = {}
    for zero, raf in (("z3", True), ("z2", False)):
        out[f"one_{zero}"] = train_dmuon(rank, world, RunOptions(steps=STEPS, reshard_after_forward=raf))
        out[f"accum_{zero}"] = train_dmuon(rank, world, RunOptions(steps=STEPS, reshard_after_forward=raf, accum=ACCUM))
        out[f"accum_nofsdp_{zero}"] = train_dmuon(
            rank, world, RunOptions(steps=3, reshard_after_forward=raf, accum=ACCUM, fsdp=False))
    # the other 2-rank checks of this file share the launch
    out["stash_hook"] = stash_hook_job(rank, world)
    out.update({f"skipped_{fsdp}": skipped_layer_job(rank, world, fsdp) for fsdp in (True, False)})
    out["grad_after_backward"] = grad_after_backward_job(rank, world)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # 2 ranks x global batch 8 = 4 samples per rank, so each micro-batch is one sample
    return run_distributed(accumulation_job, 2)


@pytest.mark.parametrize("zero", ["z3", "z2"])
def test_accumulated_step_matches_full_batch_step(runs, zero):
    one, acc = runs[0][f"one_{zero}"], runs[0][f"accum_{zero}"]
    assert_close_to(acc, one, f"{zero} accumulated vs one step")
    for res in runs[1:]:  # and every rank agrees bit for bit
        assert res[f"accum_{zero}"]["losses"] == acc["losses"]


@pytest.mark.parametrize("zero", ["z3", "z2"])
@pytest.mark.parametrize("variant", ["", "nofsdp_"])
def test_no_gradient_traffic_inside_no_sync(runs, zero, variant):
    r = runs[0][f"accum_{variant}{zero}"]
    plain_params = variant == "nofsdp_"  # without fully_shard dmuon averages the plain params itself
    P = r["P"]
    assert len(r["micro_counts"]) == ACCUM * len(r["losses"])
    for inside, c in r["micro_counts"]:
        if inside:
            assert c["reduce"]["calls"] == 0 and c["replicated_grad_all_reduce"]["calls"] == 0, c
        else:
            assert c["reduce"]["elements"] == P, c
            assert c["replicated_grad_all_reduce"]["calls"] == (1 if plain_params else 0), c
        # weights still travel for every micro-batch
        assert c["forward_broadcast"]["elements"] == P, c
        assert c["backward_broadcast"]["elements"] == (P if zero == "z3" else 0), c


def stash_hook_job(rank: int, world: int) -> dict:
    from tests._dist import device
    from tests._training import batches, root_sharded

    model, opt = root_sharded(world)
    dps = [dp for dp in model._dmuon_state.dedicated() if dp.owner == rank]

    def armed() -> int:
        return sum(dp.stash_hook is not None for dp in dps)

    seen = []
    (t1, y1), (t2, y2) = ((t.to(device()), y.to(device())) for t, y in batches(2))
    opt.zero_grad()
    seen.append(armed())                         # fresh: no per-parameter pre-hook
    model(t1, y1).loss.backward()
    seen.append(armed())                         # backward finished the reduces: averages in .grad, armed
    model(t2, y2).loss.backward()                # accumulation without no_sync: the second backward
    seen.append(armed())                         # set them aside, reduced its own, added them back
    opt.step()
    opt.zero_grad()
    seen.append(armed())                         # grads gone: disarmed
    model(t1, y1).loss.backward()
    opt.step()
    seen.append(armed())                         # the step's reduce left grads in .grad
    opt.zero_grad(set_to_none=False)
    seen.append(armed())                         # zeroed, not None: stays armed
    del model
    return dict(seen=seen, owned=len(dps))


def test_stash_hook_lives_only_while_a_reduced_grad_can_be_accumulated_into(runs):
    for res in (r["stash_hook"] for r in runs):
        n = res["owned"]
        assert n > 0
        assert res["seen"] == [0, n, n, 0, n, n]


def one_rank_accumulation_job(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from tests._dist import DEVICE_TYPE, device
    from tests._training import KJ, batches, build_model, projection_predicate

    data = [(t.to(device()), y.to(device())) for t, y in batches(3)]
    plain = build_model().to(device())
    for tok, tgt in data:  # torch's own accumulation into .grad
        plain(tok, tgt).loss.backward()
    want = {n: p.grad.clone() for n, p in plain.named_parameters() if projection_predicate(n, p)}
    model = build_model().to(device())
    dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, (1,)), projection_predicate)
    dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")
    for tok, tgt in data:  # no no_sync: each backward "reduces", later ones accumulate on top
        model(tok, tgt).loss.backward()
    dmuon.wait_all_reduces(model)
    got = {n: p.grad.clone() for n, p in dmuon.get_owned_params(model).items()}
    del model
    return dict(same=sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want))


def test_one_rank_accumulation_without_no_sync_equals_torch_bitwise():
    # world size 1 hands the local gradients over without a copy; accumulation must still add up as torch's
    assert run_distributed(one_rank_accumulation_job, 1)[0]["same"]


# --------------------------------------------------------------------------------------------------- #
# A matrix that gets a gradient in a no_sync micro-batch but not in the last one                         #
# --------------------------------------------------------------------------------------------------- #
#: per micro-batch, the layers that run: layers 1 and 3 only in the first (no_sync) one
MICRO_ROUTES = ((0, 1, 2, 3), (0, 2))
SKIP_STEPS = 3


def _routed_model() -> RoutedLlama:
    torch.manual_seed(0)
    model = RoutedLlama(CFG4)
    model.init_weights(0)
    return model


def _micro(tok: torch.Tensor, i: int, ranks: range, world: int) -> torch.Tensor:
    """Micro-batch ``i`` of the given ranks' slices of the global batch, in rank order."""
    per = GLOBAL_BATCH // world
    micro = per // len(MICRO_ROUTES)
    return torch.cat([tok[r * per + i * micro : r * per + (i + 1) * micro] for r in ranks])


@rank_threads()
def _skipped_layer_oracle(world: int) -> dict:
    """One process, the same micro-batches of every rank at once, torch.optim.Muon + AdamW."""
    model = _routed_model()
    proj = [p for n, p in model.named_parameters() if projection_predicate(n, p)]
    om = torch.optim.Muon(proj, lr=MUON_HP.lr, weight_decay=MUON_HP.weight_decay, ns_coefficients=KJ)
    oa = torch.optim.AdamW([p for n, p in model.named_parameters() if not projection_predicate(n, p)],
                           **ADAMW_HP.group_entries())
    losses = []
    for tok, tgt in batches(SKIP_STEPS):
        om.zero_grad()
        oa.zero_grad()
        total = 0.0
        for i, route in enumerate(MICRO_ROUTES):
            model.route = route
            loss = model(_micro(tok, i, range(world), world), _micro(tgt, i, range(world), world)).loss
            (loss / len(MICRO_ROUTES)).backward()
            total += loss.item() / len(MICRO_ROUTES)
        om.step()
        oa.step()
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def skipped_layer_job(rank: int, world: int, fsdp: bool) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = _routed_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **muon_kwargs())
    losses = []
    for tok, tgt in batches(SKIP_STEPS):
        opt.zero_grad()
        total = 0.0
        for i, route in enumerate(MICRO_ROUTES):
            model.route = route
            with dmuon.no_sync(model) if i < len(MICRO_ROUTES) - 1 else contextlib.nullcontext():
                loss = model(_micro(tok, i, range(rank, rank + 1), world).to(device()),
                             _micro(tgt, i, range(rank, rank + 1), world).to(device())).loss
                (loss / len(MICRO_ROUTES)).backward()
            total += loss.item() / len(MICRO_ROUTES)
        opt.step()
        logged = torch.tensor(total, device=device())
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return {"losses": losses, "weights": full_weights(model)}


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "no_fsdp"])
def test_matrix_unused_in_the_last_micro_batch_is_averaged_once(runs, fsdp):
    """Layers 1 and 3 run only in the first micro-batch (inside no_sync): their dedicated gradients must
    still be averaged over the ranks, like the FSDP2 params around them (this used to leave each owner
    with its local part only: 2e-2 off the oracle after 3 steps)."""
    results = [r[f"skipped_{fsdp}"] for r in runs]
    oracle = _skipped_layer_oracle(2)
    skipped = [k for k in oracle["weights"] if k.startswith(("layers.1.", "layers.3.")) and "proj" in k]
    assert skipped, "the scenario must have dedicated matrices that skip the last micro-batch"
    assert_close_to(results[0], oracle, f"skipped layers, fsdp={fsdp}")
    for res in results[1:]:
        assert_bitwise(res, results[0], "every rank holds the same weights")


# --------------------------------------------------------------------------------------------------- #
# .grad after backward()                                                                                #
# --------------------------------------------------------------------------------------------------- #
def grad_after_backward_job(rank: int, world: int) -> dict:
    from tests._training import root_sharded

    model, _ = root_sharded(world)
    tok, tgt = batches(1)[0]
    per = GLOBAL_BATCH // world
    model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss.backward()
    # read .grad directly, as grad logging or a custom clip would: no dmuon call in between
    return {n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
            for n, p in dmuon.get_owned_params(model).items()}


@rank_threads()
def _half_batch_average(world: int) -> dict:
    """The ranks' gradients averaged as the reduce averages them: (g_0 + ... ) / world in fp32."""
    from tests._training import build_model

    tok, tgt = batches(1)[0]
    per = GLOBAL_BATCH // world
    total: dict = {}
    for r in range(world):
        model = build_model()
        model(tok[r * per:(r + 1) * per], tgt[r * per:(r + 1) * per]).loss.backward()
        for n, p in model.named_parameters():
            total[n] = p.grad if n not in total else total[n] + p.grad
    return {n: g / world for n, g in total.items()}


def test_owner_grad_holds_the_average_when_backward_returns(runs):
    """As under FSDP2 and DDP: no wait_all_reduces or step() needed before reading .grad (it used to be None
    on the owner until then)."""
    results = [r["grad_after_backward"] for r in runs]
    want = _half_batch_average(2)
    seen = 0
    for rank, grads in enumerate(results):
        for n, g in grads.items():
            assert g is not None, f"rank {rank}: {n}.grad is None after backward()"
            assert torch.equal(g, want[n]), (rank, n, rel_err(g, want[n]))
            seen += 1
    assert seen == 14, "every dedicated matrix is owned by one of the two ranks"
