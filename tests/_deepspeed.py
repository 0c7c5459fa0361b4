"""DeepSpeed jobs the DeepSpeed tests share: each rank's setup, the config, the test model under
``deepspeed.initialize`` with ``dmuon.Muon``, and docs/guides/deepspeed.md's loop (``engine.backward`` +
``engine.step`` per micro-batch; DeepSpeed's ``gradient_accumulation_steps`` decides the boundary).

The ranks are ``tests/_dist.py``'s gloo processes: DeepSpeed's CPU accelerator takes the process group they made
(``deepspeed.init_distributed``), with ``LOCAL_RANK`` set as torchrun would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests._training import GLOBAL_BATCH, batches, build_model, full_weights, muon_kwargs, projection_predicate

# before anything imports deepspeed: its CPU accelerator (it would pick CUDA where there is one)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def setup(rank: int) -> Any:
    """DeepSpeed on this rank: ``LOCAL_RANK`` (which DeepSpeed asserts), no shared-memory comm op (compiling it
    takes half a minute and a compiler), and the gloo group ``run_distributed`` made. Returns the module."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def config(world: int, *, stage: int, accum: int, clip: float = 0.0, **extra: Any) -> dict[str, Any]:
    """The DeepSpeed config of one run: the global batch split over ``world`` ranks and ``accum`` micro-batches;
    ``gradient_clipping`` always set (DeepSpeed's default is 1.0)."""
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // accum, "gradient_accumulation_steps": accum,
            "zero_optimization": {"stage": stage}, "gradient_clipping": clip, "steps_per_print": 10**9, **extra}


@dataclass(frozen=True)
class Run:
    """One training run: ZeRO stage, micro-batches per step, DeepSpeed's ``gradient_clipping`` (0: off)."""

    stage: int
    accum: int
    clip: float = 0.0
    #: a deliberately wrong variant: ``"reduce"`` (the dedicated gradients averaged a second time, as ZeRO would
    #: if they were in its groups), ``"step"`` (an AdamW steps them too, as ZeRO's would)
    wrong: str | None = None

    @property
    def name(self) -> str:
        return f"zero{self.stage} accum{self.accum} clip{self.clip:g}" + (f" wrong={self.wrong}" if self.wrong else "")


def build(world: int, run: Run, *, schedule: Callable[[dmuon.Muon], Any] | None = None,
          **ds_extra: Any) -> tuple[Any, torch.nn.Module, dmuon.Muon]:
    """The test model dedicated over ``world`` ranks, ``dmuon.Muon`` (the parity hyperparameters) and the engine;
    ``schedule(optimizer)``: the torch scheduler the engine gets."""
    import deepspeed

    torch.manual_seed(0)
    model = build_model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False)
    opt = dmuon.Muon(model, **muon_kwargs())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           lr_scheduler=None if schedule is None else schedule(opt),
                                           config=config(world, stage=run.stage, accum=run.accum, clip=run.clip,
                                                         **ds_extra))
    return engine, model, opt


def build_zero_init(world: int, run: Run) -> tuple[Any, torch.nn.Module, dmuon.Muon, int, bool]:
    """:func:`build` with the model built under ``deepspeed.zero.Init`` (ZeRO-3 partitions every param at
    construction; the test weights written through ``GatheredParameters`` from rank 0). Also returns how many
    params were partitioned (0 elements here) when ``dedicate_params`` got the model, and whether a
    ``dedicate_params`` refused first (``layout="node"`` on one node: after the selected params were gathered
    whole) left every one of the engine's params in place."""
    import deepspeed

    from tests._training import CFG
    from dmuon.tools.models import TinyLlama

    cfg = config(world, stage=run.stage, accum=run.accum, clip=run.clip)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLlama(CFG)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.init_weights(0)
    partitioned = sum(p.numel() == 0 for p in model.parameters())
    before = [(n, id(p)) for n, p in model.named_parameters()]
    try:
        dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False,
                              layout="node")
        kept = False
    except ValueError:
        kept = [(n, id(p)) for n, p in model.named_parameters()] == before
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False)
    opt = dmuon.Muon(model, **muon_kwargs())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, model, opt, partitioned, kept


def build_bf16(world: int, run: Run, **ds_extra: Any) -> tuple[Any, torch.nn.Module, dmuon.Muon]:
    """:func:`build` in bf16 (DeepSpeed's ``"bf16"``, plus ``ds_extra``): the model cast before
    ``dedicate_params``, as DeepSpeed's bf16 needs, dedicated gradients reduced in fp32, fp32 Muon masters."""
    import deepspeed

    torch.manual_seed(0)
    model = build_model().to(torch.bfloat16)
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False,
                          reduce_dtype=torch.float32)
    opt = dmuon.Muon(model, **muon_kwargs(), master_dtype=torch.float32)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(
        world, stage=run.stage, accum=run.accum, clip=run.clip, bf16={"enabled": True}, **ds_extra))
    return engine, model, opt


def train(engine: Any, model: torch.nn.Module, rank: int, world: int, run: Run, steps: range,
          before_step: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """docs/guides/deepspeed.md's loop over ``steps`` of the shared batches; ``before_step`` runs after each
    accumulation boundary's backward (the wrong variants). Returns the mean losses and DeepSpeed's norms."""
    per = GLOBAL_BATCH // world
    micro = per // run.accum
    losses, norms = [], []
    for step, (tok, tgt) in enumerate(batches(steps.stop)):
        if step not in steps:
            continue
        total = torch.zeros(())
        for i in range(run.accum):
            lo = rank * per + i * micro
            loss = engine(tok[lo:lo + micro], tgt[lo:lo + micro]).loss
            engine.backward(loss)
            if i == run.accum - 1 and before_step is not None:
                before_step()
            engine.step()
            total += loss.detach() / run.accum
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
    return {"losses": losses, "norms": norms}


def reduce_again(model: torch.nn.Module, world: int) -> Callable[[], None]:
    """The ``"reduce"`` wrong variant: every dedicated gradient averaged once more over the ranks with DeepSpeed's
    all-reduce, the owner's average against the others' zeros, as ZeRO would average a param it held."""
    from deepspeed import comm

    def hook() -> None:
        owned = dmuon.get_owned_grads(model)
        for name, p in sorted(dmuon.get_dedicated_params(model).items()):
            g = owned[name] if name in owned else torch.zeros(p.shape, dtype=p.dtype)
            comm.all_reduce(g)
            g.div_(world)

    return hook


def step_too(model: torch.nn.Module, opt: dmuon.Muon) -> Callable[[], None]:
    """The ``"step"`` wrong variant: an AdamW with dmuon's AdamW settings also steps the owned dedicated params, as
    ZeRO's AdamW would if they were in its groups."""
    groups = opt._adamw.defaults
    extra = torch.optim.AdamW(list(dmuon.get_owned_params(model).values()) or [torch.zeros(1, requires_grad=True)],
                              lr=groups["lr"], betas=groups["betas"], eps=groups["eps"],
                              weight_decay=groups["weight_decay"])
    return extra.step


def zero3_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The params ZeRO-3 partitioned (each holds its slice in ``ds_tensor``; the dedicated ones hold none)."""
    return [p for p in model.parameters() if getattr(p, "ds_tensor", None) is not None]


def result(model: torch.nn.Module, trained: dict[str, list[float]]) -> dict[str, Any]:
    """What a job returns for one run: losses, norms, every weight whole, and this rank's own copy of each param
    ZeRO trains (to compare the ranks; under ZeRO-3 gathered with DeepSpeed's ``GatheredParameters``)."""
    import deepspeed

    dedicated = dmuon.get_dedicated_params(model)
    with deepspeed.zero.GatheredParameters(zero3_params(model)):
        local = {n: p.detach().clone() for n, p in model.named_parameters() if n not in dedicated}
        return {**trained, "weights": full_weights(model), "local": local}
