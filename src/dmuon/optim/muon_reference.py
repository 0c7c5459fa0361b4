"""Muon one matrix at a time on one process, with cautious weight decay: the oracle for the switch
``cautious_weight_decay`` (``torch.optim.Muon``, the oracle of everything else, has no such switch).

Written from the formulas (Jordan et al.'s Muon as ``torch.optim.Muon`` states it; Cautious Weight Decay, Chen
et al. 2025, arXiv 2510.12402: decay where ``sign(update) == sign(W)``), in their own arithmetic: the decay as
``W - lr wd mask W`` where ``dmuon.optim.update.decay_`` multiplies. Without the switch its steps agree with
``torch.optim.Muon`` to rounding. 2-D parameters only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .newton_schulz import KELLER_JORDAN_COEFFICIENTS, newton_schulz
from .update import AdjustLR, adjusted_lr

__all__ = ["MuonReference"]


class MuonReference(torch.optim.Optimizer):
    r"""Single-process Muon for 2-D parameters:
    :math:`W \leftarrow W - \eta\lambda\,m \odot W - \eta\,s(W)\,O`, :math:`O = \mathrm{NS}(U)` of the (Nesterov)
    momentum :math:`U`, and the decay mask :math:`m = [O \odot W \ge 0]` under ``cautious_weight_decay`` (else 1).

    Example::

        opt = MuonReference([w], lr=0.02, weight_decay=0.1, cautious_weight_decay=True)
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 0.02, *, momentum: float = 0.95,
                 nesterov: bool = True, weight_decay: float = 0.0, cautious_weight_decay: bool = False,
                 ns_steps: int = 5, ns_coefficients: tuple[float, float, float] = KELLER_JORDAN_COEFFICIENTS,
                 eps: float = 1e-7, adjust_lr_fn: str | None = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      cautious_weight_decay=cautious_weight_decay, ns_steps=ns_steps,
                                      ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"MuonReference takes 2-D parameters, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - g["momentum"])
                u = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                O = newton_schulz(u, g["ns_steps"], g["ns_coefficients"], g["eps"], backend="direct")
                decay = g["lr"] * g["weight_decay"]
                if decay:
                    keep = (O * p >= 0) if g["cautious_weight_decay"] else torch.ones_like(p, dtype=torch.bool)
                    p.sub_(torch.where(keep, p * decay, torch.zeros_like(p)))
                p.add_(O, alpha=-adjusted_lr(g["lr"], AdjustLR.parse(g["adjust_lr_fn"]), p.shape))
        return loss
