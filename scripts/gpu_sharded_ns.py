"""GPU measurement of Newton–Schulz over a tensor-parallel shard (``dmuon/optim/sharded_ns.py``, issue 16).

    python scripts/gpu_sharded_ns.py [--out FILE] [--reps N]

For each Llama-3.1-8B matrix shape and TP degree t, one rank's work in the Gram path: its shard (rows split
for ``ColwiseParallel`` q/k/v/gate/up, columns split for ``RowwiseParallel`` o/down), the local Gram
product, the NS recursion in Gram space and the shard's product with ``Q``; the all-reduce is left out
(one GPU) and its payload reported in bytes. Baselines from the same process: ``torch.optim.Muon``'s NS
and ``dmuon.newton_schulz(backend="auto")`` on the whole matrix (what an owner without TP runs). At t = 1
the Gram path is also checked against the float64 iteration. Not a test; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from dmuon.optim.newton_schulz import newton_schulz
from dmuon.optim.sharded_ns import gram_side, newton_schulz_sharded
from dmuon.tools.timing import median_ms

KJ = (3.4445, -4.7750, 2.0315)
#: (name, (rows, cols), split dim under TP): Llama-3.1-8B's projections
SHAPES = [("q/o-like 4096x4096 colwise", (4096, 4096), 0), ("k/v 1024x4096 colwise", (1024, 4096), 0),
          ("gate/up 14336x4096 colwise", (14336, 4096), 0), ("down 4096x14336 rowwise", (4096, 14336), 1)]


def exact(M: torch.Tensor) -> torch.Tensor:
    X = M.double() / M.double().norm()
    for _ in range(5):
        A = X @ X.mT
        X = KJ[0] * X + (KJ[1] * A + KJ[2] * A @ A) @ X
    return X


def main() -> None:
    ap = argparse.ArgumentParser(description="NS over one TP shard against full-matrix NS, on one GPU")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per cell (median)")
    args = ap.parse_args()
    from torch.optim._muon import _zeropower_via_newtonschulz

    rows = []
    for name, shape, dim in SHAPES:
        M = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        base = {"torch_ms": median_ms(lambda: _zeropower_via_newtonschulz(M, KJ, 5, 1e-7), reps=args.reps),
                "dmuon_auto_ms": median_ms(lambda: newton_schulz(M, 5, KJ, backend="auto"), reps=args.reps)}
        for tp in (1, 2, 4, 8):
            shard = M.chunk(tp, dim=dim)[0].contiguous()
            for dtype in (torch.float32, torch.float16):
                restart = (3,) if dtype == torch.float16 else ()

                def run() -> torch.Tensor:
                    return newton_schulz_sharded(shard, sharded_dim=dim, all_reduce=lambda t: t, coefficients=KJ,
                                                 dtype=dtype, restart_after=restart)

                r = {"shape": name, "tp": tp, "dtype": str(dtype), "restart_after": list(restart), **base,
                     "sharded_ms": median_ms(run, reps=args.reps),
                     "all_reduce_bytes": gram_side(shape, dim) ** 2 * torch.empty((), dtype=dtype).element_size()
                     * (1 + len(restart)),
                     "all_gather_bytes_instead": shape[0] * shape[1] * 2}
                if tp == 1:
                    ref = exact(M)
                    r["distance_f64"] = ((run().double() - ref).norm() / ref.norm()).item()
                    t = _zeropower_via_newtonschulz(M, KJ, 5, 1e-7).double()
                    r["torch_distance_f64"] = ((t - ref).norm() / ref.norm()).item()
                r["sharded_vs_torch"] = r["sharded_ms"] / r["torch_ms"]
                rows.append(r)
                print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
