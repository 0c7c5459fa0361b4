"""dmuon under DeepSpeed ZeRO stage 2 (docs/guides/deepspeed.md as a program), runnable as is.

    python examples/deepspeed_dmuon.py                         # starts 2 local ranks (CPU: gloo; 2+ GPUs: NCCL)
    torchrun --nproc_per_node 2 examples/deepspeed_dmuon.py [--stage 1/3] [--bf16]

``import deepspeed`` first, then ``dmuon.dedicate_params`` (which installs dmuon's DeepSpeed glue),
``dmuon.Muon(model, ...)`` and ``deepspeed.initialize(model=model, optimizer=optimizer, config=...)``; the loop
is DeepSpeed's own (``engine.backward(loss); engine.step()`` per micro-batch, ``gradient_accumulation_steps``
decides the boundary, ``gradient_clipping`` clips by the norm of every gradient, the dedicated ones included).
After training it saves with ``engine.save_checkpoint``, loads into a fresh model and engine, and checks that
one more step gives the same loss on both. The model and data are the custom-loop example's. On the CPU
DeepSpeed needs ``DS_ACCELERATOR=cpu`` (set here when there is no GPU). Exits non-zero if the loss did not
fall by the margin its last line states (``dmuon.tools.verdict``) or the restored engine differs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: gloo between the ranks
try:
    import deepspeed
except ImportError as e:  # an extra this example needs; say which, not just ModuleNotFoundError
    sys.exit(f"deepspeed_dmuon: needs the [deepspeed] extra: pip install -e \".[deepspeed]\" (missing: {e.name})")

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell
from custom_loop import BATCH_PER_RANK, STEPS, MarkovTokens, MyModel  # noqa: E402 - this folder's example

ACCUM = 2  # micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps)


def build(stage: int, bf16: bool, mesh: object, device: torch.device) -> tuple[object, torch.nn.Module]:
    """The model, dmuon's two calls and the engine: what a training script does before its loop."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MyModel().to(device)
    if bf16:
        model = model.to(torch.bfloat16)  # DeepSpeed's bf16: cast before dedicate_params, as any cast
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n,
                          reduce_dtype=torch.float32 if bf16 else None, verbose=False)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, master_dtype=torch.float32 if bf16 else None)
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH_PER_RANK // ACCUM,
        "gradient_accumulation_steps": ACCUM,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="ZeRO stage (default 2)")
    parser.add_argument("--bf16", action="store_true", help="DeepSpeed's bf16 (fp32 Muon state on the owners)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    if not use_cuda:  # skip compiling DeepSpeed's shared-memory comm op (half a minute, needs a compiler)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))
    engine, model = build(args.stage, args.bf16, mesh, device)

    dataset = MarkovTokens(STEPS * BATCH_PER_RANK * world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_PER_RANK // ACCUM, sampler=sampler)
    losses: list[float] = []
    for i, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = engine(batch).loss
        engine.backward(loss)
        engine.step()  # the optimizer step at every ACCUM-th micro-batch: ZeRO's AdamW and dmuon's Muon
        if (i + 1) % ACCUM == 0:
            logged = loss.detach().float().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            losses.append(logged.item())
            if rank == 0:
                print(f"step {len(losses):>2}  loss {losses[-1]:.4f}  norm {engine.get_global_grad_norm():.3f}",
                      flush=True)

    # A checkpoint round trip: every rank saves (rank 0 the model file, each rank its own ZeRO file with its
    # matrices' Muon state), a fresh model and engine load it, and one more batch gives the same loss on both.
    probe = {k: v.to(device) for k, v in next(iter(loader)).items()}
    ckpt = [tempfile.mkdtemp(prefix="deepspeed_dmuon_") if rank == 0 else None]
    dist.broadcast_object_list(ckpt)  # one folder for every rank
    engine.save_checkpoint(ckpt[0], tag="final")
    fresh, _ = build(args.stage, args.bf16, mesh, device)
    fresh.load_checkpoint(ckpt[0], tag="final")
    with torch.no_grad():
        same = bool(torch.equal(engine(probe).loss, fresh(probe).loss))

    ok, text = loss_fell(losses, by=0.2)
    ok = ok and same
    if rank == 0:
        print(f"deepspeed_dmuon: {'OK' if ok else 'FAILED'} ZeRO-{args.stage}{' bf16' if args.bf16 else ''}, {text}; "
              f"restored engine {'matches' if same else 'DIFFERS'}", flush=True)
        import shutil

        shutil.rmtree(ckpt[0], ignore_errors=True)
    dist.barrier()
    # Free the engines first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the barrier above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del engine, fresh, model
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
