"""Peak GPU memory of a training step on one GPU: FSDP2 + AdamW, torch.optim.Muon + AdamW and dmuon, on an HF
Llama-3.2-1B-shaped model and an HF Qwen3-MoE model (random weights, bf16, 4 x 1024 tokens).

    python scripts/gpu_memory.py --out DIR [--steps 3] [--models llama1b,qwen3moe]

Each (model, variant) runs in its own process (a fresh CUDA context), one rank of NCCL; its peak
``torch.cuda.max_memory_allocated`` after the forward, the backward and the optimizer step of each step is
recorded. ``torch_muon`` has no FSDP2 and needs 2-D params, so the MoE model runs it with its experts on
AdamW (marked). Writes DIR/memory.json and DIR/memory.txt. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODELS = ("llama1b", "qwen3moe")
VARIANTS = ("fsdp_adamw", "torch_muon", "dmuon")


def _model(name: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if name == "llama1b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)
        cls = LlamaForCausalLM
    else:  # Qwen3-30B-A3B's layer shapes, 6 layers
        cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                             num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)
        cls = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cls(cfg).to(torch.bfloat16)


def _muon_param(name: str, p) -> bool:
    """The projections and experts; not the router (``mlp.gate``), embeddings, norms or head."""
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name and not name.endswith("mlp.gate.weight")


def child(model_name: str, variant: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,))
    model = _model(model_name)
    note = ""
    if variant == "dmuon":
        dmuon.dedicate_params(model, mesh, _muon_param, verbose=False)
    if variant in ("dmuon", "fsdp_adamw"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if variant == "dmuon":
        opts = [dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)]
    elif variant == "fsdp_adamw":
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    else:
        muon = [p for n, p in model.named_parameters() if _muon_param(n, p) and p.ndim == 2]
        rest = [p for n, p in model.named_parameters() if not (_muon_param(n, p) and p.ndim == 2)]
        note = "experts on AdamW (torch.optim.Muon takes 2-D params)" if model_name == "qwen3moe" else ""
        opts = [torch.optim.Muon(muon, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    gen = torch.Generator("cuda").manual_seed(0)
    phases = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        tok = torch.randint(0, model.config.vocab_size, (4, 1024), device="cuda", generator=gen)
        for o in opts:
            o.zero_grad()
        loss = model(input_ids=tok, labels=tok).loss
        fwd = torch.cuda.max_memory_allocated()
        loss.backward()
        bwd = torch.cuda.max_memory_allocated()
        for o in opts:
            o.step()
        torch.cuda.synchronize()
        phases.append({"forward": fwd / 2**30, "backward": bwd / 2**30, "step": torch.cuda.max_memory_allocated() / 2**30})
    n = sum(p.numel() for p in model.parameters())
    out = {"model": model_name, "variant": variant, "params": n, "peak GiB": torch.cuda.max_memory_allocated() / 2**30,
           "phases": phases, "note": note}
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"))
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.steps)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for m in args.models.split(","):
        for v in VARIANTS:
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            proc = subprocess.run([sys.executable, __file__, "--child", m, v, "--steps", str(args.steps)], env=env,
                                  capture_output=True, text=True, timeout=600)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                results.append({"model": m, "variant": v, "error": proc.stderr[-2000:]})
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
            print(results[-1] if "error" not in results[-1] else f"{m} {v} failed: {results[-1]['error'][-500:]}",
                  flush=True)
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = "\n".join(f"{r['model']:9s} {r['variant']:11s} " + (f"peak {r['peak GiB']:.2f} GiB, params {r['params'] / 1e9:.2f}B "
                                                               f"{r['note']}" if "error" not in r else "FAILED")
                     for r in results)
    print(text)
    with open(os.path.join(args.out, "memory.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
