"""A plain Accelerate loop around a model that dmuon + FSDP2 already distributed.

    torchrun --nproc_per_node 2 examples/accelerate_dmuon.py [--output_dir DIR]

``Accelerator()`` starts the process group; the model is built, given owners with
``dmuon.dedicate_params`` and sharded with ``fully_shard`` as in docs/guides/custom-loop.md; then everything
goes through ``accelerator.prepare`` as usual. With ``import dmuon.integrations.hf`` Accelerate leaves
the model unwrapped (no DDP; autocast / compile as configured), ``accelerator.accumulate`` defers
gradient traffic with ``dmuon.no_sync``, ``accelerator.clip_grad_norm_(model.parameters(), ...)`` is
``dmuon.clip_grad_norm_`` and ``accelerator.save_model`` gathers the full weights for the main process.
The package docstring of ``dmuon/integrations/hf/__init__.py`` lists which Accelerate features apply.

Runs on CUDA (NCCL) when available, otherwise CPU (gloo; ``Accelerator(cpu=True)`` makes Accelerate see
the torchrun ranks). Exits non-zero if the loss did not fall by the margin its last line states
(``dmuon.tools.verdict``) or the saved weights do not match.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

try:
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # an extra this example needs; say which, not just ModuleNotFoundError
    sys.exit(f"accelerate_dmuon: needs the [hf] extra (transformers, accelerate, safetensors): "
             f"pip install -e \".[hf]\" (missing: {e.name})")

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell
import dmuon.integrations.hf  # noqa: F401  (Trainer / Accelerate glue for dmuon models)

VOCAB = 64
SEQ_LEN = 32
EPOCHS = 3
ACCUM = 2
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MarkovTokens(Dataset):
    """Token sequences from a fixed random Markov chain (4 likely successors per token), identical on
    every rank; ``labels`` = ``input_ids`` (the model shifts)."""

    def __init__(self, n_samples: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
        transition = torch.zeros(VOCAB, VOCAB)
        for tok in range(VOCAB):
            transition[tok, torch.randperm(VOCAB, generator=gen)[:4]] = probs
        seq = torch.empty(n_samples, SEQ_LEN, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (n_samples,), generator=gen)
        for t in range(SEQ_LEN - 1):
            seq[:, t + 1] = torch.multinomial(transition[seq[:, t]], 1, generator=gen).squeeze(1)
        self.seq = seq

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.seq[i], "labels": self.seq[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=None,
                        help="where save_model writes the weights (default: a temporary folder, removed at the end)")
    return parser.parse_args(argv)


def main(cli: argparse.Namespace) -> int:
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=ACCUM)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    # Every rank must name the same folder: the main process picks the temporary one and tells the others.
    holder = [cli.output_dir or (tempfile.mkdtemp(prefix="accelerate_dmuon_") if accelerator.is_main_process
                                 else None)]
    dist.broadcast_object_list(holder, src=0)
    output_dir = holder[0]

    torch.manual_seed(0)  # same init on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config).to(accelerator.device)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    loader = DataLoader(MarkovTokens(32), batch_size=2, shuffle=True)
    # A prepared scheduler steps once per process for every optimizer step (Accelerate's convention for
    # per-sample schedules), so count its horizon in those units. It scales the Muon and AdamW groups.
    updates = EPOCHS * len(loader) // (accelerator.num_processes * ACCUM)
    horizon = updates * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / horizon))

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses: list[float] = []
    norm = torch.zeros(())
    for epoch in range(EPOCHS):
        window: list[torch.Tensor] = []
        for batch in loader:
            with accelerator.accumulate(model):  # dmuon.no_sync on all but the last micro-batch
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # dmuon.clip_grad_norm_
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.append(loss.detach())
        epoch_loss = accelerator.reduce(torch.stack(window).mean(), reduction="mean").item()
        losses.append(epoch_loss)
        accelerator.print(f"epoch {epoch + 1}/{EPOCHS}  loss {epoch_loss:.4f}  grad norm {float(norm):.4f}  "
                          f"lr muon {optimizer.param_groups[0]['lr']:.5f} adamw {optimizer.param_groups[1]['lr']:.6f}")

    accelerator.save_model(model, output_dir)  # weights gathered on every rank, written by the main process
    accelerator.wait_for_everyone()
    trained = dmuon.get_model_state_dict(model, rank0_only=True)  # collective
    ok, text = loss_fell(losses, by=0.05)  # epoch means: epochs 2-3 average about -12% on 2 CPU ranks
    if accelerator.is_main_process:
        import safetensors.torch

        saved = safetensors.torch.load_file(os.path.join(output_dir, "model.safetensors"))
        same = saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in trained)
        ok = ok and same
        print(f"saved weights match the trained model: {same}", flush=True)
        verdict = "OK" if ok else "FAILED"
        print(f"accelerate_dmuon: {verdict} {text}", flush=True)
    flag = torch.tensor([1.0 if ok else 0.0], device=accelerator.device)
    ok_everywhere = accelerator.reduce(flag, reduction="sum").item() == accelerator.num_processes
    if accelerator.is_main_process and cli.output_dir is None:  # every rank is past the reduce: nobody reads it
        shutil.rmtree(output_dir, ignore_errors=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the verdict's reduce above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, optimizer
    gc.collect()
    accelerator.end_training()
    return 0 if ok_everywhere else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
