"""The Muon update of tensor-parallel shards ([Note: TP update] in ``dmuon/optim/tp_update.py``) on 2 gloo ranks:
each shard ends bit for bit where the full matrix's update puts it (``muon_update_batch_`` on one process, of the
whole matrices that tp rank runs Newton-Schulz for: matrix k on tp rank k mod 2), for rows and columns split, a
batch that does not divide over the tp ranks, and two steps (the momentum lives on the shards).

In bfloat16 the elementwise steps are not bit-identical between a shard and the whole matrix on the CPU:
torch 2.13's ``add_(x, alpha=...)`` and ``lerp`` round differently in their vectorised body and their scalar
tail (a 240-element add and the same add as two 120-element halves differ in the element the half's tail
holds), and Newton-Schulz spreads one such difference over the matrix. There the reference does the
elementwise steps on the shards and Newton-Schulz on the whole matrices, which is the exchange's whole
claim, and holds bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dmuon.optim.tp_update import exchange_cost, muon_update_tp_, roots
from dmuon.optim.update import MuonHParams, muon_update_batch_
from tests._dist import run_distributed

WORLD = 2
CASES = [(tp_dim, n, dtype) for tp_dim in (0, 1) for n in (1, 3) for dtype in (torch.float32, torch.bfloat16)]


def _exchange(send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int]) -> None:
    dist.all_to_all_single(recv, send, recv_counts, send_counts)


def _shardwise_reference(full: list[torch.Tensor], grads: list[list[torch.Tensor]], hp: MuonHParams, tp_dim: int,
                         world: int) -> list[list[torch.Tensor]]:
    """Every rank's shards after the steps, with momentum, decay and step on each shard and Newton-Schulz on
    the whole matrices of each tp rank's batch (2-D for a batch of one, as ``muon_update_batch_`` does)."""
    from dmuon.optim.update import _apply_update_, _orthogonalise, _stacked_updates
    from dmuon.runtime.blocks import Blocks

    w = [[x.chunk(world, dim=tp_dim)[r].clone() for x in full] for r in range(world)]
    bufs = [[torch.zeros_like(x) for x in w[r]] for r in range(world)]
    for g in grads:
        shards = [[x.chunk(world, dim=tp_dim)[r].contiguous() for x in g] for r in range(world)]
        upd = [_stacked_updates(shards[r], bufs[r], hp) for r in range(world)]
        for root in range(world):
            ks = [k for k in range(len(full)) if k % world == root]
            if not ks:
                continue
            batch = torch.stack([torch.cat([upd[r][k] for r in range(world)], dim=tp_dim) for k in ks])
            orthos = _orthogonalise(batch[0], hp).unsqueeze(0) if len(ks) == 1 else _orthogonalise(batch, hp)
            for k, o in zip(ks, orthos):
                for r in range(world):
                    _apply_update_(w[r][k], o.chunk(world, dim=tp_dim)[r].contiguous(), hp, Blocks.of(full[0].shape))
    return w


def tp_update_job(rank: int, world: int) -> list[dict]:
    out = []
    hp = MuonHParams(lr=0.05, weight_decay=0.1, nesterov=True)
    for tp_dim, n, dtype in CASES:
        gen = torch.Generator().manual_seed(n * 10 + tp_dim)
        full = [torch.randn(12, 20, generator=gen).to(dtype) for _ in range(n)]
        grads = [[torch.randn(12, 20, generator=gen).to(dtype) for _ in range(n)] for _ in range(2)]
        ref, ref_bufs = [w.clone() for w in full], [torch.zeros_like(w) for w in full]
        mine = [w.chunk(world, dim=tp_dim)[rank].clone() for w in full]
        bufs = [torch.zeros_like(w) for w in mine]
        shardwise = _shardwise_reference(full, grads, hp, tp_dim, world)[rank]
        for g in grads:
            for root in range(world):  # the batch that tp rank orthogonalises
                ks = [k for k in range(n) if k % world == root]
                if ks:
                    muon_update_batch_([ref[k] for k in ks], [g[k] for k in ks], [ref_bufs[k] for k in ks], hp)
            muon_update_tp_(mine, [x.chunk(world, dim=tp_dim)[rank].contiguous() for x in g], bufs, hp,
                            full_shape=(12, 20), tp_dim=tp_dim, tp_rank=rank, tp_size=world, exchange=_exchange)
        out.append({"got": mine, "want": [w.chunk(world, dim=tp_dim)[rank] for w in ref], "shardwise": shardwise,
                    "bufs": bufs, "want_bufs": [b.chunk(world, dim=tp_dim)[rank] for b in ref_bufs]})
    return out


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_distributed(tp_update_job, WORLD)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"dim{d}-n{n}-{str(t)[6:]}" for d, n, t in CASES])
def test_each_shard_gets_the_full_matrix_update_bit_for_bit(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        # float32: the full matrices' own update; bfloat16: the shard-wise elementwise steps (docstring)
        want_all = r["want"] if CASES[case][2] == torch.float32 else r["shardwise"]
        for got, want in zip(r["got"], want_all):
            assert torch.equal(got, want), (rank, CASES[case], (got.float() - want.float()).abs().max())
        if CASES[case][2] == torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(r["shardwise"], r["want"]))  # the two references agree
        for got, want in zip(r["bufs"], r["want_bufs"]):  # the momentum is elementwise lerps: bit for bit
            assert torch.equal(got, want), (rank, CASES[case])


def test_matrices_are_dealt_round_robin_and_the_bytes_add_up():
    assert roots(5, 2) == [0, 1, 0, 1, 0]
    # 3 matrices of 10-element shards at tp=2: rank 0 runs NS on 2 of them; it sends out the shard of the
    # one it does not run (10) and, of its 2 results, the other rank's shards (20)
    assert exchange_cost(3, 10, tp_rank=0, tp_size=2) == (2, 30)
    assert exchange_cost(3, 10, tp_rank=1, tp_size=2) == (1, 30)
    assert exchange_cost(1, 10, tp_rank=3, tp_size=4) == (0, 10)


def test_uneven_shards_are_refused():
    w = torch.zeros(5, 4)
    with pytest.raises(ValueError, match="do not split"):
        muon_update_tp_([w], [w], [w.clone()], MuonHParams(), full_shape=(12, 4), tp_dim=0, tp_rank=0, tp_size=2,
                        exchange=_exchange)
