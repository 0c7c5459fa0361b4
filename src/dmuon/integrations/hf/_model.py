"""What dmuon needs to know about HF transformers models: which objects are dmuon models (the test every
Trainer / Accelerator replacement dispatches on), and the matrices of each family's fused weights.

[Note: HF matrix blocks] HF transformers 5 fuses several matrices into one param in a few places, each family
in its own layout (read from the modeling files of transformers 5.25):

* fused experts ``gate_up_proj``: ``[E, 2I, H]``, gate rows then up rows, in most families (Qwen2/3-MoE,
  Mixtral, DeepSeek-V3, OLMoE); ``[E, H, 2I]`` (the experts compute ``x @ W``) with gate columns then up
  columns in Llama 4 (``gate_up.chunk(2, dim=-1)``), and with gate and up alternating column by column in
  GPT-OSS (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``). Experts built with HF's
  ``use_experts_implementation`` say so themselves (``is_transposed``: ``[E, H, 2I]``; ``is_concatenated=False``:
  interleaved); Llama 4's experts carry neither, and their ``down_proj`` ``[E, I, H]`` tells the orientation;
* DeepSeek's multi-head latent attention (V2, V3): ``q_b_proj`` (or ``q_proj`` without a query LoRA)
  ``[heads * (nope + rope), r]`` and ``kv_b_proj`` ``[heads * (nope + v), r]`` stack one block of rows per
  head.

:func:`matrix_blocks` answers ``dedicate_params(blocks=...)`` for all of them, so that each expert's gate and
up, and each head's rows, are orthogonalised as their own matrices ([Note: matrix blocks] in
``dmuon/runtime/blocks.py``); every other param is one matrix per trailing two dims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ...runtime.blocks import Columns, Interleaved, RowBlocks
from ...runtime.hooks import STATE_ATTR

__all__ = ["dmuon_model_of", "matrix_blocks"]


def dmuon_model_of(module: Any) -> nn.Module | None:
    """The module ``dedicate_params`` prepared, looking through ``torch.compile`` / DDP-style wrappers;
    ``None`` for any other object (so callers can fall back to the framework's own code path)."""
    seen = 0
    while isinstance(module, nn.Module) and seen < 8:
        if getattr(module, STATE_ATTR, None) is not None:
            return module
        inner = getattr(module, "_orig_mod", None)  # not `or`: a module with __len__ can be falsy
        module = inner if inner is not None else getattr(module, "module", None)
        seen += 1
    return None


def matrix_blocks(model: nn.Module) -> Callable[[str, nn.Parameter], RowBlocks]:
    """``dedicate_params(blocks=...)`` for an HF transformers model: each expert's gate and up as two
    matrices, in the layout of its family (rows, columns, or interleaved columns), and DeepSeek's MLA
    ``q_b_proj`` / ``kv_b_proj`` as one matrix per head ([Note: HF matrix blocks]); ``None`` (one matrix)
    for every other param. Call it before ``fully_shard`` (it knows the params by identity).

    Example::

        from dmuon.integrations.hf import matrix_blocks

        dmuon.dedicate_params(model, mesh, predicate, blocks=matrix_blocks(model))
    """
    spec: dict[int, RowBlocks] = {}
    for module in model.modules():
        gate_up = module._parameters.get("gate_up_proj")
        if gate_up is not None and gate_up.ndim == 3 and getattr(module, "has_gate", True):
            spec[id(gate_up)] = _gate_up_blocks(module, gate_up)
        heads = getattr(module, "num_heads", None)
        if isinstance(heads, int) and isinstance(getattr(module, "kv_b_proj", None), nn.Linear):  # MLA
            for name in ("q_b_proj", "q_proj", "kv_b_proj"):
                linear = getattr(module, name, None)
                if isinstance(linear, nn.Linear):
                    spec[id(linear.weight)] = heads

    def blocks(fqn: str, p: nn.Parameter) -> RowBlocks:
        return spec.get(id(p))

    return blocks


def _gate_up_blocks(experts: nn.Module, gate_up: nn.Parameter) -> RowBlocks:
    """Gate and up of one fused experts param: two blocks along the rows (``[E, 2I, H]``) or the columns
    (``[E, H, 2I]``), halves or interleaved."""
    columns = getattr(experts, "is_transposed", None)
    if not isinstance(columns, bool):  # Llama 4: no flag; down_proj [E, I, H] against gate_up [E, H, 2I]
        down = experts._parameters.get("down_proj")
        columns = down is not None and down.ndim == 3 and gate_up.shape[-1] == 2 * down.shape[-2] \
            and gate_up.shape[-2] == down.shape[-1]
    split: RowBlocks = 2
    if getattr(experts, "is_concatenated", True) is False:  # [gate0, up0, gate1, up1, ...]
        split = Interleaved(2, gate_up.shape[-1 if columns else -2] // 2)
    return Columns(split) if columns else split  # type: ignore[arg-type]
