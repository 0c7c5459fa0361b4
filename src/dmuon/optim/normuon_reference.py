"""NorMuon as the paper writes it, one matrix at a time on one process: the oracle ``normuon.py`` is tested
against (as dion keeps ``*_reference.py`` beside its optimizers).

Written from Algorithm 1 of Li, Liu, Liang, Chen and Zhao, "NorMuon: Making Muon more efficient and scalable"
(arXiv 2510.05491), in its own arithmetic: the row mean ``mean_cols(O * O)``, the EMA as ``beta2 v + (1 - beta2)
x``, ``O^ = O / (sqrt(v) + eps)`` materialised, and its Frobenius norm taken directly, where ``normuon.py`` folds
all of that into per-row multipliers computed from row sums. Momentum and Newton-Schulz are Muon's (a
``torch.optim.Muon``-style lerp momentum, optionally Nesterov, and :func:`dmuon.newton_schulz`, which is
``torch.optim.Muon``'s iteration bit for bit). 2-D parameters only: an expert or a row block is its own
parameter here (the tests give each its own).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .newton_schulz import KELLER_JORDAN_COEFFICIENTS, newton_schulz
from .update import AdjustLR, adjusted_lr

__all__ = ["NorMuonReference"]


class NorMuonReference(torch.optim.Optimizer):
    r"""Single-process NorMuon for 2-D parameters, from the paper's formulas:

    .. math::
        B \leftarrow \mu B + (1 - \mu) G,\quad O = \mathrm{NS}(\text{Nesterov} ? (1-\mu) G + \mu B : B),\quad
        v \leftarrow \beta_2 v + (1-\beta_2)\,\mathrm{mean}_j O_{ij}^2,\quad
        \hat O = O / (\sqrt{v} + \epsilon),\quad
        W \leftarrow W - \eta\lambda W - \eta\,\rho\sqrt{mn}\,\hat O / \lVert\hat O\rVert_F

    (``rms_target=None``: :math:`\eta\,s(W)\,\lVert O\rVert_F\,\hat O / \lVert\hat O\rVert_F` with Muon's shape
    factor :math:`s` instead). ``cautious_weight_decay``: the decay only where :math:`\hat O \odot W \ge 0`.

    Example::

        opt = NorMuonReference([w], lr=0.01, weight_decay=0.1)
        loss.backward(); opt.step()
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 0.02, *, momentum: float = 0.95,
                 nesterov: bool = True, beta2: float = 0.95, normuon_eps: float = 1e-8,
                 rms_target: float | None = 0.2, weight_decay: float = 0.0, cautious_weight_decay: bool = False,
                 ns_steps: int = 5, ns_coefficients: tuple[float, float, float] = KELLER_JORDAN_COEFFICIENTS,
                 eps: float = 1e-7, adjust_lr_fn: str | None = None) -> None:
        defaults: dict[str, Any] = dict(lr=lr, momentum=momentum, nesterov=nesterov, beta2=beta2,
                                        normuon_eps=normuon_eps, rms_target=rms_target, weight_decay=weight_decay,
                                        cautious_weight_decay=cautious_weight_decay, ns_steps=ns_steps,
                                        ns_coefficients=ns_coefficients, eps=eps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"NorMuonReference takes 2-D parameters, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, self.state[p], g)
        return loss

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, st: dict[str, Any], g: dict[str, Any]) -> None:
        m, n = p.shape
        wide = torch.promote_types(p.dtype, torch.float32)
        if not st:
            st["momentum_buffer"] = torch.zeros_like(p)
            st["row_second_moment"] = torch.zeros((m, 1), dtype=wide, device=p.device)
        buf, v = st["momentum_buffer"], st["row_second_moment"]
        buf.lerp_(grad, 1 - g["momentum"])
        u = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        O = newton_schulz(u, g["ns_steps"], g["ns_coefficients"], g["eps"], backend="direct").to(wide)
        v.mul_(g["beta2"]).add_((O * O).mean(dim=1, keepdim=True), alpha=1 - g["beta2"])
        O_hat = O / (v.sqrt() + g["normuon_eps"])
        norm_hat = torch.linalg.matrix_norm(O_hat)
        if g["rms_target"] is not None:
            step = g["rms_target"] * math.sqrt(m * n)
        else:
            step = adjusted_lr(1.0, AdjustLR.parse(g["adjust_lr_fn"]), (m, n)) * torch.linalg.matrix_norm(O)
        update = O_hat * (step / norm_hat) if norm_hat > 0 else torch.zeros_like(O_hat)
        decay = g["lr"] * g["weight_decay"]
        if decay:
            keep = (O_hat * p >= 0) if g["cautious_weight_decay"] else torch.ones_like(p, dtype=torch.bool)
            p.sub_(torch.where(keep, p * decay, torch.zeros_like(p)))
        p.sub_(g["lr"] * update.to(p.dtype))
