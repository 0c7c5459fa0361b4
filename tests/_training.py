"""Shared training scenarios: the single-process oracle and the dmuon run it is compared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.optim import AdamWHParams, MuonHParams
from dmuon.tools.models import CausalLMOutput, TinyLlama, TinyLlamaConfig, projection_predicate
from tests._dist import DEVICE_TYPE, device, rank_threads

# [Note: test scale] bf16 rounding inside Newton-Schulz amplifies the last-bit differences that any
# split of the batch causes (fp32 sums in another order). For this configuration the oracle itself,
# fed the same global batch as 2 or 4 accumulated halves/quarters, moves its per-step losses by at
# most 3.2e-5 / 5.6e-5 relative and its weights by 1.0e-3 over 20 steps (measured on CPU, torch 2.13),
# an order below the parity bounds (1e-4, 5e-3). At dim=64 / lr=0.02 that floor was 2.4e-4, above the
# loss bound, so the tests use this size rather than a looser bound.
CFG = TinyLlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=64)
GLOBAL_BATCH = 8
SEQ = 32
KJ = (3.4445, -4.7750, 2.0315)


#: The hyperparameters of the parity runs, in dmuon's own records (the oracle reads the same fields).
MUON_HP = MuonHParams(lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct")
ADAMW_HP = AdamWHParams(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def muon_kwargs(muon: MuonHParams = MUON_HP, adamw: AdamWHParams = ADAMW_HP) -> dict:
    """``dmuon.Muon``'s keyword arguments for these records."""
    return {**muon.group_entries(), **{f"adamw_{k}": v for k, v in adamw.group_entries().items()}}


def batches(steps: int, seed: int = 1234, global_batch: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, CFG.vocab_size, (global_batch, SEQ + 1), generator=gen)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def build_model(seed: int = 0, cfg: TinyLlamaConfig = CFG, extra_unused: bool = False) -> TinyLlama:
    model = TinyLlama(cfg)
    model.init_weights(seed)
    if extra_unused:
        add_unused_proj(model)
    return model


def add_unused_proj(model: TinyLlama) -> None:
    """A dedicated-looking matrix in layers.1 that forward never touches (gets no gradient)."""
    extra = nn.Linear(CFG.dim, CFG.dim, bias=False)
    with torch.no_grad():
        extra.weight.copy_(torch.randn(CFG.dim, CFG.dim, generator=torch.Generator().manual_seed(7)))
    model.layers[1].mlp.unused_proj = extra


@rank_threads()  # its bits must be the ranks' (test_lifecycle compares a 1-rank run exactly)
def train_oracle(steps: int, hp: MuonHParams = MUON_HP, adamw: AdamWHParams = ADAMW_HP,
                 extra_unused: bool = False, *, adapt: Callable[[TinyLlama], None] | None = None,
                 no_decay: Callable[[str, torch.Tensor], bool] | None = None, max_norm: float | None = None) -> dict:
    """Single process, torch.optim.Muon for the projections + torch.optim.AdamW for the rest. ``adapt``
    changes the built model first (the same change the ranks make); the AdamW params ``no_decay`` selects
    get their own group with weight decay 0; ``max_norm``: every step clipped by torch's
    ``clip_grad_norm_`` (its norms are returned as ``"norms"``)."""
    torch.manual_seed(0)
    dev = device()
    model = build_model(extra_unused=extra_unused).to(dev)
    if adapt is not None:
        adapt(model)
    muon_params = [p for n, p in model.named_parameters() if projection_predicate(n, p)]
    rest = [(n, p) for n, p in model.named_parameters() if not projection_predicate(n, p)]
    other: list = [p for n, p in rest if no_decay is None or not no_decay(n, p)]
    if no_decay is not None:
        other = [{"params": other}, {"params": [p for n, p in rest if no_decay(n, p)], "weight_decay": 0.0}]
    opt_m = torch.optim.Muon(
        muon_params, lr=hp.lr, weight_decay=hp.weight_decay, momentum=hp.momentum, nesterov=hp.nesterov,
        ns_coefficients=hp.ns_coefficients, ns_steps=hp.ns_steps, eps=hp.eps, adjust_lr_fn=hp.adjust_lr_fn.value,
    )
    opt_a = torch.optim.AdamW(other, **adamw.group_entries())
    losses, norms = [], []
    for tok, tgt in batches(steps):
        opt_m.zero_grad()
        opt_a.zero_grad()
        loss = model(tok.to(dev), tgt.to(dev)).loss
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt_m.step()
        opt_a.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def root_sharded(world: int) -> tuple[TinyLlama, dmuon.Muon]:
    """The test model dedicated on this pass's device with FSDP2 on the root only, and ``dmuon.Muon``
    (lr 0.01, torch's coefficients): for tests about dmuon's own hooks and lifetime. Root only because
    FSDP2 units per layer keep a dropped model alive by themselves (torch 2.13 on CPU, without dmuon)."""
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")


#: four small layers for the routed model: enough to skip and reorder layers
CFG4 = TinyLlamaConfig(vocab_size=128, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64)


class RoutedLlama(TinyLlama):
    """TinyLlama that runs ``self.route`` (layer indices, in order) instead of every layer."""

    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__(cfg)
        self.route: tuple[int, ...] = tuple(range(cfg.n_layers))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> CausalLMOutput:
        h = self.tok_embeddings(tokens)
        for i in self.route:
            h = self.layers[i](h)
        logits = self.lm_head(self.norm(h)).float()
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return CausalLMOutput(logits, loss)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor on every rank: a dedicated one broadcast from its owner over dmuon's
    data-parallel ranks (under TP that is the owner's shard, then gathered over "tp"); FSDP2's DTensors
    gathered; plain ones as they are. Written with torch.distributed, not dmuon's state-dict functions."""
    from dmuon.runtime.comm import Dim
    from dmuon.runtime.hooks import get_state

    out = {}
    dedicated = dmuon.get_dedicated_params(model)
    ctx = get_state(model).ctx if dedicated else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in dedicated:
                shard = p._local_tensor if isinstance(p, DTensor) else p
                owner = ctx.global_rank(Dim.WORLD, p._dedicated_owner_rank)
                mine = dist.get_rank() == owner
                buf = shard.detach().clone() if mine else torch.empty(shard.shape, dtype=shard.dtype, device=shard.device)
                if ctx.world_size > 1:
                    dist.broadcast(buf, src=owner, group=ctx.groups[Dim.WORLD])
                if isinstance(p, DTensor):  # tensor parallel: the shards of the matrix, in tp order
                    parts = [torch.empty_like(buf) for _ in range(p.device_mesh.size())]
                    dist.all_gather(parts, buf, group=p.device_mesh.get_group())
                    buf = torch.cat(parts, dim=p.placements[0].dim)
                out[name] = buf
            elif isinstance(p, DTensor):
                out[name] = p.full_tensor().detach().clone()
            else:
                out[name] = p.detach().clone()
    return out


def non_owner_storage_bytes(model: nn.Module) -> int:
    rank = dist.get_rank()
    return sum(
        p.untyped_storage().nbytes()
        for p in dmuon.get_dedicated_params(model).values()
        if p._dedicated_owner_rank != rank
    )


@dataclass
class RunOptions:
    steps: int = 20
    reshard_after_forward: bool = True
    fsdp: bool = True
    checkpoint: bool = False
    meta_init: bool = False
    #: add a dedicated matrix that never gets a gradient
    extra_unused: bool = False
    #: run the local batch as two forwards (halves) before one backward
    two_forwards: bool = False
    #: an eval-mode no_grad forward between backward and step, and one after step
    eval_between: bool = False
    #: micro-batches per step: all but the last under dmuon.no_sync
    accum: int = 1
    #: one hook boundary for the whole model, whose forward returns a dataclass (CausalLMOutput)
    root_boundary: bool = False
    #: dedicate_params(prefetch=...): broadcast the next boundary's weights early
    prefetch: bool = True
    hp: MuonHParams = MUON_HP


def train_dmuon(rank: int, world: int, opts: RunOptions) -> dict:
    """docs/guides/custom-loop.md's loop (on the CPU, or one GPU per rank); records what the tests compare."""
    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    if opts.meta_init:
        with torch.device("meta"):
            model = TinyLlama(CFG)
    else:
        model = build_model(extra_unused=opts.extra_unused).to(device())
    plan = dmuon.dedicate_params(
        model, mesh, predicate=projection_predicate, reshard_after_forward=opts.reshard_after_forward,
        prefetch=opts.prefetch,
        hook_boundary_predicate=(lambda m: isinstance(m, TinyLlama)) if opts.root_boundary else None,
    )
    if opts.fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if opts.meta_init:
        model.to_empty(device=device())
        model.init_weights(0)
    if opts.checkpoint:
        from torch.utils.checkpoint import checkpoint

        for layer in model.layers:
            layer.forward = _checkpointed(layer.forward, checkpoint)
    opt = dmuon.Muon(model, **muon_kwargs(opts.hp))
    P = sum(p.numel() for p in dmuon.get_dedicated_params(model).values())
    # Every all-gather in the job is FSDP2's (dmuon issues none): record their sizes.
    # (torch 2.13 FSDP2 calls dist.all_gather_single, older releases dist.all_gather_into_tensor.)
    gathered = [0]
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(real):
        def all_gather(output, *args, **kwargs):
            gathered[0] += output.numel()
            return real(output, *args, **kwargs)

        return all_gather

    for n in names:
        setattr(dist, n, counting(originals[n]))
    try:
        return _train_loop(rank, world, opts, model, opt, plan, P, gathered)
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)


def _train_loop(rank, world, opts, model, opt, plan, P, gathered) -> dict:
    per, dev = GLOBAL_BATCH // world, device()
    losses, counts, between_fwd_bwd, after_step, eval_logits, micro_counts = [], [], [], [], [], []
    for tok, tgt in batches(opts.steps):
        tok, tgt = tok[rank * per : (rank + 1) * per].to(dev), tgt[rank * per : (rank + 1) * per].to(dev)
        dmuon.diagnostics.reset_comm_counts(model)
        gathered[0] = 0
        opt.zero_grad()
        if opts.accum > 1:
            loss = _accumulate(model, tok, tgt, opts.accum, micro_counts)
        elif opts.two_forwards:
            h = per // 2
            loss = (model(tok[:h], tgt[:h]).loss + model(tok[h:], tgt[h:]).loss) / 2
        else:
            loss = model(tok, tgt).loss
        between_fwd_bwd.append(non_owner_storage_bytes(model))
        if opts.accum == 1:
            loss.backward()
        if opts.eval_between:
            model.eval()
            with torch.no_grad():
                model(tok)
            model.train()
            if opts.fsdp:
                # FSDP2's own pitfall, not dmuon's: the root stays unsharded after a no_grad forward, so
                # without this the next forward would reuse its pre-step root weights.
                model.reshard()
        opt.step()
        if opts.eval_between:
            with torch.no_grad():
                model(tok)
        counts.append(dict(dmuon.diagnostics.comm_counts(model), fsdp_all_gather_elements=gathered[0]))
        after_step.append(non_owner_storage_bytes(model))
        with torch.no_grad():
            eval_logits.append(model(batches(1, seed=99)[0][0][:2].to(dev)).logits.clone())
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return {
        "losses": losses,
        "weights": full_weights(model),
        "P": P,
        "counts": counts,
        "storage_between_fwd_bwd": between_fwd_bwd,
        "storage_after_step": after_step,
        "eval_logits": eval_logits,
        "micro_counts": micro_counts,
        "imbalance": plan.imbalance,
        "owned": sorted(dmuon.get_owned_params(model)),
        "other_numel_padded": sum(
            -(-p.shape[0] // world) * world * (p.numel() // p.shape[0])
            for n, p in model.named_parameters()
            if not hasattr(p, "_dedicated_owner_rank")
        ),
    }


def _accumulate(model, tok, tgt, accum, micro_counts) -> torch.Tensor:
    """docs/guides/gradient-accumulation.md's loop: micro-batches 1..accum-1 under no_sync, the last outside."""
    from contextlib import nullcontext

    m = tok.shape[0] // accum
    total = torch.zeros((), device=tok.device)
    for i in range(accum):
        ctx = dmuon.no_sync(model) if i < accum - 1 else nullcontext()
        dmuon.diagnostics.reset_comm_counts(model)
        with ctx:
            loss = model(tok[i * m : (i + 1) * m], tgt[i * m : (i + 1) * m]).loss / accum
            loss.backward()
        micro_counts.append((i < accum - 1, dmuon.diagnostics.comm_counts(model)))
        total += loss.detach()
    return total


def _checkpointed(fwd, checkpoint):
    def run(*args, **kwargs):
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    return run


def hand_clip_(model: TinyLlama, cfg: TinyLlamaConfig, *, tau: float, alpha: float) -> None:
    """QK-clip written out by hand from each layer's reported maxima (the oracle's side of the QK-clip tests):
    every query head above ``tau`` scaled by ``(tau / max) ** alpha``, every key head by ``(tau / top) **
    (1 - alpha)`` of its group's largest query maximum. Clears the reports."""
    from dmuon.optim.qk_clip import RECORD_ATTR

    per, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    with torch.no_grad():
        for layer in model.layers:
            att = layer.attention
            m = getattr(att, RECORD_ATTR).tolist()
            setattr(att, RECORD_ATTR, None)
            for h, s in enumerate(m):
                if s > tau:
                    att.q_proj.weight[h * hd:(h + 1) * hd] *= (tau / s) ** alpha
            for g in range(cfg.n_kv_heads):
                top = max(m[g * per:(g + 1) * per])
                if top > tau:
                    att.k_proj.weight[g * hd:(g + 1) * hd] *= (tau / top) ** (1 - alpha)
