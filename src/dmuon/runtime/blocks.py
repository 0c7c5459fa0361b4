"""How one parameter splits into the independent matrices Muon orthogonalises: its :class:`Blocks`.

[Note: matrix blocks]
Muon orthogonalises *matrices*. A parameter is not always one:

* a 2-D weight ``[m, n]`` is one matrix;
* a parameter with more dims is a batch of matrices over its leading dims: mixture-of-experts weights
  ``[E, m, n]`` (torchtitan's ``GroupedExperts``, HF transformers' fused experts) are ``E`` separate
  ``m x n`` matrices. Flattening them to ``[E m, n]`` and orthogonalising that is another update (the
  experts' rows would share one polar factor), so the expert axis is never mixed;
* a fused projection stacks several matrices along its rows: a fused QKV ``[q + k + v, d]`` is three, a
  fused gate/up ``[E, 2 I, H]`` is ``2 E``; per-head blocks split ``q`` further (DeepSeek's MLA ``q_b_proj``
  and ``kv_b_proj``: one block per head). ``dedicate_params(blocks=...)`` declares such *row blocks*; each is
  orthogonalised alone;
* a fused projection may also *interleave* its matrices: torchtitan's ``FusedQKVLinear`` stores ``n_kv``
  groups of rows, each ``[the group's q heads, its k head, its v head]``, so ``q`` is rows ``0:hq`` of every
  group, not one contiguous range. :class:`Interleaved` declares that: the row blocks of one group, repeated
  ``groups`` times; block ``i`` is the ``i``-th block of every group, stacked in group order (the stock
  ``wq`` / ``wk`` / ``wv``, as torchtitan's checkpoint split produces them);
* a fused projection stored for ``x @ W`` stacks its matrices along the *columns*: HF's Llama 4 experts
  ``gate_up_proj`` ``[E, H, 2 I]`` (gate columns, then up columns) and GPT-OSS's (gate and up alternating,
  column by column: ``[..., ::2]`` and ``[..., 1::2]``). :class:`Columns` declares any of the splits above
  along dim -1 instead: ``Columns(2)``, ``Columns(Interleaved(2, I))``. Columns are the rows of the
  transpose, so nothing else changes: each block is an ``m x n_b`` matrix in the parameter's own orientation
  (``torch.optim.Muon`` on that 2-D slice is the oracle), batched by runs of equal blocks exactly as row
  blocks are, and its lr reads its own ``(m, n_b)``.

Everything that depends on the matrices' shapes reads them from here: Newton–Schulz batches (same-shape
blocks go through one batched call, gathered through :meth:`Blocks.view`), the learning-rate rule
(``adjust_lr_fn`` on each block's own ``m, n``, not on the parameter's first two dims: :meth:`Blocks.spans`),
the owner plan's cost model (:meth:`Blocks.matrices`), the tensor-parallel update (blocks of the *full*
matrix), and diagnostics. Momentum, weight decay and the step are elementwise, so they run on the parameter
as it is.

Shape arithmetic, plus one strided view (:meth:`Blocks.view`); no ``torch.distributed``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Blocks", "Columns", "Interleaved", "Run", "RowBlocks"]


@dataclass(frozen=True, slots=True)
class Interleaved:
    """Row blocks that repeat ``groups`` times along the rows: ``rows`` (a count or row sizes, as for a
    contiguous split) tiles one group of ``shape[-2] // groups`` rows, and block ``i`` is the ``i``-th block
    of every group, stacked in group order: a ``groups * rows[i]`` x ``n`` matrix. Inside :class:`Columns`,
    the same along the columns.

    Example::

        Interleaved((2 * 128, 128, 128), 8)  # torchtitan's fused QKV, 8 KV groups of [2 q heads, k, v]
        Columns(Interleaved(2, 96))          # GPT-OSS gate_up_proj [E, H, 192]: gate [..., ::2], up [..., 1::2]
    """

    rows: int | Sequence[int]
    groups: int

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int):
            object.__setattr__(self, "rows", tuple(self.rows))


@dataclass(frozen=True, slots=True)
class Columns:
    """Blocks along the columns (dim -1) instead of the rows: ``blocks`` is any row split (a count, the
    sizes in order, or :class:`Interleaved`), read along dim -1. Each block is then an ``m x n_b`` matrix
    of the parameter as stored ([Note: matrix blocks]).

    Example::

        Columns(2)                           # Llama 4 gate_up_proj [E, H, 2I]: gate columns, then up columns
        Columns(Interleaved(2, 96))          # GPT-OSS gate_up_proj [E, H, 2 * 96]: gate and up alternate
    """

    blocks: int | Sequence[int] | Interleaved

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, (int, Interleaved, Columns)) and not hasattr(self.blocks, "__index__"):
            object.__setattr__(self, "blocks", tuple(self.blocks))


#: What ``dedicate_params(blocks=...)`` may answer for one parameter: ``None`` (the default: one matrix per
#: trailing two dims), ``k`` (``k`` equal row blocks), the row sizes of the blocks, in order,
#: :class:`Interleaved` blocks, or any of these along the columns, :class:`Columns`.
RowBlocks = int | Sequence[int] | Interleaved | Columns | None


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive blocks of ``size`` rows (columns, for :class:`Columns` blocks) each, starting at
    ``start`` along the split dim."""

    start: int
    size: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.size * self.count


@dataclass(frozen=True, slots=True)
class Blocks:
    """The matrices of a parameter of ``shape``: its leading dims are a batch, and its last two dims are
    split along the rows (along the columns with ``columns``) into blocks of ``rows`` sizes (one block,
    ``(shape[-2],)``, unless declared). With ``groups > 1`` the split dim is ``groups`` repeats of that split
    ([Note: matrix blocks]), and each block gathers its part of every repeat.

    Example::

        Blocks.of((8, 512, 128))                # 8 experts, each one 512 x 128 matrix
        Blocks.of((3072, 1024), (2048, 512, 512))  # fused q, k, v: three matrices
        Blocks.of((8, 1024, 128), 2)            # fused gate/up experts: 16 matrices of 512 x 128
        Blocks.of((3072, 1024), Interleaved((256, 64, 64), 8))  # q, k, v of 8 interleaved KV groups
        Blocks.of((8, 128, 1024), Columns(2))   # gate/up as columns: 16 matrices of 128 x 512
    """

    shape: tuple[int, ...]
    #: the block sizes of one group along the split dim (of the whole dim when ``groups == 1``)
    rows: tuple[int, ...]
    #: how many times ``rows`` repeats along the split dim; 1: contiguous blocks
    groups: int = 1
    #: the blocks split dim -1 (:class:`Columns`); ``False``: dim -2
    columns: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _dims(self.shape))
        object.__setattr__(self, "rows", tuple(operator.index(r) for r in self.rows))
        object.__setattr__(self, "groups", operator.index(self.groups))
        object.__setattr__(self, "columns", bool(self.columns))

    @classmethod
    def of(cls, shape: Sequence[int], rows: RowBlocks = None, *, what: str = "dmuon") -> Blocks:
        """The blocks of ``shape`` with the split ``rows`` (see :data:`RowBlocks`); ``ValueError`` naming
        ``what`` when the split does not tile its dim or the shape has fewer than 2 dims. A split into one
        block is the whole matrix, whichever dim it names."""
        dims = _dims(shape, what)
        columns = isinstance(rows, Columns)
        spec = rows.blocks if isinstance(rows, Columns) else rows
        if isinstance(spec, Columns):
            raise ValueError(f"{what}: {rows!r} nests Columns in Columns; give Columns one count, sizes or "
                             "Interleaved split of the columns")
        sizes, groups = _split(dims[-1] if columns else dims[-2], spec, dims, "column" if columns else "row", what)
        if len(sizes) == 1:  # one block (per group: every row in order) is the whole matrix
            return cls(dims, (dims[-2],))
        return cls(dims, sizes, groups, columns)

    # ------------------------------------------------------------------ #
    # Shape arithmetic                                                     #
    # ------------------------------------------------------------------ #
    @property
    def batch(self) -> int:
        """The number of matrices along the leading dims (1 for a 2-D parameter)."""
        return math.prod(self.shape[:-2])

    @property
    def cols(self) -> int:
        """The parameter's columns, ``shape[-1]``."""
        return self.shape[-1]

    @property
    def dim(self) -> int:
        """The dim the blocks split: -2 (rows) or -1 (:class:`Columns`)."""
        return -1 if self.columns else -2

    @property
    def count(self) -> int:
        """How many matrices Muon orthogonalises for this parameter."""
        return self.batch * len(self.rows)

    @property
    def period(self) -> int:
        """The extent of one group along the split dim: ``sum(rows)`` (all of it for contiguous blocks)."""
        return self.shape[self.dim] // self.groups

    @property
    def spec(self) -> RowBlocks:
        """What :meth:`of` takes to rebuild these blocks for another leading shape (an expert shard)."""
        split: RowBlocks = self.rows if self.groups == 1 else Interleaved(self.rows, self.groups)
        return Columns(split) if self.columns else split  # type: ignore[arg-type]

    @property
    def is_single(self) -> bool:
        """One 2-D matrix: the parameter itself (the path ``torch.optim.Muon`` takes)."""
        return len(self.shape) == 2 and len(self.rows) == 1

    @property
    def runs(self) -> tuple[Run, ...]:
        """Consecutive equal blocks merged: each run's matrices are ``batch * count`` of
        :meth:`run_shape` (one batched Newton–Schulz call). With ``groups > 1`` the runs are those of one
        group (relative to the group's start), and each matrix gathers ``groups * size`` rows (columns)."""
        out: list[Run] = []
        start = 0
        for r in self.rows:
            if out and out[-1].size == r:
                out[-1] = Run(out[-1].start, r, out[-1].count + 1)
            else:
                out.append(Run(start, r, 1))
            start += r
        return tuple(out)

    def run_shape(self, run: Run) -> tuple[int, int]:
        """``(m, n)`` of each matrix of ``run``, in the parameter's orientation."""
        size = self.groups * run.size
        return (self.shape[-2], size) if self.columns else (size, self.shape[-1])

    def matrices(self) -> list[tuple[tuple[int, int], int]]:
        """``((m, n), how many)`` per distinct block shape, in order of first appearance."""
        counts: dict[tuple[int, int], int] = {}
        for run in self.runs:
            key = self.run_shape(run)
            counts[key] = counts.get(key, 0) + run.count * self.batch
        return list(counts.items())

    def spans(self, start: int, stop: int) -> list[tuple[int, int, tuple[int, int]]]:
        """The runs that meet ``[start, stop)`` of the split dim, as ``(local_start, local_stop, (m, n))``
        relative to ``start``, ``(m, n)`` the shape of the run's matrices, neighbours of the same shape
        merged: where a parameter (or a tensor-parallel shard of it) steps with each block's own lr."""
        out: list[tuple[int, int, tuple[int, int]]] = []
        period = self.period
        for g in range(start // period, -(-stop // period)):
            for run in self.runs:
                lo, hi = max(g * period + run.start, start), min(g * period + run.stop, stop)
                if lo >= hi:
                    continue
                shape = self.run_shape(run)
                if out and out[-1][1] == lo - start and out[-1][2] == shape:
                    out[-1] = (out[-1][0], hi - start, shape)
                else:
                    out.append((lo - start, hi - start, shape))
        return out

    def view(self, t: Tensor, run: Run) -> Tensor:
        """The matrices of ``run`` in ``t`` (``blocks.shape``, or a stack ``(N, *blocks.shape)``), as a strided
        view whose ``reshape(-1, *run_shape(run))`` is them in batch order (leading dims, then the run's
        blocks): ``(..., count, groups, size, n)`` for row blocks, ``(..., count, m, groups, size)`` for
        :class:`Columns`. Writing through it writes the blocks back."""
        if self.columns:  # (..., m, groups, count * size) -> (..., count, m, groups, size)
            v = t.unflatten(-1, (self.groups, self.period))[..., run.start:run.stop]
            return v.unflatten(-1, (run.count, run.size)).movedim(-2, -4)
        # (..., groups, count * size, n) -> (..., count, groups, size, n)
        v = t.unflatten(-2, (self.groups, self.period))[..., run.start:run.stop, :]
        return v.unflatten(-2, (run.count, run.size)).transpose(-4, -3)

    def describe(self) -> str:
        """``8 x (512 x 128)`` / ``(2048 x 1024) + 2 x (512 x 1024)``: for messages and diagnostics."""
        return " + ".join(f"{k} x ({m} x {n})" if k > 1 else f"({m} x {n})" for (m, n), k in self.matrices())


def _split(n: int, spec: object, dims: tuple[int, ...], kind: str, what: str) -> tuple[tuple[int, ...], int]:
    """The block sizes of one group and the group count of ``spec`` over ``n`` rows (``kind``: "row" or
    "column", for the messages)."""
    if isinstance(spec, Interleaved):
        groups = spec.groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or n % groups:
            raise ValueError(f"{what}: {groups!r} interleaved groups do not tile the {n} {kind}s of shape {dims}; "
                             f"pass a group count that divides {n}")
        sizes, _ = _split(n // groups, spec.rows, dims, kind, f"{what} (one of {groups} groups)")
        return sizes, groups
    if spec is None:
        return (n,), 1
    if isinstance(spec, bool):
        raise ValueError(f"{what}: {kind} blocks must be an int count or a sequence of {kind} sizes, got {spec!r}")
    if isinstance(spec, int) or hasattr(spec, "__index__"):
        k = operator.index(spec)  # type: ignore[arg-type]
        if k < 1 or n % k:
            raise ValueError(f"{what}: {k} {kind} blocks do not tile the {n} {kind}s of shape {dims}; pass a count "
                             f"that divides {n}, or the {kind} sizes of each block")
        return (n // k,) * k, 1
    try:
        sizes = tuple(operator.index(r) for r in spec)  # type: ignore[attr-defined]
    except TypeError:
        raise ValueError(f"{what}: {kind} blocks must be an int count or a sequence of int {kind} sizes, "
                         f"got {spec!r}") from None
    if not sizes or any(r < 1 for r in sizes) or sum(sizes) != n:
        raise ValueError(f"{what}: {kind} blocks {list(sizes)} do not tile the {n} {kind}s of shape {dims} "
                         f"(they sum to {sum(sizes)}); give positive sizes that add up to {n}")
    return sizes, 1


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
