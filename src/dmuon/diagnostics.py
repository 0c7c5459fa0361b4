"""What dmuon does on each rank: the communication counter (what dmuon's own collectives move, so tests and
benchmarks can check the cost model), the Newton–Schulz call of each shape group, and :func:`summarize`,
one page per job.

Every collective dmuon issues goes through :mod:`dmuon.runtime.comm`, which records its payload in the
model's :class:`CommCounter`; this page reads it.
Counts are *payload elements per collective* (the number of tensor elements in the broadcast or reduce
buffer) and their bytes (which tell dtypes apart: a bf16 model's reduce with
``reduce_dtype=torch.float32`` moves 4 bytes per element, its broadcasts 2), identical on every rank of
the collective. For dedicated parameters of total size P, one training step therefore shows
``forward_broadcast == P``, ``backward_broadcast == P`` under Z3 (0 under Z2) and ``reduce == P``.
``calls`` are launches: every owner of a boundary shares one per phase, so a 1-D step shows one
``forward_broadcast``, one ``reduce`` and under Z3 one ``backward_broadcast`` per boundary, whatever the
world size.

Example::

    dmuon.diagnostics.reset_comm_counts(model)
    loss = model(batch).loss; loss.backward(); optimizer.step()
    print(dmuon.diagnostics.comm_counts(model))
    # {'forward_broadcast': {'elements': 4096, 'bytes': 16384, 'calls': 4, 'by_dim': {'shard': {...}}}, ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .optim.groups import canonical_name
from .optim.muon import Muon
from .optim.newton_schulz import explain
from .optim import routes
from .partition import ns_cost, shard_ns_cost
from .runtime.route import Route
from .runtime.comm import CommCounter, CommKind, all_gather_object
from .engines import state_of as get_state

__all__ = ["CommKind", "CommCounter", "Summary", "comm_counts", "reset_comm_counts", "ns_backends", "qk_clip",
           "summarize"]


def _counter(model: nn.Module) -> CommCounter:
    return get_state(model).ctx.counter


def comm_counts(model: nn.Module) -> dict[str, Any]:
    """Totals since the last :func:`reset_comm_counts` for a model prepared by ``dedicate_params``.

    Example::

        counts = dmuon.diagnostics.comm_counts(model)
        assert counts["reduce"]["elements"] == sum(p.numel() for p in dmuon.get_dedicated_params(model).values())
    """
    return _counter(model).as_dict()


def reset_comm_counts(model: nn.Module) -> None:
    """Zero the counters (e.g. at the start of the step you want to measure).

    Example::

        dmuon.diagnostics.reset_comm_counts(model)
        train_one_step()
        print(dmuon.diagnostics.comm_counts(model)["forward_broadcast"])
    """
    _counter(model).reset()


def ns_backends(optimizer: Muon) -> list[dict[str, Any]]:
    """Per shape group of the matrices this rank owns: the batched Newton–Schulz call ``step()`` makes
    (``"shape"``: batch x rows x cols), its form and dtype, which kernel forms the symmetric products and
    why (a missing package, a GPU older than Hopper, a matrix too small to gain). Local, no collective.

    Example::

        for row in dmuon.diagnostics.ns_backends(optimizer):
            print(row["shape"], row["form"], row["symmetric_products"], row["why"])
        # (4, 2048, 8192) gram quack quack's symmetric GEMM (Hopper+)
    """
    if not isinstance(optimizer, Muon):
        raise TypeError(f"dmuon.diagnostics.ns_backends needs a dmuon.Muon, got {type(optimizer).__name__}")
    return [{"shape": (n, *shape), **explain((n, *shape), backend, device=device)}
            for (n, shape, backend, device, _) in _ns_calls(optimizer)]


def qk_clip(optimizer: Muon) -> dict[str, Any] | None:
    """What the last ``step()``'s QK-clip did (``None`` when the optimizer has no ``qk_clip``): ``"clipped_heads"``
    of ``"heads"`` query heads, ``"max_logit"`` (the largest over every head and rank), per attention module
    the ``"clipped"`` head indices and every head's ``"max_logits"``. The same on every rank. Local.

    Example::

        stats = dmuon.diagnostics.qk_clip(optimizer)
        print(f"step {stats['step']}: {stats['clipped_heads']} heads clipped, largest logit {stats['max_logit']:.1f}")
    """
    if not isinstance(optimizer, Muon):
        raise TypeError(f"dmuon.diagnostics.qk_clip needs a dmuon.Muon, got {type(optimizer).__name__}")
    return None if optimizer.qk_clip is None else optimizer.qk_clip.stats.as_dict()


def _ns_calls(optimizer: Muon) -> list[tuple[int, tuple[int, ...], str, torch.device, int]]:
    """``(batch, matrix shape, backend, device, tp elements sent)`` of each batched NS call one ``step()`` of
    this rank makes: one per run of equal blocks of each layout group ([Note: matrix blocks] in
    ``dmuon/runtime/blocks.py``), the engine's shards of ``muon_sharded`` params included. A tensor-parallel
    shape group runs NS on the full matrices dealt to this tp rank ([Note: TP update] in
    ``dmuon/optim/tp_update.py``) and sends the rest of its shards over "tp"."""
    state = optimizer.runtime
    dps = {id(dp.param): dp for dp in state.dedicated()}
    out = []
    for group in optimizer.param_groups:
        if group["kind"] != "muon":
            continue
        counts: dict[tuple, int] = {}
        how: dict[tuple, routes.RouteStrategy] = {}  # each key's route ([Note: route strategies])
        device = torch.device("cpu")
        for p, name in zip(group["params"], group["param_names"]):
            dp = dps.get(id(p))
            route = routes.of(dp)
            key = route.ns_batch(state, routes.Member(canonical_name(name), p, dp))
            if key is None:
                continue
            counts[key] = counts.get(key, 0) + 1
            how.setdefault(key, route)
            device = p.device
        for (blocks, split), n in sorted(counts.items(), key=lambda kv: (kv[0][0].shape, kv[0][0].rows)):
            mine, sent = how[(blocks, split)].ns_work(state, n, split)
            for run in blocks.runs:
                batch = mine * blocks.batch * run.count
                out.append((batch, blocks.run_shape(run), group["ns_backend"], device, sent))
                sent = 0  # the exchange moves each group once
    return [c for c in out if c[0] or c[4]]


# ---------------------------------------------------------------------- #
# One page per job: who owns what, what a step should move, what it moved #
# ---------------------------------------------------------------------- #
_KINDS = ("forward_broadcast", "backward_broadcast", "reduce", "replicate_publish")


@dataclass
class Summary:
    """What :func:`summarize` gathered: one row per rank. ``as_dict()`` is JSON-able; ``str()`` a table."""

    rows: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"ranks": self.rows}

    def table(self) -> str:
        kinds = _KINDS + (("tp_exchange",) if any("tp_exchange" in r["expected"] for r in self.rows) else ())
        staged = any(r.get("stage", 0) for r in self.rows)  # pipeline stages: a stage column
        stage = (lambda r: f"{r['stage']:>5} ") if staged else (lambda r: "")
        head = (f"{'rank':>4} " + ("stage " if staged else "") + f"{'slot':>4} {'owned':>5} {'elements':>12} "
                f"{'MiB':>9} {'NS share':>8}  " + "  ".join(f"{k} expected/measured" for k in kinds))
        lines = [head]
        total_flops = sum(r["ns_flops"] for r in self.rows) or 1
        for r in self.rows:
            moved = "  ".join(f"{r['expected'].get(k, 0):,}/{r['measured'].get(k, 0):,}" for k in kinds)
            lines.append(f"{r['rank']:>4} {stage(r)}{r['slot']:>4} {len(r['owned']):>5} {r['owned_elements']:>12,} "
                         f"{r['owned_bytes'] / 2**20:>9.2f} {r['ns_flops'] / total_flops:>8.1%}  {moved}")
        for r in self.rows:
            lines.append(f"rank {r['rank']}: " + ", ".join(f"{p['fqn']} {tuple(p['shape'])}" for p in r["owned"]))
            for g in r.get("ns_backends", []):
                lines.append(f"  NS {tuple(g['shape'])}: {g['form']} ({g['dtype']}), symmetric products "
                             f"{g['symmetric_products']}: {g['why']}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def summarize(model: nn.Module, *, optimizer: Muon | None = None) -> Summary:
    """Per rank: the dedicated matrices it owns (shape, elements, bytes, NS cost), the elements one step
    should move by kind (``docs/architecture.md`` section 5) next to what the counters measured since the
    last :func:`reset_comm_counts`, and with ``optimizer`` the NS call of each shape group
    (:func:`ns_backends`) and, under tensor parallelism, the elements each step sends over "tp"
    (``tp_exchange``) and this tp rank's NS flops. Collective: every rank gets every row. Under pipeline
    parallelism each row names its rank's ``stage`` and counts that stage's matrices (``P`` is the stage's);
    with several stage modules per rank, call it once per module, every rank in the same order.

    Example::

        dmuon.diagnostics.reset_comm_counts(model)
        train_one_step()
        summary = dmuon.diagnostics.summarize(model, optimizer=optimizer)
        if dist.get_rank() == 0:
            print(summary)                      # a table
            json.dump(summary.as_dict(), f)     # or JSON
    """
    state = get_state(model)
    ctx = state.ctx
    dps = list(state.dedicated())
    P = sum(dp.shape.numel() for dp in dps)
    column = sum(dp.shape.numel() for dp in dps if dp.owner % ctx.shard_size == ctx.shard_index)
    hsdp = ctx.replicate_size > 1
    # the node layout's rails carry this rank's local index's buckets once more ([Note: node layout])
    rail = 0 if ctx.node_size is None else sum(dp.shape.numel() for dp in dps
                                               if dp.owner % ctx.node_size == ctx.shard_index % ctx.node_size)
    owned = [dp for dp in dps if dp.is_owner]
    counts = comm_counts(model)
    tp_size = state.tp_mesh.size() if state.tp_mesh is not None else 1
    row = {
        # under pipeline parallelism: the rank's stage (an index into its model's Topology.stages, ordered by
        # lowest rank) and the stage's share; every rank's row is gathered over the whole job
        "rank": torch.distributed.get_rank(), "slot": ctx.rank, "stage": state.topology.stage,
        "layout": state.layout,
        "owned": [{"fqn": dp.fqn, "shape": list(dp.shape), "numel": dp.shape.numel(),
                   "bytes": dp.shape.numel() * torch.empty((), dtype=dp.dtype).element_size(),
                   "route": dp.route.value,  # an adamw_owner param runs no NS
                   # a TP matrix's NS runs whole on one of its tp ranks: 1/t of it each on average (exactly,
                   # per rank, with ``optimizer``, below)
                   "ns_flops": shard_ns_cost(tuple(dp.shape), None if dp.tp_dim is None else (dp.tp_dim, tp_size),
                                             dp.blocks.spec if dp.blocks is not None else None)
                   if dp.route is Route.MUON else 0.0}
                  for dp in owned],
        # the replicate stages move the tensors of this rank's shard column, on each of its holders
        "expected": {"forward_broadcast": P + rail,
                     "backward_broadcast": P + rail if state.config.reshard_after_forward else 0,
                     "reduce": P + rail + (column if hsdp else 0), "replicate_publish": column if hsdp else 0},
        "measured": {k: v["elements"] for k, v in counts.items() if isinstance(v, dict) and "elements" in v},
    }
    row["owned_elements"] = sum(p["numel"] for p in row["owned"])
    row["owned_bytes"] = sum(p["bytes"] for p in row["owned"])
    row["ns_flops"] = sum(p["ns_flops"] for p in row["owned"])
    if optimizer is not None:
        # what this rank's step really runs: under TP this tp rank's full matrices ([Note: TP update]), and the
        # engine's shards of ``muon_sharded`` experts ([Note: Muon on the engine's shards])
        calls = _ns_calls(optimizer)
        row["ns_backends"] = [{**g, "shape": list(g["shape"])} for g in ns_backends(optimizer)]
        row["ns_flops"] = sum(n * ns_cost(shape) for n, shape, _, _, _ in calls if n)
        if state.tp_mesh is not None:
            row["expected"]["tp_exchange"] = sum(c[4] for c in calls)
    rows = all_gather_object(ctx, row)  # every rank of the job: under TP, every tp index too
    return Summary(sorted(rows, key=lambda r: r["rank"]))  # type: ignore[arg-type]
