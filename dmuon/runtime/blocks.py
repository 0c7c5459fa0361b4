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
  declares such *row blocks*; each is orthogonalised alone.

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

__all__ = ["Blocks", "Run", "RowBlocks"]

#: What ``dedicate_params(blocks=...)`` may answer for one parameter: ``None`` (the default: one matrix per
#: trailing two dims), ``k`` (``k`` equal row blocks) or the row sizes of the blocks, in order.
RowBlocks = int | Sequence[int] | None


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
    split along the rows into blocks of ``rows`` sizes (one block, ``(shape[-2],)``, unless declared).

    Example::

        Blocks.of((8, 512, 128))                # 8 experts, each one 512 x 128 matrix
        Blocks.of((3072, 1024), (2048, 512, 512))  # fused q, k, v: three matrices
        Blocks.of((8, 1024, 128), 2)            # fused gate/up experts: 16 matrices of 512 x 128
    """

    shape: tuple[int, ...]
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _dims(self.shape))
        object.__setattr__(self, "rows", tuple(operator.index(r) for r in self.rows))

    @classmethod
    def of(cls, shape: Sequence[int], rows: RowBlocks = None, *, what: str = "dmuon") -> Blocks:
        """The blocks of ``shape`` with the row split ``rows`` (see :data:`RowBlocks`); ``ValueError``
        naming ``what`` when the split does not tile the rows or the shape has fewer than 2 dims."""
        dims = _dims(shape, what)
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
    def is_single(self) -> bool:
        """One 2-D matrix: the parameter itself (the path ``torch.optim.Muon`` takes)."""
        return len(self.shape) == 2 and len(self.rows) == 1

    @property
    def runs(self) -> tuple[Run, ...]:
        """Consecutive equal row blocks merged: each run is one strided view ``[..., start:stop, :]`` that
        reshapes to ``(batch * count, size, cols)`` matrices."""
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
            key = (run.size, self.cols)
            counts[key] = counts.get(key, 0) + run.count * self.batch
        return list(counts.items())

    def rows_in(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The runs that meet rows ``[start, stop)``, as ``(local_start, local_stop, block_rows)`` relative
        to ``start``: where a tensor-parallel shard of the rows is updated with each block's own lr."""
        out = []
        for run in self.runs:
            lo, hi = max(run.start, start), min(run.stop, stop)
            if lo < hi:
                out.append((lo - start, hi - start, run.size))
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
