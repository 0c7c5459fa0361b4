"""Pipeline-parallel runs of the test model (docs/guides/pipeline-parallelism.md's loop) and their oracle.

Two stages of ``tests._training.CFG`` (two layers): stage 0 holds the embeddings and ``layers.0``, stage 1
``layers.1``, the final norm and the head, each with the full model's FQNs. Every rank runs one stage under
torch's own ``PipelineStage`` and schedules, with ``dmuon.dedicate_params`` on the stage's ``mesh["dp"]`` and
``fully_shard`` over the same mesh. The oracle is the whole model on one process (``torch.optim.Muon`` +
``torch.optim.AdamW``) over the global batch: the mean of the microbatch losses, as the schedule averages them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama, projection_predicate
from tests._dist import rank_threads
from tests._training import ADAMW_HP, GLOBAL_BATCH, MUON_HP, batches, build_model, full_weights, muon_kwargs

#: stage -> the layers it holds (of tests._training.CFG's two)
LAYERS = {0: (0,), 1: (1,)}
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
    schedule: str = "1f1b"  # or "gpipe"
    reshard_after_forward: bool = True
    microbatches: int = 2
    #: schedule steps per optimizer step (accumulation across steps: scale_grads=False, the loss divided)
    accum: int = 1
    max_norm: float | None = None
    steps: int = 3


def _schedule(name: str) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name]


def build_stage(mesh, *, reshard_after_forward: bool = True) -> tuple[Stage, dmuon.Muon]:
    """This rank's stage of the test model, dedicated over ``mesh["dp"]`` and sharded with FSDP2 over it."""
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    layers = tuple(i for s in sorted(LAYERS) for i in LAYERS[s]) if pp == 1 else LAYERS[pp_rank]  # pp 1: every layer
    stage = Stage(build_model(), layers, first=pp_rank == 0, last=pp_rank == pp - 1)
    dmuon.dedicate_params(stage, mesh["dp"], projection_predicate, reshard_after_forward=reshard_after_forward,
                          verbose=False)
    for layer in stage.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    return stage, dmuon.Muon(stage, **muon_kwargs())


def run_scenario(mesh, sc: Scenario) -> dict:
    """Train ``sc`` on this rank's stage; every rank returns its stage's weights, the last stage its losses."""
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model, opt = build_stage(mesh, reshard_after_forward=sc.reshard_after_forward)
    pipe = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    scale = sc.microbatches * sc.accum

    def loss_fn(logits, targets):
        return lm_loss(logits, targets) / (sc.accum if sc.accum > 1 else 1)

    schedule = _schedule(sc.schedule)(pipe, n_microbatches=sc.microbatches, loss_fn=loss_fn,
                                      scale_grads=sc.accum == 1)
    per = GLOBAL_BATCH // dp
    losses, norms, clipped, reduces = [], [], [], []
    for tok, tgt in batches(sc.steps):
        tok, tgt = tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]
        dmuon.diagnostics.reset_comm_counts(model)
        opt.zero_grad()
        mb: list[torch.Tensor] = []
        chunk = per // sc.accum
        for a in range(sc.accum):
            part = slice(a * chunk, (a + 1) * chunk)
            if pipe.is_first:
                schedule.step(tok[part])
            else:
                out: list[torch.Tensor] = []  # the schedule refills the list it is given
                schedule.step(target=tgt[part], losses=out)
                mb.extend(out)
        if sc.max_norm is not None:  # the norm, then the norm of what clipping left (a second clip that scales by 1)
            norms.append(dmuon.clip_grad_norm_(model, sc.max_norm).item())
            clipped.append(dmuon.clip_grad_norm_(model, 1e30).item())
        opt.step()
        counts = dmuon.diagnostics.comm_counts(model)
        reduces.append((counts["reduce"]["elements"], counts["reduce"]["calls"],
                        counts["forward_broadcast"]["elements"], counts["backward_broadcast"]["elements"]))
        if mb:  # the mean loss of this rank's microbatches (each already divided by accum)
            losses.append(sum(x.item() for x in mb) * (sc.accum if sc.accum > 1 else 1) / scale)
    P = sum(p.numel() for p in dmuon.get_dedicated_params(model).values())
    return {"losses": losses, "norms": norms, "clipped": clipped, "weights": full_weights(model), "reduces": reduces,
            "P": P, "dp": dp, "pp_rank": pp_rank}


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


def logits_of(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole model's logits on :data:`EVAL_TOKENS` with these weights, on one process."""
    model = build_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(EVAL_TOKENS).logits


@rank_threads()
def oracle(steps: int, *, max_norm: float | None = None, per_stage_clip: bool = False) -> dict:
    """The whole model on one process: ``torch.optim.Muon`` for the projections, ``torch.optim.AdamW`` for the
    rest, over the global batch. ``max_norm``: clipped by torch's ``clip_grad_norm_`` over every parameter, or
    with ``per_stage_clip`` each stage's parameters by their own norm (the wrong variant); ``"clipped"``: the
    total norm of the gradients after clipping, each step."""
    torch.manual_seed(0)
    model = build_model()
    named = list(model.named_parameters())
    opt_m = torch.optim.Muon([p for n, p in named if projection_predicate(n, p)], lr=MUON_HP.lr,
                             weight_decay=MUON_HP.weight_decay, momentum=MUON_HP.momentum, nesterov=MUON_HP.nesterov,
                             ns_coefficients=MUON_HP.ns_coefficients, ns_steps=MUON_HP.ns_steps, eps=MUON_HP.eps,
                             adjust_lr_fn=MUON_HP.adjust_lr_fn.value)
    opt_a = torch.optim.AdamW([p for n, p in named if not projection_predicate(n, p)], **ADAMW_HP.group_entries())
    stage_of = {n: (0 if n.startswith(("tok_embeddings", "layers.0.")) else 1) for n, _ in named}
    losses, norms, clipped = [], [], []
    for tok, tgt in batches(steps):
        opt_m.zero_grad()
        opt_a.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        if max_norm is not None and not per_stage_clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        elif max_norm is not None:
            for s in (0, 1):
                torch.nn.utils.clip_grad_norm_([p for n, p in named if stage_of[n] == s], max_norm)
        if max_norm is not None:
            clipped.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for _, p in named])).item())
        opt_m.step()
        opt_a.step()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "clipped": clipped, "weights": weights, "logits": logits_of(weights)}



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
