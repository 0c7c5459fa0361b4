"""The Muon update of one matrix (or a batch of same-shape matrices), and the hyperparameter records.

Pure tensor math, no distributed code: the owner of a matrix calls it on the full matrix. With the
``"direct"`` Newton–Schulz backend the arithmetic is ``torch.optim.Muon``'s, operation for operation.

:class:`MuonHParams` and :class:`AdamWHParams` are the one list of hyperparameters: ``dmuon.Muon``
validates its arguments by building them, ``Muon.step`` reads each param group through
:meth:`MuonHParams.from_group`, and the torchtitan container and the tests take their names from here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..runtime.blocks import Blocks
from .newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_STEPS,
    KELLER_JORDAN_COEFFICIENTS,
    Coefficients,
    newton_schulz_native,
    parse_coefficients,
    resolve_backend,
)

__all__ = ["AdjustLR", "adjusted_lr", "MuonHParams", "AdamWHParams", "muon_update_", "muon_update_batch_",
           "orthogonalise", "decay_", "NS_CHUNK_ELEMENTS"]

#: [Note: NS memory] The most matrix elements one batched Newton–Schulz call takes. A shape group can be far
#: larger (every expert of a rank, thousands of 768 x 2048 matrices; every layer's MLP matrix at world size 1),
#: and a call's float16 copy of its input and its products scale with the batch, so larger groups run in
#: chunks of at most this many elements (at least one matrix), and :func:`muon_update_batch_` stacks at
#: most this many elements of updates at a time. The extra memory of a step is then bounded by a few times
#: this (times 2 bytes) whatever the model, and per matrix the arithmetic is unchanged. 2**28, measured on an
#: H200 (2026-12-02, ``scripts/gpu_moe_ns.py --sweep``): a Qwen3-30B-A3B layer's experts (3 x 128 of 768 x
#: 2048) took 23.4 ms in chunks of 2**26, 21.2 in 2**28 (and 16.4 with quack's kernel at that batch), with
#: 1.1 against 2.3 GiB of workspace; a DeepSeek-V3 layer's share at EP=8 (3 x 32 of 2048 x 7168) 70.9 against
#: 61.7 ms, 2.6 against 4.6 GiB (gram-newton-schulz: 64.7 ms, 6.5 GiB). Larger chunks gained nothing more.
NS_CHUNK_ELEMENTS = 2**28


class AdjustLR(enum.Enum):
    """Shape-based learning-rate scaling, with ``torch.optim.Muon``'s meaning."""

    #: Keller Jordan's: ``lr * sqrt(max(1, rows / cols))``.
    ORIGINAL = "original"
    #: Moonshot's: ``lr * 0.2 * sqrt(max(rows, cols))`` so the update RMS matches AdamW's.
    MATCH_RMS_ADAMW = "match_rms_adamw"

    @classmethod
    def parse(cls, value: str | AdjustLR | None) -> AdjustLR:
        if value is None:
            return cls.ORIGINAL
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw'; got {value!r}"
            ) from None


def adjusted_lr(lr: float, adjust_lr_fn: AdjustLR, shape: Sequence[int]) -> float:
    """The learning rate Muon applies to one matrix of ``shape`` (rows, cols): a block's own, never a
    parameter's first two dims (see [Note: matrix blocks] in ``dmuon/runtime/blocks.py``)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is AdjustLR.ORIGINAL:
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _check_nonneg(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0 or math.isinf(value):
        raise ValueError(f"dmuon.Muon: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class MuonHParams:
    """Muon's hyperparameters for one param group, validated once (``torch.optim.Muon``'s meanings).

    Example::

        hp = MuonHParams(lr=0.02, weight_decay=0.01, ns_coefficients="polar_express")
        muon_update_(weight, grad, momentum_buffer, hp)
    """

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = DEFAULT_NS_STEPS
    #: One ``(a, b, c)``, a per-step sequence of them, or a schedule name; kept as given (a name stays a
    #: name, so state dicts show what the user chose).
    ns_coefficients: Coefficients = KELLER_JORDAN_COEFFICIENTS
    eps: float = DEFAULT_EPS
    weight_decay: float = 0.0
    adjust_lr_fn: AdjustLR = AdjustLR.ORIGINAL
    ns_backend: str = "auto"
    #: Decay only the coordinates whose update has the parameter's sign (:func:`decay_`).
    cautious_weight_decay: bool = False
    #: The ``algorithm`` of the param groups this record describes (``dmuon/optim/rules.py``).
    ALGORITHM: ClassVar[str] = "muon"

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "weight_decay"):
            _check_nonneg(name, getattr(self, name))
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"dmuon.Muon: momentum must be in [0, 1), got {self.momentum!r}")
        steps = self.ns_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 100:
            raise ValueError(f"dmuon.Muon: ns_steps must be an int in [0, 100), got {steps!r}")
        try:
            schedule = parse_coefficients(self.ns_coefficients)
            resolve_backend((1, 1), self.ns_backend)
        except ValueError as e:
            raise ValueError(f"dmuon.Muon: ns_{e}") from None
        if not isinstance(self.ns_coefficients, str):  # tuples of floats, one triple unwrapped
            object.__setattr__(self, "ns_coefficients", schedule[0] if len(schedule) == 1 else schedule)
        if not self.eps > 0:
            raise ValueError(f"dmuon.Muon: eps must be > 0, got {self.eps!r}")
        object.__setattr__(self, "adjust_lr_fn", AdjustLR.parse(self.adjust_lr_fn))  # type: ignore[arg-type]
        object.__setattr__(self, "nesterov", bool(self.nesterov))
        if not isinstance(self.cautious_weight_decay, bool):
            raise TypeError(f"dmuon.Muon: cautious_weight_decay must be True or False, got {self.cautious_weight_decay!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> MuonHParams:
        """The record of a Muon param group as it stands now (a scheduler may have changed ``lr``)."""
        return cls(**{name: group[name] for name in cls.names() if name in group})

    def group_entries(self) -> dict[str, Any]:
        """The param-group keys: plain values (``adjust_lr_fn`` by name), as ``torch.optim`` groups hold, and the
        ``algorithm``."""
        entries = {name: getattr(self, name) for name in self.names()}
        entries["adjust_lr_fn"] = self.adjust_lr_fn.value
        return {"algorithm": self.ALGORITHM, **entries}


@dataclass(frozen=True, slots=True)
class AdamWHParams:
    """The AdamW hyperparameters of the non-Muon groups (``torch.optim.AdamW``'s meanings)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        for name in ("lr", "eps", "weight_decay"):
            _check_nonneg(f"adamw_{name}", getattr(self, name))
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"dmuon.Muon: adamw_betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", betas)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def group_entries(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


# --------------------------------------------------------------------------------------------------- #
# The update                                                                                           #
# --------------------------------------------------------------------------------------------------- #
def muon_update_(param: Tensor, grad: Tensor, momentum_buffer: Tensor, hp: MuonHParams,
                 blocks: Blocks | None = None) -> None:
    """One Muon step on one parameter, in place: a matrix (the same arithmetic as ``torch.optim.Muon`` with
    the ``"direct"`` backend), or every matrix of ``blocks`` (experts, row blocks), each orthogonalised and
    scaled alone as ``torch.optim.Muon`` would a parameter of that block's shape.

    Example::

        muon_update_(w, w.grad, torch.zeros_like(w), MuonHParams(lr=0.02))
        muon_update_(experts, experts.grad, buf, MuonHParams(), Blocks.of(experts.shape))  # [E, m, n]
    """
    blocks = _blocks_of(param, blocks)
    momentum_buffer.lerp_(grad, 1 - hp.momentum)
    update = grad.lerp(momentum_buffer, hp.momentum) if hp.nesterov else momentum_buffer
    _apply_update_(param, orthogonalise(update, hp, blocks), hp, blocks)


def _blocks_of(param: Tensor, blocks: Blocks | None) -> Blocks:
    if blocks is None:
        return Blocks.of(param.shape, what="dmuon.optim")
    if tuple(param.shape) != blocks.shape:
        raise ValueError(f"dmuon.optim: a parameter of shape {tuple(param.shape)} updated with blocks of {blocks.shape}")
    return blocks


def _orthogonalise(update: Tensor, hp: MuonHParams) -> Tensor:
    """Newton-Schulz of one matrix or a stacked group, in chunks of at most :data:`NS_CHUNK_ELEMENTS` ([Note: NS
    memory]); on CUDA replayed from a graph per shape group ([Note: NS graphs] in ``dmuon/optim/_graphs.py``):
    the same kernels, bit for bit."""
    if update.ndim == 3 and update.numel() > NS_CHUNK_ELEMENTS and update.shape[0] > 1:
        per = max(1, NS_CHUNK_ELEMENTS // (update.shape[1] * update.shape[2]))
        out: Tensor | None = None
        for i in range(0, update.shape[0], per):
            part = _orthogonalise(update[i:i + per], hp)
            if out is None:
                out = torch.empty(update.shape, dtype=part.dtype, device=update.device)
            out[i:i + per].copy_(part)  # a graph's output is reused by its next replay
        return out  # type: ignore[return-value]

    def ns(X: Tensor) -> Tensor:
        return newton_schulz_native(X, hp.ns_steps, hp.ns_coefficients, hp.eps, backend=hp.ns_backend)

    if not update.is_cuda:
        return ns(update)
    from . import _graphs

    if not _graphs.enabled(update):
        return ns(update)
    return _graphs.run(ns, update, (hp.ns_steps, repr(hp.ns_coefficients), hp.eps, hp.ns_backend))


def orthogonalise(update: Tensor, hp: MuonHParams, blocks: Blocks) -> Tensor:
    """Newton-Schulz of every matrix of ``update``, whose shape is ``blocks.shape`` or ``(N, *blocks.shape)``
    (``N`` parameters of the same layout, stacked): each run of equal blocks (rows, interleaved rows or
    columns: :meth:`Blocks.view`) goes through one batched call on its matrices in the parameter's own
    orientation, and the result comes back in the update's shape, in Newton-Schulz's native dtype. A lone
    2-D matrix takes the 2-D call, as ``torch.optim.Muon`` does."""
    lead = update.ndim - len(blocks.shape)
    if lead not in (0, 1) or tuple(update.shape[lead:]) != blocks.shape:
        raise ValueError(f"dmuon.optim: update of shape {tuple(update.shape)} does not hold blocks of {blocks.shape}")
    if len(blocks.rows) == 1:  # the matrices are the trailing two dims: a view
        if update.ndim == 2:
            return _orthogonalise(update, hp)
        return _orthogonalise(update.reshape(-1, *update.shape[-2:]), hp).view(update.shape)
    out: Tensor | None = None
    for run in blocks.runs:
        region = blocks.view(update, run)
        result = _orthogonalise(region.reshape(-1, *blocks.run_shape(run)), hp)
        if out is None:  # every run has the same native dtype: it depends on the device and backend only
            out = torch.empty(update.shape, dtype=result.dtype, device=update.device)
        blocks.view(out, run).copy_(result.view(region.shape))
    return out  # type: ignore[return-value]


def decay_(param: Tensor, update: Tensor, hp: MuonHParams) -> None:
    """Decoupled weight decay, ``W <- (1 - lr wd) W``, as ``torch.optim.Muon``; a factor of exactly 1 is skipped
    (``x * 1.0 == x`` bit for bit), which saves a pass over the weights when decay is off. With
    ``hp.cautious_weight_decay`` only where ``update * W >= 0``: the coordinates the step (``W -= c * update``,
    ``c > 0``) moves towards zero anyway (Cautious Weight Decay, Chen et al. 2025, arXiv 2510.12402; ties decay,
    as there). Those coordinates round exactly as the plain decay's. ``update`` is the orthogonalised update (or
    any positive multiple of it per coordinate row), of ``param``'s shape.

    Example::

        decay_(w, ortho, MuonHParams(lr=0.02, weight_decay=0.1, cautious_weight_decay=True))
    """
    factor = 1 - hp.lr * hp.weight_decay
    if factor == 1:
        return
    if not hp.cautious_weight_decay:
        param.mul_(factor)
        return
    # where(mask, W * f, W): the scalar multiply rounds as mul_(f) does (a tensor of factors would round f
    # to the param's dtype first)
    param.copy_(torch.where((update * param) >= 0, param * factor, param))


def _apply_update_(param: Tensor, ortho: Tensor, hp: MuonHParams, blocks: Blocks, start: int = 0) -> None:
    """Decoupled decay (:func:`decay_`) then the scaled step, as ``torch.optim.Muon``. Each run of blocks
    steps with its own block's lr. ``blocks`` describe the whole parameter; ``param`` may be a
    tensor-parallel shard of it whose extent along the blocks' dim (``blocks.dim``) starts at ``start`` of
    the whole (the lr scales with the block, not the shard)."""
    decay_(param, ortho, hp)
    # ``ortho`` may be float16 (Gram form): the add computes in float32 and rounds once into the param
    dim = blocks.dim
    spans = blocks.spans(start, start + param.shape[dim])
    if len(spans) == 1:
        param.add_(ortho, alpha=-adjusted_lr(hp.lr, hp.adjust_lr_fn, spans[0][2]))
        return
    for lo, hi, shape in spans:
        lr = adjusted_lr(hp.lr, hp.adjust_lr_fn, shape)
        param.narrow(dim, lo, hi - lo).add_(ortho.narrow(dim, lo, hi - lo), alpha=-lr)


def _stacked_updates(grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor], hp: MuonHParams) -> Tensor:
    """Advance each momentum and write the (Nesterov) updates straight into one stacked buffer (no
    separate stack copy): the input of one batched Newton-Schulz call."""
    updates = torch.empty((len(grads), *grads[0].shape), dtype=grads[0].dtype, device=grads[0].device)
    for g, buf, u in zip(grads, momentum_buffers, updates.unbind(0)):
        buf.lerp_(g, 1 - hp.momentum)
        if hp.nesterov:
            torch.lerp(g, buf, hp.momentum, out=u)
        else:
            u.copy_(buf)
    return updates


def muon_update_batch_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
                       hp: MuonHParams, blocks: Blocks | None = None) -> None:
    """:func:`muon_update_` for parameters of the same shape and ``blocks``, with one batched Newton-Schulz
    call per run of row blocks: fewer, larger matrix products. Per matrix the arithmetic is unchanged
    (bit-identical to the one-by-one form on CPU; see ``tests/test_optim.py``).

    Example::

        muon_update_batch_([w1, w2], [g1, g2], [b1, b2], MuonHParams())
    """
    if len(params) == 1:
        muon_update_(params[0], grads[0], momentum_buffers[0], hp, blocks)
        return
    per = max(1, NS_CHUNK_ELEMENTS // max(1, params[0].numel()))
    if len(params) > per:  # bounded memory: at most a chunk of stacked updates at a time ([Note: NS memory])
        for i in range(0, len(params), per):
            muon_update_batch_(params[i:i + per], grads[i:i + per], momentum_buffers[i:i + per], hp, blocks)
        return
    blocks = _blocks_of(params[0], blocks)
    orthos = orthogonalise(_stacked_updates(grads, momentum_buffers, hp), hp, blocks)
    for p, o in zip(params, orthos.unbind(0)):
        _apply_update_(p, o, hp, blocks)
