"""Shared MoE scenarios: the tiny MoE model, its single-process oracle (torch's Muon on one 2-D parameter per
expert slice and row block; :func:`per_matrix_oracle` for any model, HF's in ``tests/test_hf_moe.py``) and the
dmuon run compared with it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.optim import AdamWHParams, MuonHParams
from dmuon.runtime.blocks import Columns, Interleaved, RowBlocks
from dmuon.runtime.hooks import get_state
from dmuon.tools.moe import TinyMoE, TinyMoEConfig, apply_expert_parallel, expert_predicate, expert_row_blocks
from tests._dist import DEVICE_TYPE, device, rank_threads
from tests._training import ADAMW_HP, GLOBAL_BATCH, MUON_HP, batches, full_weights, muon_kwargs
from tests._variants import reference_optimizer

#: 2 MoE layers of 4 experts (top-2), experts 96 x 128 (not square: the lr rule reads each expert's own shape),
#: a shared expert; vocabulary and batch as the dense parity tests. Fixed routing: learned top-k routing turns
#: last-bit differences into expert flips (dmuon/tools/moe.py). The oracle's own floor at this size ([Note: test
#: scale] in tests/_training.py), fed the global batch as 2 / 4 accumulated parts: losses within 3.7e-5 /
#: 2.9e-5 relative, weights within 9.7e-4, over 20 steps (CPU, torch 2.13); at dim 64 it was 8.2e-5, too close
#: to the 1e-4 bound.
MOE_CFG = TinyMoEConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=192, max_seq_len=64,
                        n_experts=4, top_k=2, expert_dim=96, routing="fixed")


def moe_cfg(**changes) -> TinyMoEConfig:
    return replace(MOE_CFG, **changes)


def build_moe(cfg: TinyMoEConfig = MOE_CFG, seed: int = 0) -> TinyMoE:
    model = TinyMoE(cfg)
    model.init_weights(seed)
    return model


def _blocks_fn(cfg: TinyMoEConfig) -> Callable[[str, nn.Parameter], int | None] | None:
    return expert_row_blocks if cfg.layout == "fused" else None


def block_index(n: int, spec) -> list:
    """The indices along one dim of ``n`` of each block of a split ``spec`` (a count, sizes, or
    ``Interleaved``), written out from the spec's plain meaning, independently of ``dmuon.runtime.blocks``:
    a slice per contiguous block, an index tensor per interleaved one (its part of every group, in order)."""
    if isinstance(spec, Interleaved):
        per = n // spec.groups
        return [torch.cat([torch.arange(g * per + s.start, g * per + s.stop) for g in range(spec.groups)])
                for s in block_index(per, spec.rows)]
    sizes = [n] if spec is None else [n // spec] * spec if isinstance(spec, int) else list(spec)
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def _slices(name: str, p: torch.Tensor, blocks_fn: Callable[[str, nn.Parameter], RowBlocks] | None) -> list[tuple]:
    """Index tuples of every matrix of ``p``: each expert, and each block of it (rows, or columns for
    ``Columns``)."""
    spec = blocks_fn(name, p) if blocks_fn is not None else None
    columns = isinstance(spec, Columns)
    blocks = block_index(p.shape[-1] if columns else p.shape[-2], spec.blocks if columns else spec)
    inner = [(slice(None), b) if columns else (b,) for b in blocks]
    if p.ndim == 2:
        return inner
    return [(e, *ix) for e in range(p.shape[0]) for ix in inner]


@rank_threads()
def train_moe_oracle(steps: int, cfg: TinyMoEConfig = MOE_CFG, hp: MuonHParams = MUON_HP,
                     adamw: AdamWHParams = ADAMW_HP, accum: int = 1, *, clip: float | None = None,
                     expert_lr: float | None = None) -> dict:
    """:func:`per_matrix_oracle` on the tiny MoE. ``accum``: the global batch as that many accumulated parts
    (the oracle's own rounding floor, and the recipe's accumulation). ``clip``:
    ``torch.nn.utils.clip_grad_norm_`` over every param first; ``expert_lr``: the experts' own param group."""
    torch.manual_seed(0)
    model = build_moe(cfg).to(device())
    return per_matrix_oracle(model, expert_predicate, _blocks_fn(cfg), lambda m, tok, tgt: m(tok, tgt).loss, steps,
                             hp, adamw, accum, clip=clip, expert_lr=expert_lr)


@rank_threads()
def per_matrix_oracle(model: nn.Module, predicate: Callable[[str, nn.Parameter], bool],
                      blocks_fn: Callable[[str, nn.Parameter], RowBlocks] | None,
                      loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], steps: int,
                      hp: MuonHParams = MUON_HP, adamw: AdamWHParams = ADAMW_HP, accum: int = 1, *,
                      clip: float | None = None, expert_lr: float | None = None) -> dict:
    """One process: ``torch.optim.Muon`` (or, for a variant's ``hp``, its reference: ``tests/_variants.py``) on
    one 2-D parameter per matrix of every param ``predicate`` selects
    (per expert, per block of ``blocks_fn``: rows, columns, interleaved; its gradient copied in, its result
    copied back),
    ``torch.optim.AdamW`` on the rest, fed :func:`tests._training.batches` whole (``accum`` parts).
    ``loss_of(model, tokens, targets)``: the loss of one batch. Any model: the tiny MoE, HF's."""
    dev = device()
    shadows: list[tuple[torch.Tensor, tuple, nn.Parameter]] = []
    rest = []
    for name, p in model.named_parameters():
        if not predicate(name, p):
            rest.append(p)
            continue
        for idx in _slices(name, p, blocks_fn):
            shadows.append((p, idx, nn.Parameter(p.detach()[idx].clone())))
    experts = [s for p, _, s in shadows if p.ndim == 3]
    dense = [s for p, _, s in shadows if p.ndim != 3]
    groups = [{"params": dense}, {"params": experts, **({"lr": expert_lr} if expert_lr is not None else {})}]
    if hp.ALGORITHM != "muon" or hp.cautious_weight_decay:  # a variant: its oracle from the paper's formulas
        opt_m = reference_optimizer(groups, hp)
    else:
        opt_m = torch.optim.Muon(groups, lr=hp.lr, weight_decay=hp.weight_decay, momentum=hp.momentum,
                                 nesterov=hp.nesterov, ns_coefficients=hp.ns_coefficients, ns_steps=hp.ns_steps,
                                 eps=hp.eps, adjust_lr_fn=hp.adjust_lr_fn.value)
    opt_a = torch.optim.AdamW(rest, **adamw.group_entries())
    losses = []
    for tok, tgt in batches(steps):
        opt_a.zero_grad()
        for p, _, _ in shadows:
            p.grad = None
        loss = 0.0
        for part_tok, part_tgt in zip(tok.chunk(accum), tgt.chunk(accum)):
            part = loss_of(model, part_tok.to(dev), part_tgt.to(dev)) / accum
            part.backward()
            loss += part.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p, idx, s in shadows:
            s.grad = p.grad[idx].clone()
        opt_m.step()
        with torch.no_grad():
            for p, idx, s in shadows:
                p[idx] = s
        opt_a.step()
        losses.append(float(loss))
    return {"losses": losses, "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


@dataclass(frozen=True)
class MoERun:
    steps: int = 10
    cfg: TinyMoEConfig = MOE_CFG
    reshard_after_forward: bool = True
    #: the experts' route: ``None`` (the default: on the engine's shards when each rank gets an expert),
    #: ``"muon"`` (one owner each), ``"muon_sharded"``, ``"mixed"`` (layer 0's on owners, the rest sharded;
    #: expert-parallel ones stay sharded)
    expert_route: str | None = None
    #: the experts on FSDP2 + AdamW instead (a wrong implementation, for the tests that must fail)
    experts_on_adamw: bool = False
    #: a fused layout without its row blocks: gate and up orthogonalised as one matrix (wrong, likewise)
    ignore_blocks: bool = False
    #: expert parallelism over this many ranks (``apply_expert_parallel``), FSDP2 over the rest for the experts
    ep: int = 1
    #: micro-batches per step (all but the last under ``dmuon.no_sync``), ``dmuon.clip_grad_norm_`` before the
    #: step, and the experts' own param group with this lr
    accum: int = 1
    clip: float | None = None
    expert_lr: float | None = None
    #: mixed precision: ``"fp32_params"`` (an fp32 model computing in bf16: FSDP2's ``param_dtype`` and
    #: ``dedicate_params(param_dtype=...)``), ``"bf16_model"`` (a bf16 model, float32 masters through
    #: ``master_dtype``); both reduce gradients in float32
    mixed: str | None = None
    hp: MuonHParams = MUON_HP
    #: ``dedicate_params``' owner layout ([Note: node layout] in ``dmuon/runtime/hierarchy.py``)
    layout: str = "auto"


def hf_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of an HF causal LM, in float32."""
    return torch.nn.functional.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())


def train_hf_dedicated(model: nn.Module, mesh, rank: int, world: int, steps: int) -> tuple[dmuon.Muon, list[float]]:
    """An HF MoE model already dedicated over ``mesh`` (``world`` ranks): FSDP2 per decoder layer then the root,
    ``dmuon.Muon`` with the parity hyperparameters, ``steps`` steps of the shared batches split over the ranks.
    Returns the optimizer and each step's loss averaged over the ranks."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **muon_kwargs(MUON_HP))
    per = GLOBAL_BATCH // world
    losses = []
    for tok, tgt in batches(steps):
        opt.zero_grad()
        loss = hf_loss(model, tok[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    return opt, losses


def dedicate_moe(model: TinyMoE, mesh, run: MoERun, ep_mesh=None) -> None:
    """``dedicate_params`` for the MoE model, then FSDP2 per layer and on the root; with expert parallelism
    (``ep_mesh``: a 2-D ("dp", "ep") mesh) the experts are placed first and get their own FSDP2 unit over
    "dp" whose gradients are averaged over every rank of the job."""
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh["ep"])
    predicate = expert_predicate
    if run.experts_on_adamw:
        def predicate(n, p):  # noqa: E306 - the wrong variant: only the 2-D matrices
            return expert_predicate(n, p) and p.ndim == 2
    def route(n, p):  # "mixed": layer 0's experts on one owner each, the others on the engine's shards
        if p.ndim != 3 or run.expert_route is None:
            return None
        if run.expert_route == "mixed":
            return "muon" if n.startswith("layers.0.") and not isinstance(p, DTensor) else "muon_sharded"
        return run.expert_route

    blocks = None if run.ignore_blocks else _blocks_fn(run.cfg)
    dmuon.dedicate_params(model, mesh, predicate, blocks=blocks, route=route, verbose=False, layout=run.layout,
                          reshard_after_forward=run.reshard_after_forward,
                          param_dtype=torch.bfloat16 if run.mixed == "fp32_params" else None,
                          reduce_dtype=torch.float32 if run.mixed else None)
    mp = {} if run.mixed is None else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if run.mixed == "fp32_params" else None, reduce_dtype=torch.float32)}
    for layer in model.layers:
        if ep_mesh is not None:
            experts = fully_shard(layer.moe.experts, mesh=ep_mesh["dp"], **mp)
            experts.set_gradient_divide_factor(float(dist.get_world_size()))
            if dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM, which a divide factor asks for
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)


def train_moe(rank: int, world: int, run: MoERun) -> dict:
    """The custom-loop recipe on the MoE model; each rank its slice of the oracle's global batch."""
    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    ep_mesh = None if run.ep == 1 else init_device_mesh(DEVICE_TYPE, (world // run.ep, run.ep),
                                                        mesh_dim_names=("dp", "ep"))
    model = build_moe(run.cfg).to(device(), torch.bfloat16 if run.mixed == "bf16_model" else torch.float32)
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.ndim == 3}
    dedicate_moe(model, mesh, run, ep_mesh)
    groups = None if run.expert_lr is None else [
        {"params": [n for n, p in model.named_parameters() if p.ndim == 3], "lr": run.expert_lr}]
    opt = dmuon.Muon(model, **muon_kwargs(run.hp), param_groups=groups,
                     master_dtype=torch.float32 if run.mixed == "bf16_model" else None)
    per, dev = GLOBAL_BATCH // world, device()
    losses = []
    for tok, tgt in batches(run.steps):
        opt.zero_grad()
        tok, tgt = tok[rank * per:(rank + 1) * per].to(dev), tgt[rank * per:(rank + 1) * per].to(dev)
        loss = torch.zeros((), device=dev)
        for i, (t, y) in enumerate(zip(tok.chunk(run.accum), tgt.chunk(run.accum))):
            with dmuon.no_sync(model) if i < run.accum - 1 else nullcontext():
                part = model(t, y).loss / run.accum
                part.backward()
            loss += part.detach().float()
        if run.clip is not None:
            dmuon.clip_grad_norm_(model, run.clip)
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    # full_weights reads the params; under param_dtype a dedicated one is the bf16 compute copy of its fp32 value
    weights = full_weights(model) if run.mixed is None else dmuon.get_model_state_dict(model)
    return {"losses": losses, "weights": weights, "owned": sorted(dmuon.get_owned_params(model)),
            "layout": get_state(model).layout,
            "initial": initial, "ns_calls": [tuple(g["shape"]) for g in dmuon.diagnostics.ns_backends(opt)],
            "expert_state": {k: {n: str(t.dtype) for n, t in v.items()}
                             for k, v in dmuon.get_optimizer_state_dict(model, opt)["state"].items() if "experts" in k},
            "expert_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()
                              if p.ndim == 3 and isinstance(p, DTensor)}}
