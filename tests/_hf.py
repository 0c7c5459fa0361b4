"""The builders the HF Trainer tests share: a tiny Llama prepared by dmuon (2 gloo ranks), its data, the
``TrainingArguments`` of a CPU job, and what torchrun would set in a rank's environment."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

WORLD = 2
VOCAB, SEQ = 64, 16
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MUON_LR, ADAMW_LR = 0.02, 1e-3


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences; every sample has SEQ tokens, so per-batch token counts are equal."""

    def __init__(self, n: int) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def rank_env(rank: int, world: int) -> None:
    # What torchrun would set; Accelerate reads them (and with use_cpu=True sees a MULTI_CPU job).
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def param_groups_of(model: nn.Module) -> list[dict[str, Any]]:
    """Per-group settings for the resume job: no decay on norms, the embedding's own lr, a second Muon lr."""
    import dmuon

    return [
        {"name": "no_decay", "params": [n for n, p in model.named_parameters() if p.ndim < 2], "weight_decay": 0.0},
        {"name": "embed", "params": ["model.embed_tokens.weight"], "lr": 3e-3, "weight_decay": 0.0},
        {"name": "attn", "params": [n for n in dmuon.get_dedicated_params(model) if "self_attn" in n], "lr": 0.01},
    ]


def build(seed: int, shard_root: bool, groups: bool = False) -> tuple[nn.Module, Any]:
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config())
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and any(k in n for k in PROJ))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if shard_root:
        fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=MUON_LR, adamw_lr=ADAMW_LR, param_groups=param_groups_of(model) if groups else None)


def training_args(output_dir: str, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=output_dir, per_device_train_batch_size=2, fsdp="", use_cpu=True, report_to="none",
                logging_steps=1, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)
