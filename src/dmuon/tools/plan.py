"""``python -m dmuon.plan``: the owner assignment, memory and traffic for a model shape, without a GPU.

    python -m dmuon.plan --preset llama3-8b --world-size 64
    python -m dmuon.plan --config path/to/config.json --world-size 16 --replicas 4 --json
    python -m dmuon.plan --simulate --preset llama3-8b --world-size 8 [--plot overhead.png]
    python -m dmuon.plan --validate

Runs the same planner ``dedicate_params`` runs (same cost model, same owners), on the projection
matrices of a Llama-shaped model, and reports per rank: owned matrices, elements, NS-cost share, the
memory dmuon holds for dedicated params (owned weights + Muon momentum, plus the transient full copies
under Z3 / Z2), and the elements dmuon's collectives move per step (payload per rank, as
``dmuon.diagnostics`` counts them). The table prints one row per distinct line, with the ranks that share
it, so a 512-rank plan fits a screen (``--per-rank``: one row per rank; ``--json``: everything).

``--simulate`` predicts the step instead (:mod:`dmuon.tools.simulate`): per design (FSDP2 + AdamW, dmuon's
ownership, the all-to-all designs), the step time, its overhead over FSDP2 + AdamW, the busiest rank's
Newton–Schulz, the bytes per rank and the exposed communication, from Newton–Schulz times measured on an
H200 and a link model given as options; ``--plot FILE`` draws the overhead from 8 to 1024 GPUs; ``--pp N``
splits the layers into N stages run by 1F1B and adds the pipeline's bubble (:mod:`dmuon.tools.pipeline`).
``--validate`` prints the model against every run ``docs/benchmarks.md`` measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

from ..layout import choose_layout
from ..links import Links
from ..partition import OwnerPlan, _count, assign_node_owners, assign_owners
from .ns_table import BACKENDS
from .presets import MOE_PRESETS, PRESET_ALIASES, PRESETS, LlamaShape, canonical_preset, projection_specs

__all__ = ["make_plan", "idle_owner_warning", "main", "cli"]

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def shape_from_hf_config(path: str) -> LlamaShape:
    """A ``LlamaShape`` from a HuggingFace ``config.json`` (Llama / Qwen2 / Mistral-style keys)."""
    with open(path) as f:
        cfg = json.load(f)
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return LlamaShape(
            name=str(cfg.get("_name_or_path") or cfg.get("model_type") or path),
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
        )
    except KeyError as e:
        raise ValueError(f"dmuon.plan: {path} lacks {e.args[0]!r}; expected a Llama-style HF config.json") from None


def make_plan(shape: str | LlamaShape, world_size: int, replicas: int = 1, dtype: str = "bf16", *,
              layout: str = "auto", gpus_per_node: int = 8, reshard: str = "z3") -> dict[str, Any]:
    """Everything the CLI prints, as one JSON-able dict: the owners, memory and traffic of the layout
    ``dedicate_params(..., layout=layout)`` takes on this mesh (``gpus_per_node`` ranks a node, ``reshard`` Z3 or
    Z2 as ``reshard_after_forward``), with the reason in ``info["layout_why"]``.

    Example::

        info = make_plan("llama3-8b", world_size=64)             # 8 nodes of 8: the node layout
        print(info["layout"], info["imbalance"], info["per_rank"][0]["persistent_bytes"])
    """
    if dtype not in _BYTES:
        raise ValueError(f"dmuon.plan: dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    if not isinstance(replicas, int) or replicas < 1 or world_size % replicas:
        raise ValueError(f"dmuon.plan: replicas must divide world_size ({world_size}), got {replicas!r}")
    specs = projection_specs(shape)
    nbytes = _BYTES[dtype]
    per_layer: dict[str, int] = defaultdict(int)
    for s in specs:
        per_layer[s.layer] += s.numel
    layout, why = _layout(list(per_layer.values()), world_size, replicas, nbytes, layout=layout,
                          gpus_per_node=gpus_per_node, reshard=reshard)
    n = gpus_per_node
    plan = (assign_node_owners(specs, world_size // n, n) if layout == "node" else assign_owners(specs, world_size))
    total = sum(s.numel for s in specs)
    largest_boundary = max(per_layer.values())
    shard = world_size // replicas
    # under HSDP the owner's whole shard column keeps a copy: sum the owned elements of each column
    column = [sum(plan.ranks[r * shard + s].numel for r in range(replicas)) for s in range(shard)]
    network = _network_elements(specs, plan, shard, layout, gpus_per_node)
    per_rank = []
    for r in plan.ranks:
        held = column[r.rank % shard]
        per_rank.append({
            "rank": r.rank,
            "params": len(r.fqns),
            "numel": r.numel,
            "ns_cost_share": r.cost / max(sum(x.cost for x in plan.ranks), 1),
            # owned weights + Muon momentum (same dtype as the weight), and the column copies (HSDP)
            "persistent_bytes": (held + r.numel) * nbytes,
            # Z3: one boundary's full weights at a time; Z2: every non-held weight from forward to backward
            "peak_transient_bytes_z3": largest_boundary * nbytes,
            "peak_transient_bytes_z2": (total - held) * nbytes,
            # what a pass of the shard row (forward gather, Z3's backward gather, reduce) charges this rank's NIC
            "network_bytes_per_pass": network[r.rank] * nbytes,
        })
    moved = {
        "z3": {"forward_broadcast": total, "backward_broadcast": total, "reduce": total},
        "z2": {"forward_broadcast": total, "backward_broadcast": 0, "reduce": total},
    }
    return {
        "preset": shape if isinstance(shape, str) else shape.name,
        "world_size": world_size,
        "replicas": replicas,
        "dtype": dtype,
        "layout": layout,
        "layout_why": why,
        "gpus_per_node": gpus_per_node,
        "dedicated_params": len(specs),
        "dedicated_elements": total,
        "imbalance": plan.imbalance,
        "summary": plan.summary_line(),
        "elements_moved_per_rank_per_step": moved,
        "per_rank": per_rank,
        "per_param": [{"fqn": s.fqn, "shape": list(s.shape), "owner": plan.owners[s.fqn], "ns_cost": s.cost}
                      for s in specs],
    }


def _layout(boundary_elements: list[int], world: int, replicas: int, nbytes: int, *, layout: str,
            gpus_per_node: int, reshard: str) -> tuple[str, str]:
    """The layout ``dedicate_params(layout=layout)`` takes on this mesh, and one line saying why: its own rule
    (``dedicate._resolve_layout``) and cost model (:func:`dmuon.layout.choose_layout`, default links)."""
    if layout not in ("auto", "flat", "node"):
        raise ValueError(f"dmuon.plan: --layout must be auto, flat or node, got {layout!r}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"dmuon.plan: --gpus-per-node must be a positive int, got {gpus_per_node!r}")
    if reshard not in ("z3", "z2"):
        raise ValueError(f"dmuon.plan: --reshard must be z3 or z2, got {reshard!r}")
    if layout == "flat":
        return "flat", "layout 'flat', as --layout flat asks: each phase one launch over every rank"
    n = gpus_per_node
    refused = ("HSDP keeps dmuon's gathers inside its shard groups already" if replicas > 1
               else None if world % n == 0 and world // n >= 2
               else f"{world} ranks are not two or more whole nodes of {n} (--gpus-per-node)")
    if refused is not None:
        if layout == "node":
            raise ValueError(f"dmuon.plan: --layout node needs a 1-D mesh over two or more whole nodes, but {refused};"
                             " pass --layout flat (or auto)")
        return "flat", f"layout 'flat': the node layout is not taken ({refused})"
    if layout == "node":
        return "node", f"layout 'node', as --layout node asks: each boundary owned inside one node of {n}"
    pick = choose_layout([e * nbytes for e in boundary_elements], world, n, z3=reshard == "z3")
    return pick.layout, f"{pick.why()} (dedicate_params(layout='auto'), {world // n} nodes of {n})"


def _network_elements(specs: list[Any], plan: OwnerPlan, shard: int, layout: str, n: int) -> list[int]:
    """Elements a pass of the shard row charges each rank's NIC, as the link model does (:mod:`dmuon.links`; HSDP's
    replicate stages aside): none inside one node; flat, every boundary whole (a ring over nodes carries it all
    on every link); node, the buckets of the rank's local index (its rail's)."""
    world = len(plan.ranks)
    if shard <= n:
        return [0] * world
    if layout == "flat":
        return [sum(s.numel for s in specs)] * world
    bucket = [0] * n
    for s in specs:
        bucket[plan.owners[s.fqn] % n] += s.numel
    return [bucket[r % n] for r in range(world)]


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f}"


def _rank_ranges(ranks: list[int], width: int) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``; cut to ``width`` characters with ``...`` if longer."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return text if len(text) <= width else text[: width - 3].rsplit(",", 1)[0] + ",..."


def _table_rows(info: dict[str, Any], per_rank: bool) -> list[tuple[str, int, str]]:
    """``(ranks, how many, the row's columns)``: one per rank, or one per distinct row (ranks in order of the
    first rank of each)."""
    groups: dict[int | str, tuple[list[int], str]] = {}
    for r in info["per_rank"]:
        cols = (f"{r['params']:>6} {_count(r['numel']):>9} {r['ns_cost_share']:>8.2%} {_gib(r['persistent_bytes']):>9} "
                f"{_gib(r['peak_transient_bytes_z3']):>9} {_gib(r['peak_transient_bytes_z2']):>9} "
                f"{_gib(r['network_bytes_per_pass']):>9}")
        groups.setdefault(r["rank"] if per_rank else cols, ([], cols))[0].append(r["rank"])
    return [(_rank_ranges(ranks, 17), len(ranks), cols) for ranks, cols in groups.values()]


def idle_owner_warning(info: dict[str, Any]) -> str | None:
    """What it costs when ranks outnumber the dedicated matrices (``None`` when they do not): some ranks own
    nothing, and the busiest owner's Newton–Schulz work has a floor that more ranks cannot lower."""
    world, n = info["world_size"], info["dedicated_params"]
    if world <= n:
        return None
    idle = sum(1 for r in info["per_rank"] if r["params"] == 0)
    costs = [p["ns_cost"] for p in info["per_param"]]
    floor = max(costs) / sum(costs)
    return (f"warning: {world} ranks but only {n} dedicated matrices: {idle} ranks own none (idle owners: they "
            f"still broadcast and reduce, but run no Newton-Schulz). The busiest owner still does {floor:.2%} of "
            f"the job's NS work, not 1/{world} = {1 / world:.2%}: one matrix's NS is the floor of the Muon step's "
            f"time, and more ranks cannot lower it.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dmuon.plan",
        description="Owner assignment, per-rank memory and per-step traffic of dmuon's dedicated matrices\n"
                    "for a Llama-shaped model, computed without a GPU by the planner dedicate_params uses;\n"
                    "with --simulate, the predicted step time of dmuon and the all-to-all designs against\n"
                    "FSDP2 + AdamW.",
        epilog="examples:\n  python -m dmuon.plan --preset llama3-8b --world-size 64\n"
               "  python -m dmuon.plan --config config.json --world-size 16 --replicas 4 --json\n"
               "  python -m dmuon.plan --simulate --preset llama3-8b --world-size 64 --replicas 8 --plot o.png\n"
               "  python -m dmuon.plan --simulate --preset qwen3-30b-a3b --world-size 8 --ep 8\n"
               "  python -m dmuon.plan --simulate --preset llama3-8b --world-size 64 --pp 4 --batch 16\n"
               "  python -m dmuon.plan --validate",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    aliases = ", ".join(f"{k}={v}" for k, v in PRESET_ALIASES.items())
    names = sorted(PRESETS) + sorted(MOE_PRESETS)
    src.add_argument("--preset", type=canonical_preset, choices=names, metavar="NAME",
                     help=f"a built-in model shape, one of: {', '.join(names)} (short names accepted: "
                          f"{aliases}; the MoE shape {', '.join(sorted(MOE_PRESETS))} with --simulate only)")
    src.add_argument("--config", metavar="PATH", help="a HuggingFace config.json of a Llama-style model "
                     "(Llama, Qwen2, Mistral keys), instead of --preset")
    parser.add_argument("--world-size", type=int, metavar="W",
                        help="number of ranks (GPUs) in the job (needed except with --validate)")
    parser.add_argument("--replicas", type=int, default=1, metavar="R",
                        help="HSDP replicate size; must divide W (default 1: plain FSDP over all W ranks)")
    parser.add_argument("--dtype", choices=sorted(_BYTES), default="bf16",
                        help="dtype of the dedicated weights and their momentum, for the memory columns "
                             "(default bf16)")
    parser.add_argument("--layout", choices=("auto", "flat", "node"), default="auto",
                        help="the owner layout of the table, as dedicate_params(layout=...) takes it: auto (default: "
                             "the node layout on a 1-D mesh over 2+ whole nodes of --gpus-per-node where dmuon's cost "
                             "model predicts it cheaper), flat or node; with --simulate, use --designs dmuon_flat,"
                             "dmuon_node instead")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--per-param", action="store_true", help="also list every matrix with its owner rank")
    parser.add_argument("--per-rank", action="store_true",
                        help="one table row per rank (default: one row per distinct row, with its ranks)")
    _simulate_options(parser)
    return parser


def _simulate_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``--simulate`` and ``--validate`` (their defaults: the link model's, see
    :mod:`dmuon.links`)."""
    sim = parser.add_argument_group("--simulate: the predicted step (no GPU needed)")
    links = Links()
    sim.add_argument("--simulate", action="store_true",
                     help="predict each design's step time, overhead over FSDP2 + AdamW, busiest rank's "
                          "Newton-Schulz, bytes per rank and exposed communication")
    sim.add_argument("--validate", action="store_true",
                     help="print the model against every step time docs/benchmarks.md measured, and its errors")
    sim.add_argument("--designs", default="dmuon,distmuon,dion", metavar="LIST",
                     help="designs to compare with fsdp_adamw, comma-separated, of: dmuon (ownership, in the layout "
                          "dedicate_params(layout='auto') takes), dmuon_flat / dmuon_node (ownership in that layout), "
                          "distmuon (all-to-all, torch's NS), dion (all-to-all, pipelined) (default dmuon,distmuon,dion)")
    sim.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size (default 1)")
    sim.add_argument("--ep", type=int, default=1, metavar="E",
                     help="expert-parallel size, inside the shard group, MoE presets only (default 1)")
    sim.add_argument("--pp", type=int, default=1, metavar="N",
                     help="pipeline stages: the layers split into N contiguous stages, each over world / N ranks, "
                          "run by 1F1B (default 1: no pipeline)")
    sim.add_argument("--microbatches", type=int, metavar="M",
                     help="with --pp: microbatches per step, dividing --batch (default 2N)")
    sim.add_argument("--batch", type=int, default=4, metavar="B",
                     help="sequences per data-parallel rank (with --pp: per pipeline) and optimizer step "
                          "(default 4)")
    sim.add_argument("--seq", type=int, default=2048, metavar="S", help="tokens per sequence (default 2048)")
    sim.add_argument("--reshard", choices=("z3", "z2"), default="z3",
                     help="dmuon: free the broadcast weights after forward (z3) or keep them (z2) (default z3); the "
                          "owner table's layout='auto' weighs it too")
    sim.add_argument("--ns-backend", choices=sorted(BACKENDS), default="auto",
                     help="dmuon's Newton-Schulz, as measured on an H200 on the day named (default auto: today's)")
    sim.add_argument("--gpus-per-node", type=int, default=links.gpus_per_node, metavar="N",
                     help=f"GPUs sharing a node's NVLink (default {links.gpus_per_node}); the owner table's node "
                          "layout too")
    sim.add_argument("--nvlink-gbs", type=float, default=links.nvlink_gbs, metavar="GBS",
                     help=f"GB/s per GPU and direction inside a node (default {links.nvlink_gbs:g})")
    sim.add_argument("--network-gbs", type=float, default=links.network_gbs, metavar="GBS",
                     help=f"GB/s per GPU and direction between nodes (default {links.network_gbs:g})")
    sim.add_argument("--nvlink-hop-us", type=float, default=links.nvlink_hop_us, metavar="US",
                     help=f"latency of one ring step inside a node, microseconds (default {links.nvlink_hop_us:g})")
    sim.add_argument("--network-hop-us", type=float, default=links.network_hop_us, metavar="US",
                     help=f"latency of one ring step between nodes, microseconds (default {links.network_hop_us:g})")
    sim.add_argument("--ring-nics", type=int, default=links.ring_nics, metavar="K",
                     help="NICs of a node one ring across nodes spreads its channels over, at most its ranks a node "
                          f"(a what-if; NCCL: one channel a NIC; default {links.ring_nics}: every ring on one NIC)")
    sim.add_argument("--broadcast", choices=("ring", "tree"), default=links.broadcast,
                     help="how broadcasts and reduces travel: ring (NCCL's only algorithm for them) or tree (a "
                          f"what-if) (default {links.broadcast})")
    sim.add_argument("--target", type=float, default=0.03, metavar="F",
                     help="the overhead (a fraction) of the 'within ... from N tokens' lines (default 0.03)")
    sim.add_argument("--sweep", action="store_true",
                     help="also print the overhead at 8 to 1024 GPUs, on 1-D FSDP and on HSDP by node")
    sim.add_argument("--plot", metavar="FILE",
                     help="draw that sweep into FILE (PNG; needs matplotlib: pip install 'dmuon[demo]')")


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.validate:
        from .simulate import format_validation, validate

        rows = validate()
        print(json.dumps({"validation": rows}) if args.json else format_validation(rows))
        return 0
    if not (args.preset or args.config):
        parser.error("one of --preset or --config is required (or --validate)")
    if args.world_size is None:
        parser.error("--world-size is required (or --validate)")
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    try:
        shape = args.preset if args.preset else shape_from_hf_config(args.config)
        if args.simulate or args.plot or args.sweep:
            return _simulate_cli(args, parser, shape)
        if args.pp != 1 or args.microbatches is not None:
            raise ValueError("dmuon.plan: --pp and --microbatches are options of --simulate; add --simulate")
        if isinstance(shape, str) and shape in MOE_PRESETS:
            raise ValueError(f"dmuon.plan: {shape} is an MoE shape; its owner table is not built here, "
                             "predict its step with --simulate")
        info = make_plan(shape, args.world_size, args.replicas, args.dtype, layout=args.layout,
                         gpus_per_node=args.gpus_per_node, reshard=args.reshard)
    except ValueError as e:
        parser.error(str(e))
    return _print_plan(args, info)


def _simulate_cli(args: argparse.Namespace, parser: argparse.ArgumentParser, shape: str | LlamaShape) -> int:
    """``--simulate``: the table (or JSON), the tokens each design needs for ``--target``, the sweep, the chart."""
    from .simulate import (MUON_DESIGNS, format_simulation, format_sweep, plot_sweep, simulate, sweep,
                           tokens_for_overhead)
    from .step_model import Scenario

    if args.per_param or args.per_rank:
        raise ValueError("dmuon.plan: --per-param and --per-rank are options of the owner table, not of --simulate")
    if args.layout != "auto":
        raise ValueError(f"dmuon.plan: --layout {args.layout} is an option of the owner table; with --simulate pass "
                         f"--designs dmuon_{args.layout} (dmuon is the layout 'auto' takes)")
    designs = tuple(d.strip() for d in args.designs.split(",") if d.strip())
    known = (*MUON_DESIGNS, "dmuon_flat", "dmuon_node")
    unknown = [d for d in designs if d not in known]
    if unknown or not designs:
        raise ValueError(f"dmuon.plan: --designs takes names of {', '.join(known)}, got {args.designs!r}")
    links = Links(gpus_per_node=args.gpus_per_node, nvlink_gbs=args.nvlink_gbs, network_gbs=args.network_gbs,
                  nvlink_hop_us=args.nvlink_hop_us, network_hop_us=args.network_hop_us, broadcast=args.broadcast,
                  ring_nics=args.ring_nics)
    preset = (PRESETS.get(shape) or MOE_PRESETS[shape]) if isinstance(shape, str) else shape
    sc = Scenario(preset, args.world_size, replicas=args.replicas, tp=args.tp, ep=args.ep, batch=args.batch,
                  seq=args.seq, dtype_bytes=_BYTES[args.dtype], reshard=args.reshard, ns_backend=args.ns_backend,
                  links=links)
    if args.pp != 1 or args.microbatches is not None:
        return _pipeline_cli(args, sc, designs)
    res = simulate(sc, designs)
    res["tokens_for_target"] = {d: tokens_for_overhead(sc, d, args.target) for d in designs}
    sw = sweep(sc, designs=designs) if args.sweep or args.plot else None
    if args.plot:
        plot_sweep(sw, args.plot)
    if args.json:
        print(json.dumps(dict(res, sweep=sw, target=args.target)))
        return 0
    print(format_simulation(res, res["tokens_for_target"], args.target))
    if sw is not None and args.sweep:
        print("\n" + format_sweep(sw))
    if args.plot:
        print(f"\nwrote {args.plot}")
    return 0


def _pipeline_cli(args: argparse.Namespace, sc: Any, designs: tuple[str, ...]) -> int:
    """``--simulate --pp N``: the pipeline's table or JSON (:mod:`dmuon.tools.pipeline`)."""
    from .pipeline import simulate_pipeline
    from .simulate import format_simulation

    if args.pp < 1:
        raise ValueError(f"dmuon.plan: --pp must be a positive int, got {args.pp}")
    if args.pp == 1:
        raise ValueError(f"dmuon.plan: --microbatches needs --pp of 2 or more, got --pp {args.pp}")
    if args.sweep or args.plot:
        raise ValueError("dmuon.plan: --sweep and --plot are not modelled with --pp; drop them or --pp")
    m = 2 * args.pp if args.microbatches is None else args.microbatches
    res = simulate_pipeline(sc, designs, pp=args.pp, microbatches=m)
    if args.json:
        print(json.dumps(dict(res, target=args.target)))
    else:
        print(format_simulation(res, {}, args.target))
    return 0


def _print_plan(args: argparse.Namespace, info: dict[str, Any]) -> int:
    """The owner table (or its JSON), with the idle-owner warning on stderr."""
    warning = idle_owner_warning(info)
    if warning:
        print(warning, file=sys.stderr)
    if args.json:
        print(json.dumps(dict(info, warnings=[warning] if warning else [])))
        return 0
    hsdp = f" as {args.replicas} x {args.world_size // args.replicas} HSDP" if args.replicas > 1 else ""
    print(f"{info['preset']}: {info['dedicated_params']} projection matrices, {_count(info['dedicated_elements'])} "
          f"elements ({_gib(info['dedicated_elements'] * _BYTES[args.dtype]).strip()} GiB in {args.dtype}), "
          f"{args.world_size} ranks{hsdp}")
    print(info["summary"])
    print(f"dmuon: {info['layout_why']}")
    print(f"\n{'ranks':<17} {'count':>5} {'params':>6} {'elements':>9} {'NS share':>8} {'owned GiB':>9} "
          f"{'Z3 peak+':>9} {'Z2 peak+':>9} {'net/pass':>9}")
    for ranks, n, cols in _table_rows(info, args.per_rank):
        print(f"{ranks:<17} {n:>5} {cols}")
    m = info["elements_moved_per_rank_per_step"]
    nbytes = _BYTES[args.dtype]
    z3, z2 = sum(m["z3"].values()), sum(m["z2"].values())
    print(f"\nmoved per rank per step (payload): Z3 {_count(z3)} elements ({_gib(z3 * nbytes).strip()} GiB), "
          f"Z2 {_count(z2)} ({_gib(z2 * nbytes).strip()} GiB)\n  forward broadcast P, backward re-broadcast P "
          f"(Z3 only), reduce P; P = {_count(info['dedicated_elements'])}")
    print("columns are per rank of the row; owned GiB: weights + Muon momentum (+ HSDP column copies);\n"
          "peak+: transient full copies on top; net/pass: GiB a pass charges the rank's NIC (the link model's)")
    if args.per_param:
        print(f"\n{'owner':>5} {'shape':>14} {'NS flops/iter':>14}  matrix")
        for p in sorted(info["per_param"], key=lambda p: (p["owner"], p["fqn"])):
            print(f"{p['owner']:>5} {'x'.join(map(str, p['shape'])):>14} {p['ns_cost']:>14.3e}  {p['fqn']}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` as a command: output piped into ``head`` that stops reading ends the run quietly."""
    try:
        return main(argv)
    except BrokenPipeError:
        # The reader is gone; point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(cli())
