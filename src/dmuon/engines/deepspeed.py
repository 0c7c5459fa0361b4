"""DeepSpeed ZeRO stage 0, 1, 2 and 3 as dmuon's engine ([Note: engines] in ``base.py``).

ZeRO-1/2 keeps every param whole on every rank and flattens the optimizer's param groups into one fp32 slice
per rank; it averages (and, at stage 2, partitions) the gradients of the params in those groups, clips by their
norm, skips a step on fp16 overflow, and steps its slice. dmuon hands it only the groups of the params it does not
dedicate, so the dedicated ones are dmuon's alone: their gradients are averaged to the owner at the accumulation
boundary DeepSpeed decides (:meth:`DeepSpeed.accumulation_boundary`), their norm joins DeepSpeed's, and the
owners update them after DeepSpeed's step. Stage 0 is the same without ZeRO's slices: the engine all-reduces
the other gradients itself and steps a torch ``AdamW`` over the model's own params. How dmuon plugs into
``deepspeed.initialize`` and DeepSpeed's optimizer is ``dmuon/integrations/deepspeed``; this module says what
DeepSpeed means to the rest of dmuon. It imports deepspeed only in the methods of a binding (a model is
DeepSpeed's once ``deepspeed.initialize`` took it).

ZeRO-3 partitions every param it is given; the dedicated ones are kept out of it by the glue ([Note: DeepSpeed
ZeRO-3] in ``dmuon/integrations/deepspeed/_zero3.py``), and this binding gathers ZeRO-3's own params whole for the
model's state dicts (:meth:`DeepSpeed.full_params`).

[Note: zero.Init models]
A model built under ``deepspeed.zero.Init`` reaches ``dedicate_params`` already partitioned: each param holds
0 elements and its slice in ``ds_tensor``, so a predicate would see no matrix. So before its checks,
``dedicate_params`` gathers each partitioned param whole on every rank once, one at a time (DeepSpeed's
``GatheredParameters``), and the predicate sees it whole; one it selects leaves ZeRO-3 as a new plain
``nn.Parameter`` holding that value (in every module that holds it), which ``dedicate_params`` then binds to its
owner (the other ranks drop their copy there); the others go back to their slices, as they were. The peak is
one param whole at a time, plus the selected matrices until they are bound. Every gather runs on every rank even
after the predicate raised on one (that error is raised after the last gather), so no rank waits for another.
Only ``predicate`` decides here: a ``route`` function sees ZeRO-3's 0-element params.

[Note: DeepSpeed state dicts]
dmuon's full state dicts hold what they hold under FSDP2: the model's params (in the model's dtype), and per
param its optimizer state by FQN. ZeRO keeps the AdamW moments and the fp32 masters of its params in its flat
slices, one per rank; DeepSpeed's own tensor-fragment functions (``deepspeed.utils.safe_get_full_*`` /
``safe_set_full_*``, which each rank calls for every param in the same order) give them whole and put them back
into this world size's slices. So a param ZeRO trains has ``step``, ``exp_avg``, ``exp_avg_sq`` in ZeRO's dtype
(fp32), and, where the model is bf16 or fp16, ``master``: its fp32 master. Loading the model dict alone
restarts ZeRO's masters from the loaded params (``after_model_load``), as ``load_module_only`` does. At stage 0
(fp32) the AdamW state is torch's own, keyed by the param: read and written as it is.
The AdamW ``step`` is per slice: ZeRO-1/2's slice of each group; ZeRO-3 splits each group into sub-groups
(``sub_group_to_group_id``), each with its own slice in ``fp32_partitioned_groups_flat`` and its own AdamW state,
and its ``grad_position`` names the sub-group that holds each param (:meth:`DeepSpeed._flat`). A sharded (DCP)
dict holds the same whole tensors (ZeRO's slices are cut across params, not per param, so no DTensor describes
them): DCP writes one copy, and every rank reads it whole at the load, where each keeps its own slice. Before the
first step (a ``dcp.load`` target) the slices get the zero state torch's AdamW would create
(:meth:`DeepSpeed.materialise_state`), so the dict has every key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar

import torch
import torch.nn as nn

from .base import Engine

__all__ = ["DeepSpeed", "is_deepspeed_engine", "partitioned_at_construction", "zero_managed"]


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (the wrapper ``deepspeed.initialize`` returns)."""
    ds = sys.modules.get("deepspeed.runtime.engine")
    return ds is not None and isinstance(model, ds.DeepSpeedEngine)


def zero_managed(model: nn.Module) -> list[str]:
    """The params of ``model`` a ZeRO optimizer already took (``deepspeed.initialize`` ran on it): ZeRO-1/2 links
    each to its fp32 slice (``_hp_mapping``, what DeepSpeed's own ``safe_get_full_fp32_param`` looks for), ZeRO-3
    gives each an id (``ds_id``) and the model its registry of params in flight. ``deepspeed.zero.Init`` alone
    (no engine yet) gives ids only: see :func:`partitioned_at_construction`."""
    engine_z3 = hasattr(model, "ds_inflight_param_registry")
    return [n for n, p in model.named_parameters()
            if hasattr(p, "_hp_mapping") or (engine_z3 and hasattr(p, "ds_id"))]


def partitioned_at_construction(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The params ``deepspeed.zero.Init`` partitioned when the model was built (each has ZeRO-3's ``ds_id`` and
    holds its slice in ``ds_tensor``), before any engine took the model; in module order, the same on every rank."""
    if hasattr(model, "ds_inflight_param_registry"):
        return []
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "ds_tensor", None) is not None]


class DeepSpeed(Engine):
    """DeepSpeed ZeRO-0/1/2/3: averages, clips and steps every non-dedicated param; decides the accumulation boundary
    (``gradient_accumulation_steps``), which dmuon's hooks follow; clips with ``gradient_clipping`` by a norm that
    includes the dedicated gradients. Not available: ``dmuon.no_sync`` (DeepSpeed's boundary decides) and
    ``dmuon.clip_grad_norm_`` (DeepSpeed clips, and its gradients live in its flat slices)."""

    kind: ClassVar[str] = "deepspeed"
    averages_plain: ClassVar[bool] = True
    bound_only: ClassVar[bool] = True
    #: the engine runs the optimizer step (``engine.step()``); ``dmuon.Muon.step`` alone would skip ZeRO's part
    drives_step: ClassVar[bool] = True

    @classmethod
    def claims(cls, model: nn.Module) -> bool:
        return is_deepspeed_engine(model)

    @classmethod
    def unwrap(cls, model: nn.Module) -> nn.Module:
        return model.module if is_deepspeed_engine(model) else model  # type: ignore[return-value]

    @classmethod
    def refuse_taken(cls, model: nn.Module) -> None:
        taken = zero_managed(model) if not is_deepspeed_engine(model) else ["<every param>"]
        if taken:
            raise ValueError(
                "dmuon.dedicate_params must run before deepspeed.initialize, but DeepSpeed already took this model "
                f"(ZeRO holds {taken[:3]}{'...' if len(taken) > 3 else ''}). Call dmuon.dedicate_params(model, mesh, "
                "...) and build dmuon.Muon(model, ...) first, then engine, optimizer, _, _ = "
                "deepspeed.initialize(model=model, optimizer=optimizer, config=...). Nothing was changed."
            )

    @classmethod
    def take_whole(cls, model: nn.Module, predicate: Callable[[str, nn.Parameter], bool] | None
                   ) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """The params ``deepspeed.zero.Init`` partitioned, each gathered once for ``predicate`` ([Note: zero.Init
        models]); the ones it selects become plain params again. Collective when there are any."""
        found = partitioned_at_construction(model)
        if not found or predicate is None:
            return []
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        whole: dict[int, nn.Parameter] = {}
        error: BaseException | None = None
        for fqn, p in found:
            with GatheredParameters([p]), torch.no_grad():
                try:
                    if error is None and predicate(fqn, p):
                        whole[id(p)] = nn.Parameter(p.data.clone(), requires_grad=p.requires_grad)
                except Exception as e:  # noqa: BLE001 - raised after the last gather, on this rank
                    error = e
        if error is not None:
            raise error
        swaps = []
        for m in model.modules():
            for k, v in list(m._parameters.items()):
                if v is not None and id(v) in whole:
                    m._parameters[k] = whole[id(v)]
                    swaps.append((m, k, v))
        return swaps

    # ------------------------------------------------------------------ #
    # The binding                                                          #
    # ------------------------------------------------------------------ #
    @property
    def zero(self) -> Any:
        """The ``DeepSpeedZeroOptimizer`` of the bound engine (at stage 0: the torch ``AdamW`` it steps)."""
        return self.wrapper.optimizer  # type: ignore[union-attr]

    @property
    def stage(self) -> int:
        """The bound engine's ZeRO stage."""
        return int(self.wrapper.zero_optimization_stage())  # type: ignore[union-attr]

    @property
    def stage0(self) -> bool:
        """ZeRO stage 0: no ZeRO optimizer; the engine steps a torch ``AdamW`` over the model's own params."""
        return self.stage == 0

    def full_params(self, *, write: bool = False) -> AbstractContextManager[Any]:
        """ZeRO-3: the params it partitioned (each holds its slice in ``ds_tensor``; the dedicated ones hold none),
        gathered whole on every rank by DeepSpeed's ``GatheredParameters`` for the block; ``write``: rank 0's values
        are broadcast and partitioned again on the way out (its ``modifier_rank``). Collective."""
        if self.stage != 3:
            return nullcontext()
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        params = [p for p in self.model.parameters() if getattr(p, "ds_tensor", None) is not None]
        return GatheredParameters(params, modifier_rank=0 if write else None)

    def accumulation_boundary(self) -> bool | None:
        engine: Any = self.wrapper
        return bool(engine.is_gradient_accumulation_boundary()) and not engine.inside_no_sync_ctxt

    @contextmanager
    def no_sync(self, *, resume: bool) -> Iterator[None]:
        raise ValueError(
            "dmuon.no_sync on a DeepSpeed model: the DeepSpeed engine decides when gradients are averaged "
            "(gradient_accumulation_steps in its config), and dmuon follows it. Call engine.backward(loss) and "
            "engine.step() for every micro-batch instead."
        )
        yield  # pragma: no cover - a generator, so the error comes from entering the block

    def check_norm(self, what: str) -> None:
        raise ValueError(
            f"{what} on a DeepSpeed model: DeepSpeed clips itself, by a norm that includes the dedicated "
            "gradients; set gradient_clipping in its config, and read the norm with engine.get_global_grad_norm()."
        )

    def check_optimizer(self) -> None:
        raise ValueError(
            "dmuon.Muon on a model deepspeed.initialize already took: build dmuon.Muon(model, ...) first and pass "
            "it to deepspeed.initialize(model=model, optimizer=optimizer, config=...)."
        )

    def after_model_load(self) -> None:
        """ZeRO keeps fp32 copies of its params (the slice it steps): restart them from the loaded values (stage 0
        in fp32 keeps none)."""
        if not self.stage0:
            self.zero.refresh_fp32_params()

    # ------------------------------------------------------------------ #
    # State dicts ([Note: DeepSpeed state dicts])                          #
    # ------------------------------------------------------------------ #
    def group_params(self, optimizer: Any, group: dict[str, Any]) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        by_name = dict(self.model.named_parameters())  # ZeRO replaced the group's params by its flat slice
        return [(name, by_name[name], group) for name in group["param_names"]]

    def _flat(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The fp32 slice on this rank whose AdamW state holds ``p``'s part: ZeRO-1/2's slice of the group (its
        ``params``), or the ZeRO-3 sub-group that holds ``p`` (``sub_group_to_group_id`` maps sub-groups to
        groups; its ``grad_position`` each param to its sub-group)."""
        zero = self.zero
        if self.stage == 3:
            return zero.fp32_partitioned_groups_flat[zero.grad_position[zero.get_param_id(p)][0]]
        return group["params"][0]

    def _flats(self) -> list[torch.Tensor]:
        """Every fp32 slice ZeRO's AdamW steps on this rank (one per group; at ZeRO-3 one per sub-group)."""
        if self.stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return [g["params"][0] for g in self.zero.optimizer.param_groups]

    def _flat_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """torch AdamW's state of the slice holding ``p`` on this rank (empty before the first step)."""
        return self.zero.optimizer.state.get(self._flat(p, group), {})

    def param_shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """A ZeRO-3 param holds 0 elements between uses: its whole shape is ``ds_shape``."""
        return tuple(p.ds_shape) if getattr(p, "ds_tensor", None) is not None else tuple(p.shape)

    def materialise_state(self, optimizer: Any) -> None:
        """The zero AdamW state of every slice ZeRO steps, as torch's AdamW creates it at its first step (a
        no-op on its numbers), and ZeRO-1/2's links of each param to it (its own lazy init). At stage 0: the
        state of the model's own params in the AdamW the engine steps."""
        facade = self.zero if self.stage0 else self.zero.optimizer
        held = [p for g in facade.param_groups for p in g["params"]] if self.stage0 else self._flats()
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # (torch AdamW's)
        for t in held:  # (DeepSpeedCPUAdam, under an offloaded optimizer, counts its steps in an int)
            if not facade.state.get(t):
                step = torch.zeros((), dtype=scalar) if isinstance(facade, torch.optim.AdamW) else 0
                facade.state[t] = {"step": step, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
        if not self.stage0 and self.stage != 3:  # ZeRO-3 reads its sub-groups' state directly
            self.zero._lazy_init_hp_params_optimizer_state()

    def optimizer_state(self, optimizer: Any, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any] | None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.stage0:  # the AdamW's own entry of the param itself
            return self.zero.state.get(p)
        flat = self._flat_state(p, group)
        if not flat:
            return None
        st: dict[str, Any] = {"step": torch.as_tensor(flat["step"], dtype=torch.float32).clone()}
        for k in sorted(k for k in flat if k != "step"):
            st[k] = safe_get_full_optimizer_state(p, k)  # collective over the ranks
        if p.dtype != self.state_dtype(p):
            st["master"] = safe_get_full_fp32_param(p)
        return st

    def state_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.stage0:
            return p.dtype
        zero = self.zero  # ZeRO-1/2's slices, or BF16_Optimizer's (stage 1, bf16, fp32 accumulation)
        if self.stage == 3:
            return zero.fp32_partitioned_groups_flat[0].dtype
        slices = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition
        return slices[0].dtype

    def load_optimizer_state(self, optimizer: Any, states: dict[torch.Tensor, dict[str, Any]]
                             ) -> dict[torch.Tensor, dict[str, Any]]:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if not states:
            return {}
        if self.stage0:  # the torch AdamW DeepSpeed steps holds the state of the model's params as they are
            for p, st in states.items():
                self.zero.state[p] = dict(st)
            return {}
        self.materialise_state(optimizer)  # before the first step: the zero state it would create
        groups = {id(p): g for g in optimizer.param_groups for _, p, g in
                  (self.group_params(optimizer, g) if g["kind"] in ("adamw", "adamw_replicated") else [])}
        for p, st in states.items():
            for k, v in st.items():
                if k == "step":
                    flat = self._flat_state(p, groups[id(p)])
                    step = torch.as_tensor(v).detach().to(torch.float32).clone().cpu()
                    flat["step"] = step if isinstance(flat["step"], torch.Tensor) else int(step.item())
                elif k == "master":
                    safe_set_full_fp32_param(p, v)
                else:
                    safe_set_full_optimizer_state(p, v, k)
        return {}

    def describe(self) -> dict[str, Any]:
        engine: Any = self.wrapper
        return {**super().describe(), "zero_stage": engine.zero_optimization_stage(),
                "gradient_accumulation_steps": engine.gradient_accumulation_steps()}
