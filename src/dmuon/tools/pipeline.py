"""``python -m dmuon.plan --simulate --pp N``: the step of a pipeline-parallel job, per design, with its bubble.

What is assumed (the runtime's, ``docs/guides/pipeline-parallelism.md``):

* **Stages.** The model's layers split into ``N`` contiguous stages balanced by layer count (the first
  ``L mod N`` stages one layer more); the embedding sits on the first stage, the final norm and the head on
  the last. Ranks are numbered stage by stage: each stage's data-parallel group is ``world / N`` consecutive
  ranks, and a stage boundary's two ranks are ``world / N`` apart. Each stage runs the design on its own
  submodel over its dp group: dmuon owns the stage's matrices among the group (:func:`stage_sizes` is what
  ``dmuon_schedule`` takes), the all-to-all designs exchange over the group, FSDP2 shards over it.
* **Schedule: 1F1B** with ``M`` microbatches of ``batch / M`` sequences. With every stage's slot (one
  microbatch's forward + backward and its two activation sends) set by the slowest stage, the pipeline takes
  ``(M + N - 1)`` slots, of which ``N - 1`` are the bubble: a fraction ``(N - 1) / (M + N - 1)`` of the
  pipeline time (GPipe, Huang et al. 2019, section 2.2; Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.1: bubble ``(p - 1)/m`` of the
  ideal time ``m (t_f + t_b)``, the same fraction of the total). 1F1B has GPipe's bubble and less memory.
* **P2P.** Per microbatch and stage boundary, the hidden states go forward and their gradient back, each
  ``batch / M x seq x hidden x dtype`` bytes, one hop over the boundary's link; counted on the slot (a stage
  waits for its input), not hidden.
* **Collectives per step.** Gradients sync once per step (the schedules turn FSDP2's sync off until the last
  microbatch; dmuon follows it). Gathered weights stay gathered after a backward
  (``reshard_after_backward=False``): under Z2 one gather per step; under Z3 a pass gathers when the pass
  before it on that stage was a forward (which freed the weights) or it is the first, which in 1F1B's order
  (``min(M, N - 1 - s)`` warm-up forwards on stage ``s``, then forward/backward pairs) is ``M + 1`` gathers a
  step on every stage (``3 P`` at ``M = 2``, what ``tests/test_pipeline.py`` counts). FSDP2's per-layer
  gathers follow the same rule (its root unit: once), for every design. These overlap the stage's compute of
  the whole step ([Note: exposed communication] in :mod:`dmuon.tools.step_model`).
* **Optimizer.** Each stage steps its own params after the pipeline drains, in parallel; the job waits for the
  slowest stage (exposed collectives + optimizer). Not modelled: the gradient norm's all-reduce over every
  rank (a scalar), hiding the last reduce under the drain's bubble.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..links import Group, broadcast_ms
from .schedules import design_parts
from .step_model import ModelSizes, Scenario, compute_ms, exposed_ms, sizes_of

__all__ = ["stage_layers", "stage_sizes", "stage_gathers", "check_pipeline", "simulate_pipeline_design",
           "simulate_pipeline", "bubble_fraction"]

#: forward / backward gathers of FSDP2's per-layer units and dmuon's broadcasts, scaled by the microbatch count
_FORWARD_GATHERS = ("fsdp2 all-gather (layers)", "dmuon forward broadcast")
_BACKWARD_GATHERS = ("fsdp2 all-gather (layers, backward)", "dmuon backward broadcast")


def bubble_fraction(pp: int, microbatches: int) -> float:
    """1F1B's (and GPipe's) idle share of the pipeline time: ``(N - 1) / (M + N - 1)``."""
    return (pp - 1) / (microbatches + pp - 1)


def check_pipeline(sc: Scenario, *, pp: int, microbatches: int) -> None:
    """Refuse what the model cannot split (``ValueError`` naming the value and the fix)."""
    for name, v in (("pp", pp), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"dmuon.plan: --{name} must be a positive int, got {v!r}")
    if sc.world % pp:
        raise ValueError(f"dmuon.plan: --pp {pp} must divide --world-size {sc.world} (each stage's data-parallel "
                         f"group is world / pp ranks); pick a divisor of {sc.world}")
    if pp > sc.shape.layers:
        raise ValueError(f"dmuon.plan: --pp {pp} is more stages than {sc.shape.name}'s {sc.shape.layers} layers; "
                         f"use at most {sc.shape.layers}")
    if sc.batch % microbatches:
        raise ValueError(f"dmuon.plan: --batch {sc.batch} (sequences per pipeline and step) must be a multiple of "
                         f"--microbatches {microbatches}; raise --batch or lower --microbatches")
    if sc.replicas > 1 or sc.tp > 1 or sc.ep > 1:
        raise ValueError(f"dmuon.plan: --pp with --replicas, --tp or --ep (got {sc.replicas}, {sc.tp}, {sc.ep}) is "
                         "not modelled: the runtime supports neither HSDP nor tensor parallelism inside a stage")


def stage_layers(layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the ``pp`` stages, balanced by count (the first ``layers % pp`` one more)."""
    out, start = [], 0
    for s in range(pp):
        n = layers // pp + (s < layers % pp)
        out.append(range(start, start + n))
        start += n
    return out


def stage_sizes(sz: ModelSizes, pp: int, stage: int) -> ModelSizes:
    """Stage ``stage``'s submodel of ``sz``: its layers' matrices, the embedding on the first, the head on the
    last; per-layer parts (attention flops, norms, router, experts) by its share of the layers."""
    if pp == 1:
        return sz
    mine = stage_layers(sz.layers, pp)[stage]
    muon = tuple(m for m in sz.muon if int(m[2].rsplit(".", 1)[-1]) in mine)
    last, share = stage == pp - 1, len(mine) / sz.layers
    layer_flops = sz.dense_flops - 2 * (sz.muon_elements + sz.head)
    return dataclasses.replace(
        sz, muon=muon, layers=len(mine), embed=sz.embed if stage == 0 else 0, head=sz.head if last else 0,
        norms=round((sz.norms - sz.hidden) * share) + (sz.hidden if last else 0), router=round(sz.router * share),
        dense_flops=2 * (sum(r * c for _, (r, c), _ in muon) + (sz.head if last else 0)) + layer_flops * share,
        expert_flops=sz.expert_flops * share)


def stage_gathers(pp: int, microbatches: int, stage: int, reshard: str) -> tuple[int, int]:
    """(forward, backward) gathers of one step on ``stage`` (module docstring): Z2 ``(1, 0)``; Z3 the passes of
    1F1B's order whose predecessor on the stage was a forward, or that come first."""
    if reshard == "z2":
        return 1, 0
    warmup = min(microbatches, pp - 1 - stage)
    order = ["F"] * warmup + ["F", "B"] * (microbatches - warmup) + ["B"] * warmup
    fwd = sum(1 for i, p in enumerate(order) if p == "F" and (i == 0 or order[i - 1] == "F"))
    bwd = sum(1 for i, p in enumerate(order) if p == "B" and order[i - 1] == "F")
    return fwd, bwd


def _scaled(c: dict[str, Any], k: int) -> dict[str, Any]:
    keys = ("bytes", "payload", "calls", "units", "ms")
    return dict(c, **{key: c[key] * k for key in keys}) if k != 1 else c


def _stage(sc: Scenario, sz: ModelSizes, design: str, pp: int, m: int, s: int) -> dict[str, Any]:
    """One stage's step: per-microbatch compute, its collectives (gathers scaled), exposure and optimizer."""
    dp = dataclasses.replace(sc, world=sc.world // pp)
    sub = stage_sizes(sz, pp, s)
    # dedicate_params takes the flat layout under pipeline stages (the node layout is not built for them yet)
    parts = design_parts(dp, "dmuon_flat" if design == "dmuon" and pp > 1 else design, sizes=sub)
    fwd_k, bwd_k = stage_gathers(pp, m, s, sc.reshard)
    colls = []
    for c in parts["collectives"]:
        k = fwd_k if c["name"] in _FORWARD_GATHERS else bwd_k if c["name"] in _BACKWARD_GATHERS else 1
        if k:
            colls.append(_scaled(c, k))
    fwd, bwd = compute_ms(dataclasses.replace(dp, batch=sc.batch // m), sub, parts["fsdp_units"])
    muon_step = parts.get("muon_step_ms", parts["ns_ms"])
    exposed_step = exposed_ms(colls, "step", 0.0)
    return {"stage": s, "layers": sub.layers, "forward_mb_ms": fwd, "backward_mb_ms": bwd,
            "exposed_forward_ms": exposed_ms(colls, "forward", m * fwd),
            "exposed_backward_ms": exposed_ms(colls, "backward", m * bwd),
            "optimizer_ms": muon_step + parts["elementwise_ms"] + exposed_step, "exposed_step_ms": exposed_step,
            "extra_exposed_ms": parts.get("a2a_exposed_ms", max(0.0, muon_step - parts["ns_ms"])),
            "ns_ms": parts["ns_ms"], "elementwise_ms": parts["elementwise_ms"],
            "bytes_per_rank": sum(c["bytes"] for c in colls), "collectives": colls, "gathers": [fwd_k, bwd_k]}


def simulate_pipeline_design(sc: Scenario, design: str, *, pp: int, microbatches: int) -> dict[str, Any]:
    """``design``'s step on ``sc`` split into ``pp`` stages run by 1F1B over ``microbatches`` (module docstring):
    the job's step (the slowest stage's), its bubble, P2P and each stage's part.

    Example::

        from dmuon.tools.presets import PRESETS
        r = simulate_pipeline_design(Scenario(PRESETS["llama3-8b"], 64, batch=16), "dmuon", pp=4, microbatches=8)
        print(r["step_ms"], r["bubble_ms"] / r["pipeline_ms"])   # 3 / 11 of the pipeline idles
    """
    check_pipeline(sc, pp=pp, microbatches=microbatches)
    sz = sizes_of(sc.shape, sc.seq)
    stages = [_stage(sc, sz, design, pp, microbatches, s) for s in range(pp)]
    act = sc.batch // microbatches * sc.seq * sz.hidden * sc.dtype_bytes
    p2p = broadcast_ms(act, Group(2 if pp > 1 else 1, sc.world // pp), sc.links)
    # the slowest stage sets every slot; P2P: an activation in, a gradient out per microbatch
    t_f = max(st["forward_mb_ms"] for st in stages) + p2p
    t_b = max(st["backward_mb_ms"] for st in stages) + p2p
    worst = max(stages, key=lambda st: st["exposed_forward_ms"] + st["exposed_backward_ms"] + st["optimizer_ms"])
    out = {
        "design": design, "pp": pp, "microbatches": microbatches, "p2p_bytes_per_microbatch": act if pp > 1 else 0,
        "p2p_ms": p2p, "pipeline_ms": (microbatches + pp - 1) * (t_f + t_b),
        "bubble_ms": (pp - 1) * (t_f + t_b), "bubble_fraction": bubble_fraction(pp, microbatches),
        "forward_ms": microbatches * t_f + worst["exposed_forward_ms"],
        "backward_ms": microbatches * t_b + worst["exposed_backward_ms"],
        "optimizer_ms": worst["optimizer_ms"], "worst_stage": worst["stage"],
        "ns_ms": max(st["ns_ms"] for st in stages),
        "exposed_ms": worst["exposed_forward_ms"] + worst["exposed_backward_ms"] + worst["exposed_step_ms"]
        + worst["extra_exposed_ms"] + 2 * microbatches * p2p,
        "bytes_per_rank": max(st["bytes_per_rank"] for st in stages) + 2 * microbatches * (act if pp > 1 else 0),
        "stages": stages,
    }
    out["step_ms"] = out["forward_ms"] + out["backward_ms"] + out["optimizer_ms"] + out["bubble_ms"]
    return out


def simulate_pipeline(sc: Scenario, designs: tuple[str, ...], *, pp: int, microbatches: int) -> dict[str, Any]:
    """Every design of ``designs`` and FSDP2 + AdamW on ``sc`` at ``pp`` stages, each with its overhead over the
    baseline at the same split (the shape of :func:`dmuon.tools.simulate.simulate`'s result, plus the pipeline's
    numbers).

    Example::

        from dmuon.tools.presets import PRESETS
        res = simulate_pipeline(Scenario(PRESETS["llama3-8b"], 64, batch=16), ("dmuon",), pp=4, microbatches=8)
        print(res["designs"]["dmuon"]["overhead"], res["bubble_fraction"])   # ..., 3 / 11
    """
    check_pipeline(sc, pp=pp, microbatches=microbatches)
    results = {d: simulate_pipeline_design(sc, d, pp=pp, microbatches=microbatches)
               for d in dict.fromkeys(("fsdp_adamw", *designs))}
    base = results["fsdp_adamw"]["step_ms"]
    for r in results.values():
        r["overhead"] = r["step_ms"] / base - 1
    return {"preset": sc.shape.name, "world_size": sc.world, "replicas": 1, "shard": sc.world // pp, "tp": 1,
            "ep": 1, "pp": pp, "microbatches": microbatches, "tokens_per_rank": sc.tokens, "batch": sc.batch,
            "seq": sc.seq, "reshard": sc.reshard, "links": dataclasses.asdict(sc.links),
            "bubble_fraction": bubble_fraction(pp, microbatches), "more_slots_than_matrices": False,
            "designs": results}
