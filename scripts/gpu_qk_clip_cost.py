"""What QK-clip's forward side costs on one GPU: one attention layer of Llama-3.2-1B's shape (32 query heads,
8 key heads, head_dim 64) on 4 x 2048 tokens, causal, bf16, against plain SDPA; and how tight the cheap bound is.

    python scripts/gpu_qk_clip_cost.py --out DIR [--reps 20]

Per variant, the median milliseconds of the attention's forward, and of forward + backward (what a training
step pays; the report itself has no backward):

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``, nothing reported;
* ``exact``: ``dmuon.qk_clip.scaled_dot_product_attention(..., bound="exact")``: SDPA plus the exact per-head
  maximum (``q k^T`` in query chunks, the causal mask, a max);
* ``lse``: ``bound="lse"``: SDPA through the flash kernel that returns its log-sum-exp, reported as the bound
  (key / value heads repeated to the query heads for that kernel);
* ``lse_no_repeat``: the same kernel on inputs that already have 32 key heads: the bound's own cost.

Tightness of the bound (``max_i lse_i - max_ij s_ij`` per head, which lies in ``[0, log 2048 = 7.6]``) on
random q, k scaled so the largest logits land near 10, 50, 100 and 300, and on inputs with one dominant key
per query row (the peaked case QK-clip is about).

Writes DIR/qk_clip_cost.json and DIR/qk_clip_cost.txt. Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from dmuon.optim.qk_clip import RECORD_ATTR
from dmuon.qk_clip import max_logits, scaled_dot_product_attention
from dmuon.tools.timing import median_ms

B, S, H, HKV, D = 4, 2048, 32, 8, 64


def _inputs(kv_heads: int = HKV, scale: float = 1.0, grad: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", generator=gen) * scale
    k = torch.randn(B, kv_heads, S, D, device="cuda", generator=gen)
    v = torch.randn(B, kv_heads, S, D, device="cuda", generator=gen)
    return tuple(t.to(torch.bfloat16).requires_grad_(grad) for t in (q, k, v))


def _variants() -> dict:
    att = nn.Module()

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def exact(q, k, v):
        return scaled_dot_product_attention(q, k, v, module=att, is_causal=True, enable_gqa=True)

    def lse(q, k, v):
        return scaled_dot_product_attention(q, k, v, module=att, is_causal=True, enable_gqa=True, bound="lse")

    return {"sdpa": (sdpa, HKV), "exact": (exact, HKV), "lse": (lse, HKV), "lse_no_repeat": (lse, H),
            "sdpa_32_kv_heads": (sdpa, H)}


def timings(reps: int) -> list[dict]:
    rows = []
    for name, (fn, kv) in _variants().items():
        q, k, v = _inputs(kv)
        grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

        def fwd():  # autograd on (the report needs it), inputs without grad: nothing is kept for a backward
            return fn(q.detach(), k.detach(), v.detach())

        def fwd_bwd():
            out = fn(q, k, v)
            out.backward(grad)

        try:
            with torch.enable_grad():
                rows.append({"variant": name, "key heads": kv, "forward ms": median_ms(fwd, reps=reps),
                             "forward+backward ms": median_ms(fwd_bwd, reps=reps)})
        except Exception as e:  # noqa: BLE001 - reported in the output, the other variants still run
            rows.append({"variant": name, "key heads": kv, "error": f"{type(e).__name__}: {e}"})
    base = {r["key heads"]: r for r in rows if r["variant"].startswith("sdpa") and "error" not in r}
    for r in rows:
        if "error" in r or r["key heads"] not in base:
            continue
        ref = base[r["key heads"]]
        r["forward x sdpa"] = r["forward ms"] / ref["forward ms"]
        r["forward+backward x sdpa"] = r["forward+backward ms"] / ref["forward+backward ms"]
    return rows


def tightness() -> list[dict]:
    rows = []
    for target in (10.0, 50.0, 100.0, 300.0):
        for peaked in (False, True):
            q, k, v = _inputs(grad=False)
            if peaked:  # one dominant key per query row: each query is the key at a random earlier position
                idx = torch.randint(0, S, (B, H, S, 1), device="cuda").clamp_max(
                    torch.arange(S, device="cuda").view(1, 1, S, 1))
                kk = k.repeat_interleave(H // HKV, dim=1)
                q = torch.gather(kk, 2, idx.expand(-1, -1, -1, D)) + 0.1 * q
            exact = max_logits(q, k, is_causal=True)
            q = q * (target / exact.max().item())
            exact = max_logits(q, k, is_causal=True)
            att = nn.Module()
            with torch.enable_grad():
                scaled_dot_product_attention(q, k, v, module=att, is_causal=True, enable_gqa=True, bound="lse")
            gap = getattr(att, RECORD_ATTR) - exact
            rows.append({"largest logit": target, "peaked": peaked, "gap min": gap.min().item(),
                         "gap median": gap.median().item(), "gap max": gap.max().item(),
                         "gap max / largest logit": gap.max().item() / target, "log S": math.log(S)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"batch": B, "seq": S, "heads": H, "kv_heads": HKV, "head_dim": D},
              "timings": timings(args.reps), "tightness": tightness()}
    with open(os.path.join(args.out, "qk_clip_cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"{result['device']}, torch {result['torch']}, {result['shape']}"]
    for r in result["timings"] + result["tightness"]:
        lines.append(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "qk_clip_cost.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
