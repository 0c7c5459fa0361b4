"""The engine seam: what dmuon asks of the engine that trains a model's other parameters.

[Note: engines]
dmuon owns the dedicated parameters; every other parameter belongs to an *engine*: FSDP2 (``fully_shard``),
DDP, DeepSpeed ZeRO-1/2, or none (a model nobody wraps, whose plain parameters dmuon averages as DDP would).
Everything dmuon needs to know about that engine is one of these questions, answered by one class per engine
(``fsdp2.py``, ``ddp.py``, ``deepspeed.py``; :class:`Engine` itself is the answer for no engine):

* *which params it manages*: it averages their gradients and steps them; dmuon averages the plain rest
  (:meth:`Engine.plain_params`, empty where the engine averages every other gradient itself);
* *how it leaves the dedicated params alone*: :meth:`Engine.leave_dedicated` at ``dedicate_params`` (DDP's
  ignore list, FSDP2's skip patch), and :meth:`Engine.refuse_taken` for a model the engine already took;
* *how its gradient sync switches off for accumulation*: :meth:`Engine.no_sync` (``dmuon.no_sync`` enters it),
  or, where the engine decides the accumulation boundary itself, :meth:`Engine.accumulation_boundary`, which
  dmuon's hooks ask at every backward (FSDP2's answer is its own sync switch, which torch's pipelining
  schedules turn off for each microbatch), and whether weights stay gathered between accumulation steps
  (:meth:`Engine.reshard_after_backward`);
* *its part of the gradient norm*: :meth:`Engine.grad_share` (this rank's share of one gradient);
* *its part of the state dicts*: :meth:`Engine.rest` (its tensors in their resting place before a state dict
  reads them) and :meth:`Engine.after_model_load` (its copies of the weights follow a load);
* *how to unwrap the model*: :meth:`Engine.unwrap` (the module ``dedicate_params`` prepared).

``engines.bind`` picks the engine of a model (build-time detection in ``dmuon.Muon``; the first forward when no
optimizer was built; ``deepspeed.initialize`` for DeepSpeed) and stores the binding on the model's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from ..runtime.hooks import DMuonState
from ..runtime.param import is_dedicated

__all__ = ["Engine"]


class Engine:
    """No engine: a model (or the part of one) nobody wraps. dmuon averages its plain trainable params at the end of
    every backward, as DDP would. The base of the other engines, whose docstrings say what they change."""

    #: the name in messages and in ``diagnostics``
    kind: ClassVar[str] = "none"
    #: whether the engine averages every non-dedicated gradient itself (DDP, DeepSpeed), so dmuon averages none
    averages_plain: ClassVar[bool] = False
    #: whether only the stored binding knows this engine: the model shows no sign of it (DeepSpeed ZeRO-1/2
    #: keeps plain params), so ``engines.of(model)`` returns the binding
    bound_only: ClassVar[bool] = False

    def __init__(self, wrapper: nn.Module, state: DMuonState) -> None:
        #: what the user handed over: the engine's wrapper (DDP, ``DeepSpeedEngine``) or the model itself
        self.wrapper = wrapper
        self.state = state

    @property
    def model(self) -> nn.Module:
        """The module ``dedicate_params`` prepared."""
        return self.state.model

    # ------------------------------------------------------------------ #
    # Detection and setup (class level: no binding exists yet)             #
    # ------------------------------------------------------------------ #
    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        """Whether ``model`` (what the user passed) is trained by this engine."""
        return True

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        """The module inside this engine's wrapper; ``model`` itself when it is not one."""
        return model

    @classmethod
    def refuse_taken(cls, model: nn.Module) -> None:
        """``dedicate_params``: raise ``ValueError`` naming the fix if this engine already took ``model``."""

    @classmethod
    def take_whole(cls, model: nn.Module, predicate: Callable[[str, nn.Parameter], bool] | None
                   ) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """``dedicate_params``, before its checks: where this engine partitioned params at construction, each
        one ``predicate`` selects made whole again and left to dmuon (the values unchanged). Collective there.
        Returns the swaps made, ``(module, name, the engine's param)``, so a failed check can put them back."""
        return []

    @classmethod
    def leave_dedicated(cls, model: nn.Module, fqns: list[str]) -> None:
        """``dedicate_params``, after every check passed: make the engine leave these params to dmuon."""

    # ------------------------------------------------------------------ #
    # Gradients                                                            #
    # ------------------------------------------------------------------ #
    def plain_params(self) -> list[nn.Parameter]:
        """The trainable params whose gradients dmuon averages at the end of each backward: neither dedicated
        nor the engine's (here: every plain one). Read at a resting point (FSDP2 modules sharded)."""
        if self.averages_plain:
            return []
        return [p for p in self.model.parameters()
                if p.requires_grad and not is_dedicated(p) and not isinstance(p, DTensor)]

    @contextmanager
    def no_sync(self, *, resume: bool) -> Iterator[None]:
        """Switch the engine's own gradient sync off for the block (``dmuon.no_sync``); on the way out, back on
        where ``resume`` (off again for a ``no_sync`` nested in another)."""
        yield

    def accumulation_boundary(self) -> bool | None:
        """Where the engine decides when gradients are averaged (DeepSpeed's ``gradient_accumulation_steps``):
        whether the backward running now closes the window. ``None``: the engine leaves it to ``no_sync``."""
        return None

    def reshard_after_backward(self) -> bool:
        """Whether the weights a backward gathered are freed when it ends though it kept its gradients local
        (an accumulation step). ``False`` where the engine keeps its own for the next microbatch (FSDP2 under
        torch's pipelining schedules): dmuon keeps its copies too, so no microbatch broadcasts more than the
        engine gathers."""
        return True

    def grad_share(self, g: torch.Tensor, *, rank: int, tp_first: bool, tp_name: str | None
                   ) -> tuple[torch.Tensor, bool]:
        """This rank's share of a non-dedicated gradient for the global norm: the local tensor (which clipping
        scales) and whether it counts here. A DTensor counts its local shard where its ``Replicate``
        coordinates are 0 (HSDP's replicas count once); a plain gradient is the same on every rank after it
        was averaged, so rank 0 counts it. Under tensor parallelism (``tp_first``: tp index 0, ``tp_name``:
        the "tp" dimension) a DTensor over "tp" counts on every tp index, the rest on tp index 0 only."""
        if isinstance(g, DTensor):
            coord = g.device_mesh.get_coordinate()
            here = coord is not None and all(c == 0 for c, pl in zip(coord, g.placements) if isinstance(pl, Replicate))
            return g.to_local(), here and (tp_first or tp_name in (g.device_mesh.mesh_dim_names or ()))
        return g, rank == 0 and tp_first

    def check_norm(self, what: str) -> None:
        """Raise where dmuon cannot compute the gradient norm itself (the engine clips; DeepSpeed)."""

    # ------------------------------------------------------------------ #
    # The optimizer                                                        #
    # ------------------------------------------------------------------ #
    def check_optimizer(self) -> None:
        """``dmuon.Muon``'s build: refuse what the engine's settings make impossible (FSDP2's input casts)."""

    # ------------------------------------------------------------------ #
    # State dicts                                                          #
    # ------------------------------------------------------------------ #
    def rest(self) -> None:
        """Put the engine's tensors in their resting place before a state dict reads or writes them."""

    def after_model_load(self) -> None:
        """A model state dict was written into the params: refresh any copy the engine keeps of them."""

    def group_params(self, optimizer: Any, group: dict[str, Any]) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        """``(FQN, param, group)`` of each param of one of ``dmuon.Muon``'s groups the engine trains."""
        return [(name, p, group) for p, name in zip(group["params"], group["param_names"])]

    def optimizer_state(self, optimizer: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any] | None:
        """The optimizer state of one param the engine trains (``None``: none yet), as the optimizer state dicts
        read it: the optimizer's own entry (live tensors)."""
        return optimizer.state.get(p)

    def state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of the optimizer state of one param the engine trains."""
        return p.dtype

    def param_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """The whole shape of one param the engine trains (a DTensor's is its global shape already)."""
        return tuple(p.shape)

    def materialise_state(self, optimizer: Any) -> None:
        """Create the zero state a first step would create where the engine keeps its params' optimizer state
        itself (DeepSpeed's ZeRO), so a sharded dict built before the first step has every key. Here: the
        optimizer's own, which ``dmuon.Muon.materialise_state`` creates."""

    def load_optimizer_state(self, optimizer: Any, states: dict[torch.Tensor, dict[str, Any]]
                             ) -> dict[torch.Tensor, dict[str, Any]]:
        """Take a checked optimizer dict's state of the params the engine trains; return what the optimizer
        keeps itself (here: all of it)."""
        return states

    def full_params(self, *, write: bool = False) -> AbstractContextManager[Any]:
        """While the block runs, every param the engine keeps in slices between uses (DeepSpeed ZeRO-3) is whole
        on every rank, so the model's state dict functions read and write it like a plain one; ``write``: what
        the block writes into them is kept (rank 0's values). Here: nothing to do. Collective where it gathers."""
        return nullcontext()

    def describe(self) -> dict[str, Any]:
        """What ``repr`` and messages show of this binding."""
        return {"engine": self.kind, "averages_plain": self.averages_plain}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"
