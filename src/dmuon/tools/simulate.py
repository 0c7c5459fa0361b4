"""``python -m dmuon.plan --simulate``: the predicted step of every design, a sweep over world sizes, the
validation against the measured runs, as tables, JSON or a chart.

The model is in :mod:`dmuon.tools.step_model` (compute, overlap, element-wise work),
:mod:`dmuon.tools.schedules` (what each design sends and computes), :mod:`dmuon.links` (links) and
:mod:`dmuon.tools.ns_table` (measured Newton–Schulz); :mod:`dmuon.tools.measured` holds the measured runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .measured import KNOWN_MISSES, validate
from .schedules import DESIGNS, auto_layout, node_layout_allowed, simulate_design
from .step_model import OVERLAP, Scenario, sizes_of

__all__ = ["simulate", "sweep", "tokens_for_overhead", "format_simulation", "format_sweep", "format_validation",
           "plot_sweep", "validate", "SWEEP_WORLDS", "MUON_DESIGNS"]

#: world sizes of the sweep and the chart
SWEEP_WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
MUON_DESIGNS = ("dmuon", "distmuon", "dion")


def simulate(sc: Scenario, designs: tuple[str, ...] = tuple(DESIGNS)) -> dict[str, Any]:
    """Every design of ``designs`` on ``sc`` (FSDP2 + AdamW always, as the baseline), each with its overhead
    ``step / baseline step - 1``, plus what the job looks like (matrices, idle owners, the NS floor).

    Example::

        from dmuon.tools.presets import PRESETS
        out = simulate(Scenario(PRESETS["llama3-8b"], world=8))
        print(out["designs"]["dmuon"]["overhead"])
    """
    sz = sizes_of(sc.shape, sc.seq)
    results = {d: simulate_design(sc, d) for d in dict.fromkeys(("fsdp_adamw", *designs))}
    base = results["fsdp_adamw"]["step_ms"]
    for r in results.values():
        r["overhead"] = r["step_ms"] / base - 1
    slots = sc.world // sc.tp
    pick = auto_layout(sc, sz)
    layout = {"layout": pick.layout, "why": pick.why(), "flat_comm_ms": pick.flat_ms, "node_comm_ms": pick.node_ms}
    if node_layout_allowed(sc):
        layout.update(flat_step_ms=simulate_design(sc, "dmuon_flat")["step_ms"],
                      node_step_ms=simulate_design(sc, "dmuon_node")["step_ms"])
    return {
        "preset": sc.shape.name, "world_size": sc.world, "replicas": sc.replicas, "shard": sc.shard, "tp": sc.tp,
        "ep": sc.ep, "tokens_per_rank": sc.tokens, "batch": sc.batch, "seq": sc.seq, "reshard": sc.reshard,
        "links": dataclasses.asdict(sc.links), "overlap": OVERLAP, "dense_muon_matrices": len(sz.muon),
        "owner_slots": slots, "more_slots_than_matrices": slots > len(sz.muon), "dmuon_layout": layout,
        "designs": {d: {k: v for k, v in r.items() if k != "plan"} for d, r in results.items()},
    }


def tokens_for_overhead(sc: Scenario, design: str, target: float, *, max_batch: int = 4096) -> int | None:
    """The batch (of ``sc.seq`` tokens, per rank and optimizer step) from which ``design`` costs at most ``target``
    over FSDP2 + AdamW: the crossing below the largest power of two that still misses; ``None`` if not even
    ``max_batch`` meets it. (At tiny batches the host floor can make a design look cheap: the search comes
    down from the top so that such a dip does not count.)"""
    def ok(batch: int) -> bool:
        s = dataclasses.replace(sc, batch=batch)
        return simulate_design(s, design)["step_ms"] <= (1 + target) * simulate_design(s, "fsdp_adamw")["step_ms"]

    if not ok(max_batch):
        return None
    hi = max_batch
    while hi > 1 and ok(hi // 2):
        hi //= 2
    lo = hi // 2
    if lo == 0:
        return 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _mesh_at(sc: Scenario, world: int, mesh: str) -> Scenario:
    """``sc`` at ``world`` ranks: ``"fsdp"`` one shard group of every rank, ``"hsdp"`` shard groups of one node."""
    node = sc.links.gpus_per_node
    replicas = 1 if mesh == "fsdp" or world <= node else world // node
    return dataclasses.replace(sc, world=world, replicas=replicas, ep=min(sc.ep, world // (replicas * sc.tp)))


def sweep(sc: Scenario, worlds: tuple[int, ...] = SWEEP_WORLDS, designs: tuple[str, ...] = MUON_DESIGNS
          ) -> dict[str, Any]:
    """Overhead against FSDP2 + AdamW of each design at each world size, on a 1-D FSDP mesh and on HSDP with
    one shard group per node; where the owner slots outnumber the dense Muon matrices, and dmuon's NS floor."""
    sz = sizes_of(sc.shape, sc.seq)
    out: dict[str, Any] = {"preset": sc.shape.name, "tokens_per_rank": sc.tokens, "worlds": list(worlds),
                           "dense_muon_matrices": len(sz.muon), "meshes": {}}
    for mesh in ("fsdp", "hsdp"):
        rows = []
        for w in worlds:
            if w % (sc.tp * max(1, sc.ep)):
                continue
            s = _mesh_at(sc, w, mesh)
            res = simulate(s, designs)
            base = res["designs"]["fsdp_adamw"]["step_ms"]
            rows.append({"world": w, "replicas": s.replicas, "baseline_step_ms": base,
                         **{d: {"overhead": res["designs"][d]["overhead"], "ns_ms": res["designs"][d]["ns_ms"],
                                "exposed_ms": res["designs"][d]["exposed_ms"]} for d in designs}})
        out["meshes"][mesh] = rows
    return out


# ------------------------------------------------------------------------------------------- printing #


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def format_simulation(res: dict[str, Any], breakeven: dict[str, int | None] | None = None,
                      target: float = 0.03) -> str:
    """The table of one simulation, a line per design, with the assumptions it rests on; ``breakeven``: the
    batch from which each design is within ``target`` of FSDP2 + AdamW (:func:`tokens_for_overhead`)."""
    links = res["links"]
    mesh = (f"{res['replicas']} x {res['shard']} HSDP" if res["replicas"] > 1 else f"FSDP over {res['shard']}")
    mesh += f", tp {res['tp']}" if res["tp"] > 1 else ""
    mesh += f", ep {res['ep']}" if res["ep"] > 1 else ""
    pp = res.get("pp", 1)
    if pp > 1:
        mesh = f"pp {pp} x dp {res['shard']}, 1F1B over {res['microbatches']} microbatches"
    lines = [f"{res['preset']} on {res['world_size']} ranks ({mesh}), {res['batch']} x {res['seq']} tokens per "
             f"{'pipeline' if pp > 1 else 'rank'}, "
             f"dmuon {res['reshard'].upper()}",
             f"links: NVLink {links['nvlink_gbs']:g} GB/s, network {links['network_gbs']:g} GB/s per GPU, "
             f"{links['gpus_per_node']} GPUs a node, hop latency {links['nvlink_hop_us']:g} / "
             f"{links['network_hop_us']:g} us, broadcast {links['broadcast']}"
             + (f", rings across nodes on {links['ring_nics']} NICs" if links.get("ring_nics", 1) > 1 else "") + "; "
             f"{OVERLAP:.0%} of hideable comm under compute",
             "",
             f"{'design':<11} {'step ms':>9} {'vs FSDP2':>9} {'fwd+bwd':>9} {'optimizer':>9} {'NS ms':>8} "
             f"{'exposed':>8} {'GB/rank':>8}" + (f" {'bubble':>8}" if pp > 1 else "")]
    for d, r in res["designs"].items():
        fwd_bwd = r["forward_ms"] + r["backward_ms"]
        lines.append(f"{d:<11} {r['step_ms']:>9.1f} {1 + r['overhead']:>8.3f}x {fwd_bwd:>9.1f} "
                     f"{r['optimizer_ms']:>9.1f} {r['ns_ms']:>8.1f} {r['exposed_ms']:>8.1f} "
                     f"{_gb(r['bytes_per_rank']):>8}" + (f" {r['bubble_ms']:>8.1f}" if pp > 1 else ""))
    lines.append("")
    if pp > 1:
        base = res["designs"]["fsdp_adamw"]
        lines.append(f"pipeline: the slowest stage sets each slot; bubble (N-1)/(M+N-1) = {pp - 1}/"
                     f"{res['microbatches'] + pp - 1} = {res['bubble_fraction']:.1%} of the pipeline time; P2P "
                     f"{base['p2p_bytes_per_microbatch'] / 1e6:.1f} MB a microbatch and boundary each way "
                     f"({base['p2p_ms']:.2f} ms); NS ms, optimizer, exposed and GB/rank: the busiest stage's")
    lines.append("NS ms: the busiest rank's Newton-Schulz; exposed: communication no compute hides (the all-to-all "
                 "designs' step() all-to-alls included);\nGB/rank: what each rank sends per step, summed over its "
                 "collectives")
    dm = res["designs"].get("dmuon")
    lay = res.get("dmuon_layout")
    if dm and lay:
        lines.append(f"dmuon: dedicate_params(layout='auto') takes {lay['why']}; predicted step "
                     f"{lay['flat_step_ms']:.1f} ms flat, {lay['node_step_ms']:.1f} ms node" if "node_step_ms" in lay
                     else "dmuon: dedicate_params(layout='auto') takes layout 'flat' (the node layout needs a 1-D "
                     "mesh over 2+ whole nodes)")
    if dm and res["more_slots_than_matrices"]:
        lines.append(f"note: {res['owner_slots']} owner slots but {res['dense_muon_matrices']} dense Muon matrices: "
                     f"{dm.get('idle_owners', 0)} slots own none; dmuon's NS is at its floor (one matrix's)")
    for d, b in (breakeven or {}).items():
        lines.append(f"{d}: within {target:.0%} of FSDP2 + AdamW from "
                     + (f"{b} x {res['seq']} tokens per rank and step" if b else "no batch up to 4096 x seq"))
    return "\n".join(lines)


def format_sweep(sw: dict[str, Any]) -> str:
    """The sweep as two tables (1-D FSDP, HSDP by node): overhead in % of each design per world size."""
    designs = [k for k in sw["meshes"]["fsdp"][0] if k in DESIGNS]
    lines = [f"{sw['preset']}, {sw['tokens_per_rank']} tokens per rank: overhead over FSDP2 + AdamW "
             f"({sw['dense_muon_matrices']} dense Muon matrices)"]
    for mesh, rows in sw["meshes"].items():
        lines += ["", f"{'FSDP (1-D)' if mesh == 'fsdp' else 'HSDP (a shard group per node)':<32}"
                  + "".join(f"{d:>11}" for d in designs)]
        for r in rows:
            cells = "".join(f"{100 * r[d]['overhead']:>10.1f}%" for d in designs)
            lines.append(f"  W={r['world']:<5} ({r['replicas']} replicas){'':<11}"[:34] + cells)
    return "\n".join(lines)


def format_validation(rows: list[dict[str, Any]] | None = None) -> str:
    """The measured runs against the planner's predictions, each with the bound it is held to, and the worst
    and median error by kind of run (calibration points left out)."""
    rows = validate() if rows is None else rows
    out = [f"{'measured point':<46} {'quantity':<9} {'predicted':>10} {'measured':>10} {'error':>8} {'bound':>6}"]
    for r in rows:
        mark = " calibration" if r["calibration"] else ""
        out.append(f"{r['id']:<46} {r['quantity']:<9} {r['predicted']:>10.2f} {r['measured']:>10.2f} "
                   f"{r['error']:>+7.1%} {r['bound']:>6.0%}{mark}")
    out.append("")
    misses = {r["id"] for r in rows if r["id"] in KNOWN_MISSES}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        groups = ((("owner step, torch's share, ratio"), ("opt_ms", "share_ms", "ratio")),) if kind == "simulated W=8" \
            else (("step / e2e", ("step_ms", "e2e_ms")), ("fwd+bwd, optimizer", ("fwdbwd_ms", "opt_ms")))
        for label, quantities in groups:
            errs = sorted(abs(r["error"]) for r in rows if r["kind"] == kind and r["quantity"] in quantities
                          and not r["calibration"] and r["id"] not in misses)
            if errs:
                out.append(f"{kind}, {label}: worst {errs[-1]:.1%}, median {errs[len(errs) // 2]:.1%} over "
                           f"{len(errs)} measurements")
    for m in sorted(misses):
        out.append(f"known miss, {m}: {KNOWN_MISSES[m][1]}")
    return "\n".join(out)


def plot_sweep(sw: dict[str, Any], path: str) -> None:
    """Overhead vs world size, one panel per mesh, a line per design, and where owner slots outnumber the
    dense Muon matrices (needs matplotlib: ``pip install "dmuon[demo]"``)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError('dmuon.plan: --plot needs matplotlib (pip install "dmuon[demo]"); the tables and --json '
                         "work without it") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    n = sw["dense_muon_matrices"]
    for ax, (mesh, rows) in zip(axes, sw["meshes"].items()):
        worlds = [r["world"] for r in rows]
        for d in (k for k in rows[0] if k in DESIGNS):
            ax.plot(worlds, [100 * r[d]["overhead"] for r in rows], marker="o", label=d)
        if worlds and n <= max(worlds):
            ax.axvline(n, color="grey", ls="--", lw=1)
            ax.annotate(f"{n} matrices:\nmore owners than matrices,\nNS at one matrix's floor", (n, 0.6),
                        xycoords=("data", "axes fraction"), fontsize=7, va="top", ha="right")
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.axhline(3, color="green", lw=0.8, ls=":")
        ax.set_yscale("symlog", linthresh=20, linscale=3)  # a few % and a few 100 % on one axis
        top = max(20.0, *(100 * r[d]["overhead"] for r in rows for d in r if d in DESIGNS))
        ticks = [t for t in (0, 3, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= top * 1.2]
        ax.set_yticks(ticks, [str(t) for t in ticks])
        low = min(100 * r[d]["overhead"] for r in rows for d in r if d in DESIGNS)
        ax.set_ylim(min(-1.0, 1.2 * low), 1.3 * top)
        ax.set_ylabel("step time over FSDP2 + AdamW (%)")
        ax.set_title("FSDP over all ranks" if mesh == "fsdp" else "HSDP, one shard group per node", fontsize=9)
        ax.set_xlabel("GPUs")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{sw['preset']}, {sw['tokens_per_rank']} tokens per GPU (predicted by python -m dmuon.plan "
                 f"--simulate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
