"""What dmuon's checkpoint checksums cost on an 8B-shaped state dict, against moving the same tensors to
the CPU (what ``get_model_state_dict`` does anyway with ``cpu_offload=True``).

    python scripts/checksum_cost.py [--preset llama3-8b] [--dtype bfloat16] [--device cuda] [--out DIR]

Every weight of the preset (embedding, projections, norms, untied head) is allocated on the device and
summed with ``checksum_part`` as one rank would at world size 1; a rank of W sums 1/W of it. Not a test;
a JSON line goes to stdout (and DIR/checksum_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dmuon.checkpoint.checksum import checksum_part
from dmuon.tools.presets import PRESETS
from dmuon.tools.timing import median_ms


def state_dict_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    c = PRESETS[preset]
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (c.vocab, c.hidden), "norm.weight": (c.hidden,),
                                       "lm_head.weight": (c.vocab, c.hidden)}
    for i in range(c.layers):
        p = f"layers.{i}."
        out.update({p + "attention.q_proj.weight": (q, c.hidden), p + "attention.k_proj.weight": (kv, c.hidden),
                    p + "attention.v_proj.weight": (kv, c.hidden), p + "attention.o_proj.weight": (c.hidden, q),
                    p + "mlp.gate_proj.weight": (c.intermediate, c.hidden),
                    p + "mlp.up_proj.weight": (c.intermediate, c.hidden),
                    p + "mlp.down_proj.weight": (c.hidden, c.intermediate),
                    p + "attention_norm.weight": (c.hidden,), p + "ffn_norm.weight": (c.hidden,)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    sd = {k: torch.randn(s, dtype=dtype, device=dev) for k, s in state_dict_shapes(args.preset).items()}
    n_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    checksum_ms = median_ms(lambda: [checksum_part(t) for t in sd.values()], reps=args.reps, warmup=1)
    offload_ms = median_ms(lambda: [t.cpu() for t in sd.values()], reps=args.reps, warmup=1)
    row = {"preset": args.preset, "dtype": args.dtype, "device": str(dev), "tensors": len(sd), "gib": n_bytes / 2**30,
           "checksum_ms": checksum_ms, "checksum_gib_per_s": n_bytes / 2**30 / (checksum_ms / 1e3),
           "cpu_offload_ms": offload_ms, "checksum_over_offload": checksum_ms / offload_ms,
           "torch": torch.__version__}
    print(json.dumps(row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "checksum_cost.json"), "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
