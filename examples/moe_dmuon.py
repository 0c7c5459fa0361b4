"""docs/guides/moe.md's HF recipe as a program: a Qwen3-MoE (HF transformers 5's fused experts) in your own loop.

    torchrun --nproc_per_node 2 examples/moe_dmuon.py [--steps N] [--experts shards|owners]
    python examples/moe_dmuon.py          # starts 2 local ranks itself

The guide's call sequence with a model built from a small config (random weights, no download) and learned
top-k routing, on synthetic data; CPU/gloo when there are fewer than 2 GPUs. Muon takes the attention
projections and every expert, each expert's gate and up as two matrices (``blocks=``); the router, the
norms, the embeddings and the head stay on AdamW. It prints where each expert param lives (on FSDP2's
shards of the expert dim, ``E / W`` whole experts per rank, or on one owner rank with ``--experts owners``),
the loss per step, then saves the trained model with ``save_pretrained`` into a temporary folder, which
it deletes, and checks on rank 0 that ``from_pretrained`` of that folder computes the loss the trained
model computes. Exits non-zero unless the loss fell by the margin its last line states
(``dmuon.tools.verdict``) and the reloaded model agrees.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

try:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
except ImportError as e:  # an extra this example needs; say which, not just ModuleNotFoundError
    sys.exit(f"moe_dmuon: needs the [hf] extra (transformers, accelerate, safetensors): "
             f"pip install -e \".[hf]\" (missing: {e.name})")

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

VOCAB = 128
#: how close the reloaded model's loss must be to the trained model's (relative): the same weights, read
#: back from safetensors, on one process instead of two
RELOAD_RTOL = 1e-5


def tiny_config() -> Qwen3MoeConfig:
    """Two decoder layers of 4 experts (top 2), each expert a 96-row gate, a 96-row up and a down matrix."""
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def is_muon_matrix(name: str, p: nn.Parameter) -> bool:
    """The guide's predicate: every expert batch ``[E, m, n]`` (never the ``[E, n]`` expert biases some families
    have) and the attention / dense MLP projections; not the router (``mlp.gate.weight``), embeddings, head."""
    if ".experts." in name:
        return p.ndim == 3
    return p.ndim == 2 and name.endswith("_proj.weight")


def row_blocks(name: str, p: nn.Parameter) -> int | None:
    """Qwen3-MoE stores gate and up stacked as the rows of ``gate_up_proj`` ``[E, 2I, H]``: two matrices each."""
    return 2 if name.endswith("gate_up_proj") else None


def dataloader(steps: int, batch: int, seq: int, rank: int, world: int, device: torch.device):
    """Synthetic batches: a repeating pattern with noise, so the loss has somewhere to go."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        base = torch.arange(seq).repeat(batch * world, 1) % 16
        ids = (base + torch.randint(0, 2, base.shape, generator=gen) * 16) % VOCAB
        ids = ids[rank * batch:(rank + 1) * batch].to(device)
        yield {"input_ids": ids, "labels": ids}


def where_experts_live(model: nn.Module, plan: dmuon.OwnerPlan) -> list[str]:
    """One line per expert param of layer 0 (the others alike): its owner, or the experts each rank holds.
    Collective (each rank reports its own shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for name, p in model.named_parameters():
        if ".experts." in name and isinstance(p, DTensor):  # on FSDP2's shards of dim 0: torch.chunk's split
            step = -(-p.shape[0] // world)
            start = min(p.shape[0], rank * step)
            mine[name] = (start, start + p.to_local().shape[0])
    every = [None] * world
    dist.all_gather_object(every, mine)
    lines = []
    for name, p in model.named_parameters():
        if ".experts." not in name or not name.startswith("model.layers.0."):
            continue
        shape = "x".join(map(str, p.shape))
        if name in plan.owners:
            lines.append(f"  {name} [{shape}]: Muon on its owner, rank {plan.owners[name]}")
        elif name in mine:
            held = ", ".join(f"rank {r}: experts {a}..{b - 1}" for r, m in enumerate(every)
                             for a, b in [m[name]] if b > a)
            lines.append(f"  {name} [{shape}]: Muon on FSDP2's shards of the expert dim ({held})")
        else:
            lines.append(f"  {name} [{shape}]: AdamW")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--experts", choices=["shards", "owners"], default="shards",
                        help="where each expert's Newton-Schulz runs: FSDP2's shards (the default with E >= ranks) "
                             "or one owner rank per expert param (route 'muon')")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same weights on every rank
    model = AutoModelForCausalLM.from_config(tiny_config()).to(device)

    # Step 1: mark the Muon params BEFORE fully_shard: projections and experts, gate and up as two blocks.
    plan = dmuon.dedicate_params(
        model, mesh, predicate=is_muon_matrix, blocks=row_blocks,
        route=(lambda n, p: "muon" if p.ndim == 3 else None) if args.experts == "owners" else None,
    )
    # Step 2: FSDP2 per decoder layer, then the root.
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Step 3: dmuon.Muon, the only optimizer.
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    lines = where_experts_live(model, plan)
    if rank == 0:
        print("where the experts of layer 0 live (layer 1 alike):", *lines, sep="\n", flush=True)

    losses = []
    for batch in dataloader(args.steps, 4, 32, rank, world, device):
        optimizer.zero_grad()
        outputs = model(**batch)
        outputs.loss.backward()
        optimizer.step()
        logged = outputs.loss.detach().float()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
        if rank == 0:
            print(f"step {len(losses):>2}  loss {losses[-1]:.4f}", flush=True)

    # Save as HF does (full tensors: the experts [E, 2I, H] as HF stores them), reload on one process, compare.
    held_out = next(dataloader(1, 4, 32, 0, 1, device))  # the same batch on every rank
    model.eval()
    with torch.no_grad():
        trained = model(**held_out).loss.float().item()
    state = dmuon.get_model_state_dict(model)  # collective
    reloaded = trained
    if rank == 0:
        with tempfile.TemporaryDirectory(prefix="moe_dmuon_") as folder:
            model.save_pretrained(folder, state_dict=state)
            plain = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
            with torch.no_grad():
                reloaded = plain(**held_out).loss.float().item()
    same = abs(reloaded - trained) <= RELOAD_RTOL * abs(trained)
    ok, text = loss_fell(losses, by=0.2)
    verdict = torch.tensor([float(ok and same)], device=device)
    dist.broadcast(verdict, src=0)  # only rank 0 reloaded; every rank exits with its verdict
    if rank == 0:
        print(f"moe_dmuon ({args.experts}): {'OK' if verdict.item() else 'FAILED'} {text}; reloaded from "
              f"save_pretrained: loss {reloaded:.6f} vs {trained:.6f} (bound {RELOAD_RTOL:.0e} relative)", flush=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the verdict's broadcast above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer, outputs
    gc.collect()
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
