"""torchtitan's mixture-of-experts models with dmuon: which MoE weights take Muon, and the parallel settings
refused before anything is sharded.

[Note: torchtitan MoE]
torchtitan 0.3.0's MoE layer (``moe.MoE``: qwen3's ``debugmodel_moe``, deepseek_v3, ...) holds

* the routed experts, ``moe.routed_experts.inner_experts`` (``GroupedExperts``): ``w1_EFD``, ``w3_EFD``
  ``[E, F, D]`` and ``w2_EDF`` ``[E, D, F]``, each a batch of ``E`` matrices. They take Muon, one expert at a
  time ([Note: matrix blocks] in ``dmuon/runtime/blocks.py``), on the engine's dim-0 shards when every rank of
  the shard dimension gets an expert or expert parallelism placed them (``muon_sharded``), else on one
  owner (``muon``) ([Note: routes] in ``dmuon/runtime/route.py``);
* the shared experts, ``moe.shared_experts.w1/w2/w3`` (deepseek_v3): plain 2-D projections, dedicated like
  the dense feed-forward (torchtitan's Kimi K2 DistMuon recipe puts them on Muon too);
* the router gate ``moe.router.gate.weight`` ``[E, D]``: it scores experts, and stays on AdamW by default,
  like the embeddings (torchtitan's Kimi K2 recipe puts it on Muon, citing Moonlight's Figure 4; pass a
  predicate that selects it to do the same: it is then one more 2-D matrix).

Expert parallelism (``expert_parallel_degree > 1``) happens in the model's ``parallelize`` step, which places
the experts ``Shard(0)`` over "ep"; dmuon dedicates right after it, as under tensor parallelism
([Note: tensor parallelism] in ``parallelize.py``), and leaves the experts there. torchtitan's FSDP2 then
shards them once more over "efsdp": along dim 0 (``_StridedShard(0)``), so each rank still holds whole
experts and Newton–Schulz runs where they live, unless the ``efsdp x ep`` ranks outnumber the experts, where
torchtitan switches the experts to ``Shard(1)`` (each expert's rows split over ranks, against padding): Muon
would then need a gather per expert, which dmuon does not do, so that setting is refused. Under HSDP
(``data_parallel_replicate_degree > 1``) each replicate row holds and updates its own copy of its experts
([Note: Muon on the engine's shards] in ``dmuon/optim/routes/sharded.py``). Also refused, as untested or
unsupported: expert parallelism with tensor parallelism (torchtitan's EP borrows the TP ranks), and tensor
parallelism without expert parallelism, which splits every expert's hidden dimension over "tp" (expert
tensor parallelism) when the experts take Muon. Each refusal is a ``ValueError`` naming the settings,
raised from the configuration alone, so on every rank alike and before anything is sharded.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch.nn as nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.distributed import ParallelDims

__all__ = ["ROUTED_EXPERT", "check_moe_options", "expert_modules"]

#: The 3-D weights of a routed-experts module (``GroupedExperts``), by canonical FQN.
ROUTED_EXPERT = re.compile(r"^layers\.\d+\.moe\.routed_experts\.inner_experts\.w[123]_E[A-Z]{2}$")


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module path, module)`` of every routed-experts module: one with ``num_experts`` and 3-D weights."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "num_experts", None), int)
            and any(p.ndim == 3 for p in m.parameters(recurse=False))]


def check_moe_options(model: nn.Module, parallel_dims: ParallelDims,
                      predicate: Callable[[str, nn.Parameter], bool]) -> None:
    """Refuse the MoE settings dmuon cannot honour (see [Note: torchtitan MoE]), from the configuration and
    the model's shapes alone (the model may still be on the meta device)."""
    modules = expert_modules(model)
    ep, tp = parallel_dims.ep, parallel_dims.tp
    if parallel_dims.ep_enabled and not modules:
        raise ValueError(f"dmuon torchtitan: expert_parallel_degree={ep}, but the model has no routed experts "
                         "(no module with num_experts and 3-D weights); set expert_parallel_degree=1.")
    selected = [(f"{path}.{name}" if path else name, m) for path, m in modules
                for name, p in m.named_parameters(recurse=False)
                if p.ndim == 3 and predicate(canonical_fqn(f"{path}.{name}" if path else name), p)]
    if not selected:
        return
    fqn, module = selected[0]
    if ep > 1 and tp > 1:
        raise ValueError(
            f"dmuon torchtitan: expert_parallel_degree={ep} with tensor_parallel_degree={tp} is not supported "
            "(torchtitan's expert parallelism then borrows the TP ranks; untested with dmuon). Use one of them, "
            "or keep the experts off Muon with a predicate."
        )
    if ep == 1 and tp > 1:
        raise ValueError(
            f"dmuon torchtitan: tensor_parallel_degree={tp} without expert parallelism splits every expert's "
            f"hidden dimension over 'tp' (expert tensor parallelism), but Muon needs whole expert matrices and "
            f"the predicate selects {fqn!r}. Set expert_parallel_degree > 1 instead of TP for the experts, or keep "
            "the experts off Muon with a predicate."
        )
    shards = parallel_dims.dp_shard * parallel_dims.cp * tp  # efsdp x ep, torchtitan's test for Shard(1)
    if ep > 1 and shards > module.num_experts:
        raise ValueError(
            f"dmuon torchtitan: expert_parallel_degree={ep} over {shards} data-parallel shard ranks, more than the "
            f"{module.num_experts} experts of {fqn!r}: torchtitan's FSDP2 then splits each expert's rows over "
            "ranks (Shard(1) over 'efsdp'), and Muon needs whole experts on a rank. Use at most "
            f"{module.num_experts} data-parallel shard ranks, or keep the experts off Muon with a predicate."
        )
