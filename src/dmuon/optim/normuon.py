"""NorMuon (Li, Liu, Liang, Chen and Zhao, 2025, arXiv 2510.05491): Muon whose orthogonalised update is
normalised per neuron (per row) by a running second moment, then rescaled to a target RMS.

For one matrix ``W`` (``m x n``) with gradient ``G``, the paper's Algorithm 1 (momentum as Muon's, so Nesterov
when the group says so; the paper's own is plain momentum, ``nesterov=False``)::

    B <- lerp(B, G, 1 - mu);  U <- lerp(G, B, mu) if nesterov else B   (Muon's momentum)
    O <- NS(U)                                                          (Muon's Newton-Schulz)
    v <- lerp(v, mean_cols(O * O), 1 - beta2)                           (v: one value per row, state)
    O^ <- O / (sqrt(v) + eps)                                           (each row by its own)
    W <- W - lr wd W - lr * (rms_target sqrt(m n) / ||O^||_F) * O^      (update RMS = rms_target * lr)

Defaults as the paper's: ``beta2 = 0.95``, ``eps = 1e-8``, ``rms_target = 0.2`` (an update of AdamW's RMS, so
AdamW-like learning rates carry over). ``rms_target=None`` instead rescales ``O^`` to ``||O||_F`` and applies
Muon's ``adjust_lr_fn`` (the norm-preserving form of the authors' code, dion and NVIDIA's Emerging-Optimizers).

How it is computed here: everything after Newton-Schulz is a per-row multiplier. With ``s_i = sum_j O_ij^2``
(the row's sum of squares, in float32 or wider), ``d_i = sqrt(v_i) + eps`` and, per matrix block ``b``
([Note: matrix blocks] in ``dmuon/runtime/blocks.py``: each expert, each row block, its own matrix),
``||O^_b||_F^2 = sum_{i in b} s_i / d_i^2``, the step is ``W_ij -= lr * c_i * O_ij`` with ``c_i = k_b / d_i``,
``k_b = rms_target sqrt(m_b n) / ||O^_b||_F``. So the row statistic ``s`` is all NorMuon needs of the whole
matrix, which is what makes it cheap where the matrix is split:

* an owner holds its matrices whole: no communication at all;
* on the engine's dim-0 shards (``Route.MUON_SHARDED``) every rank holds whole experts, and ``v`` is a DTensor
  ``[E, m, 1]`` laid out like the experts;
* under tensor parallelism ([Note: TP update] in ``tp_update.py``) the root of each matrix computes ``s``
  from the full Newton-Schulz result and sends its ``m`` values back with every shard, in the same
  all-to-all (:func:`dmuon.optim.tp_update.orthogonalise_tp`); every tp rank of the owner slot keeps the whole
  ``v`` (``m`` values, the same on each: the same ``s``, the same arithmetic) and computes every ``c_i``
  itself, so a column-split shard (``RowwiseParallel``) gets whole-row statistics and a row-split one the
  block norms over every row. No extra collective.

A zero update (a matrix that never had a gradient) stays zero (``k_b = 0`` where ``||O^_b|| = 0``).
Pure tensor math, no ``torch.distributed``. The single-process oracle written from the paper's formulas is
``normuon_reference.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..runtime.blocks import Blocks, Run
from .tp_update import Exchange, check_shards, orthogonalise_tp
from .update import (
    NS_CHUNK_ELEMENTS,
    MuonHParams,
    _blocks_of,
    _stacked_updates,
    adjusted_lr,
    decay_,
    orthogonalise,
)

__all__ = ["NorMuonHParams", "stat_dtype", "row_sums", "row_scales_", "normuon_update_batch_",
           "normuon_update_tp_"]


@dataclass(frozen=True, slots=True)
class NorMuonHParams(MuonHParams):
    """NorMuon's hyperparameters: Muon's, plus the second moment's. Example::

        hp = NorMuonHParams(lr=0.01, weight_decay=0.1, beta2=0.95, rms_target=0.2)
    """

    #: decay of the per-row second moment
    beta2: float = 0.95
    #: added to ``sqrt(v)`` before dividing (the paper's epsilon; Muon's ``eps`` is Newton-Schulz's norm floor)
    normuon_eps: float = 1e-8
    #: the update's RMS per unit of lr (the paper's 0.2); ``None``: keep ``||O||_F`` and apply ``adjust_lr_fn``
    rms_target: float | None = 0.2
    ALGORITHM: ClassVar[str] = "normuon"

    def __post_init__(self) -> None:
        MuonHParams.__post_init__(self)  # (zero-argument super() does not work in a slots dataclass)
        b = self.beta2
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"dmuon.Muon: beta2 must be a number in [0, 1), got {b!r}")
        e = self.normuon_eps
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not 0.0 < e < math.inf:
            raise ValueError(f"dmuon.Muon: normuon_eps must be a finite number > 0, got {e!r}")
        r = self.rms_target
        if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 < r < math.inf):
            raise ValueError(f"dmuon.Muon: rms_target must be a finite number > 0 or None, got {r!r}")


def stat_dtype(update_dtype: torch.dtype) -> torch.dtype:
    """The dtype of NorMuon's row statistics and second moment: the update's, at least float32."""
    return torch.promote_types(update_dtype, torch.float32)


def row_sums(ortho: Tensor, dtype: torch.dtype) -> Tensor:
    """``s_i = sum_j O_ij^2`` of every row of ``ortho`` (``[..., m, n]``), as ``[..., m, 1]`` in ``dtype``."""
    return ortho.to(dtype).square().sum(dim=-1, keepdim=True)


def row_scales_(sums: Tensor, second_moment: Tensor, hp: NorMuonHParams, blocks: Blocks) -> Tensor:
    """NorMuon's per-row multipliers ``c`` (``[..., m, 1]``, the dtype of ``sums``) of a parameter whose
    Newton-Schulz result has row sums of squares ``sums``, advancing its ``second_moment`` (same shape) in
    place. ``blocks`` describe the parameter (``sums`` holds every row of it; the leading dims are its batch):
    row blocks, contiguous or interleaved; not :class:`~dmuon.runtime.blocks.Columns` (a row of the parameter
    crosses every column block, and each needs its own statistic of it)."""
    if blocks.columns:
        raise ValueError(f"dmuon.optim: NorMuon keeps one second moment per row of the parameter, and the column "
                         f"blocks of {blocks.shape} ({blocks.describe()}) would each need their own; train it with "
                         "algorithm='muon', or declare its blocks along the rows")
    n = blocks.cols
    second_moment.lerp_(sums / n, 1 - hp.beta2)
    denom = second_moment.sqrt() + hp.normuon_eps
    normalised = sums / denom.square()  # ||row of O^||^2
    scales = torch.empty_like(denom)
    for run in blocks.runs:
        shape = blocks.run_shape(run)
        norm_hat = _per_block(normalised, blocks, run).sqrt()
        if hp.rms_target is not None:
            target = hp.rms_target * math.sqrt(shape[0] * shape[1])
        else:  # ||O_b||_F, and the block's Muon lr factor
            target = adjusted_lr(1.0, hp.adjust_lr_fn, shape) * _per_block(sums, blocks, run).sqrt()
        k = torch.where(norm_hat > 0, target / norm_hat, 0.0)
        # every row of every block of the run (interleaved ones gather theirs from each group): k_b / d_i
        blocks.view(scales, run).copy_(k[..., None, None] / blocks.view(denom, run))
    return scales


def _per_block(t: Tensor, blocks: Blocks, run: Run) -> Tensor:
    """``[..., count, 1]``: the sum of ``t`` (``[..., m, 1]``) over the rows of each block of ``run``."""
    v = blocks.view(t, run)  # (..., count, groups, size, 1)
    return v.reshape(*v.shape[:-3], -1).sum(dim=-1, keepdim=True)


def _step_(param: Tensor, ortho: Tensor, scales: Tensor, hp: NorMuonHParams) -> None:
    """Decay (:func:`dmuon.optim.update.decay_`, cautious where asked: ``c_i > 0`` keeps ``O``'s signs), then
    ``W -= lr * c * O``."""
    decay_(param, ortho, hp)
    param.add_(ortho * scales, alpha=-hp.lr)


def normuon_update_batch_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                          second_moments: Sequence[Tensor], hp: NorMuonHParams, blocks: Blocks | None = None) -> None:
    """One NorMuon step, in place, on parameters of the same shape and ``blocks`` (one batched Newton-Schulz call
    per run of row blocks; a lone parameter takes the unbatched call, as Muon's). ``second_moments``: each
    parameter's ``[..., m, 1]`` in :func:`stat_dtype` of the update.

    Example::

        w, buf, v = torch.randn(64, 32), torch.zeros(64, 32), torch.zeros(64, 1)
        normuon_update_batch_([w], [torch.randn(64, 32)], [buf], [v], NorMuonHParams(lr=0.01))
    """
    per = max(1, NS_CHUNK_ELEMENTS // max(1, params[0].numel()))
    if len(params) > per:  # bounded memory, as muon_update_batch_ ([Note: NS memory] in update.py)
        for i in range(0, len(params), per):
            normuon_update_batch_(params[i:i + per], grads[i:i + per], momentum_buffers[i:i + per],
                                  second_moments[i:i + per], hp, blocks)
        return
    blocks = _blocks_of(params[0], blocks)
    if len(params) == 1:
        buf, g = momentum_buffers[0], grads[0]
        buf.lerp_(g, 1 - hp.momentum)
        orthos = [orthogonalise(g.lerp(buf, hp.momentum) if hp.nesterov else buf, hp, blocks)]
    else:
        orthos = list(orthogonalise(_stacked_updates(grads, momentum_buffers, hp), hp, blocks).unbind(0))
    for p, o, v in zip(params, orthos, second_moments):
        _step_(p, o, row_scales_(row_sums(o, v.dtype), v, hp, blocks), hp)


def normuon_update_tp_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                       second_moments: Sequence[Tensor], hp: NorMuonHParams, *, full_shape: Sequence[int], tp_dim: int,
                       tp_rank: int, tp_size: int, exchange: Exchange, blocks: Blocks | None = None) -> None:
    """:func:`normuon_update_batch_` for tensor-parallel shards (see this module's docstring): each tp rank
    passes its shards and momenta of the same matrices, in the same order, and each matrix's whole second
    moment ``[m, 1]`` (the same on every tp rank of the slot). Two all-to-alls, as Muon's.

    Example::

        normuon_update_tp_([w_shard], [g_shard], [buf_shard], [v], NorMuonHParams(), full_shape=(4096, 1024),
                           tp_dim=1, tp_rank=tp_rank, tp_size=2, exchange=exchange)
    """
    full_shape, blocks = check_shards(params, full_shape, tp_dim, tp_size, blocks, "normuon_update_tp_")
    updates = _stacked_updates(grads, momentum_buffers, hp)
    dtype = second_moments[0].dtype
    orthos, sums = orthogonalise_tp(updates, hp, full_shape=full_shape, tp_dim=tp_dim, tp_rank=tp_rank,
                                    tp_size=tp_size, exchange=exchange, blocks=blocks,
                                    payload=lambda o: row_sums(o, dtype).flatten(1), payload_shape=(full_shape[0], dtype))
    rows = params[0].shape[0]
    row_start = tp_rank * rows if tp_dim == 0 else 0  # the shard's first row of the full matrix
    for p, o, s, v in zip(params, orthos, sums or [], second_moments):
        scales = row_scales_(s.view(full_shape[0], 1), v, hp, blocks)
        _step_(p, o, scales[row_start:row_start + rows], hp)
