"""How one parameter splits into the independent matrices Muon orthogonalises: its :class:`Blocks`.

[Note: matrix blocks]
Muon orthogonalises *matrices*. A parameter is not always one:

* a 2-D weight ``[m, n]`` is one matrix;
* a parameter with more dims is a batch of matrices over its leading dims: mixture-of-experts weights
  ``[E, m, n]`` (torchtitan's ``GroupedExperts``, HF transformers' fused experts) are ``E`` separate
  ``m x n`` matrices. Flattening them to ``[E m, n]`` and orthogonalising that is another update (the
  experts' rows would share one polar factor), so the expert axis is never mixed;
* a fused projection stacks several matrices along its rows: a fused QKV ``[q + k + v, d]`` is three, a
  fused gate/up ``[E, 2 I, H]`` is ``2 E``; per-head blocks split ``q`` further. ``dedicate_params(blocks=...)``
  declares such *row blocks*; each is orthogonalised alone;
* a fused projection may also *interleave* its matrices: torchtitan's ``FusedQKVLinear`` stores ``n_kv``
  groups of rows, each ``[the group's q heads, its k head, its v head]``, so ``q`` is rows ``0:hq`` of every
  group, not one contiguous range. :class:`Interleaved` declares that: the row blocks of one group, repeated
  ``groups`` times; block ``i`` is the ``i``-th block of every group, stacked in group order (the stock
  ``wq`` / ``wk`` / ``wv``, as torchtitan's checkpoint split produces them).

Everything that depends on the matrices' shapes reads them from here: Newton–Schulz batches (same-shape
blocks go through one batched call), the learning-rate rule (``adjust_lr_fn`` on each block's own
``m, n``, not on the parameter's first two dims), the owner plan's cost model, the tensor-parallel update
(blocks of the *full* matrix), and diagnostics. Momentum, weight decay and the step are elementwise, so
they run on the parameter as it is.

Pure shape arithmetic: no tensors, no ``torch.distributed``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Blocks", "Interleaved", "Run", "RowBlocks"]


@dataclass(frozen=True, slots=True)
class Interleaved:
    """Row blocks that repeat ``groups`` times along the rows: ``rows`` (a count or row sizes, as for a
    contiguous split) tiles one group of ``shape[-2] // groups`` rows, and block ``i`` is the ``i``-th block
    of every group, stacked in group order: a ``groups * rows[i]`` x ``n`` matrix.

    Example::

        Interleaved((2 * 128, 128, 128), 8)  # torchtitan's fused QKV, 8 KV groups of [2 q heads, k, v]
    """

    rows: int | Sequence[int]
    groups: int

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int):
            object.__setattr__(self, "rows", tuple(self.rows))


#: What ``dedicate_params(blocks=...)`` may answer for one parameter: ``None`` (the default: one matrix per
#: trailing two dims), ``k`` (``k`` equal row blocks), the row sizes of the blocks, in order, or
#: :class:`Interleaved` blocks.
RowBlocks = int | Sequence[int] | Interleaved | None


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive row blocks of ``size`` rows each, starting at row ``start`` (of dim -2)."""

    start: int
    size: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.size * self.count


@dataclass(frozen=True, slots=True)
class Blocks:
    """The matrices of a parameter of ``shape``: its leading dims are a batch, and its last two dims are
    split along the rows into blocks of ``rows`` sizes (one block, ``(shape[-2],)``, unless declared). With
    ``groups > 1`` the rows are ``groups`` repeats of that split ([Note: matrix blocks]), and each block
    gathers its rows from every repeat.

    Example::

        Blocks.of((8, 512, 128))                # 8 experts, each one 512 x 128 matrix
        Blocks.of((3072, 1024), (2048, 512, 512))  # fused q, k, v: three matrices
        Blocks.of((8, 1024, 128), 2)            # fused gate/up experts: 16 matrices of 512 x 128
        Blocks.of((3072, 1024), Interleaved((256, 64, 64), 8))  # q, k, v of 8 interleaved KV groups
    """

    shape: tuple[int, ...]
    #: the row sizes of one group (of the whole matrix when ``groups == 1``)
    rows: tuple[int, ...]
    #: how many times ``rows`` repeats along dim -2; 1: contiguous blocks
    groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _dims(self.shape))
        object.__setattr__(self, "rows", tuple(operator.index(r) for r in self.rows))
        object.__setattr__(self, "groups", operator.index(self.groups))

    @classmethod
    def of(cls, shape: Sequence[int], rows: RowBlocks = None, *, what: str = "dmuon") -> Blocks:
        """The blocks of ``shape`` with the row split ``rows`` (see :data:`RowBlocks`); ``ValueError``
        naming ``what`` when the split does not tile the rows or the shape has fewer than 2 dims."""
        dims = _dims(shape, what)
        if isinstance(rows, Interleaved):
            groups = rows.groups
            if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or dims[-2] % groups:
                raise ValueError(f"{what}: {groups!r} interleaved groups do not tile the {dims[-2]} rows of shape "
                                 f"{dims}; pass a group count that divides {dims[-2]}")
            one = cls.of((*dims[:-2], dims[-2] // groups, dims[-1]), rows.rows, what=f"{what} (one of {groups} groups)")
            # one block per group is every row in order: the whole matrix
            return cls(dims, (dims[-2],)) if len(one.rows) == 1 else cls(dims, one.rows, groups)
        m = dims[-2]
        if rows is None:
            sizes: tuple[int, ...] = (m,)
        elif isinstance(rows, bool):
            raise ValueError(f"{what}: row blocks must be an int count or a sequence of row sizes, got {rows!r}")
        elif isinstance(rows, int) or hasattr(rows, "__index__"):
            k = operator.index(rows)  # type: ignore[arg-type]
            if k < 1 or m % k:
                raise ValueError(f"{what}: {k} row blocks do not tile the {m} rows of shape {dims}; pass a count "
                                 f"that divides {m}, or the row sizes of each block")
            sizes = (m // k,) * k
        else:
            try:
                sizes = tuple(operator.index(r) for r in rows)  # type: ignore[union-attr]
            except TypeError:
                raise ValueError(f"{what}: row blocks must be an int count or a sequence of int row sizes, "
                                 f"got {rows!r}") from None
            if not sizes or any(r < 1 for r in sizes) or sum(sizes) != m:
                raise ValueError(f"{what}: row blocks {list(sizes)} do not tile the {m} rows of shape {dims} "
                                 f"(they sum to {sum(sizes)}); give positive sizes that add up to {m}")
        return cls(dims, sizes)

    # ------------------------------------------------------------------ #
    # Shape arithmetic                                                     #
    # ------------------------------------------------------------------ #
    @property
    def batch(self) -> int:
        """The number of matrices along the leading dims (1 for a 2-D parameter)."""
        return math.prod(self.shape[:-2])

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def count(self) -> int:
        """How many matrices Muon orthogonalises for this parameter."""
        return self.batch * len(self.rows)

    @property
    def period(self) -> int:
        """The rows of one group: ``sum(rows)`` (``shape[-2]`` for contiguous blocks)."""
        return self.shape[-2] // self.groups

    @property
    def spec(self) -> RowBlocks:
        """What :meth:`of` takes to rebuild these blocks for another leading shape (an expert shard)."""
        return self.rows if self.groups == 1 else Interleaved(self.rows, self.groups)

    @property
    def is_single(self) -> bool:
        """One 2-D matrix: the parameter itself (the path ``torch.optim.Muon`` takes)."""
        return len(self.shape) == 2 and len(self.rows) == 1

    @property
    def runs(self) -> tuple[Run, ...]:
        """Consecutive equal row blocks merged: each run is one strided view ``[..., start:stop, :]`` that
        reshapes to ``(batch * count, size, cols)`` matrices. With ``groups > 1`` the runs are those of one
        group (rows relative to the group's first), and run ``r``'s matrices are ``groups * r.size`` rows
        high."""
        out: list[Run] = []
        start = 0
        for r in self.rows:
            if out and out[-1].size == r:
                out[-1] = Run(out[-1].start, r, out[-1].count + 1)
            else:
                out.append(Run(start, r, 1))
            start += r
        return tuple(out)

    def matrices(self) -> list[tuple[tuple[int, int], int]]:
        """``((m, n), how many)`` per distinct block shape, in row order of first appearance."""
        counts: dict[tuple[int, int], int] = {}
        for run in self.runs:
            key = (self.groups * run.size, self.cols)
            counts[key] = counts.get(key, 0) + run.count * self.batch
        return list(counts.items())

    def rows_in(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The runs that meet rows ``[start, stop)``, as ``(local_start, local_stop, block_rows)`` relative
        to ``start``, ``block_rows`` the height of the run's matrices, neighbours of the same height merged:
        where a tensor-parallel shard of the rows is updated with each block's own lr."""
        out: list[tuple[int, int, int]] = []
        period = self.period
        for g in range(start // period, -(-stop // period)):
            for run in self.runs:
                lo, hi = max(g * period + run.start, start), min(g * period + run.stop, stop)
                if lo >= hi:
                    continue
                if out and out[-1][1] == lo - start and out[-1][2] == self.groups * run.size:
                    out[-1] = (out[-1][0], hi - start, out[-1][2])
                else:
                    out.append((lo - start, hi - start, self.groups * run.size))
        return out

    def describe(self) -> str:
        """``8 x (512 x 128)`` / ``(2048 x 1024) + 2 x (512 x 1024)``: for messages and diagnostics."""
        return " + ".join(f"{k} x ({m} x {n})" if k > 1 else f"({m} x {n})" for (m, n), k in self.matrices())


def _dims(shape: Sequence[int], what: str = "dmuon") -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"{what}: a shape must be a sequence of ints, got {shape!r}") from None
    if len(dims) < 2:
        raise ValueError(f"{what}: Muon orthogonalises matrices; shape {dims} has {len(dims)} dims (needs 2, or "
                         "more for a batch of matrices such as experts [E, m, n])")
    if any(d < 1 for d in dims[-2:]) or any(d < 0 for d in dims):
        raise ValueError(f"{what}: shape {dims} has an empty matrix dimension")
    return dims
