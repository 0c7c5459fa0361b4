"""MuonClip's forward side: attention modules report each head's largest pre-softmax logit, which
``dmuon.Muon(qk_clip=dmuon.QKClip(...))`` reads after backward (``dmuon/optim/qk_clip.py``, [Note: QK-clip]).

A report is a running maximum kept on the attention module (the module whose ``q``/``k`` projections get
clipped) until the next ``step()`` reads and clears it, so micro-batches, several forwards and activation
checkpointing's recomputation all count, once. Only forwards with autograd on report (an eval forward under
``torch.no_grad()`` does not).

Three ways in:

* :func:`scaled_dot_product_attention`: ``F.scaled_dot_product_attention`` that also reports (one line to change
  in a model's attention);
* :func:`record_max_logits`: report maxima computed elsewhere (e.g. :func:`max_logits`);
* ready-made: HF transformers' attention interface (``dmuon.integrations.hf.use_qk_clip_attention``) and
  torchtitan's inner attention (``dmuon.integrations.torchtitan.report_max_logits``).

What it costs: the exact maximum (``bound="exact"``) needs ``q k^T`` for every pair of positions, which fused
attention kernels never materialise: computed here in query chunks, about the forward's ``QK^T`` matmul again
(``scripts/gpu_qk_clip_cost.py`` measures it). ``bound="lse"`` is nearly free: the attention kernel's own
log-sum-exp of each query row satisfies ``max_j s_ij <= lse_i <= max_j s_ij + log(n_i)`` (``n_i`` the keys row
``i`` attends to), so ``max_i lse_i`` over-estimates the head's maximum by at most ``log`` of the sequence length
(7.6 at 2048 tokens, against tau = 100), and by much less for the peaked rows that matter (one logit far above
the rest: ``lse - max -> 0``). Clipping with it is conservative: a clipped head ends at or below tau.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .optim.qk_clip import RECORD_ATTR

__all__ = ["max_logits", "record_max_logits", "scaled_dot_product_attention", "BOUNDS"]

#: ``bound=`` of :func:`scaled_dot_product_attention`
BOUNDS = ("exact", "lse")
#: elements of one chunk of logits (batch x heads x query rows x keys) in :func:`max_logits`
_CHUNK_ELEMENTS = 2**26


def max_logits(q: Tensor, k: Tensor, *, scale: float | None = None, is_causal: bool = False,
               attn_mask: Tensor | None = None) -> Tensor:
    """Each query head's largest logit ``scale * q_i . k_j`` over the batch and the attended pairs, as float32
    ``[H]``. ``q``: ``(B, H, S, D)``, ``k``: ``(B, H_kv, T, D)`` with ``H`` a multiple of ``H_kv`` (query head
    ``h`` reads key head ``h // (H / H_kv)``, as ``F.scaled_dot_product_attention(enable_gqa=True)``);
    ``is_causal`` and ``attn_mask`` as there (a float mask counts where it is above half its dtype's lowest
    value; its values are not added: QK-clip bounds ``q . k``). A head with no attended pair gets ``-inf``.

    Example::

        >>> max_logits(torch.ones(1, 2, 3, 4), torch.ones(1, 1, 3, 4), scale=1.0)
        tensor([4., 4.])
    """
    b, h, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"max_logits: {h} query heads do not share {hkv} key heads evenly")
    scale = d ** -0.5 if scale is None else scale
    rep = h // hkv
    qg = q.reshape(b, hkv, rep, s, d)
    kt = k.reshape(b, hkv, 1, t, d).transpose(-1, -2)
    allowed = _allowed(attn_mask, is_causal, s, t, q.device)  # broadcastable to (B, H, S, T)
    best = torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * h * t))
    for i in range(0, s, rows):
        logits = torch.matmul(qg[..., i:i + rows, :], kt).reshape(b, h, -1, t).float()  # (B, H, chunk, T)
        if allowed is not None:
            logits = logits.masked_fill(~allowed[..., i:i + rows, :], -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 2, 3)))
    return best * scale


def _allowed(attn_mask: Tensor | None, is_causal: bool, s: int, t: int, device: torch.device) -> Tensor | None:
    """Where a query may attend, broadcastable to ``(B, H, S, T)`` (``None``: everywhere)."""
    allowed = None
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
    if is_causal:
        causal = torch.ones(s, t, dtype=torch.bool, device=device).tril()
        allowed = causal if allowed is None else allowed & causal
    return allowed


def record_max_logits(module: nn.Module, values: Tensor) -> None:
    """Report ``values`` (``[H]``, each query head's largest logit in this forward) for ``module``, the attention
    module whose projections ``QKClip`` clips: kept as a running maximum until the next ``step()``. Does
    nothing without autograd (an eval forward).

    Example::

        dmuon.qk_clip.record_max_logits(self, dmuon.qk_clip.max_logits(q, k, is_causal=True))
    """
    if not torch.is_grad_enabled() or _in_pipeline_shape_inference():
        return
    values = values.detach().float()
    seen = getattr(module, RECORD_ATTR, None)
    setattr(module, RECORD_ATTR, values if seen is None else torch.maximum(seen, values))


# [Note: pipeline shape inference]
# torch's ``PipelineStage`` (torch 2.13, "dynamic" mode: no ``input_args`` / ``output_args`` given) learns its
# stage's shapes at the first ``schedule.step`` by running the stage module once, with autograd on, on inputs
# made by ``torch.empty`` (``stage.py``: ``_forward_metadata_inference``, ``_to_tensor``). Its logits are those of
# uninitialised memory: reported, they would clip heads at the first step by whatever that memory held. A
# report made inside that call is dropped; it is recognised by the function's name and file on the call stack
# (a private name: another torch that renames it reports again, which the pipeline QK-clip test would show).
_SHAPE_INFERENCE = "_forward_metadata_inference"


def _in_pipeline_shape_inference() -> bool:
    """Whether this forward is torch's pipeline shape inference ([Note: pipeline shape inference])."""
    frame = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == _SHAPE_INFERENCE and code.co_filename.endswith(("pipelining/stage.py",
                                                                            "pipelining\\stage.py")):
            return True
        frame = frame.f_back
    return False


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, *, module: nn.Module,
                                 attn_mask: Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, bound: str = "exact") -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, ...)`` that also reports each head's largest logit for
    ``module`` (:func:`record_max_logits`). ``bound="exact"``: :func:`max_logits`; ``"lse"``: the attention
    kernel's log-sum-exp bound (module docstring; causal or no mask, no dropout), computed where the kernel
    returns it (CPU, and CUDA's flash kernel; elsewhere the exact maximum).

    Example::

        out = dmuon.qk_clip.scaled_dot_product_attention(q, k, v, module=self, is_causal=True)
    """
    if bound not in BOUNDS:
        raise ValueError(f"dmuon.qk_clip: bound must be one of {list(BOUNDS)}, got {bound!r}")
    if not torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if bound == "lse" and attn_mask is None:
        out = _with_lse(q, k, v, is_causal=is_causal, scale=scale, module=module)
        if out is not None:
            return out
    record_max_logits(module, max_logits(q, k, scale=scale, is_causal=is_causal, attn_mask=attn_mask))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def _with_lse(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: float | None,
              module: nn.Module) -> Tensor | None:
    """Attention through a kernel that also returns the log-sum-exp of each query row, and the report of its
    per-head maximum; ``None`` where no such kernel is at hand (then the caller takes the exact path). torch's
    private entry points of its own SDPA kernels: looked up, never assumed."""
    if k.shape[1] != q.shape[1]:  # these kernels take as many key heads as query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ops = torch.ops.aten
    if q.device.type == "cpu" and hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        out, lse = ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[:2]
    elif q.is_cuda and hasattr(ops, "_scaled_dot_product_flash_attention") and q.dtype in (torch.float16,
                                                                                           torch.bfloat16):
        out, lse = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    else:
        return None
    record_max_logits(module, lse[..., :q.shape[2]].detach().float().amax(dim=(0, 2)))
    return out
