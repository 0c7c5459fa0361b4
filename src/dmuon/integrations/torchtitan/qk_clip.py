"""QK-clip's forward side for torchtitan models: each attention module's ``inner_attention`` (torchtitan's
``ScaledDotProductAttention``) reports its heads' largest logits (``dmuon/qk_clip.py``) through a forward
pre-hook on its inputs, so the model code stays torchtitan's. ``dmuon.QKClip`` finds the heads by the
attention's ``qkv_linear`` (``wq``/``wk``, or the fused ``wqkv`` with its per-group interleave) and its
``n_heads`` / ``n_kv_heads`` / ``head_dim``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ...qk_clip import max_logits, record_max_logits

__all__ = ["report_max_logits"]


def report_max_logits(model: nn.Module) -> list[RemovableHandle]:
    """Make every attention module of ``model`` with an ``inner_attention`` report its per-head maxima (exact:
    ``q k^T`` once more per forward, see ``dmuon/qk_clip.py``); returns the hooks' handles. Call it on the model
    before ``dmuon.Muon(model, qk_clip=dmuon.QKClip(...))``'s first step, e.g. right after building it.
    Causal attention without ``attention_masks`` (torchtitan's ``ScaledDotProductAttention``) only.

    Example::

        model = model_config.build()
        dmuon.integrations.torchtitan.report_max_logits(model)
    """
    handles = []
    for name, module in model.named_modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, nn.Module) and isinstance(getattr(module, "n_heads", None), int):
            handles.append(inner.register_forward_pre_hook(_hook(module, name), with_kwargs=True))
    if not handles:
        raise ValueError("dmuon.integrations.torchtitan.report_max_logits: the model has no attention module with "
                         "an inner_attention and n_heads (torchtitan's GQAttention); report the maxima with "
                         "dmuon.qk_clip.record_max_logits instead")
    return handles


def _hook(attention: nn.Module, name: str) -> Any:
    def pre_hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        if kwargs.get("attention_masks") is not None:
            raise ValueError(f"dmuon.integrations.torchtitan.report_max_logits: attention {name!r} runs with "
                             "attention_masks (flex / varlen attention); the reporting covers causal SDPA only")
        q, k = args[0].transpose(1, 2), args[1].transpose(1, 2)  # (B, L, N, H) -> (B, N, L, H)
        record_max_logits(attention, max_logits(q, k, scale=kwargs.get("scale"),
                                                is_causal=kwargs.get("is_causal", True)))

    return pre_hook
