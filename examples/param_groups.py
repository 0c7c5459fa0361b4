"""Param groups the ``torch.optim`` way, on a dmuon model, runnable as is.

    torchrun --nproc_per_node 2 examples/param_groups.py

The usual day-one split: no weight decay on norms and biases, the embedding and the head on AdamW with
their own learning rate, and the MLP matrices on Muon with a smaller learning rate than the attention
matrices (which keep the constructor's). A warm-up ``LambdaLR`` scales every group from its own lr.
Groups name params by FQN here; parameter objects (taken after ``fully_shard``) and ``(name, param)``
pairs work too. Prints each group and exits non-zero if the loss did not decrease.
"""

from __future__ import annotations

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
from examples.custom_loop import BATCH_PER_RANK, STEPS, MarkovTokens, MyModel  # noqa: E402


def main() -> int:
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    if rank == 0:
        for group, names in zip(optimizer.param_groups, optimizer.group_fqns()):
            print(f"group {group['name']:<13} {group['kind']:<16} lr {group['lr']:.4g}  weight_decay "
                  f"{group['weight_decay']:<5}  {len(names)} params", flush=True)

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

    ok = losses[-1] < losses[0]
    if rank == 0:
        verdict = "OK" if ok else "FAILED (the loss did not decrease)"
        print(f"param_groups: {verdict} loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    del model, optimizer, scheduler  # free FSDP2 before the process group (see custom_loop.py)
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main))  # plain `python` starts 2 local ranks itself
