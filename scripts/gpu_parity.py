"""CUDA/NCCL check against torch.optim.Muon + torch.optim.AdamW on one process (run on a GPU machine, not
in CI). At world size 1 dmuon must match bit for bit (Z2 and Z3), as it does on CPU/gloo in the test suite;
under torchrun each rank trains on its slice of the same batches and the check reports the distance to
the one-process oracle (the test suite's bounds: 1e-4 on losses, 1e-3 relative on weights) and whether
Z2 and Z3 agree bit for bit.

    python scripts/gpu_parity.py
    torchrun --nproc_per_node 2 scripts/gpu_parity.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama, TinyLlamaConfig, projection_predicate

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


def oracle(device: torch.device, parts: int = 1) -> tuple[list[float], dict]:
    """One process; ``parts > 1`` feeds each batch as that many accumulated slices (the same arithmetic
    split dmuon's ranks make): its distance to ``parts=1`` is the oracle's own noise floor."""
    m = model_on(device)
    om = torch.optim.Muon([p for n, p in m.named_parameters() if projection_predicate(n, p)], lr=0.02,
                          weight_decay=0.01, ns_coefficients=KJ)
    oa = torch.optim.AdamW([p for n, p in m.named_parameters() if not projection_predicate(n, p)], lr=1e-3)
    losses = []
    for tok, tgt in data(device):
        om.zero_grad(); oa.zero_grad()
        n = tok.shape[0] // parts
        total = 0.0
        for i in range(parts):
            loss = m(tok[i * n:(i + 1) * n], tgt[i * n:(i + 1) * n]).loss
            (loss / parts if parts > 1 else loss).backward()
            total += loss.item()
        om.step(); oa.step()
        losses.append(total / parts)
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def run_dmuon(device: torch.device, z3: bool) -> tuple[list[float], dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    m = model_on(device)
    dmuon.dedicate_params(m, mesh, projection_predicate, reshard_after_forward=z3)
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = dmuon.Muon(m, lr=0.02, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3)
    losses = []
    for tok, tgt in data(device):
        n = tok.shape[0] // world  # this rank's slice; equal slices, so the mean of the means is the mean
        opt.zero_grad()
        loss = m(tok[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]).loss
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(avg.item())
    if world == 1:
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in m.named_parameters()}
    else:
        weights = {k: v.to(device) for k, v in dmuon.get_model_state_dict(m).items()}
    del m, opt
    return losses, weights


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    ref_losses, ref_w = oracle(device)
    if world > 1 and rank == 0:
        fl, fw = oracle(device, parts=world)
        floor_w = max(((fw[k].double() - ref_w[k].double()).norm() / ref_w[k].double().norm()).item() for k in ref_w)
        floor_l = max(abs(a - b) for a, b in zip(fl, ref_losses))
        print(f"oracle noise floor ({world} accumulated slices vs whole batch): max loss diff={floor_l:.2e} "
              f"max weight rel diff={floor_w:.3e}")
    runs = {}
    for z3 in (True, False):
        losses, w = run_dmuon(device, z3)
        runs[z3] = (losses, w)
        worst = max(((w[k].double() - ref_w[k].double()).norm() / ref_w[k].double().norm()).item() for k in ref_w)
        worst_loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
        same = losses == ref_losses and all(torch.equal(w[k], ref_w[k]) for k in ref_w)
        within = worst_loss <= 1e-4 and worst <= 1e-3
        if rank == 0:
            print(f"{'Z3' if z3 else 'Z2'} world {world}: bitwise={same} within_test_bounds={within} "
                  f"loss0={losses[0]:.6f} lossN={losses[-1]:.6f} (oracle {ref_losses[-1]:.6f}) "
                  f"max loss diff={worst_loss:.2e} max weight rel diff={worst:.3e}")
    z2_eq_z3 = runs[True][0] == runs[False][0] and all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in ref_w)
    if rank == 0:
        print(f"Z2 == Z3 bit for bit: {z2_eq_z3}")
        print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {world} x {torch.cuda.get_device_name(0)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
