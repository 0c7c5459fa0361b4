"""docs/guides/hf-trainer.md as a program, runnable as is.

    torchrun --nproc_per_node 2 examples/hf_trainer_dmuon.py [--output_dir DIR]

It follows the guide: a ``LlamaForCausalLM`` (tiny, built from a small ``LlamaConfig``: no download),
``dmuon.dedicate_params`` on the attention / MLP projections *before* ``fully_shard`` (per decoder layer,
then the root), ``dmuon.Muon`` passed to a plain ``transformers.Trainer`` through ``optimizers=``, and
``fsdp=""``. Trainer's defaults stay on: ``max_grad_norm=1.0`` (clipped by ``dmuon.clip_grad_norm_``),
its linear learning-rate schedule (it scales the Muon and the AdamW groups), and a checkpoint at the end
of training (gathered on every rank, written by rank 0). Rank 0 then loads that checkpoint with a plain
``AutoModelForCausalLM.from_pretrained`` and checks it against the trained weights.

``dmuon.dedicate_params`` in a script that imported transformers (or accelerate) installs
``dmuon.integrations.hf``, which teaches Trainer and Accelerate about dmuon models;
``dmuon.integrations.hf.DMuonTrainer`` is the same as an explicit drop-in subclass.

The data is a synthetic Markov-chain token set, so the loss falls within a few epochs. Runs on CUDA
(NCCL) when available, otherwise CPU (gloo; ``use_cpu=True`` makes Accelerate see the torchrun ranks).
Exits non-zero if the loss did not fall by the margin its last line states (``dmuon.tools.verdict``) or the
checkpoint does not match.
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
from torch.utils.data import Dataset

try:
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
except ImportError as e:  # an extra this example needs; say which, not just ModuleNotFoundError
    sys.exit(f"hf_trainer_dmuon: needs the [hf] extra (transformers, accelerate, safetensors): "
             f"pip install -e \".[hf]\" (missing: {e.name})")

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

VOCAB = 64
SEQ_LEN = 32
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MarkovTokens(Dataset):
    """Token sequences from a fixed random Markov chain (4 likely successors per token). Built from a
    fixed seed, so every rank holds the same dataset; ``labels`` = ``input_ids`` (the model shifts)."""

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


class LossLog(TrainerCallback):
    """Keeps the losses Trainer logs (averaged over ranks by Trainer itself)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=None,
                        help="where Trainer writes its checkpoint (default: a temporary folder, removed at the end)")
    return parser.parse_args(argv)


def main(cli: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))
    # Every rank must write to the same folder: rank 0 picks the temporary one and tells the others.
    holder = [cli.output_dir or (tempfile.mkdtemp(prefix="hf_trainer_dmuon_") if rank == 0 else None)]
    dist.broadcast_object_list(holder, src=0)
    output_dir = holder[0]

    torch.manual_seed(0)  # same init on every rank: fully_shard and the owners keep what each rank built
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config).to(device)

    # Step 1: mark dedicated params BEFORE fully_shard.
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    # Step 2: apply FSDP2 -- dedicated params are skipped automatically.
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Step 3: use dmuon.Muon.
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)

    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        num_train_epochs=3,
        fsdp="",  # the model is already sharded
        use_cpu=not use_cuda,  # CPU only: let Accelerate see the torchrun ranks
        logging_steps=4,
        report_to="none",
    )
    log = LossLog()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=MarkovTokens(32),
        optimizers=(optimizer, None),  # (optimizer, lr_scheduler): Trainer builds a linear schedule
        callbacks=[log],
    )
    trainer.train()

    # The end-of-training checkpoint, loaded the ordinary way on one process.
    final = dmuon.get_model_state_dict(model, rank0_only=True)  # collective
    ckpt = os.path.join(output_dir, f"checkpoint-{trainer.state.global_step}")
    ok, text = loss_fell(log.losses, by=0.1)  # reaches about -20% on 2 CPU ranks
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
        same = reloaded.keys() == final.keys() and all(torch.equal(reloaded[k], final[k]) for k in final)
        ok = ok and same
        print(f"checkpoint {ckpt}: optimizer.pt {os.path.isfile(os.path.join(ckpt, 'optimizer.pt'))}, "
              f"from_pretrained matches the trained weights: {same}", flush=True)
        verdict = "OK" if ok else "FAILED"
        print(f"hf_trainer_dmuon: {verdict} {text} ({trainer.state.global_step} steps)", flush=True)
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # gloo supports MIN; one verdict for every rank's exit code
    if rank == 0 and cli.output_dir is None:  # every rank is past its last file access (the all_reduce)
        shutil.rmtree(output_dir, ignore_errors=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the verdict's all_reduce above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del trainer, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0 if flag.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
