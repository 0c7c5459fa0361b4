"""A tiny Llama-shaped decoder for the demo, the tests and the CPU benchmark preset.

Layout and names follow the usual Llama convention (``layers.N.attention.{q,k,v,o}_proj``,
``layers.N.mlp.{gate,up,down}_proj``, RMSNorm, rotary embeddings, untied ``lm_head``) so dmuon's default
hook boundaries (``layers.N``) and name-based predicates apply as they would to a real model.
The model holds no parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyLlamaConfig", "TinyLlama", "CausalLMOutput", "projection_predicate"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 176
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    #: attention reports each head's largest logit for ``dmuon.QKClip`` (``dmuon.qk_clip``)
    report_max_logits: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def projection_predicate(name: str, param: nn.Parameter) -> bool:
    """Select the attention and MLP projection matrices (the ``"proj" in name`` of README.md's script and
    the guides)."""
    return param.ndim == 2 and "proj" in name


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` (batch, heads, seq, head_dim)."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cfg, hd = self.cfg, self.cfg.head_dim
        q = self.q_proj(x).view(b, s, cfg.n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        rep = cfg.n_heads // cfg.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if cfg.report_max_logits:
            from ..qk_clip import scaled_dot_product_attention

            out = scaled_dot_product_attention(q, k, v, module=self, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, cfg.n_heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """``model(tokens, targets=None) -> CausalLMOutput`` with ``.logits`` and (given targets) ``.loss``."""

    #: the decoder block (the MoE variant swaps in its own)
    block_cls: type[nn.Module] = Block

    def __init__(self, cfg: TinyLlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or TinyLlamaConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(self.block_cls(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init, the same on every rank and process (works after ``to_empty``, on FSDP2
        DTensors, and skips dmuon's empty placeholders)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 1:
                    full = torch.ones(p.shape)
                else:
                    std = 0.02 if "embeddings" in name else p.shape[-1] ** -0.5
                    full = torch.randn(p.shape, generator=gen) * std
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements))
                elif p.untyped_storage().nbytes() > 0:  # skip dmuon's 0-byte placeholders
                    p.copy_(full)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> CausalLMOutput:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h)).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return CausalLMOutput(logits, loss)
