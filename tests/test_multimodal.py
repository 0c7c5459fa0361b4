"""Custom hook boundaries on a nested vision-language model (vision.blocks.N + merger + decoder.layers.N
+ head): the boundaries are the ones the predicate names, training matches the single-process oracle,
strict mode names a weight left outside every boundary, and the example runs under torchrun."""

from __future__ import annotations


import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from examples.multimodal_boundaries import DecoderLayer, VisionBlock, batches, build, predicate
from tests._asserts import assert_losses_close, torchrun
from tests._dist import run_distributed

STEPS = 8
KJ = (3.4445, -4.7750, 2.0315)


def _oracle() -> list[float]:
    from examples.multimodal_boundaries import ToyVLM

    torch.manual_seed(0)
    model = ToyVLM()
    om = torch.optim.Muon([p for n, p in model.named_parameters() if predicate(n, p)], lr=0.01,
                          weight_decay=0.0, ns_coefficients=KJ)
    oa = torch.optim.AdamW([p for n, p in model.named_parameters() if not predicate(n, p)], lr=1e-3)
    losses = []
    for patches, tokens, labels in batches(STEPS, 8):
        om.zero_grad()
        oa.zero_grad()
        loss = model(patches, tokens, labels)
        loss.backward()
        om.step()
        oa.step()
        losses.append(loss.item())
    return losses


def vlm_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (world,))
    model = build(mesh)
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3)
    per = 8 // world
    losses = []
    for patches, tokens, labels in batches(STEPS, 8):
        sl = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        loss = model(patches[sl], tokens[sl], labels[sl])
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    groups = sorted(g.fqn for g in model._dmuon_state.groups)
    # strict: a predicate that forgets the projector's module names the orphaned weight
    from examples.multimodal_boundaries import ToyVLM

    try:
        dmuon.dedicate_params(ToyVLM(), mesh, predicate,
                              hook_boundary_predicate=lambda m: isinstance(m, (VisionBlock, DecoderLayer)))
        strict_error = ""
    except ValueError as e:
        strict_error = str(e)
    return {"losses": losses, "groups": groups, "strict_error": strict_error}


def test_boundaries_parity_and_strict_mode():
    r = run_distributed(vlm_job, 2)[0]
    assert r["groups"] == ["decoder.layers.0", "decoder.layers.1", "merger", "vision.blocks.0", "vision.blocks.1"]
    assert_losses_close(r["losses"], _oracle(), "multimodal boundaries vs oracle")
    assert "'merger.proj.weight'" in r["strict_error"], r["strict_error"]


def test_example_runs_under_torchrun():
    proc = torchrun("examples/multimodal_boundaries.py")
    assert "multimodal_boundaries: OK" in proc.stdout, proc.stdout
