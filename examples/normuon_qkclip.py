"""NorMuon with cautious weight decay and QK-clip (MuonClip) on a tiny Llama, runnable as is.

    python examples/normuon_qkclip.py                          # starts 2 local ranks itself
    torchrun --nproc_per_node 2 examples/normuon_qkclip.py

The guides: docs/guides/normuon.md, docs/guides/cautious-weight-decay.md and docs/guides/qk-clip.md. The
model's attention reports each head's largest logit through ``dmuon.qk_clip.scaled_dot_product_attention``
(``TinyLlamaConfig(report_max_logits=True)``); its query head 0 starts scaled up, so its logits begin above
``TAU`` and QK-clip has something to do. Every projection trains with NorMuon; the rest with AdamW.

It then trains the same model on the same batches on one process, with the single-process NorMuon written
from the paper's formulas (``dmuon.optim.normuon_reference``), torch's AdamW and the clip done by hand: the
result dmuon must reproduce. It prints ``OK`` when the loss fell by at least 20% (the mean of the last 3
steps against the first), QK-clip clipped heads, and every step's loss is within ``PARITY_RTOL`` of the
one-process run; otherwise ``FAILED`` and a non-zero exit code. CUDA (NCCL) when there is a GPU, else CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.optim.normuon_reference import NorMuonReference
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.models import TinyLlama, TinyLlamaConfig
from dmuon.tools.verdict import loss_fell, within

STEPS, BATCH_PER_RANK, SEQ_LEN, VOCAB = 10, 8, 64, 64
CFG = TinyLlamaConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                      max_seq_len=SEQ_LEN, report_max_logits=True)
TAU = 20.0
#: NorMuon's settings: an update RMS of 0.2 * lr (the paper's target), so an AdamW-like learning rate
NORMUON = dict(lr=0.01, weight_decay=0.1, cautious_weight_decay=True, beta2=0.95, rms_target=0.2)
ADAMW_LR = 1e-3
#: As examples/custom_loop.py's bound: on the CPU only the gradient average's summation order differs from the
#: one-process run; on CUDA dmuon's float16 Newton-Schulz differs from the reference's bfloat16 one.
PARITY_RTOL = {"cpu": 3e-4, "cuda": 5e-2}


def build_model(device: torch.device) -> TinyLlama:
    torch.manual_seed(0)  # the same init on every rank
    model = TinyLlama(CFG).to(device)
    with torch.no_grad():
        for layer in model.layers:  # query head 0 far too large: its logits start above TAU
            layer.attention.q_proj.weight[:CFG.head_dim] *= 30.0
    return model


def batches(world_size: int) -> list[torch.Tensor]:
    """``STEPS`` global batches of a fixed Markov chain (token t -> 5t + 1 or a random token), all ranks' rows."""
    gen = torch.Generator().manual_seed(0)
    n = BATCH_PER_RANK * world_size
    out = []
    for _ in range(STEPS):
        seq = torch.empty(n, SEQ_LEN + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
        for t in range(SEQ_LEN):
            noise = torch.randint(0, VOCAB, (n,), generator=gen)
            keep = torch.rand(n, generator=gen) < 0.8
            seq[:, t + 1] = torch.where(keep, (seq[:, t] * 5 + 1) % VOCAB, noise)
        out.append(seq)
    return out


def is_projection(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "proj" in name


def one_process_losses(data: list[torch.Tensor], device: torch.device) -> list[float]:
    """The same run on one process: NorMuon from the paper's formulas, AdamW, and QK-clip by hand."""
    model = build_model(device)
    named = dict(model.named_parameters())
    norm = NorMuonReference([p for n, p in named.items() if is_projection(n, p)], **NORMUON)
    adamw = torch.optim.AdamW([p for n, p in named.items() if not is_projection(n, p)], lr=ADAMW_LR)
    hd, per = CFG.head_dim, CFG.n_heads // CFG.n_kv_heads
    losses = []
    for seq in data:
        seq = seq.to(device)
        for opt in (norm, adamw):
            opt.zero_grad()
        loss = model(seq[:, :-1], seq[:, 1:]).loss
        loss.backward()
        for opt in (norm, adamw):
            opt.step()
        with torch.no_grad():  # MuonClip: each head above TAU scaled back, sqrt on W_q and on its key head
            for layer in model.layers:
                att = layer.attention
                m = att._dmuon_max_logits.tolist()
                att._dmuon_max_logits = None
                for h, s in enumerate(m):
                    if s > TAU:
                        att.q_proj.weight[h * hd:(h + 1) * hd] *= (TAU / s) ** 0.5
                for g in range(CFG.n_kv_heads):
                    top = max(m[g * per:(g + 1) * per])
                    if top > TAU:
                        att.k_proj.weight[g * hd:(g + 1) * hd] *= (TAU / top) ** 0.5
        losses.append(loss.item())
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))

    model = build_model(device)
    dmuon.dedicate_params(model, mesh, predicate=is_projection)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, algorithm="normuon", **NORMUON, adamw_lr=ADAMW_LR,
                           qk_clip=dmuon.QKClip(tau=TAU))

    data = batches(world_size)
    losses, clipped = [], []
    for step, seq in enumerate(data):
        seq = seq[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK].to(device)
        optimizer.zero_grad()
        loss = model(seq[:, :-1], seq[:, 1:]).loss
        loss.backward()
        optimizer.step()  # NorMuon on the owners, AdamW on FSDP2's shards, then QK-clip on the owners
        stats = dmuon.diagnostics.qk_clip(optimizer)  # the same on every rank
        clipped.append(stats["clipped_heads"])
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
        if rank == 0:
            print(f"step {step + 1:>2}/{STEPS}  loss {losses[-1]:.4f}  largest logit {stats['max_logit']:7.2f}  "
                  f"clipped {stats['clipped_heads']}/{stats['heads']} heads", flush=True)

    fell, fell_text = loss_fell(losses, by=0.2)
    same, same_text = within(losses, one_process_losses(data, device), rtol=PARITY_RTOL[device.type])
    ok = fell and same and clipped[0] > 0
    if rank == 0:
        print(f"normuon_qkclip: {'OK' if ok else 'FAILED'} {fell_text}; QK-clip clipped {sum(clipped)} heads over "
              f"{STEPS} steps; per-step losses against one process (NorMuon reference + hand clip): {same_text}",
              flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))
