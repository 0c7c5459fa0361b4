"""QK-clip's forward side for HF transformers models: an attention function registered in transformers'
``AttentionInterface`` that runs transformers' own SDPA attention and reports each head's largest logit
(``dmuon/qk_clip.py``) on the attention module, which ``dmuon.QKClip`` finds by its ``q_proj`` / ``k_proj``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...qk_clip import max_logits, record_max_logits

__all__ = ["QK_CLIP_ATTENTION", "use_qk_clip_attention", "qk_clip_attention_forward"]

#: the name the attention function is registered under (``attn_implementation=QK_CLIP_ATTENTION``)
QK_CLIP_ATTENTION = "dmuon_qk_clip"


def qk_clip_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, after reporting ``module``'s per-head maxima (with autograd on:
    training forwards). The mask is the one SDPA sees: ``attention_mask`` (boolean or additive), or causal when
    transformers passes none (``is_causal``, else the module's own flag, for more than one query)."""
    if torch.is_grad_enabled():
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal and attention_mask is None and query.shape[2] > 1)
        mask = attention_mask[..., :key.shape[2]] if attention_mask is not None else None
        record_max_logits(module, max_logits(query, key, scale=scaling, is_causal=causal, attn_mask=mask))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_qk_clip_attention(model: nn.Module) -> nn.Module:
    """Register :func:`qk_clip_attention_forward` as ``"dmuon_qk_clip"`` and switch ``model`` to it (transformers'
    ``set_attn_implementation``); returns ``model``. Or load with ``attn_implementation="dmuon_qk_clip"`` after
    registering (any call of this function registers it).

    Example::

        model = use_qk_clip_attention(AutoModelForCausalLM.from_pretrained(name))
        ...
        optimizer = dmuon.Muon(model, lr=0.02, qk_clip=dmuon.QKClip(tau=100.0))
    """
    AttentionInterface.register(QK_CLIP_ATTENTION, qk_clip_attention_forward)
    model.set_attn_implementation(QK_CLIP_ATTENTION)  # type: ignore[operator]
    return model
