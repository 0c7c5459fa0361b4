"""ZeRO stage 0: DeepSpeed's data-parallel engine with no ZeRO optimizer, and what joins its step.

[Note: DeepSpeed stage 0]
At stage 0 (fp32) ``engine.optimizer`` is the facade itself (torch's ``AdamW`` over the group dicts of
``dmuon.Muon`` whose params DeepSpeed trains, [Note: DeepSpeed step]), stepping the model's own params. The engine
then does by hand what ZeRO does inside its optimizer, and over *every* param of the module, the dedicated ones
included: at the accumulation boundary it all-reduces every gradient (``_get_gradients_for_reduction`` makes a zero
gradient for a param without one, so a non-owner would get a whole-matrix gradient and the owner's average
would be averaged again), clips with ``deepspeed.runtime.utils.clip_grad_norm_`` over the norm each rank sees
(the owners' gradients on one rank only: different factors on different ranks), and clears every ``.grad`` behind
dmuon's back. Three methods of that engine and one of the facade change, per instance:

* ``_get_gradients_for_reduction``: the gradients of the params DeepSpeed trains only (DeepSpeed's own rules for
  them: a zero gradient where a rank has none, experts apart);
* ``clip_fp32_gradients``: nothing; the clip runs in the step (below), once dmuon's reduces finished;
* ``facade.step``: ``dmuon.Muon.apply_update`` with, as its engine step, the clip by the whole model's norm (the
  averaged plain gradients, the same on every rank, and the owners' dedicated ones, summed over the ranks; the
  factor ``max_norm / (norm + 1e-6)``, at most 1, DeepSpeed's and torch's), then the facade's own AdamW step;
  the norm is what ``engine.get_global_grad_norm()`` reads;
* ``zero_grad``: the engine's, and dmuon's dedicated gradients through dmuon's own state (after its reduces).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ...optim import Muon
from ...runtime import comm as C
from ...runtime.hooks import DMuonState
from ...runtime.param import is_dedicated
from ._norms import owned_grads, squared_norm

__all__ = ["Stage0"]


class Stage0:
    """The engine methods replaced at ZeRO stage 0 ([Note: DeepSpeed stage 0]) for one dmuon model."""

    #: what is replaced or read on the engine (``install`` checks they exist)
    ENGINE_METHODS = ("_get_gradients_for_reduction", "clip_fp32_gradients", "zero_grad", "gradient_clipping")

    def __init__(self, state: DMuonState, muon: Muon, facade: torch.optim.Optimizer, engine: Any,
                 before_step: Callable[[], None]) -> None:
        self.state, self.muon, self.facade, self.engine = state, muon, facade, engine
        self.before_step = before_step  # dmuon's groups follow a config scheduler

    def attach(self) -> None:
        engine, facade = self.engine, self.facade
        engine._get_gradients_for_reduction = self._grads_for_reduction
        engine.clip_fp32_gradients = lambda: None  # the step clips, once dmuon's reduces are done
        engine.zero_grad = functools.wraps(engine.zero_grad)(functools.partial(self._zero_grad, engine.zero_grad))
        original = facade.step
        facade.step = functools.wraps(original)(functools.partial(self._step, original))

    def _plain(self) -> list[torch.nn.Parameter]:
        """The params DeepSpeed trains here, in module order (the same list on every rank)."""
        return [p for p in self.state.model.parameters() if p.requires_grad and not is_dedicated(p)]

    def _grads_for_reduction(self) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        from deepspeed.moe.utils import is_moe_param

        plain: list[torch.Tensor] = []
        experts: dict[str, list[torch.Tensor]] = {k: [] for k in getattr(self.engine, "expert_data_parallel_group",
                                                                          None) or {}}
        for p in self._plain():
            if p.numel() == 0:
                continue
            if p.grad is None:  # every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
            (experts[p.group_name] if is_moe_param(p) else plain).append(p.grad.data)
        return plain, experts

    @torch.no_grad()
    def _step(self, facade_step: Any, closure: Any = None) -> None:
        def engine_step() -> bool:
            max_norm = float(self.engine.gradient_clipping())
            if max_norm > 0:
                self._clip(max_norm)
            facade_step()
            return True

        self.before_step()
        self.muon.apply_update(engine_step=engine_step)

    def _clip(self, max_norm: float) -> None:
        """Every gradient scaled by the whole model's clip factor; the norm kept for ``get_global_grad_norm``."""
        ctx = self.state.ctx
        plain = [p.grad for p in self._plain() if p.grad is not None]
        owned = owned_grads(self.state)
        total = torch.sqrt(squared_norm(plain, ctx.device) + C.all_reduce_sum(ctx, squared_norm(owned, ctx.device)))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in plain + owned:
            g.mul_(coef.to(g.device))
        self.facade._global_grad_norm = total.item()  # type: ignore[attr-defined]  # the engine reads it

    def _zero_grad(self, original: Any) -> None:
        self.state.finish_reduces()
        self.state.clear_grads(set_to_none=True)
        original()
