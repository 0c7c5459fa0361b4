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
from typing import Any

import torch
from torch import Tensor

from .newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_STEPS,
    KELLER_JORDAN_COEFFICIENTS,
    Coefficients,
    newton_schulz_native,
    parse_coefficients,
    resolve_backend,
)

__all__ = ["AdjustLR", "adjusted_lr", "MuonHParams", "AdamWHParams", "muon_update_", "muon_update_batch_"]


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
    """The learning rate Muon applies to a matrix of ``shape`` (rows, cols)."""
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

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> MuonHParams:
        """The record of a Muon param group as it stands now (a scheduler may have changed ``lr``)."""
        return cls(**{name: group[name] for name in cls.names() if name in group})

    def group_entries(self) -> dict[str, Any]:
        """The param-group keys: plain values (``adjust_lr_fn`` by name), as ``torch.optim`` groups hold."""
        entries = {name: getattr(self, name) for name in self.names()}
        entries["adjust_lr_fn"] = self.adjust_lr_fn.value
        return entries


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
def muon_update_(param: Tensor, grad: Tensor, momentum_buffer: Tensor, hp: MuonHParams) -> None:
    """One Muon step on one full matrix, in place (same arithmetic as ``torch.optim.Muon`` with the
    ``"direct"`` backend).

    Example::

        muon_update_(w, w.grad, torch.zeros_like(w), MuonHParams(lr=0.02))
    """
    momentum_buffer.lerp_(grad, 1 - hp.momentum)
    update = grad.lerp(momentum_buffer, hp.momentum) if hp.nesterov else momentum_buffer
    _apply_update_(param, _orthogonalise(update, hp), hp)


def _orthogonalise(update: Tensor, hp: MuonHParams) -> Tensor:
    """Newton-Schulz of one matrix or a stacked group; on CUDA replayed from a graph per shape group
    ([Note: NS graphs] in ``dmuon/optim/_graphs.py``): the same kernels, bit for bit."""
    def ns(X: Tensor) -> Tensor:
        return newton_schulz_native(X, hp.ns_steps, hp.ns_coefficients, hp.eps, backend=hp.ns_backend)

    if not update.is_cuda:
        return ns(update)
    from . import _graphs

    if not _graphs.enabled(update):
        return ns(update)
    return _graphs.run(ns, update, (hp.ns_steps, repr(hp.ns_coefficients), hp.eps, hp.ns_backend))


def _apply_update_(param: Tensor, ortho: Tensor, hp: MuonHParams, shape: Sequence[int] | None = None) -> None:
    """Decoupled decay then the scaled step, as ``torch.optim.Muon``. A decay factor of exactly 1 is
    skipped (``x * 1.0 == x`` bit for bit), which saves a pass over the weights when it is off. ``shape``:
    the full matrix's, where ``param`` is a tensor-parallel shard of it (the lr scales with the matrix)."""
    if hp.lr * hp.weight_decay != 0.0:
        param.mul_(1 - hp.lr * hp.weight_decay)
    # ``ortho`` may be float16 (Gram form): the add computes in float32 and rounds once into the param
    param.add_(ortho, alpha=-adjusted_lr(hp.lr, hp.adjust_lr_fn, param.shape if shape is None else shape))


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
                       hp: MuonHParams) -> None:
    """:func:`muon_update_` for same-shape matrices, with one batched Newton-Schulz call: fewer, larger
    matrix products. Per matrix the arithmetic is unchanged (bit-identical to the one-by-one form on CPU;
    see ``tests/test_optim.py``).

    Example::

        muon_update_batch_([w1, w2], [g1, g2], [b1, b2], MuonHParams())
    """
    if len(params) == 1:
        muon_update_(params[0], grads[0], momentum_buffers[0], hp)
        return
    orthos = _orthogonalise(_stacked_updates(grads, momentum_buffers, hp), hp)
    for p, o in zip(params, orthos.unbind(0)):
        _apply_update_(p, o, hp)
