"""GPU investigation for issue 6 (run on the device H200): where dmuon's step time goes.

    python scripts/gpu_profile.py --out DIR [--parts ns,fwdbwd,opt]

* ``ns``: Newton-Schulz time per shape group of the Llama presets (all matrices of one shape at once, as
  ``dmuon.Muon.step`` batches them at world size 1): torch's per-matrix function vs dmuon's batched direct
  and Gram forms, Keller Jordan and Polar Express coefficients.
* ``fwdbwd``: torch profiler summary of one forward+backward of the 1B preset for the unwrapped model,
  FSDP2 and dmuon Z3: host (CPU) time vs device kernel time and the costliest host-side ops.
* ``opt``: the same for one ``optimizer.step()``.

Not a test; results go to DIR/*.txt and DIR/ns.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn, reps: int = 5) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def part_ns(out_dir: str) -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    from dmuon.newton_schulz import KELLER_JORDAN_COEFFICIENTS as KJ
    from dmuon.newton_schulz import newton_schulz
    from dmuon.presets import projection_specs

    rows = []
    for preset in ("llama3.2-1b", "llama3-8b"):
        groups: dict[tuple, int] = {}
        for s in projection_specs(preset):
            groups[tuple(s.shape)] = groups.get(tuple(s.shape), 0) + 1
        for shape, count in groups.items():
            for n in sorted({1, min(count, 4), count}):
                G = torch.randn((n, *shape), device="cuda", dtype=torch.bfloat16)
                r = {"preset": preset, "shape": shape, "batch": n}
                r["torch_loop"] = _timed(lambda: [_zeropower_via_newtonschulz(g, KJ, 5, 1e-7) for g in G])
                for be in ("direct", "gram"):
                    for co in ("keller_jordan", "polar_express"):
                        r[f"{be}_{co}"] = _timed(lambda: newton_schulz(G, 5, co, backend=be))
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

    from dmuon import bench

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="ns,fwdbwd,opt")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    if "ns" in parts:
        part_ns(args.out)
    for what in ("fwdbwd", "opt"):
        if what in parts:
            part_model(args.out, what)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
