"""dmuon in torchtitan's ``parallelize_fn`` step: which matrices to dedicate, :func:`dedicate` on torchtitan's
meshes, :func:`with_dmuon` / :func:`dmuon_model_spec` that run it before ``fully_shard`` (after the model's
``parallelize`` step under tensor or expert parallelism, [Note: tensor parallelism]), the trainer settings
they check first, and the mixed-precision dtypes they hand to dmuon.

[Note: mixed precision]
torchtitan's parallelize functions always give FSDP2 ``MixedPrecisionPolicy(param_dtype=
training.mixed_precision_param, reduce_dtype=training.mixed_precision_reduce)``, at every data-parallel
degree (the autocast path ``TrainingConfig``'s docstring mentions does not exist in torchtitan 0.3.0).
FSDP2 casts only the parameters it manages, so :func:`with_dmuon` hands the same settings to
:func:`dedicate` as dmuon's ``param_dtype`` / ``reduce_dtype`` (:func:`mixed_precision_dtypes`). With
torchtitan's defaults (an fp32 model, ``"bfloat16"`` / ``"float32"``) the dedicated matrices compute and
travel in bf16, their owners keep the fp32 values that Muon updates and checkpoints hold, and their
gradients are reduced and kept in fp32, as FSDP2 does for its own parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torchtitan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.config import TORCH_DTYPE_MAP, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.module import Module as TitanModule

import dmuon

from ...runtime.comm import all_gather_default
from ...runtime.precision import is_wider
from ...partition import OwnerPlan
from ._fused_qkv import QKVBlocks, _unhook_fused_qkv, fused_qkv_blocks
from ._moe import ROUTED_EXPERT, check_moe_options

Predicate = Callable[[str, nn.Parameter], bool]

#: Matrices of torchtitan's decoder blocks: attention (fused ``wqkv`` or ``wq``/``wk``/``wv``, and ``wo``;
#: MLA's ``wq``/``wkv_a``/``wkv_b``), the dense feed-forward (``w1``/``w2``/``w3``) and an MoE layer's shared
#: experts (the same three). Not the MoE router's gate.
_BLOCK_MATRIX = re.compile(r"^layers\.\d+\.(?:attention|feed_forward|moe\.shared_experts)\.(?:.+\.)?weight$")

#: Named in the TP errors, which depend on torchtitan 0.3.0's module protocol.
_TORCHTITAN_VERSION: str = getattr(torchtitan, "__version__", "of unknown version")

#: Models prepared through this package, so :func:`clip_grad_norm_` can find the model of a parameter list.
_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def default_predicate(fqn: str, param: nn.Parameter) -> bool:
    """The 2-D weights of every decoder block's attention, dense feed-forward and MoE shared experts, and the
    3-D routed experts (``w1_EFD``, ``w2_EDF``, ``w3_EFD``: each expert its own matrix).

    Embeddings, ``lm_head``, norms and the MoE router's gate stay on AdamW ([Note: torchtitan MoE] in
    ``_moe.py``). ``fqn`` is compared in torchtitan's canonical form (activation-checkpoint wrapper segments
    removed).
    """
    name = canonical_fqn(fqn)
    if param.ndim == 3:
        return ROUTED_EXPERT.match(name) is not None
    return param.ndim == 2 and _BLOCK_MATRIX.match(name) is not None


def _check_parallel_dims(parallel_dims: ParallelDims) -> None:
    if not isinstance(parallel_dims, ParallelDims):
        raise TypeError(f"dmuon torchtitan: expected torchtitan's ParallelDims, got {type(parallel_dims).__name__}")
    if parallel_dims.cp != 1:
        raise ValueError(
            f"dmuon torchtitan: only data, tensor, expert and pipeline parallelism are supported, got "
            f"context_parallel_degree={parallel_dims.cp}; set it to 1."
        )
    if parallel_dims.pp > 1:  # each stage's model part is dedicated over its "fsdp" mesh ([Note: pipeline stages])
        others = {"tensor_parallel_degree": parallel_dims.tp, "expert_parallel_degree": parallel_dims.ep,
                  "data_parallel_replicate_degree": parallel_dims.dp_replicate}
        unsupported = {k: v for k, v in others.items() if v != 1}
        if unsupported:
            raise ValueError(
                f"dmuon torchtitan: pipeline_parallel_degree={parallel_dims.pp} runs with FSDP inside each stage "
                f"only so far, got {unsupported}; set those to 1."
            )
    if parallel_dims.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"dmuon torchtitan: parallelism.spmd_backend must be 'partial_dtensor', got "
            f"{parallel_dims.spmd_backend!r}; the other backends require every parameter to be a DTensor, "
            "dedicated ones included."
        )


def _meshes(model: nn.Module, parallel_dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh | None]:
    """dmuon's ``(mesh, replicate_mesh)`` from torchtitan's meshes. See [Note: tensor parallelism]."""
    if parallel_dims.tp_enabled and not any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"dmuon torchtitan: tensor_parallel_degree={parallel_dims.tp} but no parameter is a DTensor yet; with "
            "tensor parallelism call dedicate after torchtitan's TP step (model.parallelize(parallel_dims)) and "
            "before fully_shard, or let with_dmuon / dmuon_model_spec place it there."
        )
    replicate = parallel_dims.get_mesh("dp_replicate") if parallel_dims.dp_replicate_enabled else None
    shard = parallel_dims.get_mesh("fsdp")
    if not parallel_dims.tp_enabled:
        return shard, replicate
    tp = parallel_dims.get_mesh("tp")
    # torchtitan's meshes, outermost first, and dmuon's name for each dimension
    if replicate is None:
        theirs, names = {"fsdp": shard, "tp": tp}, ("dp", "tp")
    else:
        theirs, names = {"dp_replicate": replicate, "fsdp": shard, "tp": tp}, ("replicate", "shard", "tp")
    mesh = init_device_mesh(tp.device_type, tuple(m.size() for m in theirs.values()), mesh_dim_names=names)
    same = mesh["tp"] == tp and all(
        mesh[name].mesh.tolist() == m.mesh.tolist() for name, m in zip(names, theirs.values(), strict=True))
    # each rank compares only its own slices of the meshes: agree, so that a mismatch on some ranks raises on
    # every rank instead of leaving the others waiting in dedicate_params' first collective
    if not all(all_gather_default(same)):
        raise RuntimeError(
            f"dmuon torchtitan: torchtitan's meshes {theirs} are not the row-major {names} grid dmuon builds "
            f"({mesh}); this torchtitan version lays its mesh out differently (tested: 0.3.0)."
        )
    return mesh, None


def dedicate(
    model: nn.Module,
    parallel_dims: ParallelDims,
    predicate: Predicate | None = None,
    *,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    qkv_blocks: QKVBlocks | str = QKVBlocks.QKV,
) -> OwnerPlan:
    """:func:`dmuon.dedicate_params` on torchtitan's data-parallel meshes; call it before ``parallelize_fn``
    (with ``tensor_parallel_degree > 1`` or ``expert_parallel_degree > 1``: after the model's
    ``parallelize`` step and before ``fully_shard``, which :func:`with_dmuon` arranges).

    The shard mesh is ``parallel_dims``' ``"fsdp"`` mesh; with ``data_parallel_replicate_degree > 1`` the
    ``"dp_replicate"`` mesh becomes dmuon's ``replicate_mesh`` (HSDP). Under TP dmuon gets the same ranks as
    a ``("dp", "tp")`` or ``("replicate", "shard", "tp")`` mesh, and the TP-sharded matrices are dedicated
    as DTensors over "tp" ([Note: tensor parallelism]); experts placed by expert parallelism stay where they
    are, Muon running on each rank's experts ([Note: torchtitan MoE] in ``_moe.py``). ``predicate(fqn, param)``
    defaults to :func:`default_predicate`. ``qkv_blocks``: how Muon splits a fused ``wqkv``, ``"qkv"`` (q, k
    and v, each alone), ``"heads"`` (one matrix per head) or ``"whole"`` (one matrix), see [Note: fused QKV
    blocks] in ``_fused_qkv.py``. Works on meta-device models (torchtitan's ``to_empty`` comes later).
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
    predicate = predicate if predicate is not None else default_predicate
    check_moe_options(model, parallel_dims, predicate)
    blocks = fused_qkv_blocks(model, qkv_blocks)
    mesh, replicate = _meshes(model, parallel_dims)
    plan = dmuon.dedicate_params(
        model, mesh, predicate, replicate_mesh=replicate, reshard_after_forward=reshard_after_forward,
        prefetch=prefetch, param_dtype=param_dtype, reduce_dtype=reduce_dtype, blocks=blocks,
    )
    _adopt(model)
    return plan


def _adopt(model: nn.Module) -> None:
    """Make a dmuon-prepared torchtitan model safe for this package's state dicts and clipping (idempotent)."""
    _unhook_fused_qkv(model)
    _MODELS.add(model)


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


# [Note: tensor parallelism]
# torchtitan 0.3.0's ``parallelize_llama`` (and its other models') applies TP, activation
# checkpointing, compile and FSDP2 in one function, and dmuon must dedicate between the first and the last:
# after TP has made the matrices DTensors over "tp", before ``fully_shard``. Expert parallelism takes the same
# step (it places the experts ``Shard(0)`` over "ep"; qwen3 and deepseek_v3 call ``model.parallelize`` when
# TP or EP is on), so dmuon dedicates after it under EP too ([Note: torchtitan MoE] in ``_moe.py``). The TP
# step is torchtitan's public module protocol, ``model.parallelize(parallel_dims)``
# (``torchtitan.protocols.module.Module``: each submodule distributes its parameters by its
# ``sharding_config``), called on the root model. So
# :func:`with_dmuon` shadows ``parallelize`` on that one model instance with a function that runs the
# class's own method and then :func:`dedicate`; nothing of torchtitan is patched, no private name is
# used, and the hook is gone once it ran. The alternatives were worse: wrapping ``apply_fsdp_to_decoder``
# means patching a name inside torchtitan's model module (private, per model), and running the TP step
# ourselves means reimplementing ``parallelize_llama`` around it. If a ``parallelize_fn`` never calls
# ``model.parallelize`` (an older torchtitan with ``parallelize_module`` plans), :func:`with_dmuon` raises
# afterwards; if it shards before TP, ``dedicate_params`` refuses the FSDP2-sharded model.
# dmuon's mesh is ``init_device_mesh(..., ("dp", "tp"))`` over the same ranks, or ("replicate", "shard",
# "tp") with ``data_parallel_replicate_degree > 1``: torchtitan's own views are named ("fsdp", "tp") /
# ("dp_replicate", "fsdp", "tp"), which ``dedicate_params`` does not take, and DeviceMesh has no public
# rename. Its "tp" dimension compares equal to torchtitan's "tp" mesh (same ranks, layout and name), which
# is what ``dedicate_params`` checks the DTensors against; :func:`_meshes` verifies every dimension.
def _check_tensor_parallel_options(parallel_dims: ParallelDims, kwargs: dict[str, Any]) -> None:
    """Refuse TP settings dmuon cannot honour yet, before anything is sharded."""
    tp = parallel_dims.tp
    compile_config = kwargs.get("compile_config")
    if tp > 1 and compile_config is not None and compile_config.enable_async_tensor_parallel:
        raise ValueError(
            f"dmuon torchtitan: compile.enable_async_tensor_parallel=True with tensor_parallel_degree={tp} is "
            "not supported (it needs torch.compile of the blocks and CUDA symmetric memory; neither is tested "
            "with dmuon). Set it to False."
        )


def _model_parallel_degrees(parallel_dims: ParallelDims) -> str:
    """The settings that make torchtitan call ``model.parallelize``, for messages."""
    named = {"tensor_parallel_degree": parallel_dims.tp, "expert_parallel_degree": parallel_dims.ep}
    return ", ".join(f"{k}={v}" for k, v in named.items() if v > 1)


@contextlib.contextmanager
def _after_model_parallelize(model: nn.Module, parallel_dims: ParallelDims, run: Callable[[], Any]) -> Iterator[None]:
    """Run ``run`` (:func:`dedicate`) right after torchtitan's TP / EP step on ``model``; raise if the block
    never took that step. See [Note: tensor parallelism]."""
    step = getattr(type(model), "parallelize", None)
    if not isinstance(model, TitanModule) or step is None or "parallelize" in vars(model):
        raise ValueError(
            f"dmuon torchtitan: {_model_parallel_degrees(parallel_dims)} needs a torchtitan Module whose "
            f"parallelize_fn calls model.parallelize(parallel_dims) (torchtitan 0.3.0's TP / EP step); got "
            f"{type(model).__name__}."
        )
    done: list[bool] = []

    def parallelize(dims: ParallelDims) -> None:
        del model.parallelize  # the class's method again from here on
        step(model, dims)
        if dims is not parallel_dims:
            raise ValueError("dmuon torchtitan: model.parallelize got another ParallelDims than parallelize_fn")
        run()
        done.append(True)

    model.parallelize = parallelize  # an instance attribute: shadows the method on this model only
    try:
        yield
    finally:
        vars(model).pop("parallelize", None)
    if not done:
        raise ValueError(
            f"dmuon torchtitan: {_model_parallel_degrees(parallel_dims)}, but the parallelize_fn never called "
            f"model.parallelize(parallel_dims), torchtitan 0.3.0's TP / EP step, after which dmuon dedicates "
            f"(torchtitan {_TORCHTITAN_VERSION} here). The model is sharded without dmuon; rebuild it, or set "
            "those degrees to 1."
        )


def with_dmuon(
    parallelize_fn: Callable[..., nn.Module],
    predicate: Predicate | None = None,
    *,
    reshard_after_forward: bool | None = None,
    qkv_blocks: QKVBlocks | str = QKVBlocks.QKV,
) -> Callable[..., nn.Module]:
    """Wrap a torchtitan ``parallelize_fn`` so it dedicates matrices first, then shards the rest.

    With ``tensor_parallel_degree > 1`` or ``expert_parallel_degree > 1`` dmuon dedicates right after the
    ``parallelize_fn``'s own TP / EP step (``model.parallelize(parallel_dims)``), before its ``fully_shard``:
    see [Note: tensor parallelism]; MoE settings dmuon cannot honour are refused first ([Note: torchtitan
    MoE] in ``_moe.py``). ``predicate`` and ``qkv_blocks`` are :func:`dedicate`'s.

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
    qkv = QKVBlocks.parse(qkv_blocks)

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> nn.Module:
        param_dtype, reduce_dtype = _check_trainer_options(kwargs)
        raf = reshard_after_forward
        if raf is None:
            parallelism = kwargs.get("parallelism")
            policy = parallelism.fsdp_reshard_after_forward if parallelism is not None else "default"
            raf = get_fsdp_reshard_after_forward_policy(policy, pp_enabled=parallel_dims.pp_enabled)
        _check_parallel_dims(parallel_dims)
        check_moe_options(model, parallel_dims, predicate if predicate is not None else default_predicate)
        run = functools.partial(dedicate, model, parallel_dims, predicate, reshard_after_forward=raf,
                                param_dtype=param_dtype, reduce_dtype=reduce_dtype, qkv_blocks=qkv)
        if not (parallel_dims.tp_enabled or parallel_dims.ep_enabled):
            run()
            model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        else:
            _check_tensor_parallel_options(parallel_dims, kwargs)
            with _after_model_parallelize(model, parallel_dims, run):
                model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        _sum_reductions_on_gloo(model)
        return model

    return parallelize


def dmuon_model_spec(
    spec: ModelSpec, predicate: Predicate | None = None, *, reshard_after_forward: bool | None = None,
    qkv_blocks: QKVBlocks | str = QKVBlocks.QKV,
) -> ModelSpec:
    """A copy of torchtitan's ``ModelSpec`` whose ``parallelize_fn`` runs dmuon first (see :func:`with_dmuon`,
    whose options these are).

    Pipelining is kept: under ``pipeline_parallel_degree > 1`` torchtitan's ``pipelining_fn`` calls the wrapped
    ``parallelize_fn`` on each model part, so each part is dedicated over its stage's data-parallel ranks
    (docs/guides/pipeline-parallelism.md).

    Example::

        config.model_spec = dmuon_model_spec(model_registry("debugmodel"))
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"dmuon torchtitan: expected a torchtitan ModelSpec, got {spec!r}")
    return dataclasses.replace(
        spec,
        parallelize_fn=with_dmuon(spec.parallelize_fn, predicate, reshard_after_forward=reshard_after_forward,
                                  qkv_blocks=qkv_blocks),
    )

