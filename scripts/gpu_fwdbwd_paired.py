"""Forward + backward of dmuon against the unwrapped model, timed in alternating steps (run on one GPU).

    python scripts/gpu_fwdbwd_paired.py --out DIR [--rounds 60] [--shapes 4x512,4x2048]

The bench times its variants one after another, so host noise that comes and goes over seconds lands on
one variant and not the other (issue 6's 1-GPU forward + backward ratio moved between 0.87 and 1.31 over 9
runs). Here every variant lives in the same process at once and each round times one step of each, in a
rotating order; the reported ratio is the median of the per-round ratios, with its quartiles. Every step
also runs ``optimizer.step()`` (untimed), so dmuon goes through its whole per-step lifecycle.

Not a test; results go to DIR/paired.json and DIR/paired.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

#: label -> (bench variant, dmuon wrap, NS options)
VARIANTS = {
    "unwrapped": ("torch_muon", "layers", None),
    "dmuon_z3_root": ("dmuon_z3", "root", {"ns_backend": "auto", "ns_coefficients": "polar_express"}),
    "dmuon_z2_root": ("dmuon_z2", "root", {"ns_backend": "auto", "ns_coefficients": "polar_express"}),
    "dmuon_z3_layers": ("dmuon_z3", "layers", None),
}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def run_shape(batch: int, seq: int, rounds: int, warmup: int, mesh, device: torch.device) -> dict:
    from dmuon.tools import bench

    built = {label: bench._build(v, "1b", device, torch.bfloat16, mesh, ns, wrap)
             for label, (v, wrap, ns) in VARIANTS.items()}
    vocab = bench.BENCH_PRESETS["1b"][5]
    tok = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=torch.Generator(device).manual_seed(0))
    x, y = tok[:, :-1], tok[:, 1:]
    labels = list(built)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(warmup + rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            model, opt = built[label]
            opt.zero_grad()
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            model(x, y).loss.backward()
            torch.cuda.synchronize(device)
            if r >= warmup:
                times[label].append(1e3 * (time.perf_counter() - t))
            opt.step()
    base = times["unwrapped"]
    out: dict = {"batch": batch, "seq": seq, "rounds": rounds, "median_ms": {}, "ratio_vs_unwrapped": {}}
    for label in labels:
        out["median_ms"][label] = statistics.median(times[label])
        if label != "unwrapped":
            q1, med, q3 = _quartiles([t / b for t, b in zip(times[label], base)])
            out["ratio_vs_unwrapped"][label] = {"q1": q1, "median": med, "q3": q3}
    del built
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--shapes", default="4x512,4x2048", help="comma-separated BATCHxSEQ")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    os.environ.update(RANK="0", WORLD_SIZE="1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (1,))
    results, lines = [], []
    for shape in args.shapes.split(","):
        batch, seq = (int(v) for v in shape.split("x"))
        res = run_shape(batch, seq, args.rounds, args.warmup, mesh, device)
        results.append(res)
        for label, ms in res["median_ms"].items():
            ratio = res["ratio_vs_unwrapped"].get(label)
            tail = f"  ratio {ratio['median']:.3f} (quartiles {ratio['q1']:.3f}-{ratio['q3']:.3f})" if ratio else ""
            lines.append(f"{batch}x{seq} {label:<16} fwd+bwd median {ms:7.2f} ms{tail}")
        print("\n".join(lines[-len(res["median_ms"]):]), flush=True)
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    with open(os.path.join(args.out, "paired.json"), "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "paired.txt"), "w") as f:
        f.write(f"{meta}\n" + "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
