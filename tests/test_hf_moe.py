"""HF transformers 5 mixture-of-experts models with the HF recipe, against the per-expert oracle.

Real ``Qwen3MoeForCausalLM`` and ``GptOssForCausalLM`` from tiny configs (random weights, no download), the
recipe of docs/guides/moe.md (its predicate and row blocks are ``examples/moe_dmuon.py``'s): ``dedicate_params``
on the attention projections and the fused experts, FSDP2 per decoder layer and on the root, ``dmuon.Muon``; 2
gloo ranks. The oracle is ``tests/_moe.py``'s: one process, ``torch.optim.Muon`` on one 2-D parameter per
expert slice and row block, ``torch.optim.AdamW`` on the rest; losses within 1e-4, weights within 5e-3.

* Qwen3-MoE (``gate_up_proj`` ``[E, 2I, H]``: gate and up are two row blocks of each expert) on both expert
  routes: FSDP2's dim-0 shards (the default with 4 experts on 2 ranks) and one owner per expert param.
  Orthogonalising the fused gate/up as one matrix (no ``blocks=``) misses the oracle.
* GPT-OSS (``gate_up_proj`` ``[E, H, 2I]``, gate and up interleaved as columns, and 2-D expert biases
  ``[E, 2I]`` / ``[E, H]``): the guide's predicate takes the 3-D experts and leaves the biases to AdamW; its
  experts are orthogonalised whole (``blocks=`` splits rows only, and a row of ``[H, 2I]`` mixes gate and up).
  On Llama 4 (built, not trained) the same predicate takes the experts and the shared expert, not the router.
* ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`` shards the model itself;
  ``dedicate_params`` then refuses it on every rank, naming the sharded modules, before changing anything.

Routing is fixed for the parity runs: HF's learned top-k router turns last-bit differences (a gradient summed
in another order over ranks) into expert flips that move the loss by ~1e-3 within a few steps whatever the
optimizer (``dmuon/tools/moe.py`` measures it). :func:`fix_routing` replaces each router's forward by the one
``routing="fixed"`` of ``dmuon/tools/moe.py`` uses: the experts of a token by its sequence position, weighted
by the softmax of the router's own logits over them, so the router still trains and the model stays smooth in
every weight. (Measured without it: GPT-OSS missed the oracle by 6.4e-4 in the loss and 2.3e-2 in the weights
after 10 steps; Qwen3-MoE happened to stay within. ``examples/moe_dmuon.py`` trains with HF's learned routing,
and ``tests/test_examples.py`` runs it.)

The experts run HF's default ``experts_implementation`` on the CPU, ``"grouped_mm"``: torch 2.13 has a float32
CPU kernel for ``torch.nn.functional.grouped_mm``, which computes what ``"eager"`` (HF's loop over the experts)
computes (checked here, since the parity runs rely on it and docs/guides/moe.md says so).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from examples.moe_dmuon import is_muon_matrix, row_blocks, tiny_config  # noqa: E402
from tests._asserts import LOSS_RTOL, WEIGHT_RTOL, assert_bitwise, assert_close_to, worst_weight  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._moe import hf_loss, per_matrix_oracle, train_hf_dedicated  # noqa: E402
from tests._training import SEQ, batches  # noqa: E402

STEPS = 10
#: [Note: init scale] in tests/test_hf.py: HF's initializer_range 0.02 makes these tiny weights small next to
#: Muon's updates, so bf16 rounding inside Newton-Schulz moves even the oracle by more than the bounds (its
#: weights by 5.2e-3 / 1.0e-2, Qwen3-MoE / GPT-OSS, fed the global batch as 2 accumulated halves for 20 steps).
#: At 0.1 that floor is 3.6e-5 / 4.8e-5 (losses) and 7.1e-4 / 1.5e-3 (weights) (CPU, torch 2.13).
INIT = 0.1


def gpt_oss_config():
    """GPT-OSS's layout at the size of :func:`examples.moe_dmuon.tiny_config`: 4 experts of ``[128, 192]``
    (gate and up interleaved as columns) and ``[96, 128]``, with their biases; one sliding-window layer."""
    return transformers.GptOssConfig(
        vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def fix_routing(model: nn.Module, seq: int = SEQ) -> int:
    """Replace the forward of every top-k router (``Qwen3MoeTopKRouter``, ``GptOssTopKRouter``, ``MixtralTopKRouter``:
    a ``weight`` ``[E, H]``, ``top_k``, and ``(logits, scores, indices)`` out) by fixed routing: token ``t`` of
    its sequence goes to experts ``t, t + 1, ... (mod E)``, weighted by the softmax of its logits over them.
    Returns how many routers it replaced."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for router in routers:
        router.forward = types.MethodType(_fixed_forward, router)
        router.fixed_seq = seq
    return len(routers)


def _fixed_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = hidden_states.reshape(-1, self.weight.shape[-1])
    logits = F.linear(h, self.weight, getattr(self, "bias", None))
    pos = torch.arange(h.shape[0], device=h.device) % self.fixed_seq
    chosen = (pos[:, None] + torch.arange(self.top_k, device=h.device)) % self.num_experts
    scores = logits.float().gather(1, chosen).softmax(dim=-1).to(logits.dtype)
    return logits, scores, chosen


def build(family: str) -> nn.Module:
    cfg = tiny_config() if family == "qwen3_moe" else gpt_oss_config()
    cfg.initializer_range = INIT
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert fix_routing(model) == cfg.num_hidden_layers
    return model


def _blocks_of(family: str, ignore_blocks: bool = False):
    """The guide's row blocks for the ``[E, 2I, H]`` layout; none for GPT-OSS's ``[E, H, 2I]``."""
    return row_blocks if family == "qwen3_moe" and not ignore_blocks else None


@dataclass(frozen=True)
class HFMoERun:
    family: str = "qwen3_moe"
    #: ``"muon"``: every expert param on one owner; ``None``: the default (FSDP2's shards, as E >= ranks)
    expert_route: str | None = None
    #: the wrong variant: a fused gate/up orthogonalised as one matrix
    ignore_blocks: bool = False


RUNS = {
    "qwen3_sharded": HFMoERun(),
    "qwen3_owner": HFMoERun(expert_route="muon"),
    "gpt_oss_sharded": HFMoERun(family="gpt_oss"),
}
WRONG = {"qwen3_fused_as_one": HFMoERun(ignore_blocks=True)}


def train_hf_moe(rank: int, world: int, run: HFMoERun) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dmuon
    from tests._training import full_weights

    mesh = init_device_mesh("cpu", (world,))
    model = build(run.family)
    route = (lambda n, p: run.expert_route if p.ndim == 3 else None) if run.expert_route else None
    dmuon.dedicate_params(model, mesh, is_muon_matrix, blocks=_blocks_of(run.family, run.ignore_blocks),
                          route=route, verbose=False)
    opt, losses = train_hf_dedicated(model, mesh, rank, world, STEPS)
    muon = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.ndim == 3}
    return {"losses": losses, "weights": full_weights(model), "muon": muon | set(dmuon.get_dedicated_params(model)),
            "owned": sorted(dmuon.get_owned_params(model)),
            "ns_calls": [tuple(g["shape"]) for g in dmuon.diagnostics.ns_backends(opt)]}


def hf_moe_job(rank: int, world: int, folder: str) -> dict:
    """Every run of this file in one launch (the ranks import transformers once); transformers' own sharding
    (``distributed_config_job``) last, after the trainings."""
    out = {name: train_hf_moe(rank, world, run) for name, run in {**RUNS, **WRONG}.items()}
    out["distributed_config"] = distributed_config_job(rank, world, folder)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_distributed(hf_moe_job, 2, str(tmp_path_factory.mktemp("hf_moe") / "tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def oracles() -> dict:
    return {family: per_matrix_oracle(build(family), is_muon_matrix, _blocks_of(family), hf_loss, STEPS)
            for family in ("qwen3_moe", "gpt_oss")}


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_per_expert_oracle(runs, oracles, name):
    r = runs[0][name]
    assert_close_to(r, oracles[RUNS[name].family], name)
    assert_bitwise(runs[1][name], r, f"{name} rank 1 vs 0")


def test_fused_gate_up_as_one_matrix_misses_the_oracle(runs, oracles):
    """The parity test can fail: without ``blocks=`` each expert's gate and up share one polar factor."""
    r, ref = runs[0]["qwen3_fused_as_one"], oracles["qwen3_moe"]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
    weight_err, key = worst_weight(r["weights"], ref["weights"])
    assert loss_err > LOSS_RTOL or weight_err > WEIGHT_RTOL, (loss_err, weight_err, key)
    assert weight_err > 2 * WEIGHT_RTOL, f"only {weight_err:.2e} off ({key}); too close to the bound"
    assert key.endswith("gate_up_proj"), key


def test_the_guides_predicate_takes_experts_not_their_biases(runs):
    """Muon gets the attention projections and the 3-D experts of each layer; routers, norms, embeddings, head and
    GPT-OSS's 2-D expert biases (``[E, 2I]``, ``[E, H]``: what ``p.ndim == 2`` under ``experts.`` would take) stay
    on AdamW. With 4 experts on 2 ranks the experts stay on FSDP2's shards (no owner), Newton-Schulz batching each
    rank's 2 experts: for Qwen3-MoE 2 x 2 gate and up blocks of 96 x 128 per layer, never a 192-row matrix."""
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    want = {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}
    for name in ("qwen3_sharded", "gpt_oss_sharded", "qwen3_owner"):
        assert runs[0][name]["muon"] == want, (name, sorted(runs[0][name]["muon"] ^ want))
    for rank, res in enumerate(runs):
        assert not [n for n in res["qwen3_sharded"]["owned"] if ".experts." in n], (rank, res["qwen3_sharded"]["owned"])
        calls = res["qwen3_sharded"]["ns_calls"]
        assert (2 * 2 * 2, 96, 128) in calls and not [c for c in calls if c[1] == 192], (rank, calls)
    owned = [set(res["qwen3_owner"]["owned"]) for res in runs]
    experts = {n for n in want if ".experts." in n}
    assert set().union(*owned) >= experts and sum(len(o & experts) for o in owned) == len(experts), owned


def test_the_guides_predicate_on_llama4_and_what_a_2d_rule_takes_on_gpt_oss():
    """Llama 4 (experts ``[E, H, 2I]`` under ``feed_forward.``, a ``router``, a shared expert; built, not
    trained): the guide's predicate takes the attention and shared-expert projections and the 3-D experts, and
    not the router. On GPT-OSS a rule ``p.ndim == 2 and "proj" in name`` would take the 2-D expert biases."""
    cfg = transformers.Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=48,
                                        intermediate_size_mlp=96, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                        num_experts_per_tok=1, max_position_embeddings=64)
    llama4 = transformers.Llama4ForCausalLM(cfg)
    taken = {n.removeprefix("model.layers.0.") for n, p in llama4.named_parameters() if is_muon_matrix(n, p)}
    assert taken == {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj",
                     "feed_forward.shared_expert.gate_proj.weight", "feed_forward.shared_expert.up_proj.weight",
                     "feed_forward.shared_expert.down_proj.weight"}, sorted(taken)
    assert tuple(llama4.model.layers[0].feed_forward.experts.gate_up_proj.shape) == (4, 64, 96)  # [E, H, 2I]
    gpt_oss = transformers.AutoModelForCausalLM.from_config(gpt_oss_config())
    naive = {n for n, p in gpt_oss.named_parameters() if p.ndim == 2 and "proj" in n and ".experts." in n}
    assert naive == {f"model.layers.{i}.mlp.experts.{b}_proj_bias" for i in range(2) for b in ("gate_up", "down")}
    assert not [n for n in naive if is_muon_matrix(n, gpt_oss.get_parameter(n))]


def test_grouped_mm_is_the_default_and_computes_eagers_float32_on_the_cpu():
    """HF's default experts implementation on the CPU is ``grouped_mm``, in float32 the loss and gradients of its
    per-expert loop ``eager`` (measured: equal losses, gradients within 2e-7)."""
    model = build("qwen3_moe")
    assert model.config._experts_implementation == "grouped_mm"
    tok, tgt = next(iter(batches(1)))
    grads = []
    for impl in ("grouped_mm", "eager"):
        model.set_experts_implementation(impl)
        model.zero_grad()
        loss = hf_loss(model, tok, tgt)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_g, g), (loss_e, e) = grads
    assert abs(loss_g - loss_e) <= 1e-6 * abs(loss_e), (loss_g, loss_e)
    assert worst_weight(g, e)[0] <= 1e-5, worst_weight(g, e)
    assert e["model.layers.0.mlp.experts.gate_up_proj"].abs().sum() > 0


def distributed_config_job(rank: int, world: int, folder: str) -> dict:
    """A tiny Qwen3-MoE saved by rank 0, loaded by every rank with transformers' own FSDP2 loading, then handed
    to ``dedicate_params``: its error on each rank, and whether anything was marked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers.distributed import DistributedConfig

    import dmuon

    if rank == 0:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(folder)
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                              distributed_config=DistributedConfig(fsdp_size=world))
    out = {"sharded_by_hf": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))}
    try:
        dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), is_muon_matrix, blocks=row_blocks)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    out["untouched"] = not any(hasattr(p, "_dedicated_owner_rank") for p in model.parameters())
    return out


def test_a_model_transformers_sharded_is_refused_clearly(runs):
    """``from_pretrained(distributed_config=...)`` runs ``fully_shard`` itself (each decoder layer, the root):
    too late for ``dedicate_params``, which says so on every rank and changes nothing. The recipe loads without
    it, then ``dedicate_params``, then ``fully_shard`` (docs/guides/moe.md)."""
    results = [res["distributed_config"] for res in runs]
    for rank, res in enumerate(results):
        assert {"", "model.layers.0", "model.layers.1"} <= set(res["sharded_by_hf"]), (rank, res["sharded_by_hf"])
        assert res["error"] is not None and "must run before fully_shard" in res["error"], (rank, res["error"])
        assert "model.layers.0" in res["error"] and "Call dedicate_params first" in res["error"], res["error"]
        assert res["untouched"], rank
