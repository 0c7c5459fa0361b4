"""dmuon's optimizer in torchtitan: :class:`DMuonOptimizersContainer` (one :class:`dmuon.Muon`), the
gradient scale it registers and the dmuon-aware :func:`clip_grad_norm_` it installs in torchtitan.

[Note: gradient scale]
torchtitan divides each rank's summed loss by the *global* token count and switches FSDP2's gradient
division off (``set_gradient_divide_factor(1.0)``), so FSDP2 *sums* gradients over the data-parallel ranks
``dp`` (the world, or the world over the "tp" degree under tensor parallelism, where every tp rank of a
dp slot computes the same loss). dmuon averages dedicated gradients over those same ``dp`` ranks, which
alone would leave them ``dp`` times too small (Muon's Newton–Schulz hides most of that, the gradient norm
and clipping would not). The container therefore registers a hook that multiplies every local dedicated
gradient by ``dp / divide_factor`` (2 on two data-parallel ranks, 1 when FSDP2 averages) before dmuon's
reduce, so each owner ends up with exactly the gradient a single process would compute. Under mixed
precision the local gradient is in the compute dtype (bf16): the product is exact for power-of-two factors
and rounded once to bf16 otherwise (e.g. 3 or 24 ranks).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.distributed import utils as tt_dist_utils

import dmuon

from ...checkpoint.checksum import CHECKSUMS_KEY
from ...runtime.hooks import STATE_ATTR
from ...runtime.param import is_dedicated
from ...optim.newton_schulz import KELLER_JORDAN_COEFFICIENTS
from ...optim.normuon import NorMuonHParams
from .parallelize import _MODELS, _adopt

_CLIP_MARK = "__dmuon_wrapped__"


# --------------------------------------------------------------------------------------------------- #
# Gradient scale and clipping                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _fsdp_divide_factor(model: nn.Module) -> float | None:
    """FSDP2's gradient divide factor on this model (``None``: FSDP2's default, the average)."""
    factors: set[float | None] = set()
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            groups = m._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
        except AttributeError:  # FSDP2 internals moved: assume torchtitan's disable_fsdp_gradient_division
            return 1.0
        factors.update(g.gradient_divide_factor for g in groups)
    if len(factors) > 1:
        raise ValueError(f"dmuon torchtitan: FSDP2 modules use different gradient divide factors {factors}")
    return factors.pop() if factors else None


def dedicated_grad_scale(model: nn.Module) -> float:
    """The factor that turns dmuon's averaged dedicated gradients into what FSDP2 gives its own params:
    ``dp / divide_factor`` (torchtitan: ``dp``, since it sums), 1.0 when FSDP2 averages. ``dp`` is the
    data-parallel ranks both average or sum over: the world, or the world over the "tp" degree."""
    factor = _fsdp_divide_factor(model)
    state = getattr(model, STATE_ATTR, None)  # without dedicate_params: the world, as FSDP2 alone averages
    dp = state.ctx.world_size if state is not None else dist.get_world_size()  # dmuon's data-parallel slots
    return 1.0 if factor is None else dp / float(factor)


def _scale(factor: float, grad: torch.Tensor) -> torch.Tensor:
    return grad * factor


def _register_grad_scale(model: nn.Module, optimizer: dmuon.Muon) -> list[RemovableHandle]:
    """Scale local gradients of params dmuon averages (dedicated, and plain replicated ones) so their reduced
    value matches FSDP2's reduction. See [Note: gradient scale]. (A TP weight's gradient gets the weight's
    placements in dmuon's own hook, ``runtime/hooks.py`` ``_placed_like``.)"""
    factor = dedicated_grad_scale(model)
    if factor == 1.0:
        return []
    params = list(dmuon.get_dedicated_params(model).values())
    params += [p for g in optimizer.param_groups if g["kind"] == "adamw_replicated" for p in g["params"]]
    return [p.register_hook(functools.partial(_scale, factor)) for p in params]


def _models_of(params: list[torch.Tensor]) -> list[nn.Module]:
    """The adopted dmuon models whose parameters together are exactly ``params`` (what the Trainer passes: one
    model, or under pipeline parallelism this rank's model parts), in the order of ``params``."""
    index = {id(p): i for i, p in enumerate(params)}
    models = [m for m in list(_MODELS) if any(id(p) in index for p in m.parameters())]
    models.sort(key=lambda m: min(index.get(id(p), len(params)) for p in m.parameters()))
    if models and {id(p) for m in models for p in m.parameters()} == index.keys():
        return models
    raise ValueError(
        f"dmuon torchtitan clip_grad_norm_: the {len(params)} parameters include dedicated ones but are not all the "
        "parameters of the model (or of this rank's pipeline model parts) prepared with dmuon_model_spec / "
        "with_dmuon / dedicate; clip the whole model (dmuon.clip_grad_norm_(model_parts, max_norm))."
    )


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: Any = None,
    ep_enabled: bool = False,
) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` signature over :func:`dmuon.clip_grad_norm_`. Collective.

    ``parameters`` must be all the parameters of one dmuon model, or under pipeline parallelism of this rank's
    model parts, as the Trainer passes them. The norm is the global one (dedicated gradients on their owners,
    FSDP2 shards, plain gradients once; every stage's), identical on every rank; ``foreach`` is ignored, and so
    is ``pp_mesh`` (dmuon's norm already sums over every rank of every stage). Under expert parallelism
    (``ep_enabled``) the experts' gradients are DTensors over ("efsdp", "ep"), and each rank counts its own
    shard of them as of every other FSDP2 gradient.

    Example::

        loss.backward()
        grad_norm = clip_grad_norm_(list(model.parameters()), max_norm=1.0)
        optimizers.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    return dmuon.clip_grad_norm_(_models_of(params), max_norm, norm_type, error_if_nonfinite)


def _install_clip_patch() -> None:
    """Route ``torchtitan.distributed.utils.clip_grad_norm_`` (what the Trainer calls) to
    :func:`clip_grad_norm_` for parameter lists with dedicated params. Idempotent."""
    original = tt_dist_utils.clip_grad_norm_
    if getattr(original, _CLIP_MARK, False):
        return

    @functools.wraps(original)
    def patched(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(is_dedicated(p) for p in params):
            return clip_grad_norm_(params, *args, **kwargs)
        return original(params, *args, **kwargs)

    setattr(patched, _CLIP_MARK, True)
    tt_dist_utils.clip_grad_norm_ = patched


# --------------------------------------------------------------------------------------------------- #
# Optimizers                                                                                           #
# --------------------------------------------------------------------------------------------------- #
_MUON = NorMuonHParams()  # the defaults (NorMuon's record holds Muon's fields and its own)
#: torchtitan's ``ParamGroupConfig.optimizer_name`` values the container takes, and what each means
_OPTIMIZER_NAMES = {"Muon": True, "AdamW": False}


def _check_group_configs(configs: Sequence[Any]) -> None:
    for i, pg in enumerate(configs):
        if not isinstance(pg, ParamGroupConfig):
            raise ValueError(f"DMuonOptimizersContainer.Config: param_groups[{i}] must be a torchtitan "
                             f"ParamGroupConfig, got {type(pg).__name__}")
        if pg.optimizer_name not in _OPTIMIZER_NAMES:
            raise ValueError(f"DMuonOptimizersContainer.Config: param_groups[{i}] ({pg.pattern!r}): optimizer_name "
                             f"must be one of {sorted(_OPTIMIZER_NAMES)}, got {pg.optimizer_name!r}")
        try:
            re.compile(pg.pattern)
        except re.error as e:
            raise ValueError(f"DMuonOptimizersContainer.Config: param_groups[{i}]: bad pattern {pg.pattern!r}: "
                             f"{e}") from None


def dmuon_param_groups(model: nn.Module, configs: Sequence[ParamGroupConfig]) -> list[dict[str, Any]]:
    r"""torchtitan's pattern groups as ``dmuon.Muon(param_groups=...)``. As torchtitan's: patterns are searched
    in each trainable param's canonical FQN, first match wins, a pattern that matches nothing raises. A
    ``"Muon"`` pattern claims dedicated matrices only and an ``"AdamW"`` one the other params (which are on
    Muon is ``dedicate``'s predicate's choice), so a catch-all ``".*"`` AdamW group works beside Muon ones.

    Example::

        ParamGroupConfig(pattern=r"norm|\.bias$", optimizer_name="AdamW", optimizer_kwargs={"weight_decay": 0.0})
    """
    dedicated = {canonical_fqn(n) for n in dmuon.get_dedicated_params(model)}
    trainable = [canonical_fqn(n) for n, p in model.named_parameters() if p.requires_grad]
    claimed: set[str] = set()
    out = []
    for pg in configs:
        use_muon = _OPTIMIZER_NAMES[pg.optimizer_name]
        pattern = re.compile(pg.pattern)
        names = [n for n in trainable if n not in claimed and (n in dedicated) == use_muon and pattern.search(n)]
        if not names:
            raise ValueError(f"DMuonOptimizersContainer: param_groups pattern {pg.pattern!r} ({pg.optimizer_name}) "
                             "matched no parameters")
        claimed.update(names)
        out.append({"params": names, "use_muon": use_muon, "name": pg.pattern, **pg.optimizer_kwargs})
    return out


class DMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one :class:`dmuon.Muon` per model part (Muon on owned dedicated
    matrices, AdamW on everything else): one part, or under pipeline parallelism each of this rank's stages.

    Build it from its config where torchtitan builds optimizers (``Trainer.Config.optimizer``), or directly
    with ``DMuonOptimizersContainer.Config(...).build(model_parts=[model])`` after the model is
    materialised. ``LRSchedulersContainer`` drives every param group's ``lr`` (Muon and AdamW alike).
    ``implementation`` selects AdamW's kernel (``"fused"``, ``"foreach"``, ``"for-loop"``). ``param_groups``
    takes torchtitan's ``ParamGroupConfig`` list with ``optimizer_name`` ``"Muon"`` or ``"AdamW"`` and the
    group's hyperparameters in ``optimizer_kwargs`` (unset ones take this config's); see
    :func:`dmuon_param_groups`. Each group's settings are in the checkpoint (``param_groups.{fqn}.{key}``).

    Example::

        optimizers = DMuonOptimizersContainer.Config(lr=0.02, adamw_lr=8e-4).build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=10).build(optimizers=optimizers,
                                                                            training_steps=100)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        # Muon's fields are MuonHParams' (same names and defaults); torchtitan's config system needs them flat.
        lr: float = _MUON.lr
        """Muon learning rate."""
        momentum: float = _MUON.momentum
        nesterov: bool = _MUON.nesterov
        ns_steps: int = _MUON.ns_steps
        ns_coefficients: tuple[float, float, float] | str = KELLER_JORDAN_COEFFICIENTS
        """``(a, b, c)``, a per-step list of them, or ``"keller_jordan"`` / ``"polar_express"``."""
        ns_backend: str = _MUON.ns_backend
        """``"direct"`` (torch's arithmetic), ``"gram"`` or ``"auto"``; see :func:`dmuon.newton_schulz`."""
        eps: float = _MUON.eps
        weight_decay: float = _MUON.weight_decay
        """Muon's decoupled weight decay."""
        adjust_lr_fn: str | None = None
        """``None``/``"original"`` or ``"match_rms_adamw"``, as in ``torch.optim.Muon``."""
        algorithm: str = "muon"
        """The Muon groups' update rule: ``"muon"`` or ``"normuon"`` (docs/guides/normuon.md)."""
        cautious_weight_decay: bool = _MUON.cautious_weight_decay
        beta2: float = _MUON.beta2
        normuon_eps: float = _MUON.normuon_eps
        rms_target: float | None = _MUON.rms_target
        """NorMuon's second-moment decay, epsilon and update RMS (the paper's defaults)."""
        adamw_lr: float = 8e-4
        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.1
        replicate_async: bool = True
        """HSDP: publish updated matrices over the replicate group without waiting inside ``step()``."""

        def __post_init__(self) -> None:
            _check_group_configs(self.param_groups)
            if self.implementation not in ("fused", "foreach", "for-loop"):
                raise ValueError(
                    "DMuonOptimizersContainer.Config: implementation must be 'fused', 'foreach' or 'for-loop', "
                    f"got {self.implementation!r}"
                )

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if not model_parts:
            raise ValueError("DMuonOptimizersContainer: model_parts is empty; pass the model (or this rank's "
                             "pipeline model parts) as a list")
        self.optimizers = [self._build_muon(config, model) for model in model_parts]
        self.model_parts = list(model_parts)
        #: the first part (the model itself without pipeline parallelism)
        self.model = model_parts[0]
        #: set by DMuonCheckpointManager while it loads: state_dict() gives staged copies ([Note: staged loads])
        self._staged = False
        self._grad_scale_hooks = [h for model, muon in zip(model_parts, self.optimizers)
                                  for h in _register_grad_scale(model, muon)]
        for model in model_parts:
            _adopt(model)
        _install_clip_patch()
        self._post_init([p for muon in self.optimizers for g in muon.param_groups for p in g["params"]])

    @staticmethod
    def _build_muon(config: Config, model: nn.Module) -> dmuon.Muon:
        return dmuon.Muon(
            model, algorithm=config.algorithm, **{name: getattr(config, name) for name in NorMuonHParams.names()},
            adamw_lr=config.adamw_lr, adamw_betas=tuple(config.adamw_betas),
            adamw_eps=config.adamw_eps, adamw_weight_decay=config.adamw_weight_decay,
            adamw_foreach=config.implementation == "foreach", adamw_fused=config.implementation == "fused",
            replicate_async=config.replicate_async,
            param_groups=dmuon_param_groups(model, config.param_groups) if config.param_groups else None,
        )

    @property
    def muon(self) -> dmuon.Muon:
        """The first part's optimizer (the only one without pipeline parallelism)."""
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat layout from dmuon's sharded dict. Collective.

        ``state.{fqn}.{name}``: live tensors (AdamW moments as DTensors, each Muon momentum on its owner
        only); ``param_groups.{fqn}.{key}``: every group's hyperparameters, for every param FQN;
        ``_dmuon_checksums.{fqn}.{name}``: every state tensor's checksum ([Note: checkpoint checksums]), on
        every rank, so a corrupted or torn optimizer checkpoint is refused like a model one. While
        :class:`DMuonCheckpointManager` loads, the tensors are staged copies instead ([Note: staged loads]).
        """
        flat: dict[str, Any] = {}
        for model, muon in zip(self.model_parts, self.optimizers):  # FQN keys: the parts' never overlap
            flat.update(self._flat(model, muon))
        return flat

    def _flat(self, model: nn.Module, muon: dmuon.Muon) -> dict[str, Any]:
        nested = dmuon.get_optimizer_state_dict(model, muon, sharded=True, staged=self._staged)
        flat: dict[str, Any] = {}
        for fqn, entry in nested["state"].items():
            for name, value in entry.items():
                flat[f"state.{canonical_fqn(fqn)}.{name}"] = value
        for group in nested["param_groups"]:
            for fqn in group["param_names"]:
                for key, value in group.items():
                    if key != "param_names":
                        flat[f"param_groups.{canonical_fqn(fqn)}.{key}"] = value
        for key, value in nested[CHECKSUMS_KEY].items():
            fqn, name = key.rsplit(".", 1)  # (a state entry's name has no dot)
            flat[f"{CHECKSUMS_KEY}.{canonical_fqn(fqn)}.{name}"] = value
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a flat dict from :meth:`state_dict` (after ``dcp.load``) through dmuon. Collective.

        Keys this optimizer does not hold (other components of torchtitan's checkpoint) are ignored;
        ``dmuon.set_optimizer_state_dict`` validates the rest and compares the checksums before anything
        changes. (:class:`DMuonCheckpointManager` loads the model and this optimizer together instead.)
        """
        for i, (model, muon) in enumerate(zip(self.model_parts, self.optimizers)):
            dmuon.set_optimizer_state_dict(model, muon, self.nested_state_dict(state_dict, part=i))

    def nested_state_dict(self, state_dict: dict[str, Any], *, part: int = 0) -> dict[str, Any]:
        """dmuon's sharded dict (``dmuon.set_optimizer_state_dict``'s input) of model part ``part`` from a flat
        one of :meth:`state_dict`'s layout; an entry it lacks keeps the live value. Collective."""
        template = dmuon.get_optimizer_state_dict(self.model_parts[part], self.optimizers[part], sharded=True)
        state = {
            fqn: {name: state_dict.get(f"state.{canonical_fqn(fqn)}.{name}", value) for name, value in entry.items()}
            for fqn, entry in template["state"].items()
        }
        groups = []
        for group in template["param_groups"]:
            names = group["param_names"]
            loaded = dict(group)
            if names:
                prefix = f"param_groups.{canonical_fqn(names[0])}."
                loaded.update({k: state_dict[prefix + k] for k in group
                               if k != "param_names" and prefix + k in state_dict})
            groups.append(loaded)
        sums = {}
        for key in template[CHECKSUMS_KEY]:
            fqn, name = key.rsplit(".", 1)
            flat_key = f"{CHECKSUMS_KEY}.{canonical_fqn(fqn)}.{name}"
            if flat_key in state_dict:
                sums[key] = state_dict[flat_key]
        return {"state": state, "param_groups": groups, CHECKSUMS_KEY: sums}
