"""Tensor parallelism x dmuon, runnable as is: training, clipping and a full state dict.

    torchrun --nproc_per_node 4 examples/tp_dmuon.py     # dp=2 x tp=2
    torchrun --nproc_per_node 2 examples/tp_dmuon.py     # dp=1 x tp=2
    python examples/tp_dmuon.py                          # starts 2 local ranks itself (dp=1 x tp=2)

Each block's MLP is split over "tp" with torch's own ``ColwiseParallel`` / ``RowwiseParallel``; dmuon owns
every MLP matrix over "dp" (each tp rank of the owner keeps its shard and its momentum) and updates it with
the Muon update of the *full* matrix: each matrix is gathered onto one tp rank of the owner's slot, which
runs Newton-Schulz on it, and the result's shards go back; FSDP2 shards the rest over "dp". The order is the
usual one: ``parallelize_module`` -> ``dmuon.dedicate_params(model, mesh)`` with the 2-D ("dp", "tp") mesh
-> ``fully_shard`` over ``mesh["dp"]`` -> ``dmuon.Muon``. The full state dict at the end has the unsplit
model's keys and shapes (it loads into a dp-only or a single-process model). CPU (gloo) when there is no
GPU. Exits non-zero if the loss did not fall by the margin its last line states (``dmuon.tools.verdict``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

TP, VOCAB, DIM, HIDDEN, LAYERS, SEQ, BATCH_PER_DP, STEPS = 2, 64, 64, 256, 2, 32, 8, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)  # ColwiseParallel: rows split over "tp"
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)  # RowwiseParallel: columns split over "tp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if world % TP:
        raise SystemExit(f"tp_dmuon: run an even number of ranks (tp={TP}), got {world}")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same init everywhere
    model = Net().to(device)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: n.endswith(("w1.weight", "w2.weight")))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)

    # a learnable toy task: each token predicts (token * 3 + 1) mod VOCAB; every dp rank its own batch
    dp_rank = mesh.get_coordinate()[0]
    gen = torch.Generator().manual_seed(100 + dp_rank)
    losses = []
    for _ in range(STEPS):
        tok = torch.randint(0, VOCAB, (BATCH_PER_DP, SEQ), generator=gen).to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tok).flatten(0, 1), ((tok * 3 + 1) % VOCAB).flatten())
        loss.backward()
        dmuon.clip_grad_norm_(model, 1.0)  # the norm of the whole model, TP shards included
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    full = dmuon.get_model_state_dict(model)  # collective: TP matrices whole, as an unsplit model has them
    fell, text = loss_fell(losses, by=0.3)  # reaches about -65% on 2 CPU ranks
    whole = tuple(full["layers.0.w1.weight"].shape) == (HIDDEN, DIM)
    ok = fell and whole
    if dist.get_rank() == 0:
        verdict = "OK" if ok else "FAILED" + ("" if whole else " (the state dict's TP matrices are not whole)")
        print(f"tp_dmuon: {verdict} dp={world // TP} x tp={TP}, {text}", flush=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the state dict's gathers above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
