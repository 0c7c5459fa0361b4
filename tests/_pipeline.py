"""Pipeline-parallel runs of the test model (docs/guides/pipeline-parallelism.md's loop) and their oracle.

Two stages of ``tests._training.CFG`` (two layers): stage 0 holds the embeddings and ``layers.0``, stage 1
``layers.1``, the final norm and the head, each with the full model's FQNs. Every rank runs one stage under
torch's own ``PipelineStage`` and schedules, with ``dmuon.dedicate_params`` on the stage's ``mesh["dp"]`` and
``fully_shard`` over the same mesh. The oracle is the whole model on one process (``torch.optim.Muon`` +
``torch.optim.AdamW``) over the global batch: the mean of the microbatch losses, as the schedule averages them.

The schedules with several stages per rank (interleaved 1F1B, looped BFS) run :data:`CFG_V`, four layers: four
virtual stages of one layer each (the embeddings on the first, the norm and head on the last), rank ``r`` of
the pp dimension holding stages ``r`` and ``r + pp``, each its own module dedicated on its own, with its own
``dmuon.Muon``, and one ``dmuon.clip_grad_norm_`` over the rank's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama, TinyLlamaConfig, projection_predicate
from tests._dist import rank_threads
from tests._training import ADAMW_HP, CFG, GLOBAL_BATCH, MUON_HP, batches, build_model, full_weights, hand_clip_, \
    muon_kwargs

#: stage -> the layers it holds (of tests._training.CFG's two)
LAYERS = {0: (0,), 1: (1,)}
#: the model of the schedules with several stages per rank: one layer per virtual stage
CFG_V = replace(CFG, n_layers=4)
#: virtual stages per rank under those schedules
VIRTUAL = 2
#: the schedules with several stages per rank (the zero-bubble ones split each backward in an input and a weight pass)
MULTI = ("interleaved", "looped_bfs", "zb", "zbv", "dualpipev")
#: the schedules whose stages go down the ranks and back ("v": rank r holds stages r and 2 pp - 1 - r)
V_SHAPED = ("zbv", "dualpipev")
#: QK-clip's threshold and query share, and the factor query head 0 of every layer is scaled up by at init (its
#: logits far above tau, the other heads below), as tests/test_qk_clip.py sets them
TAU, ALPHA, BOOST = 8.0, 0.5, 12.0
#: the batch whose logits the tests compare after training
EVAL_TOKENS = batches(1, seed=99)[0][0][:2]


class Stage(nn.Module):
    """One pipeline stage of ``TinyLlama`` with the full model's FQNs (``layers`` a ``ModuleDict`` keyed by the
    global layer index, as torchtitan's): the embeddings on the first, the norm and head on the last."""

    def __init__(self, full: TinyLlama, layers: tuple[int, ...], *, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in layers})
        self.norm = full.norm if last else None
        self.lm_head = full.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h)).float() if self.lm_head is not None else h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class Scenario:
    """One training run of the job."""

    name: str
    schedule: str = "1f1b"  # or "gpipe", or one of MULTI
    reshard_after_forward: bool = True
    microbatches: int = 2
    #: schedule steps per optimizer step (accumulation across steps: scale_grads=False, the loss divided)
    accum: int = 1
    max_norm: float | None = None
    #: clip through ``torch.nn.utils.clip_grad_norm_`` over every parameter of the rank's stages (torchtitan's
    #: call), which dmuon routes to its own, instead of ``dmuon.clip_grad_norm_``
    torch_clip: bool = False
    #: the model reports its per-head maxima (query head 0 boosted) and every stage's dmuon.Muon clips them
    qk_clip: bool = False
    #: after the last step, each stage module's dmuon.diagnostics.summarize (as a dict)
    summary: bool = False
    steps: int = 3


def make_model(cfg: TinyLlamaConfig = CFG, *, qk_clip: bool = False) -> TinyLlama:
    """The test model; ``qk_clip``: reporting its attention maxima, query head 0 of every layer scaled by
    :data:`BOOST` (its logits above :data:`TAU`, every other head's below)."""
    if not qk_clip:
        return build_model(cfg=cfg)
    model = build_model(cfg=replace(cfg, report_max_logits=True))
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.q_proj.weight[:cfg.head_dim] *= BOOST
    return model


def _optimizer(model: nn.Module, qk_clip: bool) -> dmuon.Muon:
    return dmuon.Muon(model, **muon_kwargs(), qk_clip=dmuon.QKClip(tau=TAU, alpha=ALPHA) if qk_clip else None)


def _schedule(name: str) -> type:
    from torch.distributed import pipelining as P

    return {"1f1b": P.Schedule1F1B, "gpipe": P.ScheduleGPipe, "interleaved": P.ScheduleInterleaved1F1B,
            "looped_bfs": P.ScheduleLoopedBFS, "zb": P.ScheduleInterleavedZeroBubble, "zbv": P.ScheduleZBVZeroBubble,
            "dualpipev": getattr(P, "ScheduleDualPipeV", None)}[name]


def build_stage(mesh, *, reshard_after_forward: bool = True, qk_clip: bool = False) -> tuple[Stage, dmuon.Muon]:
    """This rank's stage of the test model, dedicated over ``mesh["dp"]`` and sharded with FSDP2 over it."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    layers = tuple(i for s in sorted(LAYERS) for i in LAYERS[s]) if pp == 1 else LAYERS[pp_rank]  # pp 1: every layer
    stage = Stage(make_model(qk_clip=qk_clip), layers, first=pp_rank == 0, last=pp_rank == pp - 1)
    dmuon.dedicate_params(stage, mesh["dp"], projection_predicate, reshard_after_forward=reshard_after_forward,
                          verbose=False)
    for layer in stage.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    return stage, _optimizer(stage, qk_clip)


def build_parts(mesh, *, reshard_after_forward: bool = True, qk_clip: bool = False, v_shaped: bool = False
                ) -> list[tuple[int, Stage, dmuon.Muon]]:
    """This rank's :data:`VIRTUAL` stages of :data:`CFG_V` (stage ``pp_rank + k * pp``), each dedicated over
    ``mesh["dp"]`` on its own, sharded with FSDP2, with its own ``dmuon.Muon``: ``(stage index, module, optimizer)``."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    n = pp * VIRTUAL
    out = []
    for index in ((pp_rank, n - 1 - pp_rank) if v_shaped else range(pp_rank, n, pp)):
        part = Stage(make_model(CFG_V, qk_clip=qk_clip), (index,), first=index == 0, last=index == n - 1)
        dmuon.dedicate_params(part, mesh["dp"], projection_predicate, reshard_after_forward=reshard_after_forward,
                              verbose=False)
        for layer in part.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        out.append((index, part, _optimizer(part, qk_clip)))
    return out


def run_scenario(mesh, sc: Scenario) -> dict:
    """Train ``sc`` on this rank's stage (or stages); every rank returns its stages' weights, the last stage its
    losses."""
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    if sc.schedule in MULTI:
        parts = build_parts(mesh, reshard_after_forward=sc.reshard_after_forward, qk_clip=sc.qk_clip,
                            v_shaped=sc.schedule in V_SHAPED)
    else:
        parts = [(pp_rank, *build_stage(mesh, reshard_after_forward=sc.reshard_after_forward, qk_clip=sc.qk_clip))]
    n_stages = pp * len(parts)
    models, opts = [m for _, m, _ in parts], [o for _, _, o in parts]
    pipes = [PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()) for i, m, _ in parts]
    first, last = any(p.is_first for p in pipes), any(p.is_last for p in pipes)
    scale = sc.microbatches * sc.accum

    def loss_fn(logits, targets):
        return lm_loss(logits, targets) / (sc.accum if sc.accum > 1 else 1)

    schedule = _schedule(sc.schedule)(pipes if sc.schedule in MULTI else pipes[0], n_microbatches=sc.microbatches,
                                      loss_fn=loss_fn, scale_grads=sc.accum == 1)
    clip_target = models if sc.schedule in MULTI else models[0]

    def clip(max_norm: float) -> float:
        if sc.torch_clip:
            return torch.nn.utils.clip_grad_norm_([p for m in models for p in m.parameters()], max_norm).item()
        return dmuon.clip_grad_norm_(clip_target, max_norm).item()
    per = GLOBAL_BATCH // dp
    losses, norms, clipped, reduces, qk = [], [], [], [], []
    for tok, tgt in batches(sc.steps):
        tok, tgt = tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]
        for model, opt in zip(models, opts):
            dmuon.diagnostics.reset_comm_counts(model)
            opt.zero_grad()
        mb: list[torch.Tensor] = []
        chunk = per // sc.accum
        for a in range(sc.accum):
            part = slice(a * chunk, (a + 1) * chunk)
            if first and last:  # a V-shaped schedule: the first and the last stage on pp rank 0
                out = []
                schedule.step(tok[part], target=tgt[part], losses=out)
                mb.extend(out)
            elif first:
                schedule.step(tok[part])
            else:
                out: list[torch.Tensor] = []  # the schedule refills the list it is given
                schedule.step(target=tgt[part], losses=out)
                mb.extend(out)
        if sc.max_norm is not None:  # the norm, then the norm of what clipping left (a second clip that scales by 1)
            norms.append(clip(sc.max_norm))
            clipped.append(clip(1e30))
        for opt in opts:
            opt.step()
        if sc.qk_clip and opts[0].qk_clip is not None:  # this rank's stages: the heads each clipped and the attention modules it saw
            qk.append([(o.qk_clip.stats.clipped_heads, sorted(o.qk_clip.stats.max_logits)) for o in opts])
        counts = [dmuon.diagnostics.comm_counts(model) for model in models]
        reduces.append(tuple(sum(c[kind][field] for c in counts) for kind, field in (
            ("reduce", "elements"), ("reduce", "calls"), ("forward_broadcast", "elements"),
            ("backward_broadcast", "elements"))))
        if mb:  # the mean loss of this rank's microbatches (each already divided by accum)
            losses.append(sum(x.item() for x in mb) * (sc.accum if sc.accum > 1 else 1) / scale)
    summaries = [dmuon.diagnostics.summarize(m, optimizer=o).as_dict() for m, o in zip(models, opts)] if sc.summary else []
    P = sum(p.numel() for model in models for p in dmuon.get_dedicated_params(model).values())
    weights = {k: v for model in models for k, v in full_weights(model).items()}
    return {"losses": losses, "norms": norms, "clipped": clipped, "weights": weights, "reduces": reduces,
            "P": P, "dp": dp, "pp_rank": pp_rank, "qk": qk, "summaries": summaries,
            "dedicated": sorted(n for m in models for n in dmuon.get_dedicated_params(m))}


def pipeline_job(rank: int, world: int, pp: int, scenarios: list[Scenario],
                 extra: Callable[[object], dict] | None = None) -> dict:
    """Every scenario, one after the other, on one ``(pp, dp)`` mesh; ``extra(mesh)`` adds its own results."""
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
    out = {sc.name: run_scenario(mesh, sc) for sc in scenarios}
    if extra is not None:
        out.update(extra(mesh))
    dist.barrier()
    return out


def merge(results: list[dict], name: str) -> dict:
    """One scenario's run as the oracle's shape: the last stage's losses (averaged over its dp ranks), the
    union of every stage's weights, the clip norms."""
    runs = [r[name] for r in results]
    last = [r for r in runs if r["losses"]]
    losses = [sum(r["losses"][s] for r in last) / len(last) for s in range(len(last[0]["losses"]))]
    weights: dict[str, torch.Tensor] = {}
    for r in runs:
        weights.update(r["weights"])
    return {"losses": losses, "weights": weights, "norms": runs[0]["norms"], "clipped": runs[0]["clipped"]}


def logits_of(weights: dict[str, torch.Tensor], cfg: TinyLlamaConfig = CFG) -> torch.Tensor:
    """The whole model's logits on :data:`EVAL_TOKENS` with these weights, on one process."""
    model = build_model(cfg=cfg)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(EVAL_TOKENS).logits


@rank_threads()
def oracle(steps: int, *, max_norm: float | None = None, per_stage_clip: bool = False,
           cfg: TinyLlamaConfig = CFG, qk_clip: bool = False, drop_weight_pass: bool = False) -> dict:
    """The whole model on one process: ``torch.optim.Muon`` for the projections, ``torch.optim.AdamW`` for the
    rest, over the global batch. ``max_norm``: clipped by torch's ``clip_grad_norm_`` over every parameter, or
    with ``per_stage_clip`` each half of the model by its own norm (the wrong variant: each of two stages
    clipping alone, or under :data:`CFG_V` each rank clipping each of its stage modules alone, so stages 0-1 and
    2-3 apart); ``"clipped"``: the total norm of
    the gradients after clipping, each step. ``cfg``: :data:`CFG_V` for the schedules with several stages per
    rank. ``qk_clip``: the boosted model (:func:`make_model`), clipped by hand after every step (``tests._training.hand_clip_``).
    ``drop_weight_pass``: the wrong variant of the zero-bubble schedules, a runtime that never sees the gradients
    their weight pass assigns: the projections of every layer but the first (the first stage's weight pass is a
    full backward, whose hooks run) keep no gradient and do not move."""
    torch.manual_seed(0)
    model = make_model(cfg, qk_clip=qk_clip)
    named = list(model.named_parameters())
    opt_m = torch.optim.Muon([p for n, p in named if projection_predicate(n, p)], lr=MUON_HP.lr,
                             weight_decay=MUON_HP.weight_decay, momentum=MUON_HP.momentum, nesterov=MUON_HP.nesterov,
                             ns_coefficients=MUON_HP.ns_coefficients, ns_steps=MUON_HP.ns_steps, eps=MUON_HP.eps,
                             adjust_lr_fn=MUON_HP.adjust_lr_fn.value)
    opt_a = torch.optim.AdamW([p for n, p in named if not projection_predicate(n, p)], **ADAMW_HP.group_entries())
    half = tuple(f"layers.{i}." for i in range(cfg.n_layers // 2))
    stage_of = {n: (0 if n.startswith(("tok_embeddings", *half)) else 1) for n, _ in named}
    losses, norms, clipped = [], [], []
    for tok, tgt in batches(steps):
        opt_m.zero_grad()
        opt_a.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        if drop_weight_pass:
            for n, p in named:
                if projection_predicate(n, p) and not n.startswith("layers.0."):
                    p.grad = None
        if max_norm is not None and not per_stage_clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        elif max_norm is not None:
            for s in (0, 1):
                torch.nn.utils.clip_grad_norm_([p for n, p in named if stage_of[n] == s], max_norm)
        if max_norm is not None:
            clipped.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for _, p in named])).item())
        opt_m.step()
        opt_a.step()
        if qk_clip:
            hand_clip_(model, cfg, tau=TAU, alpha=ALPHA)
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "clipped": clipped, "weights": weights,
            "logits": logits_of(weights, cfg)}



# --------------------------------------------------------------------------------------------------- #
# Checkpoints across pipeline layouts                                                                  #
# --------------------------------------------------------------------------------------------------- #
class Trainer:
    """This rank's stage on a ``(pp, dp)`` mesh (pp 1: the whole model, as one stage), trained one 1F1B step
    (two microbatches) at a time on its dp share of the global batch."""

    def __init__(self, mesh):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        torch.manual_seed(0)
        self.dp, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self.model, self.opt = build_stage(mesh)
        self.pipe = PipelineStage(self.model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(self.pipe, n_microbatches=2, loss_fn=lm_loss)

    def step(self, tok: torch.Tensor, tgt: torch.Tensor) -> float | None:
        """One optimizer step; the mean loss of this rank's microbatches on the last stage, else ``None``."""
        per = GLOBAL_BATCH // self.dp
        part = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        self.opt.zero_grad()
        out: list[torch.Tensor] = []
        if self.pipe.is_first and self.pipe.is_last:
            self.schedule.step(tok[part], target=tgt[part], losses=out)
        elif self.pipe.is_first:
            self.schedule.step(tok[part])
        else:
            self.schedule.step(target=tgt[part], losses=out)
        self.opt.step()
        return sum(x.item() for x in out) / len(out) if out else None

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dmuon.get_state_dict(self.model, self.opt, sharded=True), checkpoint_id=path)

    def staged(self, path: str) -> dict:
        """The checkpoint at ``path`` read into staged copies (nothing live changed yet)."""
        import torch.distributed.checkpoint as dcp

        sd = dmuon.get_state_dict(self.model, self.opt, sharded=True, staged=True)
        dcp.load(sd, checkpoint_id=path)
        return sd

    def snapshot(self) -> dict[str, torch.Tensor]:
        """This stage's weights and this rank's optimizer state (staged copies' local tensors), by key."""
        out = {f"model.{k}": v for k, v in full_weights(self.model).items()}
        optim = dmuon.get_optimizer_state_dict(self.model, self.opt, sharded=True, staged=True)

        def walk(prefix: str, x) -> None:
            if isinstance(x, dict):
                for k, v in x.items():
                    walk(f"{prefix}.{k}", v)
            elif isinstance(x, torch.Tensor):
                out[prefix] = (x.to_local() if hasattr(x, "to_local") else x).clone()

        walk("optim", optim)
        return out


class PartsTrainer:
    """This rank's :data:`VIRTUAL` stage modules of :data:`CFG_V` (:func:`build_parts`) on a ``(pp, dp)`` mesh, trained
    one interleaved 1F1B step (two microbatches) at a time, and checkpointed as the pipeline guide shows: one
    ``dmuon.get_state_dict`` over the rank's lists of modules and optimizers (the k-th module's dict under
    ``"part{k}"``), one ``dcp.save`` / ``dcp.load``."""

    def __init__(self, mesh):
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

        torch.manual_seed(0)
        self.dp, self.dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        n = mesh["pp"].size() * VIRTUAL
        parts = build_parts(mesh)
        self.models, self.opts = [m for _, m, _ in parts], [o for _, _, o in parts]
        pipes = [PipelineStage(m, i, n, torch.device("cpu"), group=mesh["pp"].get_group()) for i, m, _ in parts]
        self.first = any(p.is_first for p in pipes)
        self.schedule = ScheduleInterleaved1F1B(pipes, n_microbatches=2, loss_fn=lm_loss)

    def step(self, tok: torch.Tensor, tgt: torch.Tensor) -> float | None:
        """One optimizer step of every module; the mean loss of this rank's microbatches where it holds the last
        stage, else ``None``."""
        per = GLOBAL_BATCH // self.dp
        part = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        for opt in self.opts:
            opt.zero_grad()
        out: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(tok[part])
        else:
            self.schedule.step(target=tgt[part], losses=out)
        for opt in self.opts:
            opt.step()
        return sum(x.item() for x in out) / len(out) if out else None

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dmuon.get_state_dict(self.models, self.opts, sharded=True), checkpoint_id=path)

    def staged(self, path: str) -> dict:
        """The checkpoint read into staged copies, one ``dcp.load`` (nothing live changed yet)."""
        import torch.distributed.checkpoint as dcp

        sd = dmuon.get_state_dict(self.models, self.opts, sharded=True, staged=True)
        dcp.load(sd, checkpoint_id=path)
        return sd

    def load(self, path: str) -> None:
        dmuon.set_state_dict(self.models, self.opts, self.staged(path))

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v for m in self.models for k, v in full_weights(m).items()}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every module's weights and this rank's optimizer state (staged copies' local tensors), by key."""
        out = {f"model.{k}": v for k, v in self.weights().items()}
        for k, (m, o) in enumerate(zip(self.models, self.opts)):
            _walk(f"optim{k}", dmuon.get_optimizer_state_dict(m, o, sharded=True, staged=True), out)
        return out


def _walk(prefix: str, x, out: dict[str, torch.Tensor]) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            _walk(f"{prefix}.{k}", v, out)
    elif isinstance(x, torch.Tensor):
        out[prefix] = (x.to_local() if hasattr(x, "to_local") else x).clone()
