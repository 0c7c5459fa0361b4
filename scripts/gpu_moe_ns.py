"""Expert Newton–Schulz and single matrices on one GPU: dmuon through its optimizer update against torch's
per-matrix loop and gram-newton-schulz (when installed); and the extra memory of one expert step.

    python scripts/gpu_moe_ns.py --out DIR [--reps 7]

* ``experts``: one MoE layer's expert params as an owner (or an expert-parallel rank) updates them, e.g.
  Qwen3-30B-A3B's ``3 x [128, 768, 2048]`` and a DeepSeek-V3 layer's share at EP=8, ``3 x [32, 2048, 7168]``.
  ``torch loop``: ``torch.optim.Muon``'s Newton–Schulz, one expert matrix after another. ``dmuon update``:
  :func:`dmuon.optim.muon_update_batch_` on the three params (momentum, NS in chunks with CUDA graphs, the
  step), as ``step()`` runs them. ``dmuon NS``: the same without momentum and step, the NS calls alone.
  ``gns``: gram-newton-schulz on each param's batch, as its README calls it. Each with its peak extra memory
  over the params, gradients and momenta.
* ``single``: one matrix per call, every backend of ``dmuon.newton_schulz`` against torch's.

Writes DIR/moe_ns.json and DIR/moe_ns.txt. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dmuon.optim import MuonHParams, muon_update_batch_
from dmuon.optim.newton_schulz import KELLER_JORDAN_COEFFICIENTS, newton_schulz_native
from dmuon.optim.update import orthogonalise
from dmuon.runtime.blocks import Blocks
from dmuon.tools.timing import median_ms

EXPERTS = {
    "qwen3-30b-a3b layer": [(128, 768, 2048)] * 3,
    "deepseek-v3 layer at ep8": [(32, 2048, 7168)] * 3,
}
SINGLE = [(2048, 8192), (8192, 2048), (2048, 2048), (512, 2048), (4096, 4096), (1024, 4096), (14336, 4096),
          (4096, 14336), (768, 2048), (2048, 7168)]


def _torch_ns(G: torch.Tensor) -> torch.Tensor:
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(G, KELLER_JORDAN_COEFFICIENTS, 5, 1e-7)


def _gns() -> dict:
    """gram-newton-schulz eager and with its torch.compile default, Keller Jordan's coefficients."""
    try:
        from gram_newton_schulz import GramNewtonSchulz  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"gram-newton-schulz unavailable: {type(e).__name__}: {e}")
        return {}
    kw = dict(ns_coefficients=[list(KELLER_JORDAN_COEFFICIENTS)] * 5, gram_newton_schulz_reset_iterations=[2])
    return {"gns eager": GramNewtonSchulz(compile_kwargs=None, **kw), "gns compiled": GramNewtonSchulz(**kw)}


def _peak_extra(fn) -> float:
    """GiB allocated at the peak of ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def experts(reps: int) -> list[dict]:
    gns = _gns()
    hp = MuonHParams(lr=0.02, ns_backend="auto")
    rows = []
    for name, shapes in EXPERTS.items():
        gen = torch.Generator("cuda").manual_seed(0)
        params = [torch.randn(s, device="cuda", dtype=torch.float32, generator=gen) * 0.02 for s in shapes]
        grads = [torch.randn(s, device="cuda", dtype=torch.float32, generator=gen) for s in shapes]
        bufs = [torch.zeros_like(p) for p in params]
        blocks = Blocks.of(shapes[0])
        row: dict = {"name": name, "shapes": shapes}
        loop = lambda: [_torch_ns(g[e]) for g in grads for e in range(g.shape[0])]  # noqa: E731
        update = lambda: muon_update_batch_(params, grads, bufs, hp, blocks)  # noqa: E731
        ns = lambda: [orthogonalise(g, hp, blocks) for g in grads]  # noqa: E731
        row["torch loop ms"] = median_ms(loop, reps=max(3, reps // 2))
        row["dmuon update ms"] = median_ms(update, reps=reps)
        row["dmuon NS ms"] = median_ms(ns, reps=reps)
        row["torch loop extra GiB"] = _peak_extra(loop)
        row["dmuon update extra GiB"] = _peak_extra(update)
        copies = [g.clone() for g in grads]  # gram-newton-schulz normalises a float32 input in place
        for label, fn in gns.items():
            call = lambda fn=fn: [fn(g) for g in copies]  # noqa: E731
            try:
                row[f"{label} ms"] = median_ms(call, reps=reps)
                row[f"{label} extra GiB"] = _peak_extra(call)
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"{name}: {label} failed: {type(e).__name__}: {e}")
        del copies
        rows.append(row)
        del params, grads, bufs
        torch.cuda.empty_cache()
    return rows


def sweep(reps: int) -> list[dict]:
    """The expert layers' NS calls (momentum and step left out) per backend and chunk bound: what
    :data:`dmuon.optim.update.NS_CHUNK_ELEMENTS` and ``"auto"`` should be. Chunks of at most
    ``_graphs.MAX_ELEMENTS`` replay from CUDA graphs, larger ones run eagerly."""
    import dmuon.optim.update as U

    rows = []
    for name, shapes in EXPERTS.items():
        gen = torch.Generator("cuda").manual_seed(0)
        grads = [torch.randn(s, device="cuda", dtype=torch.float32, generator=gen) for s in shapes]
        blocks = Blocks.of(shapes[0])
        for backend in ("auto", "direct", "direct_fp16", "gram"):
            hp = MuonHParams(ns_backend=backend)
            for chunk in (2**24, 2**26, 2**28, 2**31):
                U.NS_CHUNK_ELEMENTS = chunk
                ms = median_ms(lambda: [orthogonalise(g, hp, blocks) for g in grads], reps=reps)
                extra = _peak_extra(lambda: [orthogonalise(g, hp, blocks) for g in grads])
                rows.append({"name": name, "backend": backend, "chunk": chunk, "ms": ms, "extra GiB": extra})
                print(f"{name} {backend:11s} chunk 2^{chunk.bit_length() - 1}: {ms:.2f} ms, {extra:.2f} GiB", flush=True)
        U.NS_CHUNK_ELEMENTS = 2**26
        del grads
        torch.cuda.empty_cache()
    return rows


def single(reps: int) -> list[dict]:
    rows = []
    for shape in SINGLE:
        G = torch.randn(shape, device="cuda", dtype=torch.float32)
        row: dict = {"shape": shape, "torch ms": median_ms(lambda: _torch_ns(G), reps=reps)}
        for backend in ("auto", "direct", "direct_fp16", "gram"):
            row[f"{backend} ms"] = median_ms(lambda: newton_schulz_native(G, 5, KELLER_JORDAN_COEFFICIENTS, 1e-7,
                                                                          backend=backend), reps=reps)
        hp = MuonHParams(ns_backend="auto")
        row["auto via update (graphs) ms"] = median_ms(lambda: orthogonalise(G, hp, Blocks.of(shape)), reps=reps)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="only the backend x chunk sweep of the expert layers")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        rows = sweep(args.reps)
        with open(os.path.join(args.out, "moe_ns_sweep.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        return
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "experts": experts(args.reps), "single": single(args.reps)}
    with open(os.path.join(args.out, "moe_ns.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{result['device']}, torch {result['torch']}"]
    for r in result["experts"]:
        lines.append(f"{r['name']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float)))
    for r in result["single"]:
        lines.append(f"{r['shape']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float)))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "moe_ns.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
