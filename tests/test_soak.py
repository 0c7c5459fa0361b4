"""A 120-step soak on 4 gloo ranks (issue 13): unused matrices, ``no_sync`` accumulation whose micro-batches
run different layers, and a save / restore into a freshly built model every 30 steps (full state dicts
through ``torch.save`` / ``torch.load``, and once through ``torch.distributed.checkpoint``). The run must be
bit-identical with its twin, which trains the same 120 steps without ever restoring. (200 steps with a
restore every 50 until the suite outgrew its 10-minute budget: the same restores, 30 steps apart.)

Both runs are one job and share their first 30 steps: at the first restore the trained pair is saved, a fresh
pair loads the checkpoint and goes on as the restored run, and the saved pair then goes on as the twin (so the
save must not disturb the model it was taken from either)."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests._asserts import assert_bitwise
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import CFG4, GLOBAL_BATCH, RoutedLlama, batches, full_weights, muon_kwargs, projection_predicate

WORLD = 4
STEPS = 120
RESTORE_AT = {30: "torch.save", 60: "dcp", 90: "torch.save"}
#: per step (cycled): the layers each of the two micro-batches runs; the first is inside no_sync
ROUTES = [((0, 1, 2, 3), (0, 2)), ((1, 3), (0, 1, 2, 3)), ((0, 1, 2, 3), (0, 1, 2, 3)), ((2,), (3, 1))]


def _build(seed: int):
    mesh = init_device_mesh(DEVICE_TYPE, (WORLD,))
    torch.manual_seed(seed)
    model = RoutedLlama(CFG4)
    model.init_weights(seed)
    model.layers[1].mlp.unused_proj = torch.nn.Linear(CFG4.dim, CFG4.dim, bias=False)  # never runs
    model.to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, **muon_kwargs())


def _step(model, opt, rank: int, tok: torch.Tensor, tgt: torch.Tensor, routes) -> float:
    per = GLOBAL_BATCH // WORLD
    micro = per // len(routes)
    opt.zero_grad()
    total = 0.0
    for i, route in enumerate(routes):
        model.route = route
        lo = rank * per + i * micro
        with dmuon.no_sync(model) if i < len(routes) - 1 else contextlib.nullcontext():
            loss = model(tok[lo:lo + micro].to(device()), tgt[lo:lo + micro].to(device())).loss / len(routes)
            loss.backward()
        total += loss.item()
    opt.step()
    return total


def _restore(model, opt, rank: int, how: str, folder: str):
    """Save ``model`` / ``opt``, build a fresh pair (another init) and load the checkpoint into it."""
    if how == "dcp":
        dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                  "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}, checkpoint_id=folder)
        model, opt = _build(seed=99)
        sd = {"model": dmuon.get_model_state_dict(model, sharded=True),
              "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}
        dcp.load(sd, checkpoint_id=folder)
        dmuon.set_model_state_dict(model, sd["model"])
        dmuon.set_optimizer_state_dict(model, opt, sd["optim"])
        return model, opt
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ckpt.pt")
    ckpt = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    if rank == 0:
        torch.save(ckpt, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    model, opt = _build(seed=99)
    ckpt = torch.load(path)
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"])
    return model, opt


def _train(model, opt, rank: int, data, start: int, stop: int, restore: bool, root: str) -> tuple[list[float], object]:
    """Steps ``start`` to ``stop`` (restoring at the ``RESTORE_AT`` steps among them if ``restore``); returns the
    losses and the model that trained last."""
    losses = []
    for step in range(start, stop):
        losses.append(_step(model, opt, rank, *data[step], ROUTES[step % len(ROUTES)]))
        how = RESTORE_AT.get(step + 1) if restore else None
        if how is not None:
            model, opt = _restore(model, opt, rank, how, os.path.join(root, f"step{step + 1}"))
    return losses, model


def _result(losses: list[float], model) -> dict:
    owned_grads = dmuon.get_owned_grads(model)
    return {"losses": losses, "weights": full_weights(model),
            "unused_grad": owned_grads.get("layers.1.mlp.unused_proj.weight", "not owned here")}


def soak_job(rank: int, world: int, root: str) -> dict:
    """The restored run and its twin, sharing their first ``min(RESTORE_AT)`` steps (see the module docstring)."""
    data = batches(STEPS)
    first = min(RESTORE_AT)
    model, opt = _build(seed=0)
    prefix, _ = _train(model, opt, rank, data, 0, first, False, root)
    fresh, fresh_opt = _restore(model, opt, rank, RESTORE_AT[first], os.path.join(root, f"step{first}"))
    losses, fresh = _train(fresh, fresh_opt, rank, data, first, STEPS, True, root)
    restored = _result(prefix + losses, fresh)
    del fresh, fresh_opt
    losses, model = _train(model, opt, rank, data, first, STEPS, False, root)
    return {"restored": restored, "twin": _result(prefix + losses, model)}


def test_soak_with_restores_is_bit_identical_to_its_twin():
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(soak_job, WORLD, root)
    restored, twin = [r["restored"] for r in runs], [r["twin"] for r in runs]
    for rank in range(WORLD):
        assert_bitwise(restored[rank], twin[rank], f"rank {rank}: restored every 30 steps vs uninterrupted")
        assert restored[rank]["losses"] == twin[rank]["losses"], f"rank {rank}: losses differ"
        assert not isinstance(restored[rank]["unused_grad"], torch.Tensor), "the unused matrix never gets a gradient"
        assert all(torch.equal(v, restored[0]["weights"][k]) for k, v in restored[rank]["weights"].items()), \
            f"rank {rank} holds other weights than rank 0"
    unused = twin[0]["weights"]["layers.1.mlp.unused_proj.weight"]
    assert torch.isfinite(unused).all()
    losses = twin[0]["losses"]
    assert len(losses) == STEPS, len(losses)
    assert sum(losses[-20:]) < sum(losses[:20]), "the soak must actually train"
