"""Per-tensor checksums that do not depend on how a tensor is sharded, so a save on 8 ranks verifies on
a load on 2, and each rank only reads its own share.

[Note: checkpoint checksums]
``torch.load`` does not check its zip records, and DCP keeps no checksum, so a flipped byte or a torn
save (metadata of one save, data of another) loads silently. dmuon's state dicts carry, per tensor,

    C(t) = sum_i  r(w_i) * ((i mod L) + 1)   (mod P),   P = 2^31 - 1, L = 2^15,

over the tensor's raw bits ``w_i`` read as signed words (int8 / int16 / int32: one word per element of
1 / 2 bytes, ``element_size / 4`` words of 4 bytes otherwise) at global flat word index ``i``. It is a
sum over positions, so each rank adds the part it holds (a dedicated tensor: its owner; a DTensor shard:
its own range, at its global offset; a replicated tensor: rank 0) and one all-reduce gives C.

Under tensor parallelism (see [Note: tensor-parallel state dicts] in ``_common.py``) the sum runs over
every rank: each owner-slot tp rank adds its shard of a TP matrix (:func:`chunk_part`: a column split's
shard is one run of words per row, each at its own global index), and everything else, which every tp
index holds alike, is counted on tp index 0 only.

Why it catches what it should, exactly: a changed byte changes one word by ``d = c * 2^(8k)``, 0 < |c| <
256, k < 4; P is prime and divides neither ``d`` (|d| < 2^32 and ``d`` is not ±P or ±2P) nor the weight
(1..L), so C changes. Data from another save differs in many words and matches only by a 1-in-P chance.

Why it is exact in int64 on any device: per row of L words, |w| < 2^31 and the weights sum to
L(L+1)/2 < 2^29, so a row sum stays below 2^60 before it is reduced mod P; the row sums mod P then add
up over at most 2^33 / L rows, far below 2^63.

[Note: checksums across pipeline stages]
Under pipeline parallelism ([Note: pipeline stages] in ``runtime/topology.py``) each stage holds other
tensors (the full model's FQNs, disjoint between stages), so one all-reduce over per-rank item lists would
pair unrelated sums, or none at all. Under stages the sums run over the union of every rank's keys
(:func:`job_keys`, one gather of the key lists), each rank adding zero where it holds no part; a key's
parts all come from its own stage, whose slot-0 rank counts its replicated tensors and gives the expected
value from the stage's table. Every rank then sees every stage's mismatches, so a corrupted part of one
stage is refused on every rank of the job together. Each stage's sharded dict carries its own keys'
checksums; DCP flattens the table into one entry per FQN, so the saved file holds every stage's and a load
with any other pp or dp degree finds the ones it needs.

Where the values live: a full state dict's tensors carry theirs as the attribute ``_dmuon_checksum``,
which ``torch.save`` / ``torch.load`` (also ``weights_only=True``) keep and ``load_state_dict`` ignores, so
the dict still loads into a plain model; a sharded (DCP) dict has one extra entry, ``_dmuon_checksums``
(FQN -> int), that DCP saves and loads like any other object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from ..runtime import comm as C

__all__ = ["P", "CHECKSUM_ATTR", "CHECKSUMS_KEY", "Item", "checksum_part", "chunk_part", "collect", "mismatches",
           "stored"]

P = 2**31 - 1
L = 2**15
#: attribute on the tensors of a full state dict
CHECKSUM_ATTR = "_dmuon_checksum"
#: the extra entry of a sharded state dict
CHECKSUMS_KEY = "_dmuon_checksums"

_WORD = {1: torch.int8, 2: torch.int16}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (flattened) as signed words."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    if size in _WORD:
        return flat.view(_WORD[size])
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.int32)


def _weighted_mod(words: torch.Tensor, start: int) -> torch.Tensor:
    """``sum_j words[j] * (((start + j) mod L) + 1) mod P`` as an int64 scalar on ``words``' device."""
    n = words.numel()
    dev = words.device
    total = torch.zeros((), dtype=torch.int64, device=dev)
    if n == 0:
        return total
    head = min(n, (-start) % L)
    pieces = []
    if head:
        pieces.append((words[:head], start % L))
    body = (n - head) // L * L
    tail = n - head - body
    if tail:
        pieces.append((words[head + body:], 0))
    for piece, first in pieces:
        w = torch.arange(first + 1, first + 1 + piece.numel(), dtype=torch.int64, device=dev)
        total = total + (piece.to(torch.int64) * w).sum() % P
    if body:
        base = torch.arange(1, L + 1, dtype=torch.int64, device=dev)
        rows = words[head:head + body].view(-1, L)
        step = max(1, (1 << 24) // L)  # rows per slice: bounded temporaries (128 MiB of int64)
        for r in range(0, rows.shape[0], step):
            total = total + ((rows[r:r + step].to(torch.int64) * base).sum(dim=1) % P).sum()
    return total % P


def checksum_part(t: torch.Tensor, word_offset: int = 0) -> torch.Tensor:
    """This part of the checksum: ``t`` holds the words of the whole tensor starting at global word index
    ``word_offset``. ``checksum_part(full)`` is the whole checksum."""
    return _weighted_mod(_words(t), word_offset)


def chunk_part(t: torch.Tensor, full_shape: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
    """This part of the checksum of a tensor of ``full_shape`` whose block at ``offsets`` is ``t`` (a
    tensor-parallel shard: rows or columns of a matrix). ``chunk_part(full, full.shape, [0, ...])`` is the
    whole checksum; the parts of disjoint blocks add up (mod P) to it."""
    dev, n, nd = t.device, t.numel(), t.dim()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * int(full_shape[d + 1])
    wpe = words_per_element(t.dtype)
    start = sum(int(o) * s for o, s in zip(offsets, strides))
    if all(int(t.shape[d]) == int(full_shape[d]) for d in range(1, nd)):  # one contiguous range
        return checksum_part(t, start * wpe)
    run = int(t.shape[-1]) * wpe  # words of one contiguous run (a row of the block)
    base = torch.full((), start, dtype=torch.int64, device=dev)
    for d in range(nd - 1):  # the global element index of each run's first element
        idx = torch.arange(int(t.shape[d]), dtype=torch.int64, device=dev) * strides[d]
        base = base.unsqueeze(-1) + idx
    base = base.reshape(-1) * wpe
    words = _words(t).view(-1, run)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    piece = min(run, 1 << 16)  # a run's slice: products < 2^46, a sum of 2^16 of them < 2^62
    rows = max(1, (1 << 24) // piece)  # runs per slice: bounded temporaries (128 MiB of int64)
    for c in range(0, run, piece):
        cols = torch.arange(c, min(run, c + piece), dtype=torch.int64, device=dev)
        for r in range(0, words.shape[0], rows):
            w = (base[r:r + rows, None] + cols) % L + 1
            total = total + ((words[r:r + rows, c:c + piece].to(torch.int64) * w).sum(dim=1) % P).sum() % P
    return total % P


def words_per_element(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size <= 2 or dtype == torch.bool else size // 4


def _rows_sharded(t: DTensor) -> bool:
    """Whether every rank's shard of ``t`` is one range of rows of the row-major tensor: placements only
    ``Replicate`` and at most one plain ``Shard(0)``. Decided from the placements alone, which every rank
    shares, so every rank takes the same path (the other one is a collective)."""
    shards = [p for p in t.placements if not isinstance(p, Replicate)]
    return len(shards) <= 1 and all(type(p) is Shard and p.dim == 0 for p in shards)


def shard_range(t: DTensor) -> tuple[int, int] | None:
    """``(first element, element count)`` of this rank's shard of ``t`` in the row-major full tensor, as
    this rank counts it for the checksum: ``(0, 0)`` where another rank counts it (replicated mesh dims
    count at coordinate 0), where the shard is empty, or where this rank is not in the mesh. ``None`` (on
    every rank alike, see :func:`_rows_sharded`): the shards are not row ranges, so coordinate 0 counts
    the full tensor."""
    if not _rows_sharded(t):
        return None
    coord = t.device_mesh.get_coordinate()
    if coord is None or not all(c == 0 for c, pl in zip(coord, t.placements) if isinstance(pl, Replicate)):
        return 0, 0
    n = t.to_local().numel()
    if n == 0 or not t.shape:
        return 0, n
    row = 1
    for s in t.shape[1:]:
        row *= s
    (chunk,) = t.__create_chunk_list__()
    return int(chunk.offsets[0]) * row, n


def counts_full(t: DTensor) -> bool:
    """Where :func:`shard_range` is ``None``: whether this rank counts the full tensor."""
    coord = t.device_mesh.get_coordinate()
    return coord is not None and all(c == 0 for c in coord)


def dtensor_part(t: DTensor) -> torch.Tensor:
    """This rank's part of a DTensor's checksum (see :func:`shard_range`)."""
    rng = shard_range(t)
    if rng is None:
        full = t.full_tensor()  # collective: every rank takes this branch for the same tensor
        return checksum_part(full) if counts_full(t) else torch.zeros((), dtype=torch.int64, device=full.device)
    first, n = rng
    local = t.to_local()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=local.device)
    return checksum_part(local, first * words_per_element(t.dtype))


# ---------------------------------------------------------------------- #
# One state dict's checksums, collectively                                 #
# ---------------------------------------------------------------------- #
@dataclass(frozen=True)
class Item:
    """One tensor of a state dict and who counts it: its ``owner`` slot (a dedicated tensor and its
    optimizer state; a tensor-parallel one has its live DTensor over "tp" as ``layout``, whose shards the
    owner slot's tp ranks count), or, with ``owner=None``, the shards of the live DTensor ``layout`` (a
    tensor of its shape) / slot 0 for anything else (a replicated tensor, a scalar ``step``)."""

    key: str
    owner: int | None
    layout: torch.Tensor | None


def _tp_part(layout: DTensor, v: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The owner slot's part of a TP matrix: a DTensor's shard at its offsets, a local shard at
    ``layout``'s, or a whole matrix (an incoming full dict) on tp index 0."""
    if isinstance(v, DTensor):
        (chunk,) = v.__create_chunk_list__()
        return chunk_part(v.to_local().detach().to(zero.device), v.shape, chunk.offsets)
    if tuple(v.shape) == tuple(layout.shape):
        return checksum_part(v.detach().to(zero.device)) if layout.device_mesh.get_local_rank() == 0 else zero
    (chunk,) = layout.__create_chunk_list__()
    return chunk_part(v.detach().to(zero.device), layout.shape, chunk.offsets)


def _spans_rows(t: Any, ctx: C.CommContext) -> bool:
    """Whether DTensor ``t`` lives on more ranks than one dp row (a 2-D ("dp", "tp") FSDP2 param), so its
    shards already count once over every rank."""
    return isinstance(t, DTensor) and t.device_mesh.size() > ctx.world_size


def _part(item: Item, v: Any, ctx: C.CommContext, everything_here: bool, tp_rank: int | None) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.int64, device=ctx.device)
    if not isinstance(v, torch.Tensor):
        return zero
    if everything_here:
        return checksum_part(v.detach().to(ctx.device))
    if item.owner is not None and isinstance(item.layout, DTensor):
        return _tp_part(item.layout, v, zero) if item.owner == ctx.rank else zero
    if tp_rank and not _spans_rows(item.layout, ctx) and not _spans_rows(v, ctx):
        return zero  # every tp index holds its own copy: tp index 0 counts it
    if item.owner is not None:
        return checksum_part(v.detach().to(ctx.device)) if item.owner == ctx.rank else zero
    if isinstance(v, DTensor):
        if v.to_local().device != ctx.device:  # a staged copy on the CPU: summed on the device, as the rest
            v = v.to(ctx.device)
        return dtensor_part(v).to(ctx.device)
    if not isinstance(item.layout, DTensor) or tuple(item.layout.shape) != tuple(v.shape):
        return checksum_part(v.detach().to(ctx.device)) if ctx.rank == 0 else zero
    rng = shard_range(item.layout)  # a full value for an FSDP2 tensor: this rank's shard of it
    if rng is None:
        return checksum_part(v.detach().to(ctx.device)) if counts_full(item.layout) else zero
    first, n = rng
    if n == 0:
        return zero
    return checksum_part(v.detach().reshape(-1)[first:first + n].to(ctx.device), first * words_per_element(v.dtype))


def job_keys(ctx: C.CommContext, keys: Sequence[str], pipelined: bool) -> list[str]:
    """The keys every rank of the job sums over, in one order: this rank's own, or under pipeline stages the
    union of every stage's (each holds other FQNs; see [Note: checksums across pipeline stages]). Collective
    where ``pipelined``."""
    if not pipelined:
        return list(keys)
    return sorted({str(k) for ks in C.all_gather_object(ctx, list(keys)) for k in ks})  # type: ignore[union-attr]


def _sums(ctx: C.CommContext, keys: Sequence[str], parts: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Each key's parts summed over every rank of the job (mod P): one all-reduce over ``keys`` (the same list
    on every rank), a rank adding zero for the keys it holds no part of."""
    if not keys:
        return {}
    zero = torch.zeros((), dtype=torch.int64, device=ctx.device)
    total = C.all_reduce_sum(ctx, torch.stack([parts.get(k, zero) for k in keys])) % P
    return dict(zip(keys, (int(x) for x in total.tolist())))


def collect(ctx: C.CommContext, items: Sequence[Item], values: Mapping[str, Any], *,
            everything_here: bool = False, tp_rank: int | None = None, pipelined: bool = False) -> dict[str, int]:
    """Every item's checksum over ``values`` (live tensors or an incoming dict; a key may be absent where
    this rank holds no part). Collective, one all-reduce: each rank adds the part it counts;
    ``everything_here``: this rank holds all of every value (a rank-0-only dict on rank 0), the others
    none. ``tp_rank``: this rank's tp index under tensor parallelism (the sum then runs over every rank).
    ``pipelined``: the job has pipeline stages, whose items differ (one more gather, of the keys).
    Parts are summed on the device, so only this rank's share is read."""
    every = _collect(ctx, items, values, everything_here, tp_rank, pipelined)
    return {it.key: every[it.key] for it in items}


def _collect(ctx: C.CommContext, items: Sequence[Item], values: Mapping[str, Any], everything_here: bool,
             tp_rank: int | None, pipelined: bool) -> dict[str, int]:
    """:func:`collect` over the job's keys (:func:`job_keys`): this rank's items and, under pipeline stages,
    every other stage's."""
    keys = job_keys(ctx, [it.key for it in items], pipelined)
    with torch.no_grad():
        parts = {it.key: _part(it, values.get(it.key), ctx, everything_here, tp_rank) for it in items}
        return _sums(ctx, keys, parts)


def stored(values: Mapping[str, Any], table: Any) -> dict[str, int]:
    """The checksums a dict carries: its ``_dmuon_checksums`` table (sharded) or its tensors' attributes."""
    if isinstance(table, Mapping):
        return {str(k): int(v) for k, v in table.items()}
    return {k: int(getattr(v, CHECKSUM_ATTR)) for k, v in values.items() if hasattr(v, CHECKSUM_ATTR)}


def mismatches(ctx: C.CommContext, items: Sequence[Item], values: Mapping[str, Any], expected: Mapping[str, int],
               *, rank0_only: bool, tp_rank: int | None = None, pipelined: bool = False) -> list[str]:
    """The keys whose incoming values do not match the checksums the dict carries in ``expected``, as global
    rank 0 sees them (under pipeline stages: each stage's first rank, for its own keys). Keys without one are
    not checked; none at all: nothing is read. The same list on every rank of the job, so all raise together.
    Collective (``tp_rank``, ``pipelined``: see :func:`collect`)."""
    keys = job_keys(ctx, [it.key for it in items], pipelined)
    me = ctx.rank == 0 if pipelined else dist.get_rank() == 0
    own = {it.key for it in items}
    with torch.no_grad():
        want = _sums(ctx, keys, {k: torch.tensor(expected.get(k, -1) + 1 if me else 0, dtype=torch.int64,
                                                 device=ctx.device) for k in keys if k in own})
    if not any(want.values()):
        return []
    got = _collect(ctx, items, values, rank0_only and me, tp_rank, pipelined)
    return [k for k in keys if want[k] and got[k] != want[k] - 1]
