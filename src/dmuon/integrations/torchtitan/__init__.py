"""dmuon inside torchtitan: dedicated Muon matrices under torchtitan's FSDP2, optimizers and DCP checkpoints.

torchtitan builds the model on the meta device, calls the model's ``parallelize_fn`` (which runs
``fully_shard``), materialises it with ``to_empty`` + ``init_weights``, and then builds the optimizers,
LR schedulers and checkpointer from its config. This package supplies one piece per step:

* :func:`dmuon_model_spec` (or :func:`with_dmuon` around any ``parallelize_fn``) runs :func:`dedicate` right
  before torchtitan's own ``fully_shard``; with ``tensor_parallel_degree > 1`` or ``expert_parallel_degree >
  1``, right after torchtitan's own TP / EP step (``model.parallelize(parallel_dims)``), so the TP-sharded
  matrices are dedicated over the data-parallel ranks ([Note: tensor parallelism]) and the experts stay on
  the ranks EP gave them ([Note: torchtitan MoE]). ``import dmuon`` makes ``fully_shard`` skip the selected
  matrices. A fused ``wqkv`` is orthogonalised as its q, k and v by default (``qkv_blocks``, [Note: fused
  QKV blocks]).
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
  (dedicated gradients live on one rank each; under TP its norm counts torchtitan's (fsdp, tp) DTensors,
  such as the vocab-parallel embedding, on every tp index; under EP each rank's experts). Building the
  container installs it in place of ``torchtitan.distributed.utils.clip_grad_norm_``,
  which the Trainer calls; for parameter lists without dedicated params it forwards to torchtitan's original
  unchanged.

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

Scope (each checked with a ``ValueError`` naming the setting):

* data parallelism, FSDP or HSDP (``data_parallel_replicate_degree > 1``), tensor parallelism over either
  (``tensor_parallel_degree > 1``, torchtitan 0.3.0's ``model.parallelize`` plan) and expert parallelism
  with FSDP or HSDP (``expert_parallel_degree > 1``); pipeline parallelism (``pipeline_parallel_degree > 1``)
  with FSDP inside each stage, one ``dmuon.Muon`` per model part (not with TP, EP or HSDP yet); no CP;
  under TP no ``compile.enable_async_tensor_parallel`` (untested); with experts on Muon, no EP with TP
  (untested), no EP over more FSDP shard ranks than experts and no TP without EP (both split experts across
  ranks; [Note: torchtitan MoE]);
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
torchtitan's default mixed precision; TP with sequence parallelism and the vocab-parallel loss at dp=1 x
tp=2, dp=2 x tp=2 and 2 replicas x 1 shard x tp=2, a dp=1 x tp=2 resume, tp=2 under the default mixed
precision: ``tests/test_torchtitan_tp.py``; a qwen3 MoE with shared experts, routing pinned, at EP=2 on 2
ranks (Z2 and Z3, a resume, bf16 experts too), without EP, and at EP=2 on 2 replicas x 2 shards, against an
oracle, and a deepseek_v3 at EP=2 without one: ``tests/test_torchtitan_moe.py``) by driving these pieces with
the calls and arguments ``Trainer.__init__`` / ``train_step`` use; ``Trainer`` itself was not run (on CPU its
device-memory monitor needs CUDA). Not tested: CUDA, ``torch.compile`` of the blocks, async checkpoint modes,
MoE with learned routing against an oracle (near-tie tokens flip experts); ``dtype="bfloat16"`` training and
MoE under torchtitan's default mixed precision (EP=2: within 2e-4 of fp32 over 6 steps) were only run by hand.

The package: ``parallelize.py`` (:func:`dedicate`, :func:`with_dmuon`, :func:`dmuon_model_spec`, the
trainer settings checked first, [Note: mixed precision] and [Note: tensor parallelism]), ``_fused_qkv.py``
(:class:`QKVBlocks`, [Note: fused QKV] and [Note: fused QKV blocks]), ``_moe.py`` ([Note: torchtitan MoE]),
``optimizer.py`` (:class:`DMuonOptimizersContainer`, :func:`clip_grad_norm_` and [Note: gradient
scale]), ``qk_clip.py`` (:func:`report_max_logits`, QK-clip's forward side) and ``checkpoint.py`` (:class:`DMuonModelWrapper`,
:class:`DMuonCheckpointManager`).
"""

from __future__ import annotations

# The submodules import torchtitan's parts; a missing torchtitan (or triton) fails here, with one message.
try:
    from .checkpoint import DMuonCheckpointManager, DMuonModelWrapper
    from .qk_clip import report_max_logits
    from .optimizer import DMuonOptimizersContainer, clip_grad_norm_, dedicated_grad_scale, dmuon_param_groups
    from ._fused_qkv import QKVBlocks
    from .parallelize import (
        Predicate,  # noqa: F401  (the predicate type alias, importable from here as before)
        dedicate,
        default_predicate,
        dmuon_model_spec,
        mixed_precision_dtypes,
        with_dmuon,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dmuon.integrations.torchtitan needs torchtitan (tested with 0.3.0); install it with "
        f"`pip install torchtitan triton`. Import failed with: {e}"
    ) from e

__all__ = [
    "DMuonCheckpointManager",
    "DMuonModelWrapper",
    "DMuonOptimizersContainer",
    "QKVBlocks",
    "clip_grad_norm_",
    "dedicate",
    "dedicated_grad_scale",
    "default_predicate",
    "dmuon_model_spec",
    "dmuon_param_groups",
    "mixed_precision_dtypes",
    "report_max_logits",
    "with_dmuon",
]
