"""Param groups the ``torch.optim`` way, on a dmuon model, runnable as is.

    torchrun --nproc_per_node 2 examples/param_groups.py

The usual day-one split: no weight decay on norms and biases, the embedding and the head on AdamW with
their own learning rate, and the MLP matrices on Muon with a smaller learning rate than the attention
matrices (which keep the constructor's). A warm-up ``LambdaLR`` scales every group from its own lr.
Groups name params by FQN here; parameter objects (taken after ``fully_shard``) and ``(name, param)``
pairs work too. Prints each group, and exits non-zero if the loss did not fall by the margin its last line
states (``dmuon.tools.verdict``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the examples package
import dmuon  # noqa: E402
from dmuon.tools.launch import main_or_spawn  # noqa: E402
from dmuon.tools.verdict import loss_fell  # noqa: E402
from examples.custom_loop import BATCH_PER_RANK, STEPS, MarkovTokens, MyModel  # noqa: E402


WARMUP = 5  # steps of linear learning-rate warm-up


def print_groups(optimizer: dmuon.Muon) -> None:
    """One row per named group: its algorithm, configured lr and weight decay, and its params over all ranks.

    ``optimizer.param_groups`` has one torch group per kind (a user AdamW group is two: FSDP2 shards and plain
    params; a Muon group holds only this rank's matrices), so rows merge a name's groups and count
    ``group_fqns()``, which lists every rank's. ``lr`` is the configured value: the scheduler keeps it as
    ``initial_lr`` and has already scaled ``group["lr"]`` to the first warm-up step's.
    """
    rows: dict[str, list] = {}
    for group, names in zip(optimizer.param_groups, optimizer.group_fqns()):
        algorithm = "muon" if group["kind"] == "muon" else "adamw"
        configured_lr = group.get("initial_lr", group["lr"])
        row = rows.setdefault(group["name"], [algorithm, configured_lr, group["weight_decay"], 0])
        row[3] += len(names)
    print(f"  {'group':<14} {'algorithm':<9} {'lr':>7} {'weight_decay':>12} {'params':>6}")
    for name, (algorithm, lr, wd, n) in rows.items():
        if n:
            print(f"  {name:<14} {algorithm:<9} {lr:>7.3g} {wd:>12.3g} {n:>6}")
    empty = [name for name, row in rows.items() if not row[3]]
    if empty:
        print(f"  (no params left for {', '.join(empty)}: the named groups took them all)")
    print(f"  lr as configured; the warm-up runs step 1 at 1/{WARMUP} of it and reaches it at step {WARMUP}",
          flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))
    torch.manual_seed(0)
    model = MyModel().to(device)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    dedicated = dmuon.get_dedicated_params(model)
    optimizer = dmuon.Muon(model, lr=0.02, weight_decay=0.01, adamw_lr=1e-3, adamw_weight_decay=0.1, param_groups=[
        {"name": "no_decay", "params": [n for n, p in model.named_parameters() if p.ndim < 2], "weight_decay": 0.0},
        {"name": "embed_head", "params": ["tok_embeddings.weight", "lm_head.weight"], "lr": 3e-3,
         "weight_decay": 0.0},
        {"name": "mlp", "params": [n for n in dedicated if ".mlp." in n], "lr": 0.01},
    ])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    if rank == 0:
        print_groups(optimizer)

    dataset = MarkovTokens(STEPS * BATCH_PER_RANK * world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    losses: list[float] = []
    for batch in DataLoader(dataset, batch_size=BATCH_PER_RANK, sampler=sampler):
        optimizer.zero_grad()
        loss = model({k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())

    ok, text = loss_fell(losses, by=0.2)  # reaches about -35% on 2 CPU ranks
    if rank == 0:
        print(f"param_groups: {'OK' if ok else 'FAILED'} {text}", flush=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the logging all_reduce above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer, scheduler
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
