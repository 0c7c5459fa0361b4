"""The names a docs page leaves to the reader, as ``tests/_docs_snippets.py`` defines them before a snippet.

Each page says what its stand-ins are (custom-loop.md: "``MyModel`` and ``dataloader`` stand for your model
class ... and your data"); these are small versions of exactly that, on the CPU:

* ``MyModel``: a Llama-shaped model (blocks in ``model.layers``, ``*_proj`` matrices, ``tok_embeddings`` and
  ``lm_head``) whose ``model(batch)`` takes a dict and returns an object with ``.loss``;
* ``dataloader``: this rank's batches, dicts of ``input_ids`` and ``labels``;
* ``train_dataset``: a dataset of such dicts, one sample each, the same on every rank (Trainer splits it);
* ``name``: a local folder with a tiny ``LlamaForCausalLM``, for ``from_pretrained(name)`` (no download);
* ``moe_name``: the same with a tiny ``Qwen3MoeForCausalLM`` (4 experts, fused ``gate_up_proj``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dmuon.tools.models import CausalLMOutput, TinyLlama, TinyLlamaConfig

VOCAB, SEQ, BATCH, STEPS = 64, 32, 4, 3


class MyModel(TinyLlama):
    """``model(batch).loss`` with ``batch = {"input_ids": ..., "labels": ...}``."""

    def __init__(self) -> None:
        super().__init__(TinyLlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                         hidden_dim=128, max_seq_len=SEQ))

    def forward(self, batch: dict[str, torch.Tensor]) -> CausalLMOutput:  # type: ignore[override]
        return super().forward(batch["input_ids"], batch["labels"])


def _tokens(n: int, seed: int) -> torch.Tensor:
    """``n`` sequences of ``SEQ + 1`` tokens following ``t -> 5 t + 1 mod VOCAB``: learnable at once."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    seq = [start]
    for _ in range(SEQ):
        seq.append((seq[-1] * 5 + 1) % VOCAB)
    return torch.cat(seq, dim=1)


def make(name: str, *, workdir: Path) -> object:
    """The stand-in called ``name`` (collective for ``name``: rank 0 writes the model, the others wait)."""
    if name == "MyModel":
        return MyModel
    if name == "dataloader":
        tok = _tokens(STEPS * BATCH, seed=dist.get_rank())
        return [{"input_ids": tok[i:i + BATCH, :-1], "labels": tok[i:i + BATCH, 1:]}
                for i in range(0, STEPS * BATCH, BATCH)]
    if name == "train_dataset":
        tok = _tokens(16, seed=0)
        return [{"input_ids": t[:-1], "labels": t[:-1]} for t in tok]  # HF models shift the labels themselves
    if name == "name":
        path = workdir / "tiny-llama"
        if dist.get_rank() == 0 and not path.exists():
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ)).save_pretrained(path)
        dist.barrier()
        return str(path)
    if name == "moe_name":
        path = workdir / "tiny-qwen3-moe"
        if dist.get_rank() == 0 and not path.exists():
            from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

            torch.manual_seed(0)
            cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ)
            Qwen3MoeForCausalLM(cfg).save_pretrained(path)
        dist.barrier()
        return str(path)
    raise KeyError(f"no stand-in called {name!r}; tests/_docs_stand_ins.py defines MyModel, dataloader, "
                   f"train_dataset, name and moe_name")
