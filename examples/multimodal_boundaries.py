"""Custom hook boundaries for a nested multimodal model, runnable as is.

    torchrun --nproc_per_node 2 examples/multimodal_boundaries.py

A toy vision-language model shaped like Qwen-VL: a vision tower (``vision.blocks.N``), a projector
(``merger``), a decoder (``decoder.layers.N``) and a head. ``hook_boundary_predicate`` names the modules
whose forward should fetch their dedicated weights: each vision block, each decoder layer, and the
projector. With ``hook_boundary_strict=True`` (the default) a dedicated weight outside every matching
module is an error that names it, instead of a silent per-Linear boundary.
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

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

DIM, VOCAB, PATCHES, TEXT = 64, 96, 8, 12


class VisionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv_proj = nn.Linear(DIM, 3 * DIM)
        self.out_proj = nn.Linear(DIM, DIM)
        self.fc_proj = nn.Linear(DIM, 2 * DIM)
        self.fc_out_proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(self.norm(x)).chunk(3, dim=-1)
        x = x + self.out_proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.fc_out_proj(F.gelu(self.fc_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = F.scaled_dot_product_attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), is_causal=True)
        x = x + self.o_proj(a)
        return x + self.down_proj(F.silu(self.up_proj(x)))


class Merger(nn.Module):
    """Vision features -> decoder embedding space."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class ToyVLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Module()
        self.vision.patch_embed = nn.Linear(16, DIM)
        self.vision.blocks = nn.ModuleList(VisionBlock() for _ in range(2))
        self.merger = Merger()
        self.decoder = nn.Module()
        self.decoder.embed = nn.Embedding(VOCAB, DIM)
        self.decoder.layers = nn.ModuleList(DecoderLayer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, patches: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        v = self.vision.patch_embed(patches)
        for block in self.vision.blocks:
            v = block(v)
        x = torch.cat([self.merger(v), self.decoder.embed(tokens)], dim=1)
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.head(x[:, PATCHES:])
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def is_boundary(module: nn.Module) -> bool:
    return isinstance(module, (VisionBlock, DecoderLayer, Merger))


def predicate(name: str, p: nn.Parameter) -> bool:
    return p.ndim == 2 and name.endswith("proj.weight")


def batches(steps: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        patches = torch.randn(batch, PATCHES, 16, generator=gen)
        tokens = torch.randint(0, VOCAB, (batch, TEXT), generator=gen)
        yield patches, tokens, (tokens + 1) % VOCAB


def build(mesh, seed: int = 0) -> ToyVLM:
    torch.manual_seed(seed)
    model = ToyVLM()
    dmuon.dedicate_params(model, mesh, predicate, hook_boundary_predicate=is_boundary)
    for block in model.vision.blocks:
        fully_shard(block, mesh=mesh)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(init_device_mesh("cpu", (world,)))
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3)
    per = 8 // world
    losses = []
    for patches, tokens, labels in batches(15, 8):
        sl = slice(rank * per, (rank + 1) * per)
        optimizer.zero_grad()
        loss = model(patches[sl], tokens[sl], labels[sl])
        loss.backward()
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    ok, text = loss_fell(losses, by=0.3)  # reaches about -55% on 2 CPU ranks
    if rank == 0:
        groups = sorted(g.fqn for g in model._dmuon_state.groups)
        print("hook boundaries:", ", ".join(groups))
        print(f"multimodal_boundaries: {'OK' if ok else 'FAILED'} {text}")
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the logging all_reduce above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer, loss
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
