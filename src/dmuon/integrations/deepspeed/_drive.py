"""How one dmuon model's step runs inside one DeepSpeed engine: the optimizer ZeRO gets, what joins ZeRO's step,
and the engine's checkpoint functions.

[Note: DeepSpeed step]
ZeRO gets a torch ``AdamW`` (the *facade*) over the group dicts of ``dmuon.Muon`` whose params it trains: it
flattens them, replaces each group's ``params`` by its fp32 slice and calls ``facade.step()`` per group. The
dedicated params are in no group DeepSpeed sees, so its hooks, reduces, norm, overflow check and ``zero_grad``
never meet them; the four methods of ZeRO's optimizer object below bring them in, as methods of that one object
(nothing process-wide changes):

* ``step``: ``dmuon.Muon.apply_update``, the update ``Muon.step`` runs (the reduces finished, QK-clip's maxima
  gathered, the owners' update, QK-clip, the non-owners' copies dropped), with ZeRO's own step as its engine
  step: after it, unless the step overflowed, the owners' gradients are unscaled and clipped by ZeRO's own
  ``unscale_and_clip_grads`` with the norm it computed (so both halves see the same factor), then Muon (and
  AdamW for ``adamw_owner`` params) runs;
* ``scaled_global_norm``: ZeRO's norm of its slices combined with the dedicated gradients' (each counted once,
  on its owner): the clip factor and ``engine.get_global_grad_norm()`` are the whole model's;
* ``has_overflow``: ZeRO's verdict or an inf / NaN in a dedicated gradient (fp16 loss scaling skips the whole
  step, dmuon's update too);
* ``zero_grad``: ZeRO's, and the dedicated gradients (after a step, and when an overflow drops the step).

[Note: DeepSpeed optimizer offload]
``"offload_optimizer": {"device": "cpu"}`` moves ZeRO's part of the step to the CPU, as DeepSpeed does: its fp32
slices, their AdamW state and the step live in CPU memory, and DeepSpeed requires its ``DeepSpeedCPUAdam`` there
unless the config sets ``"zero_force_ds_cpu_optimizer": false``; so the facade is that class (an AdamW,
``adamw_mode=True``, over the same group dicts), or torch's AdamW where the config allows it. The dedicated
matrices are not ZeRO's: their Muon state (momentum, fp32 master) stays on the owner's device, next to the
gradient the owner receives and the Newton–Schulz it runs there; moving it to the CPU would put a copy each way
per matrix and step on the critical path, a separate choice dmuon does not make. ``"nvme"`` (ZeRO-Infinity) is
refused: its state is swapped to files dmuon's state dicts do not read.

[Note: DeepSpeed config schedulers]
A config ``"scheduler"`` (``WarmupLR``, ``WarmupDecayLR``, ``OneCycle``, a torch scheduler by name) is built by
DeepSpeed on its own optimizer, so it sets the lr of ZeRO's groups (the shared AdamW group dicts), often to the
config's absolute numbers (``warmup_max_lr``: an AdamW lr). Muon's lr is of another scale, so dmuon's own groups
follow at the ratio they were built with: before each update, each takes the first ZeRO group's lr times its
lr over that group's lr as built (``dmuon.Muon(lr=0.02, adamw_lr=1e-3)`` under a warm-up to 1e-3: Muon warms up
to 0.02). A scheduler passed as ``lr_scheduler=`` (a torch scheduler on ``dmuon.Muon``) drives every group itself.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from ... import engines
from ...checkpoint import get_model_state_dict, set_model_state_dict
from ...checkpoint.model import ModelLoad, apply_model_sd
from ...optim import Muon
from ...runtime import comm as C
from ...runtime.hooks import DMuonState
from ._load import load_checkpoint
from ._norms import owned_grads, owned_overflow, owned_squared_norm
from ._part import STATE_KEY, engine_groups, own_groups, owned_part, part_of, part_problems
from ._stage0 import Stage0
from ._zero3 import Zero3

__all__ = ["Drive"]


class Drive:
    """The optimizer ZeRO gets for one dmuon model, and the methods that bring the dedicated params into ZeRO's
    step ([Note: DeepSpeed step]). Built before ``DeepSpeedEngine.__init__`` runs, attached after."""

    #: what the glue replaces on each object, per instance (``install`` checks they exist)
    ENGINE_METHODS: ClassVar[tuple[str, ...]] = ("module_state_dict", "load_module_state_dict", "load_checkpoint",
                                                  "save_checkpoint", "is_gradient_accumulation_boundary",
                                                  "load_universal_checkpoint", "_get_all_ckpt_names",
                                                  "_get_zero_ckpt_name", "zero_optimization_stage",
                                                  "_zero3_consolidated_16bit_state_dict",
                                                  *Stage0.ENGINE_METHODS)
    ZERO_METHODS: ClassVar[tuple[str, ...]] = ("step", "scaled_global_norm", "has_overflow", "zero_grad",
                                                "unscale_and_clip_grads", "refresh_fp32_params",
                                                "_lazy_init_hp_params_optimizer_state")
    BF16_METHODS: ClassVar[tuple[str, ...]] = ("step", "get_grads_for_norm", "zero_grad", "refresh_fp32_params",
                                                "_lazy_init_hp_params_optimizer_state")

    def __init__(self, state: DMuonState, muon: Muon, *, cpu_adam: bool = False) -> None:
        self.state, self.muon = state, muon
        shared = engine_groups(muon)
        #: what ZeRO wraps: torch's AdamW over the very group dicts of ``muon`` whose params DeepSpeed trains, or
        #: (``cpu_adam``: an offloaded optimizer, [Note: DeepSpeed optimizer offload]) DeepSpeed's CPU AdamW
        self.facade: torch.optim.Optimizer
        if cpu_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.facade = DeepSpeedCPUAdam(shared, adamw_mode=True)
        else:
            self.facade = torch.optim.AdamW(shared, **muon.adamw_kernels)
        self.shared = list(self.facade.param_groups)
        #: each of dmuon's own groups with its lr over the first group ZeRO steps, as built: the ratio a config
        #: ``"scheduler"`` (which sets the lr of ZeRO's groups only) keeps ([Note: DeepSpeed config schedulers])
        ref = self.shared[0]["lr"]
        self.ratios = [(g, g["lr"] / ref) for g in own_groups(muon)] if ref else []
        self.follows = False
        self.facade.register_state_dict_post_hook(self._save_owned)
        self.facade.register_load_state_dict_pre_hook(self._take_owned)
        self.facade.register_load_state_dict_post_hook(self._relink)
        self._loaded: dict[str, Any] | None = None
        #: the model dict ``engine.load_checkpoint`` checked, while DeepSpeed's own load runs
        self._checked: ModelLoad | None = None
        #: ZeRO's norm of this step, combined with the dedicated gradients' (``scaled_global_norm``)
        self.norm: torch.Tensor | None = None
        #: ZeRO stage 0, while ``engine.save_checkpoint`` runs: every rank's owned part, gathered (rank 0 writes
        #: the one file that holds the optimizer, [Note: DeepSpeed stage 0])
        self._parts: list[Any] | None = None
        self.engine: Any = None
        self.stage = -1
        #: ZeRO stage 1 in bf16 with fp32 gradient accumulation: DeepSpeed's ``BF16_Optimizer``, not ZeRO's
        self.bf16_optimizer = False

    # ------------------------------------------------------------------ #
    # Attaching                                                            #
    # ------------------------------------------------------------------ #
    def attach(self, engine: Any) -> None:
        """``DeepSpeedEngine.__init__`` is done: bind the engine, route dmuon's steps through it."""
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.follows = engine.lr_scheduler is not None and engine.client_lr_scheduler is None
        self.follow_schedule()
        zero = engine.optimizer
        if self.stage == 0:  # no ZeRO optimizer: the engine's own methods ([Note: DeepSpeed stage 0])
            Stage0(self.state, self.muon, self.facade, engine, self.follow_schedule).attach()
        elif self.stage == 3:  # ZeRO-3's optimizer and its parameter coordinator ([Note: DeepSpeed ZeRO-3])
            Zero3(self.state, self.muon, engine, self.follow_schedule).attach()
        else:  # ZeRO-1/2's optimizer, or at stage 1 in bf16 with fp32 accumulation DeepSpeed's BF16_Optimizer
            self.bf16_optimizer = _is_bf16_optimizer(zero)
            joins = ("step", "get_grads_for_norm", "zero_grad") if self.bf16_optimizer else \
                ("step", "scaled_global_norm", "has_overflow", "zero_grad")
            for name in joins:
                setattr(zero, name, _bound(getattr(self, f"_zero_{name}"), getattr(zero, name)))
        engine.save_checkpoint = functools.wraps(engine.save_checkpoint)(
            functools.partial(self._save_checkpoint, engine.save_checkpoint))
        engine.module_state_dict = self._module_state_dict
        if self.stage == 3:  # save_16bit_model / zero3_save_16bit_model's whole model: dmuon's, ZeRO-3's gathered
            engine._zero3_consolidated_16bit_state_dict = self._module_state_dict
        engine.load_module_state_dict = self._load_module_state_dict
        engine.load_checkpoint = functools.wraps(engine.load_checkpoint)(
            functools.partial(load_checkpoint, engine, self.state, self.muon, self.facade, engine.load_checkpoint,
                              self._check))
        muon = self.muon
        muon._deepspeed_drive = self
        muon.leave_adamw_to_engine()  # ZeRO steps the groups it trains; dmuon's AdamW the owners' only
        engines.bind(engine)  # no plain params for dmuon; the engine's accumulation boundary

    # ------------------------------------------------------------------ #
    # ZeRO's optimizer                                                     #
    # ------------------------------------------------------------------ #
    def follow_schedule(self) -> None:
        """Under a config ``"scheduler"``: dmuon's own groups take the lr of the first group ZeRO steps times their
        ratio as built ([Note: DeepSpeed config schedulers]). Before each update, so both halves use the lr the
        scheduler set last."""
        if self.follows:
            ref = self.shared[0]["lr"]
            for g, ratio in self.ratios:
                g["lr"] = ratio * ref

    @torch.no_grad()
    def _zero_step(self, original: Any, closure: Any = None) -> None:
        self.follow_schedule()
        self.muon.apply_update(engine_step=lambda: self._engine_step(original))  # the update Muon.step runs

    def _engine_step(self, zero_step: Any) -> bool:
        """ZeRO's own step, then (unless it overflowed) the owners' gradients unscaled and clipped by ZeRO's
        factor; whether dmuon's part of the step runs."""
        zero = self.engine.optimizer
        self.norm = None
        zero_step()
        if zero.overflow:  # ZeRO skipped the step and dropped the gradients (``zero_grad``: ours too)
            return False
        if self.bf16_optimizer:  # its step clipped the owners' gradients too (``get_grads_for_norm``)
            return True
        grads = [g for dp in self.state.owned() if (g := dp.reduced_grad()) is not None]
        if grads:
            zero.unscale_and_clip_grads(grads, self.norm)
        return True

    def _zero_scaled_global_norm(self, original: Any, norm_type: float = 2) -> torch.Tensor:
        theirs = original(norm_type)
        ctx = self.state.ctx
        ours = owned_squared_norm(self.state)
        theirs_t = torch.as_tensor(theirs, dtype=torch.float32).to(ctx.device)
        total = torch.sqrt(theirs_t.clamp(min=0) ** 2 + ours)
        # ZeRO marks an inf / NaN norm -1 (its overflow sentinel); keep it, and mark a dedicated one the same way
        total = torch.where((theirs_t < 0) | ~torch.isfinite(total), torch.full_like(total, -1.0), total)
        self.norm = total.to(theirs.device if isinstance(theirs, torch.Tensor) else total.device)
        return self.norm

    def _zero_get_grads_for_norm(self, original: Any, for_clipping: bool = False) -> Any:
        """``BF16_Optimizer``: the gradients its step takes the norm of (each rank has all of its own, averaged,
        and sums them locally), plus one scalar that holds the dedicated gradients' norm, summed over their
        owners; for the clip, the owners' gradients themselves. So its norm, clip factor and inf / NaN verdict
        are the whole model's, as at stage 1 and 2."""
        theirs = original(for_clipping)
        if for_clipping:
            return theirs + owned_grads(self.state)
        plain, experts = theirs
        return [*plain, owned_squared_norm(self.state).sqrt().reshape(1)], experts

    def _zero_has_overflow(self, original: Any, partition_gradients: bool = True) -> bool:
        theirs = original(partition_gradients)
        return owned_overflow(self.state) or bool(theirs)  # every rank reaches the all-reduce

    def _zero_zero_grad(self, original: Any, set_to_none: bool = True) -> None:
        original(set_to_none)
        self.state.finish_reduces()
        self.state.clear_grads(set_to_none=set_to_none)

    # ------------------------------------------------------------------ #
    # Checkpoints                                                          #
    # ------------------------------------------------------------------ #
    def _module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                           exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """``engine.save_checkpoint`` (every rank): the full model dict, gathered by every rank, kept by rank 0."""
        sd = get_model_state_dict(self.state.model, rank0_only=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.state.model.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    def _check(self, load: ModelLoad | None) -> None:
        self._checked = load

    def _load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True, *args: Any,
                                **kwargs: Any) -> None:
        """``engine.load_checkpoint`` (every rank reads the same file): dmuon's setter (which restarts ZeRO's fp32
        copies from the loaded values; its optimizer files then bring the saved ones); the dict dmuon's load
        already checked is written without a second check ([Note: atomic DeepSpeed loads] in ``_load.py``)."""
        load = self._checked
        if load is not None and load.sd is checkpoint["module"]:
            apply_model_sd(load)
        else:
            set_model_state_dict(self.state.model, checkpoint["module"])

    def _save_checkpoint(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """``engine.save_checkpoint`` (every rank). At stage 0 only rank 0 writes the optimizer's state (in the
        model file), so every rank's owned part is gathered first and the facade's state dict carries them all."""
        if self.stage == 0:
            self._parts = C.all_gather_object(self.state.ctx, _on_cpu(owned_part(self.state, self.muon)))
        try:
            return original(*args, **kwargs)
        finally:
            self._parts = None

    def _save_owned(self, facade: Any, sd: dict[str, Any]) -> dict[str, Any]:
        sd[STATE_KEY] = {"parts": self._parts} if self._parts is not None else owned_part(self.state, self.muon)
        return sd

    def _take_owned(self, facade: Any, sd: dict[str, Any]) -> dict[str, Any]:
        self._loaded = part_of(sd.pop(STATE_KEY, None), self.state.ctx.rank)
        return sd

    def _relink(self, facade: Any) -> None:
        """After ZeRO loaded the facade: torch's ``load_state_dict`` made new group dicts, so copy their values
        into the shared ones (which ``dmuon.Muon`` and its schedulers hold) and hand those back; then restore
        the owners' state (checked before anything was written: ``engine.load_checkpoint``)."""
        for shared, new in zip(self.shared, facade.param_groups):
            shared.update(new)
        facade.param_groups = self.shared
        part, self._loaded = self._loaded, None
        found = part_problems(part, self.state, self.muon, "the ZeRO file")
        if found:  # only a load that bypassed engine.load_checkpoint gets here
            raise ValueError(f"dmuon: ZeRO's optimizer state was loaded without engine.load_checkpoint's checks, and "
                             f"its dmuon part does not fit: {found[0]}.")
        for g, saved in zip(own_groups(self.muon), part["groups"]):  # type: ignore[index]
            g.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        for dp in self.state.owned():
            entry = part["state"].get(dp.fqn)  # type: ignore[index]
            self.muon.state.pop(dp.param, None)
            if entry:
                self.muon.state[dp.param] = {k: v.to(dp.param.device) if isinstance(v, torch.Tensor) and k != "step"
                                             else v for k, v in entry.items()}
            dp.forget_master_version()


def _is_bf16_optimizer(zero: Any) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(zero, BF16_Optimizer)


def _on_cpu(x: Any) -> Any:
    """``x`` with every tensor copied to the CPU (what a gather of objects sends)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(v) for v in x)
    return x


def _bound(method: Any, original: Any) -> Any:
    """``method`` with ZeRO's own bound method first: what replaces it on the instance."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(original, *args, **kwargs)

    call.__wrapped__ = original  # type: ignore[attr-defined]
    call.__name__ = getattr(original, "__name__", "method")
    return call

