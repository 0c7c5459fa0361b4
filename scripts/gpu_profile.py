"""GPU profile (run on the device H200): where dmuon's step time goes.

    python scripts/gpu_profile.py --out DIR [--parts ns,fwdbwd,opt]
    torchrun --nproc_per_node 4 scripts/gpu_profile.py --parts overlap [--no-prefetch] [--replicate 2] --out DIR

* ``ns``: Newton-Schulz time per shape group of the Llama presets (all matrices of one shape at once, as
  ``dmuon.Muon.step`` batches them at world size 1): torch's per-matrix function vs dmuon's batched direct
  and Gram forms, Keller Jordan and Polar Express coefficients.
* ``fwdbwd``: torch profiler summary of one forward+backward of the 1B preset for the unwrapped model,
  FSDP2 and dmuon Z3: host (CPU) time vs device kernel time and the costliest host-side ops.
* ``opt``: the same for one ``optimizer.step()``.
* ``overlap`` (under torchrun, 2+ GPUs): one forward+backward of dmuon Z3 (root wrap) profiled on every
  rank; how much of the NCCL kernels' time runs while a compute kernel runs (the overlap that async
  collectives and prefetch are for). ``--no-prefetch`` builds it with ``dedicate_params(prefetch=False)``,
  ``--replicate R`` on the ``(R, W // R)`` HSDP mesh of ``python -m dmuon.bench --replicate R``; the summary
  goes to ``DIR/overlap_prefetch_{on,off}_replicate{R}.txt``, so runs of each setting share one DIR.

Not a test; results go to DIR/*.txt and DIR/ns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from dmuon.tools.presets import shape_groups
from dmuon.tools.timing import median_ms


def part_ns(out_dir: str) -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    from dmuon.optim.newton_schulz import KELLER_JORDAN_COEFFICIENTS as KJ
    from dmuon.optim.newton_schulz import newton_schulz

    rows = []
    for preset in ("llama3.2-1b", "llama3-8b"):
        for shape, count in shape_groups(preset).items():
            for n in sorted({1, min(count, 4), count}):
                G = torch.randn((n, *shape), device="cuda", dtype=torch.bfloat16)
                r = {"preset": preset, "shape": shape, "batch": n}
                r["torch_loop"] = median_ms(lambda: [_zeropower_via_newtonschulz(g, KJ, 5, 1e-7) for g in G])
                for be in ("direct", "gram"):
                    for co in ("keller_jordan", "polar_express"):
                        r[f"{be}_{co}"] = median_ms(lambda: newton_schulz(G, 5, co, backend=be))
                rows.append(r)
                print(json.dumps(r), flush=True)
                del G
    with open(os.path.join(out_dir, "ns.json"), "w") as f:
        json.dump(rows, f, indent=1)


def _profile(fn, path: str, title: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    dev_total = sum(e.self_device_time_total for e in ka) / 1e3
    text = (f"== {title}: wall {wall:.1f} ms (unprofiled), device kernels {dev_total:.1f} ms\n"
            + ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60) + "\n"
            + ka.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60) + "\n")
    with open(path, "a") as f:
        f.write(text)
    print(f"{title}: wall {wall:.1f} ms, device kernels {dev_total:.1f} ms", flush=True)
    return text


def part_model(out_dir: str, what: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.tools import bench

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    device = torch.device("cuda", 0)
    vocab = bench.BENCH_PRESETS["1b"][5]
    tok = torch.randint(0, vocab, (4, 513), device=device)
    x, y = tok[:, :-1], tok[:, 1:]
    cases = [("torch_muon", None), ("fsdp_adamw", None), ("dmuon_z3", None),
             ("dmuon_z3", {"ns_backend": "auto", "ns_coefficients": "polar_express"})]
    for variant, ns in cases:
        model, opt = bench._build(variant, "1b", device, torch.bfloat16, mesh, ns)
        label = variant + (" auto+PE" if ns else "")

        def fwdbwd():
            opt.zero_grad()
            model(x, y).loss.backward()

        def full():
            fwdbwd()
            opt.step()

        if what == "fwdbwd":
            _profile(fwdbwd, os.path.join(out_dir, "fwdbwd.txt"), f"fwd+bwd {label}")
        else:
            fwdbwd()
            torch.cuda.synchronize()
            _profile(lambda: opt.step(), os.path.join(out_dir, "opt.txt"), f"opt.step {label}")
        del model, opt
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)


def part_overlap(out_dir: str, prefetch: bool = True, replicate: int = 1) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from dmuon.tools import bench

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = bench.make_mesh("cuda", world, replicate)
    vocab = bench.BENCH_PRESETS["1b"][5]
    tok = torch.randint(0, vocab, (4, 2049), device=device, generator=torch.Generator(device).manual_seed(rank))
    x, y = tok[:, :-1], tok[:, 1:]
    model, opt = bench._build("dmuon_z3", "1b", device, torch.bfloat16, mesh,
                              {"ns_backend": "auto", "ns_coefficients": "polar_express"}, "root", prefetch=prefetch)

    def fwdbwd() -> None:
        opt.zero_grad()
        model(x, y).loss.backward()
        torch.cuda.synchronize()

    for _ in range(3):
        fwdbwd()
        opt.step()
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwdbwd()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = _union([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
    comm_total = sum(b - a for a, b in comm)
    hidden = sum(_covered(a, b, compute) for a, b in comm)
    line = (f"rank {rank}: fwd+bwd with {len(comm)} NCCL kernels, {comm_total / 1e3:.2f} ms of NCCL kernel time, "
            f"{hidden / 1e3:.2f} ms of it ({100 * hidden / max(comm_total, 1e-9):.0f}%) while compute kernels ran")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        text = "\n".join(lines)  # type: ignore[arg-type]
        print(text, flush=True)
        name = f"overlap_prefetch_{'on' if prefetch else 'off'}_replicate{replicate}.txt"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text + "\n")
    del model, opt
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="ns,fwdbwd,opt")
    p.add_argument("--no-prefetch", action="store_true",
                   help="overlap: dedicate_params(prefetch=False), to see what prefetch hides")
    p.add_argument("--replicate", type=int, default=1,
                   help="overlap: HSDP with R replicas x W/R shards (as python -m dmuon.bench --replicate)")
    args = p.parse_args()
    parts = args.parts.split(",")
    if "overlap" in parts:
        from dmuon.tools.bench import replicate_error

        bad = replicate_error(int(os.environ.get("WORLD_SIZE", "1")), args.replicate)
        if bad:
            p.error(bad)
    os.makedirs(args.out, exist_ok=True)
    if "overlap" in parts:
        part_overlap(args.out, prefetch=not args.no_prefetch, replicate=args.replicate)
        return
    if "ns" in parts:
        part_ns(args.out)
    for what in ("fwdbwd", "opt"):
        if what in parts:
            part_model(args.out, what)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
