"""The model families whose fused weights are not contiguous row blocks, against the per-matrix oracle.

Real HF transformers 5 models from tiny configs (random weights, no download), each fused weight split the way
its modeling file reads it ([Note: HF matrix blocks] in ``dmuon/integrations/hf/_model.py``):

* GPT-OSS: experts ``gate_up_proj`` ``[E, H, 2I]`` whose gate and up alternate column by column
  (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``): ``Columns(Interleaved(2, I))``; experts on FSDP2's dim-0
  shards (the default: ``E >= W``);
* Llama 4: experts ``gate_up_proj`` ``[E, H, 2I]``, gate columns then up columns (``chunk(2, dim=-1)``):
  ``Columns(2)``; experts on one owner each (route ``"muon"``);
* DeepSeek-V3: MLA ``q_b_proj`` / ``kv_b_proj`` one row block per head, experts ``[E, 2I, H]`` two row blocks.

``dedicate_params(blocks=dmuon.integrations.hf.matrix_blocks(model))``, FSDP2 per decoder layer and on the root,
``dmuon.Muon``, at 2 and 4 gloo ranks. The oracle is ``tests/_moe.py``'s: one process, ``torch.optim.Muon`` on
one 2-D parameter per expert AND per block (its indices written out from the layouts above by
``tests._moe.block_index``, not by dmuon), ``torch.optim.AdamW`` on the rest; losses within 1e-4, weights
within 5e-3 (``tests/_asserts.py``), and every rank's result the same bit for bit. Orthogonalising each
expert's gate and up together (no column blocks, what dmuon did before), or GPT-OSS's as halves instead of
interleaved columns, misses the oracle. Routing is fixed by position as in ``tests/test_hf_moe.py`` (a learned
top-k router flips near-tie tokens on last-bit differences); the initial scale is its [Note: init scale].
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from dmuon.runtime.blocks import Blocks, Columns, Interleaved  # noqa: E402
from tests._asserts import WEIGHT_RTOL, assert_bitwise, assert_close_to, worst_weight  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._moe import block_index, hf_loss, per_matrix_oracle, train_hf_dedicated  # noqa: E402
from tests._training import SEQ  # noqa: E402

STEPS = 3
INIT = 0.1  # [Note: init scale] in tests/test_hf.py
H, I, HEADS = 32, 24, 4  # hidden, expert width (H x I blocks: not square, so the lr rule reads each block's shape)
FAMILIES = ("gpt_oss", "llama4", "deepseek_v3")


def config(family: str):
    common = dict(vocab_size=128, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS,
                  max_position_embeddings=64, initializer_range=INIT)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=I, num_key_value_heads=2, head_dim=8,
                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama4":
        return transformers.Llama4TextConfig(**common, intermediate_size=I, intermediate_size_mlp=2 * I,
                                             num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                             num_experts_per_tok=1)
    return transformers.DeepseekV3Config(**common, intermediate_size=40, moe_intermediate_size=I,
                                         num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2,
                                         n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def expected_blocks(family: str, name: str):
    """Each family's split, from its modeling file (the module docstring), for the oracle and the helper's check."""
    if name.endswith("experts.gate_up_proj"):
        return {"gpt_oss": Columns(Interleaved(2, I)), "llama4": Columns(2), "deepseek_v3": 2}[family]
    if family == "deepseek_v3" and name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
        return HEADS
    return None


def predicate(name: str, p: nn.Parameter) -> bool:
    """The experts (3-D; not GPT-OSS's 2-D expert biases) and the 2-D projections; not routers, norms, embeddings."""
    if ".experts." in name:
        return p.ndim == 3
    return p.ndim == 2 and "_proj" in name and name.endswith(".weight")


# --------------------------------------------------------------------------------------------------- #
# Fixed routing (tests/test_hf_moe.py's, for every router here)                                        #
# --------------------------------------------------------------------------------------------------- #
def _chosen(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ``t`` of its sequence goes to experts ``t, t + 1, ... (mod E)``; the logits of the router's weight."""
    logits = F.linear(h, self.weight, getattr(self, "bias", None))
    pos = torch.arange(h.shape[0], device=h.device) % SEQ
    return logits, (pos[:, None] + torch.arange(self.top_k, device=h.device)) % self.num_experts


def _topk_forward(self, hidden_states: torch.Tensor):  # GptOssTopKRouter, DeepseekV3TopkRouter
    logits, chosen = _chosen(self, hidden_states.reshape(-1, self.weight.shape[-1]))
    return logits, logits.gather(1, chosen).softmax(dim=-1), chosen


def _llama4_forward(self, hidden_states: torch.Tensor):  # Llama4Router: (scores [T, E], logits)
    logits, chosen = _chosen(self, hidden_states)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, chosen, logits.gather(1, chosen))
    return torch.sigmoid(scores), logits


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = config(family)
    auto = transformers.AutoModelForCausalLM.from_config
    model = transformers.Llama4ForCausalLM(cfg) if family == "llama4" else auto(cfg)
    fixed = 0
    for m in model.modules():
        kind = type(m).__name__
        if kind.lower().endswith("topkrouter") or kind == "Llama4Router":
            m.forward = types.MethodType(_llama4_forward if kind == "Llama4Router" else _topk_forward, m)
            fixed += 1
    assert fixed == (1 if family == "deepseek_v3" else 2), (family, fixed)  # DeepSeek's layer 0 is dense
    return model


# --------------------------------------------------------------------------------------------------- #
# The runs                                                                                             #
# --------------------------------------------------------------------------------------------------- #
@dataclass(frozen=True)
class FamilyRun:
    family: str
    #: ``"muon"``: every expert param on one owner; ``None``: the default (FSDP2's shards, as E >= ranks)
    expert_route: str | None = None
    #: ``"hf"``: ``matrix_blocks(model)``; the wrong variants: ``"fused"`` (gate/up as one matrix per expert,
    #: what dmuon did before column blocks), ``"halves"`` (GPT-OSS's columns as two contiguous halves)
    gate_up: str = "hf"


RUNS = {"gpt_oss": FamilyRun("gpt_oss"), "llama4": FamilyRun("llama4", expert_route="muon"),
        "deepseek_v3": FamilyRun("deepseek_v3")}
WRONG = {"gpt_oss_fused": FamilyRun("gpt_oss", gate_up="fused"),
         "gpt_oss_halves": FamilyRun("gpt_oss", gate_up="halves"),
         "llama4_fused": FamilyRun("llama4", expert_route="muon", gate_up="fused")}


def train_family(rank: int, world: int, run: FamilyRun) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.integrations.hf import matrix_blocks
    from tests._training import full_weights

    mesh = init_device_mesh("cpu", (world,))
    model = build(run.family)
    hf = matrix_blocks(model)
    wrong = {"hf": None, "fused": None, "halves": Columns(2)}[run.gate_up]
    blocks = hf if run.gate_up == "hf" else (lambda n, p: wrong if n.endswith("gate_up_proj") else hf(n, p))
    route = (lambda n, p: run.expert_route if p.ndim == 3 else None) if run.expert_route else None
    dmuon.dedicate_params(model, mesh, predicate, blocks=blocks, route=route, verbose=False)
    opt, losses = train_hf_dedicated(model, mesh, rank, world, STEPS)
    return {"losses": losses, "weights": full_weights(model), "owned": sorted(dmuon.get_owned_params(model)),
            "ns_calls": [tuple(g["shape"]) for g in dmuon.diagnostics.ns_backends(opt)]}


def normuon_refusal(rank: int, world: int) -> dict:
    """``algorithm="normuon"`` on column-blocked experts: refused by ``dmuon.Muon`` on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.integrations.hf import matrix_blocks

    model = build("llama4")
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), predicate, blocks=matrix_blocks(model),
                          verbose=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    out = {}
    for algorithm in ("normuon", "muon"):
        try:
            dmuon.Muon(model, lr=0.01, algorithm=algorithm)
            out[algorithm] = None
        except ValueError as e:
            out[algorithm] = str(e)
    return out


#: tensor-parallel column blocks: ``(tp_dim, the blocks of [12, 10] matrices)``; blocks (4, 6) have two lrs,
#: and a column shard of 5 cuts the first block's columns from the second's
TP_CASES = [(tp_dim, spec) for tp_dim in (0, 1) for spec in (Columns((4, 6)), Columns(Interleaved(2, 5)))]


def tp_column_blocks(rank: int, world: int) -> list[dict]:
    """``muon_update_tp_`` of 3 column-blocked matrices split over ``world`` tp ranks, 2 steps, against
    ``muon_update_batch_`` of the whole matrices each tp rank orthogonalises (as ``tests/test_tp_update.py``)."""
    import torch.distributed as dist

    from dmuon.optim.tp_update import muon_update_tp_
    from dmuon.optim.update import MuonHParams, muon_update_batch_

    def exchange(send, send_counts, recv, recv_counts):
        dist.all_to_all_single(recv, send, recv_counts, send_counts)

    hp, out = MuonHParams(lr=0.05, weight_decay=0.1), []
    for tp_dim, spec in TP_CASES:
        blocks = Blocks.of((12, 10), spec)
        gen = torch.Generator().manual_seed(tp_dim)
        full = [torch.randn(12, 10, generator=gen) for _ in range(3)]
        grads = [[torch.randn(12, 10, generator=gen) for _ in range(3)] for _ in range(2)]
        ref, ref_bufs = [w.clone() for w in full], [torch.zeros_like(w) for w in full]
        mine = [w.chunk(world, dim=tp_dim)[rank].clone() for w in full]
        bufs = [torch.zeros_like(w) for w in mine]
        for g in grads:
            for root in range(world):
                ks = [k for k in range(3) if k % world == root]
                muon_update_batch_([ref[k] for k in ks], [g[k] for k in ks], [ref_bufs[k] for k in ks], hp, blocks)
            muon_update_tp_(mine, [x.chunk(world, dim=tp_dim)[rank].contiguous() for x in g], bufs, hp,
                            full_shape=(12, 10), tp_dim=tp_dim, tp_rank=rank, tp_size=world, exchange=exchange,
                            blocks=blocks)
        out.append({"got": mine, "want": [w.chunk(world, dim=tp_dim)[rank] for w in ref]})
    return out


def families_job(rank: int, world: int) -> dict:
    runs = {**RUNS, **WRONG} if world == 2 else RUNS
    out = {name: train_family(rank, world, run) for name, run in runs.items()}
    if world == 2:
        out["normuon"] = normuon_refusal(rank, world)
        out["tp"] = tp_column_blocks(rank, world)
    return out


_JOBS: dict[int, list[dict]] = {}


def _job(world: int) -> tuple[int, list[dict]]:
    """One job per world size, shared by the tests (the 2-rank one also runs the wrong variants)."""
    if world not in _JOBS:
        _JOBS[world] = run_distributed(families_job, world)
    return world, _JOBS[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request) -> tuple[int, list[dict]]:
    return _job(request.param)


@pytest.fixture(scope="module")
def two_ranks() -> tuple[int, list[dict]]:
    return _job(2)


@pytest.fixture(scope="module")
def oracles() -> dict:
    out = {}
    for f in FAMILIES:
        model = build(f)
        ref = per_matrix_oracle(model, predicate, lambda n, p, f=f: expected_blocks(f, n), hf_loss, STEPS)
        params = dict(model.named_parameters())  # not DeepSeek's router buffer (e_score_correction_bias)
        out[f] = {"losses": ref["losses"], "weights": {k: v for k, v in ref["weights"].items() if k in params}}
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_the_per_block_oracle(runs, oracles, name):
    world, results = runs
    r = results[0][name]
    assert_close_to(r, oracles[RUNS[name].family], f"{name} at {world} ranks")
    for rank in range(1, world):
        assert_bitwise(results[rank][name], r, f"{name} rank {rank} vs 0")


@pytest.mark.parametrize("name", list(WRONG))
def test_gate_and_up_together_miss_the_oracle(two_ranks, oracles, name):
    """The parity test can fail: gate and up orthogonalised as one ``H x 2I`` matrix per expert (no column
    blocks), or GPT-OSS's interleaved columns split as halves, move ``gate_up_proj`` far past the bound."""
    _, results = two_ranks
    r, ref = results[0][name], oracles[WRONG[name].family]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
    gate_up = {k: v for k, v in ref["weights"].items() if k.endswith("gate_up_proj")}
    err, key = worst_weight(r["weights"], gate_up)
    assert err > 2 * WEIGHT_RTOL, f"{name}: {key} only {err:.2e} off (losses {loss_err:.2e})"
    with pytest.raises(AssertionError):
        assert_close_to(r, ref, name)


def test_newton_schulz_runs_on_each_block_never_the_fused_matrix(runs):
    """Every gate/up Newton–Schulz call is on ``H x I`` blocks (and DeepSeek's per head); none on ``H x 2I``."""
    world, results = runs
    for name in RUNS:  # each rank's calls: the matrices it owns, and its share of the experts on FSDP2's shards
        calls = {c[1:] for res in results for c in res[name]["ns_calls"]}
        fused = (2 * I, H) if name == "deepseek_v3" else (H, 2 * I)
        blocks = {(12, 16), (16, 16), (I, H)} if name == "deepseek_v3" else {(H, I)}
        assert blocks <= calls and fused not in calls and (48, 16) not in calls and (64, 16) not in calls, (name, calls)
    owned = set().union(*(res["llama4"]["owned"] for res in results))
    assert {f"model.layers.{i}.feed_forward.experts.gate_up_proj" for i in range(2)} <= owned, owned


def test_normuon_refuses_column_blocks_on_every_rank(two_ranks):
    """NorMuon keeps one second moment per row of a param; column blocks would each need their own. Refused
    by ``dmuon.Muon`` on every rank (in the gather of its build); Muon itself builds on the same model."""
    _, results = two_ranks
    for rank, res in enumerate(results):
        msg = res["normuon"]["normuon"]
        assert msg is not None and "whose blocks split its columns" in msg and "gate_up_proj" in msg, (rank, msg)
        assert "algorithm='muon'" in msg, msg
        assert res["normuon"]["muon"] is None, (rank, res["normuon"]["muon"])


def test_matrix_blocks_reads_each_familys_layout():
    """``matrix_blocks`` gives every param its family's split, and the splits mean what HF's forward reads:
    GPT-OSS's gate is columns ``::2``, Llama 4's the first half, DeepSeek's ``[E, 2I, H]`` the first ``I``
    rows; on Qwen3-MoE (``[E, 2I, H]`` like DeepSeek) it gives ``2``."""
    from dmuon.integrations.hf import matrix_blocks

    for family in FAMILIES:
        model = build(family)
        fn = matrix_blocks(model)
        got = {n: fn(n, p) for n, p in model.named_parameters()}
        assert got == {n: expected_blocks(family, n) for n in got}, family
        for n, p in model.named_parameters():
            if predicate(n, p):
                Blocks.of(p.shape, got[n], what=n)  # every split tiles its param
    gate, up = block_index(2 * I, Interleaved(2, I))
    assert torch.equal(gate, torch.arange(0, 2 * I, 2)) and torch.equal(up, torch.arange(1, 2 * I, 2))
    assert block_index(2 * I, 2) == [slice(0, I), slice(I, 2 * I)]
    qwen = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=H, intermediate_size=2 * I, moe_intermediate_size=I, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2))
    fn = matrix_blocks(qwen)
    assert {n: fn(n, p) for n, p in qwen.named_parameters() if fn(n, p) is not None} == \
        {"model.layers.0.mlp.experts.gate_up_proj": 2}


@pytest.mark.parametrize("case", range(len(TP_CASES)), ids=[f"dim{d}-{type(s.blocks).__name__}" for d, s in TP_CASES])
def test_tensor_parallel_shards_of_column_blocks_get_the_whole_matrix_update(two_ranks, case):
    """Under TP the blocks describe the full matrix: each shard ends bit for bit where the whole matrix's
    column-blocked update puts it, the lr of each block applied to the shard's part of it."""
    _, results = two_ranks
    for rank, res in enumerate(results):
        for got, want in zip(res["tp"][case]["got"], res["tp"][case]["want"]):
            assert torch.equal(got, want), (rank, TP_CASES[case], (got - want).abs().max())


# --------------------------------------------------------------------------------------------------- #
# The seam itself, on one process                                                                      #
# --------------------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("spec", [Columns(2), Columns(Interleaved(2, 5)), Columns((4, 6))], ids=str)
def test_column_blocks_step_as_torch_muon_on_each_block(spec):
    """``muon_update_batch_`` on two ``[3, 12, 10]`` params with column blocks equals ``torch.optim.Muon`` on one
    2-D param per expert and block, bit for bit (NS on each block as stored, 12 x n_b; its own lr)."""
    from dmuon.optim.update import MuonHParams, muon_update_batch_

    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(3, 12, 10, generator=gen) for _ in range(2)]
    grads = [[torch.randn(3, 12, 10, generator=gen) for _ in range(2)] for _ in range(3)]
    idx = [(e, slice(None), b) for e in range(3) for b in block_index(10, spec.blocks)]
    shadows = [[nn.Parameter(w[ix].clone()) for ix in idx] for w in ws]
    opt = torch.optim.Muon([s for per in shadows for s in per], lr=0.05, weight_decay=0.1)
    mine, bufs = [w.clone() for w in ws], [torch.zeros_like(w) for w in ws]
    for g in grads:
        muon_update_batch_(mine, g, bufs, MuonHParams(lr=0.05, weight_decay=0.1), Blocks.of((3, 12, 10), spec))
        for per, gi in zip(shadows, g):
            for s, ix in zip(per, idx):
                s.grad = gi[ix].clone()
        opt.step()
    for w, per in zip(mine, shadows):
        want = torch.empty_like(w)
        for s, ix in zip(per, idx):
            want[ix] = s.detach()
        assert torch.equal(w, want), (spec, (w - want).abs().max())


def test_normuon_on_interleaved_row_blocks_matches_the_reference():
    """NorMuon's row scales of interleaved row blocks (torchtitan's fused QKV) cover every row of every group;
    each block as the paper's NorMuon on its own 2-D matrix (before: only the first group's rows were scaled,
    the rest read uninitialised memory)."""
    from dmuon.optim.normuon import NorMuonHParams, normuon_update_batch_
    from dmuon.optim.normuon_reference import NorMuonReference

    spec, hp = Interleaved((2, 1, 1), 3), NorMuonHParams(lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    w, grads = torch.randn(12, 8, generator=gen), [torch.randn(12, 8, generator=gen) for _ in range(3)]
    idx = block_index(12, spec)
    shadows = [nn.Parameter(w[ix].clone()) for ix in idx]
    opt = NorMuonReference(shadows, lr=hp.lr, weight_decay=hp.weight_decay)
    mine, buf, v = w.clone(), torch.zeros_like(w), torch.zeros(12, 1)
    for g in grads:
        normuon_update_batch_([mine], [g], [buf], [v], hp, Blocks.of((12, 8), spec))
        for s, ix in zip(shadows, idx):
            s.grad = g[ix].clone()
        opt.step()
    want = torch.empty_like(w)
    for s, ix in zip(shadows, idx):
        want[ix] = s.detach()
    torch.testing.assert_close(mine, want)


def test_column_blocks_that_do_not_tile_are_refused():
    for spec, msg in [(Columns(3), "3 column blocks do not tile the 10 columns of shape (4, 12, 10)"),
                      (Columns((4, 5)), "column blocks [4, 5] do not tile the 10 columns"),
                      (Columns(Interleaved(2, 4)), "4 interleaved groups do not tile the 10 columns"),
                      (Columns(Columns(2)), "nests Columns in Columns")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            Blocks.of((4, 12, 10), spec, what="blocks('w')")
    b = Blocks.of((4, 12, 10), Columns(Interleaved(2, 5)))
    assert (b.describe(), b.spec, b.dim) == ("8 x (12 x 5)", Columns(Interleaved((1, 1), 5)), -1)
    assert Blocks.of((4, 12, 10), Columns(1)) == Blocks.of((4, 12, 10))  # one block: the whole matrix
