"""The Muon update of tensor-parallel shards: each matrix gathered onto one tp rank, Newton–Schulz of the full
matrix there, its result sent back in shards.

[Note: TP update] Tensor parallelism keeps a weight split over the "tp" ranks (``ColwiseParallel``: rows,
``Shard(0)``; ``RowwiseParallel``: columns, ``Shard(1)``), and every tp rank of the owner's dp slot keeps
its shard and that shard's momentum. Muon must orthogonalise the *full* matrix (orthogonalising each shard
alone is another update; ``tests/test_tp.py`` shows it missing the oracle). Momentum, decay and the step are
elementwise, so they stay on the shards; only Newton–Schulz needs the whole matrix:

1. the same-shape matrices of one owner slot are dealt round-robin over its tp ranks (matrix ``k`` to tp
   rank ``k mod t``), and one all-to-all over "tp" brings each tp rank the other shards of its matrices;
2. each tp rank runs the ordinary batched Newton–Schulz (:func:`dmuon.optim.update.orthogonalise`, the
   same backend, kernels and CUDA graphs as an owner without TP) on the ``~N/t`` full matrices it got;
3. a second all-to-all returns every shard of every result to the tp rank that holds that shard.

So each tp rank's update is bit for bit what an owner without TP that held its matrices computes (the same
calls on the same batch), and the NS work of the slot is split ``t`` ways. Bytes per tp rank and step: about ``2 (t-1)/t^2`` of the slot's matrices (the
update's dtype out, Newton–Schulz's native float16/bfloat16 back). Measured against the alternative that
never gathers (all-reduce of each matrix's Gram matrix over the sharded side, the NS polynomial in Gram
space; ``docs/benchmarks.md``, 2026-12-01 issue 16): on an H200 that path cost each tp rank the whole
Gram-space iteration of an ``s x s`` matrix (``s`` the unsplit side, 4096 for every Llama-3.1-8B matrix)
whatever ``t`` is, 4.1–7.1 ms in float16 and 56–75 ms in float32 per matrix against 2.7–5.3 ms for the full
matrix's NS here, divided by ``t``; its all-reduce also carried ``s^2`` float32 per matrix (67 MB) against
the matrix itself in bfloat16 (8–117 MB) moved once each way. Pure tensor layout: the all-to-all is the
caller's (``exchange``), so this module stays free of distributed code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .newton_schulz import native_dtype
from ..runtime.blocks import Blocks
from .update import MuonHParams, _apply_update_, _stacked_updates, orthogonalise

__all__ = ["Exchange", "Payload", "muon_update_tp_", "orthogonalise_tp", "check_shards", "roots", "exchange_cost"]

#: ``exchange(send, send_counts, recv, recv_counts)``: one all-to-all over the tp ranks (element counts per
#: peer, in tp-rank order), e.g. ``dist.all_to_all_single`` over the "tp" group.
Exchange = Callable[[Tensor, list[int], Tensor, list[int]], None]


def roots(n: int, tp_size: int) -> list[int]:
    """The tp rank that runs Newton–Schulz for each of ``n`` same-shape matrices: round-robin."""
    return [k % tp_size for k in range(n)]


def _dealt(n: int, tp_size: int) -> list[int]:
    """How many of ``n`` matrices :func:`roots` deals to each tp rank."""
    return [len(range(d, n, tp_size)) for d in range(tp_size)]


def exchange_cost(n: int, shard_numel: int, *, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """For one call of :func:`muon_update_tp_` on ``n`` matrices: how many of them this tp rank orthogonalises,
    and how many elements it sends to its tp peers over both all-to-alls (the shards of the other ranks'
    matrices out, the other ranks' shards of its own results back)."""
    mine = _dealt(n, tp_size)[tp_rank]
    return mine, (n - mine + (tp_size - 1) * mine) * shard_numel


def _assemble(parts: Tensor, tp_dim: int) -> Tensor:
    """``(t, c, *local)`` shards, tp-rank-major, to ``(c, *full)`` matrices (shards concatenated along ``tp_dim``)."""
    t, c, m, n = parts.shape
    if tp_dim == 0:
        return parts.movedim(0, 1).reshape(c, t * m, n)
    return parts.permute(1, 2, 0, 3).reshape(c, m, t * n)


def _split(full: Tensor, tp_dim: int, t: int) -> Tensor:
    """The inverse of :func:`_assemble`: ``(c, *full)`` to contiguous ``(t, c, *local)`` shards."""
    c, m, n = full.shape
    if tp_dim == 0:
        return full.view(c, t, m // t, n).movedim(1, 0).contiguous()
    return full.view(c, m, t, n // t).permute(2, 0, 1, 3).contiguous()


def muon_update_tp_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                    hp: MuonHParams, *, full_shape: Sequence[int], tp_dim: int, tp_rank: int, tp_size: int,
                    exchange: Exchange, blocks: Blocks | None = None) -> None:
    """:func:`dmuon.optim.update.muon_update_batch_` for same-shape tensor-parallel *shards* ([Note: TP
    update]): every tp rank of the owner slot passes its shards of the same matrices, in the same order, and
    each shard receives its part of the full matrix's Muon update (the lr scaled by ``full_shape``, or by each
    block of ``blocks``, row or column ones, which describe the full matrix: [Note: matrix blocks] in
    ``dmuon/runtime/blocks.py``).

    Example::

        tp = mesh["tp"].get_group()
        def exchange(send, send_counts, recv, recv_counts):
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=tp)
        muon_update_tp_([w_shard], [g_shard], [buf_shard], MuonHParams(), full_shape=(4096, 1024), tp_dim=0,
                        tp_rank=mesh["tp"].get_local_rank(), tp_size=2, exchange=exchange)
    """
    full_shape, blocks = check_shards(params, full_shape, tp_dim, tp_size, blocks, "muon_update_tp_")
    updates = _stacked_updates(grads, momentum_buffers, hp)
    orthos, _ = orthogonalise_tp(updates, hp, full_shape=full_shape, tp_dim=tp_dim, tp_rank=tp_rank,
                                 tp_size=tp_size, exchange=exchange, blocks=blocks)
    # where the shard starts along the blocks' dim of the full matrix (0 when TP splits the other dim)
    start = tp_rank * params[0].shape[tp_dim] if tp_dim == len(full_shape) + blocks.dim else 0
    for p, o in zip(params, orthos):
        _apply_update_(p, o, hp, blocks, start)


def check_shards(params: Sequence[Tensor], full_shape: Sequence[int], tp_dim: int, tp_size: int,
                 blocks: Blocks | None, what: str) -> tuple[tuple[int, ...], Blocks]:
    """The full shape and its blocks, after checking that ``params`` are shards of it along ``tp_dim``."""
    full_shape = tuple(full_shape)
    local = tuple(params[0].shape)
    if tp_dim not in (0, 1) or len(full_shape) != 2 or local[tp_dim] * tp_size != full_shape[tp_dim]:
        raise ValueError(f"{what}: shards {local} do not split {full_shape} along dim {tp_dim} "
                         f"over {tp_size} tp ranks")
    blocks = Blocks.of(full_shape, what=what) if blocks is None else blocks
    if blocks.shape != full_shape:
        raise ValueError(f"{what}: blocks of {blocks.shape} for matrices of {full_shape}")
    return full_shape, blocks


#: What a root computes from the full Newton-Schulz results of its matrices ``(c, *full)`` and sends back with
#: each shard: ``(c, k)`` values per matrix (an update rule's statistic of the whole matrix, e.g. NorMuon's row sums).
Payload = Callable[[Tensor], Tensor]


def orthogonalise_tp(updates: Tensor, hp: MuonHParams, *, full_shape: tuple[int, ...], tp_dim: int, tp_rank: int,
                     tp_size: int, exchange: Exchange, blocks: Blocks, payload: Payload | None = None,
                     payload_shape: tuple[int, torch.dtype] = (0, torch.float32),
                     ) -> tuple[list[Tensor], list[Tensor] | None]:
    """Steps 1-3 of [Note: TP update] for the stacked momentum updates ``(N, *local)`` of this tp rank's shards:
    each shard's part of its full matrix's Newton-Schulz result, in NS's native dtype, and, with ``payload``
    (``payload_shape``: its ``k`` values per matrix and their dtype), what the matrix's root computed from the
    whole result. The payload travels in the second all-to-all with the shards, its bits packed as the
    native dtype's words (no extra collective)."""
    numel, n, local = updates[0].numel(), updates.shape[0], tuple(updates.shape[1:])
    counts = _dealt(n, tp_size)
    mine = counts[tp_rank]
    # out: the shards of tp rank d's matrices, for d = 0..t-1; in: my matrices' shards from every tp rank
    send = torch.cat([updates[d::tp_size].reshape(-1) for d in range(tp_size)])
    recv = updates.new_empty(tp_size * mine * numel)
    exchange(send, [c * numel for c in counts], recv, [mine * numel] * tp_size)
    # every root's result has Newton-Schulz's native dtype, the same for any batch of this shape
    out_dtype = native_dtype((max(mine, 1), *full_shape), hp.ns_backend, device=updates.device)
    k, extra_dtype = payload_shape if payload is not None else (0, out_dtype)
    extra = k * extra_dtype.itemsize // out_dtype.itemsize  # payload words per matrix
    if extra * out_dtype.itemsize != k * extra_dtype.itemsize:
        raise ValueError(f"orthogonalise_tp: a payload of {k} {extra_dtype} does not pack into {out_dtype} words")
    if mine:
        full = _assemble(recv.view(tp_size, mine, *local), tp_dim)
        # one matrix goes through the 2-D call, as muon_update_batch_ sends it: the same kernels as an owner
        # without TP that holds this tp rank's matrices
        orthos = orthogonalise(full[0], hp, blocks).unsqueeze(0) if mine == 1 else orthogonalise(full, hp, blocks)
        back = _split(orthos.to(out_dtype), tp_dim, tp_size).reshape(tp_size, mine, numel)  # a no-op cast
        if payload is not None:
            words = payload(orthos).to(extra_dtype).contiguous().view(out_dtype).reshape(1, mine, extra)
            back = torch.cat([back, words.expand(tp_size, mine, extra)], dim=2)
        back = back.reshape(-1)
    else:
        back = updates.new_empty(0, dtype=out_dtype)
    per = numel + extra
    mine_back = updates.new_empty(n * per, dtype=out_dtype)
    exchange(back, [mine * per] * tp_size, mine_back, [c * per for c in counts])
    from_root = [part.view(c, per) for part, c in zip(mine_back.split([c * per for c in counts]), counts)]
    shards = [from_root[j % tp_size][j // tp_size, :numel].view(local) for j in range(n)]
    if payload is None:
        return shards, None
    return shards, [from_root[j % tp_size][j // tp_size, numel:].contiguous().view(extra_dtype) for j in range(n)]
