"""A tiny mixture-of-experts decoder for the MoE tests, example and benchmark preset.

The TinyLlama of :mod:`dmuon.tools.models` with each block's feed-forward replaced by a routed MoE layer whose
experts are stored the way the large MoE codebases store them: 3-D parameters holding every expert's matrix.

* ``separate`` (torchtitan's ``GroupedExperts``): ``w1`` ``[E, F, D]`` (gate), ``w3`` ``[E, F, D]`` (up),
  ``w2`` ``[E, D, F]`` (down);
* ``fused`` (HF transformers 5's fused experts): ``gate_up_proj`` ``[E, 2F, D]`` (gate and up stacked as
  two row blocks of each expert) and ``down_proj`` ``[E, D, F]``.

A router ``router.gate`` (``[E, D]``, a 2-D Linear) picks the top-``k`` experts per token; an optional
shared expert is a plain MLP. Experts run one after another on the tokens routed to them (index_add on
the CPU: deterministic, the same bits on every rank). ``dead_expert`` masks one expert out of the router,
so it gets no token in any step (its gradient is zeros). The model holds no parallelism;
:func:`apply_expert_parallel` adds expert parallelism the plain-PyTorch way.

``routing="fixed"`` is for tests that compare two runs to 1e-4: learned top-k routing is discontinuous, and a
last-bit difference between two runs (a gradient summed in another order over ranks) flips a near-tie token
to another expert, which moves the loss by ~1e-3 within a few steps (measured: a 1e-6 relative perturbation
of the initial weights moved the oracle's own step-3 loss by 7.4e-4). Fixed routing picks the experts of a
token from its sequence position alone and still weighs them by the router's softmax, so the router trains
and the model is smooth in every weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .models import MLP, Attention, TinyLlama, TinyLlamaConfig

__all__ = ["TinyMoEConfig", "TinyMoE", "MoE", "expert_predicate", "expert_row_blocks", "apply_expert_parallel"]


@dataclass(frozen=True)
class TinyMoEConfig(TinyLlamaConfig):
    n_experts: int = 4
    top_k: int = 2
    #: rows of each expert's gate / up matrix (``F``)
    expert_dim: int = 64
    #: ``"separate"`` (w1 / w2 / w3) or ``"fused"`` (gate_up_proj / down_proj)
    layout: str = "separate"
    shared_expert: bool = True
    #: an expert the router never picks (``None``: all compete)
    dead_expert: int | None = None
    #: ``"learned"`` (top-k of the router's scores) or ``"fixed"`` (experts by sequence position, weighted by
    #: the router's scores: smooth, for exact comparisons)
    routing: str = "learned"


def expert_predicate(name: str, param: nn.Parameter) -> bool:
    """The dense projections (2-D) and the experts (3-D); not the router, embeddings, norms or head."""
    if param.ndim == 3:
        return True
    return param.ndim == 2 and "proj" in name and "router" not in name


def expert_row_blocks(name: str, param: nn.Parameter) -> int | None:
    """``dedicate_params(blocks=...)`` for the fused layout: gate and up are two row blocks of each expert."""
    return 2 if name.endswith("gate_up_proj") else None


class Experts(nn.Module):
    """Every expert's matrices as 3-D parameters, run expert by expert on their tokens."""

    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        E, D, Fd = cfg.n_experts, cfg.dim, cfg.expert_dim
        self.layout = cfg.layout
        if cfg.layout == "separate":
            self.w1 = nn.Parameter(torch.empty(E, Fd, D))
            self.w3 = nn.Parameter(torch.empty(E, Fd, D))
            self.w2 = nn.Parameter(torch.empty(E, D, Fd))
        elif cfg.layout == "fused":
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fd, D))
            self.down_proj = nn.Parameter(torch.empty(E, D, Fd))
        else:
            raise ValueError(f"TinyMoEConfig.layout must be 'separate' or 'fused', got {cfg.layout!r}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, first: int = 0) -> torch.Tensor:
        """The weighted sum of the chosen experts per token, from this rank's experts ``first, first + 1, ...``
        (all of them without expert parallelism). A module call, so an FSDP2 unit on the experts unshards."""
        w = {name: p.to_local() if isinstance(p, DTensor) else p for name, p in self.named_parameters()}
        out = torch.zeros_like(x)
        for k in range(next(iter(w.values())).shape[0]):
            token, slot = (chosen == first + k).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, self._expert(w, k, x[token]) * weights[token, slot, None])
        return out

    def _expert(self, w: dict[str, torch.Tensor], e: int, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "separate":
            h = F.silu(x @ w["w1"][e].T) * (x @ w["w3"][e].T)
            return h @ w["w2"][e].T
        gate, up = (x @ w["gate_up_proj"][e].T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w["down_proj"][e].T


class MoE(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Module()
        self.router.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg) if cfg.shared_expert else None
        #: expert parallelism: the mesh the experts are split over (:func:`apply_expert_parallel`)
        self.ep_mesh: DeviceMesh | None = None

    def _route(self, probs: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, chosen)`` per token: the top-k experts, or under fixed routing experts by position."""
        cfg = self.cfg
        if cfg.routing == "learned":
            return torch.topk(probs, cfg.top_k, dim=-1)
        live = torch.tensor([e for e in range(cfg.n_experts) if e != cfg.dead_expert], device=probs.device)
        pos = torch.arange(seq, device=probs.device).repeat(probs.shape[0] // seq)
        chosen = live[(pos[:, None] + torch.arange(cfg.top_k, device=probs.device)) % len(live)]
        return probs.gather(1, chosen), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router.gate(x).float()
        if self.cfg.dead_expert is not None:
            logits[:, self.cfg.dead_expert] = float("-inf")
        weights, chosen = self._route(logits.softmax(dim=-1), shape[-2])
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(x, weights, chosen) if self.ep_mesh is None else self._experts_ep(x, weights, chosen)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)


    def _experts_ep(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: every rank of the ep group runs its experts on the tokens of the whole group
        (gathered), and each rank sums its own tokens' parts from every rank."""
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()  # type: ignore[union-attr]
        first = self.ep_mesh.get_local_rank() * (self.cfg.n_experts // ep)  # type: ignore[union-attr]
        x_all, w_all, c_all = (_Gather.apply(t, group) for t in (x, weights, chosen))
        return _SumMine.apply(self.experts(x_all, w_all, c_all, first), group)


class _Gather(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; the gradient of a rank's rows sums over the ranks.
    (Written with all-gather and all-reduce only: gloo has no reduce-scatter.)"""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.n = group, t.shape[0]
        out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 / earlier
        gather(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n:(r + 1) * ctx.n], None


class _SumMine(torch.autograd.Function):
    """Each rank's rows of the sum over ranks (the inverse of :class:`_Gather`)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        total = t.contiguous().clone()
        dist.all_reduce(total, group=group)
        n, r = t.shape[0] // dist.get_world_size(group), dist.get_rank(group)
        return total[r * n:(r + 1) * n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _Gather.forward(ctx, grad, ctx.group), None


def apply_expert_parallel(model: TinyMoE, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over ``ep_mesh`` (``Shard(0)``: rank ``r`` keeps experts ``r E/ep ...``),
    as torchtitan's expert parallelism places them. Each rank's expert gradients then sum the losses of its ep
    group's tokens: average them over the whole job (e.g. ``fully_shard(moe.experts, mesh=dp_mesh)`` with
    ``set_gradient_divide_factor(world_size)``)."""
    for layer in model.layers:
        moe = layer.moe
        if moe.cfg.n_experts % ep_mesh.size():
            raise ValueError(f"apply_expert_parallel: {moe.cfg.n_experts} experts do not split over {ep_mesh.size()} ranks")
        for name, p in list(moe.experts.named_parameters()):
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(p.detach(), ep_mesh, [Shard(0)])))
        moe.ep_mesh = ep_mesh


class MoEBlock(nn.Module):
    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.mlp_norm(x))


class TinyMoE(TinyLlama):
    """``model(tokens, targets=None) -> CausalLMOutput``, as :class:`dmuon.tools.models.TinyLlama` (whose
    deterministic ``init_weights`` scales each expert matrix by its own fan-in)."""

    block_cls = MoEBlock

    def __init__(self, cfg: TinyMoEConfig | None = None):
        super().__init__(cfg or TinyMoEConfig())
