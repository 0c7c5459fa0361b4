"""dmuon with DistributedDataParallel instead of FSDP2, runnable as is.

    torchrun --nproc_per_node 2 examples/ddp_dmuon.py

``dmuon.dedicate_params`` first: it puts the dedicated matrices on DDP's own ignore list
(``_ddp_params_and_buffers_to_ignore``), so the ``DistributedDataParallel`` built next broadcasts and
all-reduces only the other parameters, and dmuon owns, broadcasts and reduces the matrices. Pass the DDP
model to ``dmuon.Muon`` (and to ``dmuon.no_sync`` for accumulation, which then also enters DDP's
``no_sync``). The model and data are the custom-loop example's. Exits non-zero if the loss did not fall
by the margin its last line states (``dmuon.tools.verdict``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell
from custom_loop import BATCH_PER_RANK, STEPS, MarkovTokens, MyModel  # noqa: E402 - this folder's example

ACCUM = 2  # micro-batches per step: all but the last under dmuon.no_sync


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
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = dmuon.Muon(ddp, lr=0.02, adamw_lr=1e-3)

    dataset = MarkovTokens(STEPS * BATCH_PER_RANK * world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_PER_RANK // ACCUM, sampler=sampler)

    losses: list[float] = []
    for i, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        last = (i + 1) % ACCUM == 0
        with contextlib.nullcontext() if last else dmuon.no_sync(ddp):
            loss = ddp(batch).loss / ACCUM
            loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
            logged = loss.detach().clone() * ACCUM
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            losses.append(logged.item())
            if rank == 0:
                print(f"step {len(losses):>2}  loss {losses[-1]:.4f}", flush=True)

    ok, text = loss_fell(losses, by=0.2)  # reaches about -35% on 2 CPU ranks
    if rank == 0:
        print(f"ddp_dmuon: {'OK' if ok else 'FAILED'} {text}", flush=True)
    # Free DDP (its reducer holds the process group) and the model before tearing the group down, on every
    # rank at the same point: a DDP model alive at destroy_process_group hung one gloo run at exit.
    dist.barrier()
    del ddp, optimizer, model
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
