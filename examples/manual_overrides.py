"""docs/guides/gradient-accumulation.md and docs/guides/checkpoints.md as one program, runnable as is.

    torchrun --nproc_per_node 2 examples/manual_overrides.py

Trains with gradient accumulation as the gradient-accumulation guide writes it (``dmuon.no_sync`` on all
but every ``accum_steps``-th micro-batch), then saves a full checkpoint as the checkpoints guide's "Full and
topology-free" section does (collective state-dict calls, ``torch.save`` on rank 0), loads it into a
*fresh* model and optimizer, and checks that the restored model computes the same loss. Exits non-zero if anything differs. CUDA (NCCL) when available, else CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # custom_loop.py's model and data
from custom_loop import BATCH_PER_RANK, MarkovTokens, MyModel  # noqa: E402

import dmuon  # noqa: E402  (custom_loop made a source checkout importable)
from dmuon.tools.launch import main_or_spawn  # noqa: E402

ACCUM_STEPS = 4
OPTIMIZER_STEPS = 4


def build(device: torch.device, mesh, seed: int):
    torch.manual_seed(seed)
    model = MyModel().to(device)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)


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
    model, optimizer = build(device, mesh, seed=0)

    micro = BATCH_PER_RANK // ACCUM_STEPS
    dataset = MarkovTokens(OPTIMIZER_STEPS * BATCH_PER_RANK * world_size)
    dataloader = DataLoader(dataset, batch_size=micro, sampler=DistributedSampler(dataset, shuffle=False))
    accum_steps = ACCUM_STEPS

    # Gradient accumulation (docs/guides/gradient-accumulation.md's loop, plus moving the batch to the device).
    for i, batch in enumerate(dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        ctx = dmuon.no_sync(model) if (i + 1) % accum_steps != 0 else nullcontext()
        with ctx:
            loss = model(batch).loss / accum_steps
            loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                print(f"optimizer step {(i + 1) // accum_steps}: last micro-batch loss {loss.item() * accum_steps:.4f}")

    # Before checkpoint save in HSDP async mode: drain pending broadcasts (nothing pending on a 1-D mesh).
    dmuon.wait_all_replicate_broadcasts(model)

    # checkpoint_save.py
    path = os.path.join(tempfile.gettempdir(), f"dmuon_manual_overrides_{os.environ.get('MASTER_PORT', '0')}.pt")
    model_sd = dmuon.get_model_state_dict(model)      # drains async work first
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
    if dist.get_rank() == 0:  # a temporary name, then a rename: a crash mid-write keeps the previous file
        torch.save({"model": model_sd, "optim": optim_sd}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()

    fresh_model, fresh_optimizer = build(device, mesh, seed=1)
    ckpt = torch.load(path, map_location="cpu")
    dmuon.set_model_state_dict(fresh_model, ckpt["model"])
    dmuon.set_optimizer_state_dict(fresh_model, fresh_optimizer, ckpt["optim"])

    batch = next(iter(DataLoader(dataset, batch_size=2)))
    probe = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        before, after = model(probe).loss.item(), fresh_model(probe).loss.item()
    restored = dmuon.get_model_state_dict(fresh_model)
    same = before == after and all(torch.equal(restored[k], v) for k, v in model_sd.items())
    dist.barrier()
    if rank == 0:
        os.remove(path)
        print(f"manual_overrides: {'OK' if same else 'FAILED'} restored loss {after:.6f} (original {before:.6f})")
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the barrier above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer, fresh_model, fresh_optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
