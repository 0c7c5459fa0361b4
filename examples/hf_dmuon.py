"""docs/guides/hf-transformers.md as a program: a HF causal LM in your own loop, runnable as is.

    torchrun --nproc_per_node 2 examples/hf_dmuon.py [--arch llama|qwen2] [--bf16]

The guide's call sequence (README.md's complete script, with HF module names) except where this machine
forces a change: the model is built from a small config (``AutoModelForCausalLM.from_config``) instead of
downloaded with ``from_pretrained``, the data is synthetic, and it runs on CPU/gloo when there is no GPU.
Exits non-zero if the loss did not fall by the margin its last line states (``dmuon.tools.verdict``).
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

try:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
except ImportError as e:  # an extra this example needs; say which, not just ModuleNotFoundError
    sys.exit(f"hf_dmuon: needs the [hf] extra (transformers, accelerate, safetensors): "
             f"pip install -e \".[hf]\" (missing: {e.name})")

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config(arch: str):
    """A few-layer config of the real architecture: no download, seconds on a CPU."""
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)


def dataloader(steps: int, batch: int, seq: int, rank: int, world: int, device: torch.device):
    """Synthetic batches: a repeating pattern with noise, so the loss has somewhere to go."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        base = torch.arange(seq).repeat(batch * world, 1) % 16
        ids = (base + torch.randint(0, 2, base.shape, generator=gen) * 16) % 128
        ids = ids[rank * batch : (rank + 1) * batch].to(device)
        yield {"input_ids": ids, "labels": ids}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama",
                        help="the HF model class, built from a small config (default llama)")
    parser.add_argument("--bf16", action="store_true", help="build the model in bfloat16 (default float32)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    device_type = "cuda" if use_cuda else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config(args.arch), dtype=torch.bfloat16 if args.bf16 else torch.float32,
    ).to(device_type)

    # Step 1: mark dedicated params BEFORE fully_shard.
    dmuon.dedicate_params(
        model, mesh,
        predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJECTIONS),
    )
    # Step 2: apply FSDP2 — dedicated params are skipped automatically.
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # Step 3: use dmuon.Muon.
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    losses = []
    for batch in dataloader(args.steps, 4, 32, dist.get_rank(), dist.get_world_size(), torch.device(device_type)):
        optimizer.zero_grad()
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        logged = outputs.loss.detach().float()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
        if dist.get_rank() == 0:
            print(f"step {len(losses):>2}  loss {losses[-1]:.4f}", flush=True)
    ok, text = loss_fell(losses, by=0.2)  # reaches about -40% on 2 CPU ranks
    if dist.get_rank() == 0:
        print(f"hf_dmuon ({args.arch}{', bf16' if args.bf16 else ''}): {'OK' if ok else 'FAILED'} {text}", flush=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the logging all_reduce above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer, outputs
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
