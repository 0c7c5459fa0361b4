"""DistributedDataParallel instead of FSDP2 (issue 15, item 4): DDP leaves the dedicated params to dmuon through
its own ignore list and averages the rest; training matches the single-process oracle at 2 ranks, with and
without no_sync accumulation, and the model state dict is the plain model's."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import dmuon
from tests._asserts import assert_close_to, rel_err
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, batches, build_model, full_weights, muon_kwargs, projection_predicate, \
    train_oracle

STEPS = 5


def ddp_job(rank: int, world: int, accum: int) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    ddp = DistributedDataParallel(model)
    opt = dmuon.Muon(ddp, **muon_kwargs())
    per = GLOBAL_BATCH // world
    micro = per // accum
    losses, first_grads = [], {}
    for step, (tok, tgt) in enumerate(batches(STEPS)):
        opt.zero_grad()
        total = 0.0
        for i in range(accum):
            lo = rank * per + i * micro
            with dmuon.no_sync(ddp) if i < accum - 1 else contextlib.nullcontext():
                loss = ddp(tok[lo:lo + micro].to(device()), tgt[lo:lo + micro].to(device())).loss / accum
                loss.backward()
            total += loss.item()
        if step == 0:  # Adam and NS are scale-invariant: check the averaging itself, once
            counts = dmuon.diagnostics.comm_counts(model)
            owned = dmuon.get_owned_params(model)
            first_grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
                           if p.grad is not None and (n in owned or not dmuon.runtime.param.is_dedicated(p))}
        opt.step()
        logged = torch.tensor(total, device=device())
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    ignored = set(ddp.parameters_to_ignore)
    return {"losses": losses, "weights": full_weights(model), "ignored": sorted(ignored), "grads": first_grads,
            "replicated_all_reduces": counts["replicated_grad_all_reduce"]["calls"],
            "dedicated": sorted(dmuon.get_dedicated_params(model)),
            "state_keys": sorted(dmuon.get_model_state_dict(ddp))}


@pytest.fixture(scope="module")
def oracle() -> dict:
    return train_oracle(STEPS)


@pytest.fixture(scope="module")
def full_batch_grads() -> dict:
    model = build_model().to(device())
    tok, tgt = batches(1)[0]
    model(tok.to(device()), tgt.to(device())).loss.backward()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_matches_the_oracle(oracle, full_batch_grads, accum):
    results = run_distributed(ddp_job, 2, accum)
    for r in results:
        # each gradient averaged exactly once: by DDP (plain params) or by dmuon (dedicated, on the owner)
        assert len(r["grads"]) > 5
        assert r["replicated_all_reduces"] == 0, "DDP averages the plain params: dmuon must not do it again"
        for n, g in r["grads"].items():
            assert rel_err(g, full_batch_grads[n]) <= 1e-4, (accum, n, rel_err(g, full_batch_grads[n]))
        assert r["ignored"] == r["dedicated"], "DDP must leave exactly the dedicated params to dmuon"
        assert r["state_keys"] == sorted(oracle["weights"]), "the state dict is the plain model's"
        assert_close_to(r, oracle, f"DDP, accum {accum}")


def ddp_first_job(rank: int, world: int) -> str:
    ddp = DistributedDataParallel(build_model())
    try:
        dmuon.dedicate_params(ddp, init_device_mesh("cpu", (world,)), projection_predicate)
    except ValueError as e:
        return str(e)
    return ""


def test_dedicate_params_after_ddp_is_refused():
    for msg in run_distributed(ddp_first_job, 2):
        assert "DistributedDataParallel" in msg and "then wrap it" in msg, msg
