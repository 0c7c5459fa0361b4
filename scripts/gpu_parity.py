"""One-process CUDA/NCCL check (run on a GPU machine, not in CI): dmuon at world size 1, Z2 and Z3, must
reproduce torch.optim.Muon + torch.optim.AdamW bit for bit, as it does on CPU/gloo in the test suite.

    python scripts/gpu_parity.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.models import TinyLlama, TinyLlamaConfig, projection_predicate

CFG = TinyLlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256)
KJ = (3.4445, -4.7750, 2.0315)
STEPS = 10


def data(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, CFG.vocab_size, (8, 33), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in toks]


def model_on(device: torch.device) -> TinyLlama:
    m = TinyLlama(CFG)
    m.init_weights(0)
    return m.to(device)


def oracle(device: torch.device) -> tuple[list[float], dict]:
    m = model_on(device)
    om = torch.optim.Muon([p for n, p in m.named_parameters() if projection_predicate(n, p)], lr=0.02,
                          weight_decay=0.01, ns_coefficients=KJ)
    oa = torch.optim.AdamW([p for n, p in m.named_parameters() if not projection_predicate(n, p)], lr=1e-3)
    losses = []
    for tok, tgt in data(device):
        om.zero_grad(); oa.zero_grad()
        loss = m(tok, tgt).loss
        loss.backward()
        om.step(); oa.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def run_dmuon(device: torch.device, z3: bool) -> tuple[list[float], dict]:
    mesh = init_device_mesh("cuda", (1,))
    m = model_on(device)
    dmuon.dedicate_params(m, mesh, projection_predicate, reshard_after_forward=z3)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = dmuon.Muon(m, lr=0.02, weight_decay=0.01, ns_coefficients=KJ, adamw_lr=1e-3)
    losses = []
    for tok, tgt in data(device):
        opt.zero_grad()
        loss = m(tok, tgt).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in m.named_parameters()}
    return losses, weights


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    ref_losses, ref_w = oracle(device)
    for z3 in (True, False):
        losses, w = run_dmuon(device, z3)
        worst = max(((w[k].double() - ref_w[k].double()).norm() / ref_w[k].double().norm()).item() for k in ref_w)
        same = losses == ref_losses and all(torch.equal(w[k], ref_w[k]) for k in ref_w)
        print(f"{'Z3' if z3 else 'Z2'}: bitwise={same} loss0={losses[0]:.6f} lossN={losses[-1]:.6f} "
              f"(oracle {ref_losses[-1]:.6f}) max weight rel diff={worst:.3e}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
