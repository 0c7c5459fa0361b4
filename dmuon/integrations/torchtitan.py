"""dmuon inside torchtitan: dedicated Muon matrices under torchtitan's FSDP2, optimizers and DCP checkpoints.

torchtitan builds the model on the meta device, calls the model's ``parallelize_fn`` (which runs
``fully_shard``), materialises it with ``to_empty`` + ``init_weights``, and then builds the optimizers,
LR schedulers and checkpointer from its config. This module supplies one piece per step:

* :func:`dmuon_model_spec` (or :func:`with_dmuon` around any ``parallelize_fn``) runs :func:`dedicate` right
  before torchtitan's own ``fully_shard``. ``import dmuon`` makes ``fully_shard`` skip the selected matrices.
* :class:`DMuonOptimizersContainer` builds one :class:`dmuon.Muon` where torchtitan builds its optimizers
  (``optimizer=DMuonOptimizersContainer.Config(lr=..., adamw_lr=...)``). Its ``state_dict`` is torchtitan's
  flat ``state.{fqn}.{name}`` / ``param_groups.{fqn}.{key}`` layout, built by
  :func:`dmuon.get_optimizer_state_dict` (``sharded=True``): each Muon momentum appears only on its owner.
* :class:`DMuonCheckpointManager` is torchtitan's DCP ``CheckpointManager`` with a model wrapper that
  saves :func:`dmuon.get_model_state_dict` (``sharded=True``): FSDP2 DTensors plus each dedicated tensor
  only on its owner, never a non-owner's 0-byte placeholder. After ``dcp.load`` it hands the loaded dict
  to :func:`dmuon.set_model_state_dict`, which republishes the owners' weights. The model part keeps
  torchtitan's stock keys (fused QKV saved as ``wq``/``wk``/``wv``), so a model without dmuon loads it.
* :func:`clip_grad_norm_` is torchtitan's ``clip_grad_norm_`` signature over :func:`dmuon.clip_grad_norm_`
  (dedicated gradients live on one rank each). Building the container installs it in place of
  ``torchtitan.distributed.utils.clip_grad_norm_``, which the Trainer calls; for parameter lists without
  dedicated params it forwards to torchtitan's original unchanged.

Trainer example::

    from torchtitan.models.llama3 import model_registry
    from dmuon.integrations import torchtitan as dmuon_tt

    config = Trainer.Config(
        model_spec=dmuon_tt.dmuon_model_spec(model_registry("8B")),
        optimizer=dmuon_tt.DMuonOptimizersContainer.Config(lr=0.02, adamw_lr=8e-4),
        checkpoint=dmuon_tt.DMuonCheckpointManager.Config(enable=True, interval=500),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        training=TrainingConfig(disable_cuda_graphs=True, ...),
        ...
    )

[Note: mixed precision]
torchtitan's parallelize functions always give FSDP2 ``MixedPrecisionPolicy(param_dtype=
training.mixed_precision_param, reduce_dtype=training.mixed_precision_reduce)``, at every data-parallel
degree (the autocast path ``TrainingConfig``'s docstring mentions does not exist in torchtitan 0.3.0).
FSDP2 casts only the parameters it manages, so :func:`with_dmuon` hands the same settings to
:func:`dedicate` as dmuon's ``param_dtype`` / ``reduce_dtype`` (:func:`mixed_precision_dtypes`). With
torchtitan's defaults (an fp32 model, ``"bfloat16"`` / ``"float32"``) the dedicated matrices compute and
travel in bf16, their owners keep the fp32 values that Muon updates and checkpoints hold, and their
gradients are reduced and kept in fp32, as FSDP2 does for its own parameters.

[Note: gradient scale]
torchtitan divides each rank's summed loss by the *global* token count and switches FSDP2's gradient
division off (``set_gradient_divide_factor(1.0)``), so FSDP2 *sums* gradients over ranks. dmuon averages
dedicated gradients over the world, which alone would leave them ``world`` times too small (Muon's
Newton–Schulz hides most of that, the gradient norm and clipping would not). The container therefore
registers a hook that multiplies every local dedicated gradient by ``world / divide_factor`` (2 on two
ranks, 1 when FSDP2 averages) before dmuon's reduce, so each owner ends up with exactly the gradient a
single process would compute. Under mixed precision the local gradient is in the compute dtype (bf16): the
product is exact for power-of-two factors and rounded once to bf16 otherwise (e.g. 3 or 24 ranks).

Scope (each checked with a ``ValueError`` naming the setting):

* data parallelism only: FSDP, or HSDP (``data_parallel_replicate_degree > 1``); no TP, CP, PP or EP,
  since dmuon's mesh must cover every rank;
* ``parallelism.spmd_backend="partial_dtensor"`` (the ``full_dtensor`` / ``spmd_types`` backends demand
  that every parameter be a DTensor, including the ones dmuon keeps whole);
* ``training.mixed_precision_param`` no wider than ``training.dtype`` (dmuon computes a dedicated matrix
  in its own dtype or a narrower one, never in a wider one: ``dtype="bfloat16"`` needs
  ``mixed_precision_param="bfloat16"``);
* ``training.enable_cpu_offload=False`` (FSDP2's offload policy does not cover dedicated params);
* on CUDA, ``training.disable_cuda_graphs=True`` (dmuon's broadcasts and storage resizes cannot be
  captured in a CUDA graph);
* the Hugging Face export/import paths of the checkpointer (``last_save_in_hf``, ``initial_load_in_hf``);
  use :func:`dmuon.get_model_state_dict` / :func:`dmuon.set_model_state_dict` for full tensors instead.

Tested on CPU/gloo (2-rank FSDP, 2x2 HSDP, selective activation checkpointing, 2-rank FSDP under
torchtitan's default mixed precision) by driving these pieces with the calls and arguments
``Trainer.__init__`` / ``train_step`` use; ``Trainer`` itself was not run (on CPU its device-memory monitor
needs CUDA). Not tested: CUDA, ``torch.compile`` of the blocks, async checkpoint modes, MoE models;
``dtype="bfloat16"`` training was only run by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

import dmuon

from ..runtime.param import is_dedicated
from ..runtime.precision import is_wider
from ..runtime.hooks import STATE_ATTR
from ..optim.newton_schulz import KELLER_JORDAN_COEFFICIENTS
from ..optim.update import MuonHParams
from ..partition import OwnerPlan

try:
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpointer import CheckpointManager, ModelWrapper
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.config import TORCH_DTYPE_MAP, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_dist_utils
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.protocols.model_spec import ModelSpec
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dmuon.integrations.torchtitan needs torchtitan (tested with 0.3.0); install it with "
        f"`pip install torchtitan triton`. Import failed with: {e}"
    ) from e

__all__ = [
    "DMuonCheckpointManager",
    "DMuonModelWrapper",
    "DMuonOptimizersContainer",
    "clip_grad_norm_",
    "dedicate",
    "dedicated_grad_scale",
    "default_predicate",
    "dmuon_model_spec",
    "mixed_precision_dtypes",
    "with_dmuon",
]

Predicate = Callable[[str, nn.Parameter], bool]

#: Matrices of torchtitan's dense decoder blocks: attention (fused ``wqkv`` or ``wq``/``wk``/``wv``, and
#: ``wo``) and the dense feed-forward (``w1``/``w2``/``w3``).
_BLOCK_MATRIX = re.compile(r"^layers\.\d+\.(?:attention|feed_forward)\.(?:.+\.)?weight$")

#: Models prepared through this module, so :func:`clip_grad_norm_` can find the model of a parameter list.
_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_CLIP_MARK = "__dmuon_wrapped__"


# --------------------------------------------------------------------------------------------------- #
# Selecting and dedicating                                                                             #
# --------------------------------------------------------------------------------------------------- #
def default_predicate(fqn: str, param: nn.Parameter) -> bool:
    """The 2-D weights of every decoder block's attention and dense feed-forward.

    Embeddings, ``lm_head``, norms, MoE routers and (3-D) experts stay on AdamW, as Muon intends. ``fqn`` is
    compared in torchtitan's canonical form (activation-checkpoint wrapper segments removed).
    """
    return param.ndim == 2 and _BLOCK_MATRIX.match(canonical_fqn(fqn)) is not None


def _check_parallel_dims(parallel_dims: ParallelDims) -> None:
    if not isinstance(parallel_dims, ParallelDims):
        raise TypeError(f"dmuon torchtitan: expected torchtitan's ParallelDims, got {type(parallel_dims).__name__}")
    others = {
        "tensor_parallel_degree": parallel_dims.tp,
        "context_parallel_degree": parallel_dims.cp,
        "pipeline_parallel_degree": parallel_dims.pp,
        "expert_parallel_degree": parallel_dims.ep,
    }
    unsupported = {k: v for k, v in others.items() if v != 1}
    if unsupported:
        raise ValueError(
            f"dmuon torchtitan: only data parallelism (FSDP / HSDP) is supported, got {unsupported}; dmuon's mesh "
            "must cover every rank."
        )
    if parallel_dims.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"dmuon torchtitan: parallelism.spmd_backend must be 'partial_dtensor', got "
            f"{parallel_dims.spmd_backend!r}; the other backends require every parameter to be a DTensor, "
            "dedicated ones included."
        )


def dedicate(
    model: nn.Module,
    parallel_dims: ParallelDims,
    predicate: Predicate | None = None,
    *,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> OwnerPlan:
    """:func:`dmuon.dedicate_params` on torchtitan's data-parallel meshes; call it before ``parallelize_fn``.

    The shard mesh is ``parallel_dims``' ``"fsdp"`` mesh; with ``data_parallel_replicate_degree > 1`` the
    ``"dp_replicate"`` mesh becomes dmuon's ``replicate_mesh`` (HSDP). ``predicate(fqn, param)`` defaults to
    :func:`default_predicate`. Works on meta-device models (torchtitan's ``to_empty`` comes later).
    ``reshard_after_forward``, ``prefetch``, ``param_dtype`` and ``reduce_dtype`` are
    :func:`dmuon.dedicate_params`'s. The dtypes must match the ``MixedPrecisionPolicy`` torchtitan gives
    FSDP2, or the first forward meets bf16 activations with fp32 weights: take them from
    :func:`mixed_precision_dtypes` (:func:`with_dmuon` does).

    Example::

        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1,
                                     world_size=world, spmd_backend="partial_dtensor")
        param_dtype, reduce_dtype = dmuon_tt.mixed_precision_dtypes(training)
        dmuon_tt.dedicate(model, parallel_dims, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, ...)
    """
    _check_parallel_dims(parallel_dims)
    shard = parallel_dims.get_mesh("fsdp")
    replicate = parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
    plan = dmuon.dedicate_params(
        model, shard, predicate if predicate is not None else default_predicate,
        replicate_mesh=replicate, reshard_after_forward=reshard_after_forward, prefetch=prefetch,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
    )
    _adopt(model)
    return plan


def _adopt(model: nn.Module) -> None:
    """Make a dmuon-prepared torchtitan model safe for this module's state dicts and clipping (idempotent)."""
    _unhook_fused_qkv(model)
    _MODELS.add(model)


# [Note: fused QKV]
# torchtitan's FusedQKVLinear (every Llama 3 flavour) registers a state_dict post-hook that splits the
# live ``wqkv`` weight into new ``wq``/``wk``/``wv`` tensors, and a load pre-hook that merges them back.
# The split reads the weight's data, which a non-owner of a dedicated ``wqkv`` does not have, and the
# tensors it produces are copies, which dmuon's state-dict functions cannot load into. ``dedicate`` removes
# both hooks, so ``model.state_dict()`` (and dmuon.get_model_state_dict) report the live ``wqkv``;
# DMuonModelWrapper applies torchtitan's own split / merge around DCP, so checkpoints keep torchtitan's
# stock ``wq``/``wk``/``wv`` layout (a model without dmuon loads them).
def _fused_qkv_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(state-dict prefix, module)`` of every FusedQKVLinear in ``model``."""
    try:
        from torchtitan.models.common.attention import FusedQKVLinear
    except ImportError:  # no triton: no torchtitan model with attention could have been built
        return []
    return [
        (f"{canonical_fqn(name)}." if name else "", m)
        for name, m in model.named_modules()
        if isinstance(m, FusedQKVLinear)
    ]


def _unhook_fused_qkv(model: nn.Module) -> None:
    """Remove FusedQKVLinear's split-on-save / merge-on-load hooks. See [Note: fused QKV]."""
    for _, module in _fused_qkv_modules(model):
        fused = {type(module)._split_qkv_on_save, type(module)._merge_qkv_on_load}
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "hook", h) in fused]:
                del hooks[key]


def _split_fused_qkv(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """torchtitan's checkpoint layout: ``wqkv`` keys (present ones only) split into ``wq``/``wk``/``wv``."""
    for prefix, module in _fused_qkv_modules(model):
        type(module)._split_qkv_on_save(module, state_dict, prefix, {})


def _merge_fused_qkv(model: nn.Module, state_dict: dict[str, Any]) -> None:
    for prefix, module in _fused_qkv_modules(model):
        type(module)._merge_qkv_on_load(module, state_dict, prefix)


def _config_dtype(training: TrainingConfig, setting: str) -> torch.dtype:
    """``TORCH_DTYPE_MAP[training.<setting>]``, or a ValueError naming the setting."""
    name = getattr(training, setting)
    if name not in TORCH_DTYPE_MAP:
        raise ValueError(f"dmuon torchtitan: training.{setting}={name!r} is not one of {sorted(TORCH_DTYPE_MAP)}")
    return TORCH_DTYPE_MAP[name]


def mixed_precision_dtypes(training: TrainingConfig) -> tuple[torch.dtype | None, torch.dtype | None]:
    """dmuon's ``(param_dtype, reduce_dtype)`` for torchtitan's ``training`` settings: the dedicated params'
    half of the ``MixedPrecisionPolicy`` torchtitan gives FSDP2. See [Note: mixed precision].

    Mirrors FSDP2's own clamping: ``param_dtype`` is ``None`` when ``mixed_precision_param`` is the model's
    dtype (``training.dtype``), ``reduce_dtype`` is ``None`` when ``mixed_precision_reduce`` is the compute
    dtype. torchtitan's defaults (``dtype="float32"``, ``"bfloat16"`` / ``"float32"``) give
    ``(torch.bfloat16, torch.float32)``; ``dtype="bfloat16"`` gives ``(None, torch.float32)`` (bf16 weights,
    gradients averaged in fp32). Raises ``ValueError`` for a ``mixed_precision_param`` wider than
    ``training.dtype`` (FSDP2 would compute bf16 weights in fp32; dmuon computes a dedicated matrix in at
    most its own precision).

    Example::

        mixed_precision_dtypes(TrainingConfig())  # (torch.bfloat16, torch.float32)
    """
    model = _config_dtype(training, "dtype")
    param = _config_dtype(training, "mixed_precision_param")
    reduce = _config_dtype(training, "mixed_precision_reduce")
    if is_wider(param, model):
        raise ValueError(
            f"dmuon torchtitan: training.mixed_precision_param={training.mixed_precision_param!r} is wider than "
            f"training.dtype={training.dtype!r}; dmuon cannot compute dedicated {training.dtype} matrices in "
            f"{training.mixed_precision_param}. Set mixed_precision_param={training.dtype!r}, or train in "
            f"dtype={training.mixed_precision_param!r}."
        )
    return (None if param == model else param), (None if reduce == param else reduce)


def _check_trainer_options(kwargs: dict[str, Any]) -> tuple[torch.dtype | None, torch.dtype | None]:
    """Reject trainer settings dmuon cannot honour, before anything is sharded; return the dedicated params'
    ``(param_dtype, reduce_dtype)`` (:func:`mixed_precision_dtypes`)."""
    training = kwargs.get("training")
    dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)
    if training is not None:
        dtypes = mixed_precision_dtypes(training)
        if training.enable_cpu_offload:
            raise ValueError(
                "dmuon torchtitan: training.enable_cpu_offload=True is not supported; FSDP2 would offload only the "
                "parameters it manages, and torchtitan would then build the dedicated ones on the CPU."
            )
        if not training.disable_cuda_graphs and torch.cuda.is_available():
            raise ValueError(
                "dmuon torchtitan: training.disable_cuda_graphs=False; dmuon's per-layer broadcasts cannot be "
                "captured in a CUDA graph. Set training.disable_cuda_graphs=True."
            )
    parallelism = kwargs.get("parallelism")
    if parallelism is not None and parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"dmuon torchtitan: parallelism.spmd_backend must be 'partial_dtensor', got {parallelism.spmd_backend!r}"
        )
    return dtypes


def _sum_reductions_on_gloo(model: nn.Module) -> None:
    """gloo has no PREMUL_SUM, which FSDP2 picks for torchtitan's divide factor 1.0: reduce with SUM."""
    if dist.get_backend() != "gloo":
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def with_dmuon(
    parallelize_fn: Callable[..., nn.Module],
    predicate: Predicate | None = None,
    *,
    reshard_after_forward: bool | None = None,
) -> Callable[..., nn.Module]:
    """Wrap a torchtitan ``parallelize_fn`` so it dedicates matrices first, then shards the rest.

    ``reshard_after_forward=None`` follows ``parallelism.fsdp_reshard_after_forward`` (``"never"`` keeps the
    broadcast copies until backward, like FSDP2's; otherwise they are freed after forward). The dedicated
    params get ``training``'s mixed precision (:func:`mixed_precision_dtypes`), as FSDP2's do. On gloo the
    wrapper also makes FSDP2 reduce with SUM (gloo lacks the PREMUL_SUM op FSDP2 would use).

    Example::

        model = with_dmuon(parallelize_llama)(model, parallel_dims=parallel_dims, training=training,
                                              parallelism=parallelism, compile_config=CompileConfig(),
                                              ac_config=None, dump_folder="out")
    """
    if not callable(parallelize_fn):
        raise ValueError(f"dmuon torchtitan: parallelize_fn must be callable, got {parallelize_fn!r}")

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> nn.Module:
        param_dtype, reduce_dtype = _check_trainer_options(kwargs)
        raf = reshard_after_forward
        if raf is None:
            parallelism = kwargs.get("parallelism")
            policy = parallelism.fsdp_reshard_after_forward if parallelism is not None else "default"
            raf = get_fsdp_reshard_after_forward_policy(policy, pp_enabled=False)
        dedicate(model, parallel_dims, predicate, reshard_after_forward=raf, param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype)
        model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        _sum_reductions_on_gloo(model)
        return model

    return parallelize


def dmuon_model_spec(
    spec: ModelSpec, predicate: Predicate | None = None, *, reshard_after_forward: bool | None = None
) -> ModelSpec:
    """A copy of torchtitan's ``ModelSpec`` whose ``parallelize_fn`` runs dmuon first (see :func:`with_dmuon`).

    Pipelining is dropped from the copy (dmuon needs one mesh over every rank), so a Trainer with
    ``pipeline_parallel_degree > 1`` refuses the spec instead of mis-training.

    Example::

        config.model_spec = dmuon_model_spec(model_registry("debugmodel"))
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"dmuon torchtitan: expected a torchtitan ModelSpec, got {spec!r}")
    return dataclasses.replace(
        spec,
        parallelize_fn=with_dmuon(spec.parallelize_fn, predicate, reshard_after_forward=reshard_after_forward),
        pipelining_fn=None,
    )


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
    ``world / divide_factor`` (torchtitan: ``world``, since it sums), 1.0 when FSDP2 averages."""
    factor = _fsdp_divide_factor(model)
    world = dist.get_world_size()
    return 1.0 if factor is None else world / float(factor)


def _scale(factor: float, grad: torch.Tensor) -> torch.Tensor:
    return grad * factor


def _register_grad_scale(model: nn.Module, optimizer: dmuon.Muon) -> list[RemovableHandle]:
    """Scale local gradients of params dmuon averages (dedicated, and plain replicated ones) so their
    reduced value matches FSDP2's reduction. See [Note: gradient scale]."""
    factor = dedicated_grad_scale(model)
    if factor == 1.0:
        return []
    params = list(dmuon.get_dedicated_params(model).values())
    params += [p for g in optimizer.param_groups if g["kind"] == "adamw_replicated" for p in g["params"]]
    return [p.register_hook(functools.partial(_scale, factor)) for p in params]


def _model_of(params: list[torch.Tensor]) -> nn.Module:
    """The adopted dmuon model whose parameters are exactly ``params`` (what the Trainer passes)."""
    ids = {id(p) for p in params}
    for model in list(_MODELS):
        if {id(p) for p in model.parameters()} == ids:
            return model
    raise ValueError(
        f"dmuon torchtitan clip_grad_norm_: the {len(params)} parameters include dedicated ones but are not all the "
        "parameters of one model prepared with dmuon_model_spec / with_dmuon / dedicate; clip the whole model "
        "(dmuon.clip_grad_norm_(model, max_norm))."
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

    ``parameters`` must be all the parameters of one dmuon model, as the Trainer passes them. The norm is the
    global one (dedicated gradients on their owners, FSDP2 shards, plain gradients once), identical on every
    rank; ``foreach`` is ignored. Pipeline and expert parallelism are refused.

    Example::

        loss.backward()
        grad_norm = clip_grad_norm_(list(model.parameters()), max_norm=1.0)
        optimizers.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if pp_mesh is not None or ep_enabled:
        raise ValueError(
            f"dmuon torchtitan clip_grad_norm_: pipeline/expert parallelism is not supported (pp_mesh={pp_mesh!r}, "
            f"ep_enabled={ep_enabled!r})"
        )
    return dmuon.clip_grad_norm_(_model_of(params), max_norm, norm_type, error_if_nonfinite)


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
_MUON = MuonHParams()  # the defaults


class DMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one :class:`dmuon.Muon` (Muon on owned dedicated matrices,
    AdamW on everything else).

    Build it from its config where torchtitan builds optimizers (``Trainer.Config.optimizer``), or directly
    with ``DMuonOptimizersContainer.Config(...).build(model_parts=[model])`` after the model is
    materialised. ``LRSchedulersContainer`` drives every param group's ``lr`` (Muon and AdamW alike).
    ``implementation`` selects AdamW's kernel (``"fused"``, ``"foreach"``, ``"for-loop"``).

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
        adamw_lr: float = 8e-4
        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.1
        replicate_async: bool = True
        """HSDP: publish updated matrices over the replicate group without waiting inside ``step()``."""

        def __post_init__(self) -> None:
            if self.param_groups:
                raise ValueError(
                    f"DMuonOptimizersContainer.Config: param_groups must be empty (dmuon.Muon builds its groups "
                    f"from the model), got {self.param_groups!r}"
                )
            if self.implementation not in ("fused", "foreach", "for-loop"):
                raise ValueError(
                    "DMuonOptimizersContainer.Config: implementation must be 'fused', 'foreach' or 'for-loop', "
                    f"got {self.implementation!r}"
                )

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(
                f"DMuonOptimizersContainer: expected one model part (no pipeline parallelism), got {len(model_parts)}"
            )
        model = model_parts[0]
        muon = dmuon.Muon(
            model, **{name: getattr(config, name) for name in MuonHParams.names()},
            adamw_lr=config.adamw_lr, adamw_betas=tuple(config.adamw_betas),
            adamw_eps=config.adamw_eps, adamw_weight_decay=config.adamw_weight_decay,
            adamw_foreach=config.implementation == "foreach", adamw_fused=config.implementation == "fused",
            replicate_async=config.replicate_async,
        )
        self.model_parts = list(model_parts)
        self.model = model
        self.optimizers = [muon]
        self._grad_scale_hooks = _register_grad_scale(model, muon)
        _adopt(model)
        _install_clip_patch()
        self._post_init([p for g in muon.param_groups for p in g["params"]])

    @property
    def muon(self) -> dmuon.Muon:
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat layout from dmuon's sharded dict. Collective.

        ``state.{fqn}.{name}``: live tensors (AdamW moments as DTensors, each Muon momentum on its owner
        only); ``param_groups.{fqn}.{key}``: every group's hyperparameters, for every param FQN.
        """
        nested = dmuon.get_optimizer_state_dict(self.model, self.muon, sharded=True)
        flat: dict[str, Any] = {}
        for fqn, entry in nested["state"].items():
            for name, value in entry.items():
                flat[f"state.{canonical_fqn(fqn)}.{name}"] = value
        for group in nested["param_groups"]:
            for fqn in group["param_names"]:
                for key, value in group.items():
                    if key != "param_names":
                        flat[f"param_groups.{canonical_fqn(fqn)}.{key}"] = value
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a flat dict from :meth:`state_dict` (after ``dcp.load``) through dmuon. Collective.

        Keys this optimizer does not hold (other components of torchtitan's checkpoint) are ignored;
        ``dmuon.set_optimizer_state_dict`` validates the rest.
        """
        template = dmuon.get_optimizer_state_dict(self.model, self.muon, sharded=True)
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
        dmuon.set_optimizer_state_dict(self.model, self.muon, {"state": state, "param_groups": groups})


# --------------------------------------------------------------------------------------------------- #
# Checkpoints                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _has_dmuon(model: nn.Module) -> bool:
    return getattr(model, STATE_ATTR, None) is not None


class DMuonModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` over :func:`dmuon.get_model_state_dict` / :func:`dmuon.set_model_state_dict`
    (sharded): FSDP2 DTensors plus each dedicated tensor only on its owner, so DCP writes every dedicated
    matrix once, from the rank that really holds it, and loads into live tensors in place. Fused QKV weights
    are saved in torchtitan's ``wq``/``wk``/``wv`` layout (see [Note: fused QKV])."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        for m in [model] if isinstance(model, nn.Module) else model:
            if _has_dmuon(m):
                _adopt(m)
        super().__init__(model)

    def _get_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for model in self.model:
            if _has_dmuon(model):
                sd = dmuon.get_model_state_dict(model, sharded=True)
                _split_fused_qkv(model, sd)
                out.update(sd)
            else:
                out.update(model.state_dict())
        return out

    def state_dict(self) -> dict[str, Any]:
        # Recomputed on every call: the split QKV tensors are copies and must reflect the current weights.
        self.cached_state_dict = self._get_state_dict()
        return self.cached_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model in self.model:
            if _has_dmuon(model):
                # the checkpoint dict also carries optimizer / scheduler / dataloader entries
                ours = {k: state_dict[k] for k in self._keys_of(model) if k in state_dict}
                _merge_fused_qkv(model, ours)
                dmuon.set_model_state_dict(model, ours)
            else:
                model.load_state_dict(state_dict, strict=False)
        self.cached_state_dict = self._get_state_dict()

    @staticmethod
    def _keys_of(model: nn.Module) -> list[str]:
        """This rank's checkpoint keys for ``model`` (no tensor data is read)."""
        keys = dict.fromkeys(dmuon.get_model_state_dict(model, sharded=True))
        for prefix, _ in _fused_qkv_modules(model):
            for param in ("weight", "bias"):
                fused = f"{prefix}wqkv.{param}"
                if fused in keys:
                    del keys[fused]
                    keys.update(dict.fromkeys(f"{prefix}{w}.{param}" for w in ("wq", "wk", "wv")))
        return list(keys)


class DMuonCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` that saves and restores the model through
    :class:`DMuonModelWrapper` (the optimizer container's own ``state_dict`` already goes through dmuon).

    Example::

        checkpointer = DMuonCheckpointManager.Config(enable=True, folder="ckpt", interval=100).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=out_dir)
        checkpointer.load()                 # latest step, if any
        ...
        checkpointer.save(step)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            for name in ("last_save_in_hf", "initial_load_in_hf"):
                if getattr(self, name):
                    raise ValueError(
                        f"DMuonCheckpointManager.Config: {name}=True is not supported (the HF adapters expect every "
                        "tensor on every rank); use dmuon.get_model_state_dict / set_model_state_dict for full tensors."
                    )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        for m in model_parts:  # before the stock ModelWrapper reads model.state_dict() once
            if _has_dmuon(m):
                _adopt(m)
        super().__init__(
            config, dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
            lr_schedulers=lr_schedulers, states=states, sd_adapter=sd_adapter, base_folder=base_folder,
        )
        if self.enable:
            self.states[MODEL] = DMuonModelWrapper(model_parts)
