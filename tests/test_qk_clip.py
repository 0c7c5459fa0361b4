"""MuonClip's QK-clip ([Note: QK-clip] in ``dmuon/optim/qk_clip.py``) on 2 gloo ranks.

The tiny Llama (4 query heads over 2 key heads: grouped-query attention) reports its per-head maxima through
``dmuon.qk_clip.scaled_dot_product_attention``; query head 0 of every layer is scaled up at init so its logits
exceed tau while its group partner (head 1) and the other group stay below.

* One step at learning rate 0 (the step only clips): each clipped head's maximum, recomputed on the same batch,
  is at most tau; head 0's query rows and its key head's rows moved by exactly ``gamma^alpha`` and
  ``gamma_group^(1 - alpha)``; every other row is bit for bit what it was; every rank saw the same maxima.
* Ten training steps against a single process that trains with torch's Muon and AdamW and clips by hand.
* Misuse: a model without attention, undedicated q/k matrices, a model that never reports: clear errors on
  every rank, before anything changes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.optim.qk_clip import RECORD_ATTR
from dmuon.tools.models import TinyLlama
from tests._asserts import assert_close_to
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import ADAMW_HP, CFG, GLOBAL_BATCH, KJ, MUON_HP, batches, full_weights, muon_kwargs, \
    hand_clip_, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
QCFG = replace(CFG, report_max_logits=True)
TAU, ALPHA, BOOST, STEPS = 8.0, 0.5, 12.0, 10
HD, PER = QCFG.head_dim, QCFG.n_heads // QCFG.n_kv_heads


def _model(cfg=QCFG) -> TinyLlama:
    model = TinyLlama(cfg)
    model.init_weights(0)
    with torch.no_grad():
        for layer in model.layers:  # query head 0 far above tau; its partner and the other group stay below
            layer.attention.q_proj.weight[:HD] *= BOOST
    return model


def _setup(world: int, *, lr_scale: float = 1.0, cfg=QCFG, predicate=projection_predicate, **clip):
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = _model(cfg).to(device())
    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {**muon_kwargs(), "lr": MUON_HP.lr * lr_scale, "adamw_lr": ADAMW_HP.lr * lr_scale}
    return model, dmuon.Muon(model, **kw, qk_clip=dmuon.QKClip(tau=TAU, alpha=ALPHA, **clip))


def _batch(rank: int, world: int, step: int = 0):
    tok, tgt = batches(STEPS)[step]
    per = GLOBAL_BATCH // world
    return tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())


def _maxima(model) -> list[list[float]]:
    """Each layer's per-head maxima over the job, of one forward (with autograd on: it reports)."""
    out = []
    for layer in model.layers:
        seen = getattr(layer.attention, RECORD_ATTR)
        setattr(layer.attention, RECORD_ATTR, None)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        out.append(seen.tolist())
    return out


def frozen_job(rank: int, world: int) -> dict:
    """Learning rate 0: the step changes nothing but the clipped rows."""
    model, opt = _setup(world, lr_scale=0.0)
    tok, tgt = _batch(rank, world)
    before = full_weights(model)
    opt.zero_grad()
    model(tok, tgt).loss.backward()
    opt.step()
    after = full_weights(model)
    model(tok, tgt).loss.backward()  # the same batch again, with the clipped weights (it reports; no step)
    return {"before": before, "after": after, "stats": opt.qk_clip.stats.as_dict(), "maxima_after": _maxima(model),
            "diag": dmuon.diagnostics.qk_clip(opt)}


def train_job(rank: int, world: int) -> dict:
    model, opt = _setup(world)
    losses, clipped = [], []
    for step in range(STEPS):
        tok, tgt = _batch(rank, world, step)
        opt.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
        clipped.append(opt.qk_clip.stats.clipped_heads)
    return {"losses": losses, "weights": full_weights(model), "clipped": clipped}


def misuse_job(rank: int, world: int) -> dict:
    from tests.test_tp import Net

    out = {}
    cases = {
        "no_attention": lambda: _no_attention(world, Net),
        "undedicated": lambda: _setup(world, predicate=lambda n, p: p.ndim == 2 and "mlp" in n),
        "bad_tau": lambda: dmuon.QKClip(tau=-1.0),
        "no_report": lambda: _step_without_reports(rank, world),
        "heads_on_rank1_only": lambda: _setup(world, heads=[] if rank == 1 else None),
        "fused_without_blocks": lambda: _fused(world, None),
    }
    for case, fn in cases.items():
        try:
            fn()
            out[case] = None
        except (TypeError, ValueError, RuntimeError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    out["fused_rows"] = _fused(world, lambda n, p: [32, 16, 16])  # q, k, v as row blocks
    return out


class FusedAttention(torch.nn.Module):
    """A fused ``[q; k; v]`` projection: 4 query heads, 2 key heads of 8 rows."""

    n_heads, n_kv_heads, head_dim = 4, 2, 8

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(16, 64, bias=False)


class FusedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": FusedAttention()})])


def _fused(world: int, blocks) -> list:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = FusedNet().to(device())
    dmuon.dedicate_params(model, mesh, lambda n, p: "qkv" in n, blocks=blocks, verbose=False)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, qk_clip=dmuon.QKClip())
    return [(a.heads.query_rows(), a.heads.key_rows()) for a in opt.qk_clip._attentions]


def _no_attention(world: int, net_cls) -> None:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = net_cls().to(device())
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and n.startswith("layers"))
    fully_shard(model, mesh=mesh)
    dmuon.Muon(model, qk_clip=dmuon.QKClip())


def _step_without_reports(rank: int, world: int) -> None:
    model, opt = _setup(world, cfg=CFG)  # attention through plain SDPA: nothing reports
    tok, tgt = _batch(rank, world)
    model(tok, tgt).loss.backward()
    before = full_weights(model)
    try:
        opt.step()
    finally:
        assert all(torch.equal(v, full_weights(model)[k]) for k, v in before.items()), "the refused step changed weights"


@rank_threads()
def hand_clipped_oracle() -> dict:
    """One process: torch's Muon and AdamW, then the clip written out by hand from each layer's reported maxima."""
    model = _model().to(device())
    named = dict(model.named_parameters())
    opt_m = torch.optim.Muon([p for n, p in named.items() if projection_predicate(n, p)], lr=MUON_HP.lr,
                             weight_decay=MUON_HP.weight_decay, ns_coefficients=KJ)
    opt_a = torch.optim.AdamW([p for n, p in named.items() if not projection_predicate(n, p)],
                              **ADAMW_HP.group_entries())
    losses = []
    for tok, tgt in batches(STEPS):
        opt_m.zero_grad()
        opt_a.zero_grad()
        loss = model(tok.to(device()), tgt.to(device())).loss
        loss.backward()
        opt_m.step()
        opt_a.step()
        hand_clip_(model, QCFG, tau=TAU, alpha=ALPHA)
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def qk_clip_jobs(rank: int, world: int) -> dict:
    """Every 2-rank run of this file in one launch: the frozen step, the training, then the misuses."""
    return {"frozen": frozen_job(rank, world), "train": train_job(rank, world), "misuse": misuse_job(rank, world)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(qk_clip_jobs, 2)


@pytest.fixture(scope="module")
def frozen(runs) -> list[dict]:
    return [r["frozen"] for r in runs]


def test_clipped_heads_end_at_or_below_tau_and_nothing_else_moves(frozen):
    r = frozen[0]
    for i, (m_before, m_after) in enumerate(zip(r["stats"]["max_logits"].values(), r["maxima_after"])):
        assert m_before[0] > TAU and max(m_before[1:]) < TAU, m_before  # the setup: head 0 alone above tau
        assert m_after[0] <= TAU * (1 + 1e-5), (i, m_after)
        q, k = f"layers.{i}.attention.q_proj.weight", f"layers.{i}.attention.k_proj.weight"
        g_q = (TAU / m_before[0]) ** ALPHA
        g_k = (TAU / max(m_before[:PER])) ** (1 - ALPHA)  # key head 0: its group's largest logit
        assert torch.equal(r["after"][q][:HD], r["before"][q][:HD] * g_q)
        assert torch.equal(r["after"][k][:HD], r["before"][k][:HD] * g_k)
        assert torch.equal(r["after"][q][HD:], r["before"][q][HD:])  # head 1 (same group) and the other group
        assert torch.equal(r["after"][k][HD:], r["before"][k][HD:])
    assert r["stats"]["clipped_heads"] == QCFG.n_layers and r["stats"]["heads"] == QCFG.n_layers * QCFG.n_heads
    untouched = [n for n in r["before"] if "q_proj" not in n and "k_proj" not in n]
    assert all(torch.equal(r["after"][n], r["before"][n]) for n in untouched)


def test_every_rank_saw_the_same_maxima_and_weights(frozen):
    for res in frozen[1:]:
        assert res["stats"] == frozen[0]["stats"] and res["diag"] == frozen[0]["diag"]
        assert all(torch.equal(v, frozen[0]["after"][k]) for k, v in res["after"].items())


def test_diagnostics_count_the_clipped_heads(frozen):
    assert frozen[0]["diag"]["clipped_heads"] == QCFG.n_layers
    assert frozen[0]["diag"]["clipped"] == {f"layers.{i}.attention": [0] for i in range(QCFG.n_layers)}


def test_training_matches_a_hand_clipped_single_process_run(runs):
    ref = hand_clipped_oracle()
    results = [r["train"] for r in runs]
    assert_close_to(results[0], ref, "2 ranks, QK-clip every step")
    assert results[0]["clipped"][0] == QCFG.n_layers  # it did clip
    assert results[0]["weights"].keys() == ref["weights"].keys()


MISUSE = {
    "no_attention": "ValueError: dmuon.QKClip: found no attention module with query and key projections",
    "undedicated": "its query matrix 'layers.0.attention.q_proj.weight' is not dedicated, so on FSDP2 + AdamW",
    "bad_tau": "ValueError: dmuon.QKClip: tau must be a finite number > 0, got -1.0",
    "no_report": "RuntimeError: dmuon.QKClip: no attention module reported its largest logits",
    "fused_without_blocks": "fused projection 'layers.0.attn.qkv_proj.weight' needs row blocks that end where the "
                            "query rows (32) and the key rows (48) end",
}


@pytest.fixture(scope="module")
def misuse(runs) -> list[dict]:
    return [r["misuse"] for r in runs]


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_raises_a_clear_error_on_every_rank(misuse, case):
    for rank, res in enumerate(misuse):
        assert res[case] is not None and MISUSE[case] in res[case], (rank, res[case])


def test_a_fused_projection_takes_its_heads_from_its_row_blocks(misuse):
    for res in misuse:
        assert res["fused_rows"] == [((0, 8, 16, 24), (32, 40))]


def test_a_layout_refused_on_one_rank_raises_on_every_rank(misuse):
    assert "found no attention module" in misuse[1]["heads_on_rank1_only"]
    assert "dmuon.QKClip refused on rank 1" in misuse[0]["heads_on_rank1_only"]


# --------------------------------------------------------------------------------------------------- #
# The forward side, one process                                                                        #
# --------------------------------------------------------------------------------------------------- #
def _logits(q, k, mask):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))


def test_max_logits_and_the_lse_bound():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 16, generator=gen) * 3 for h in (4, 2, 2))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    exact = dmuon.qk_clip.max_logits(q, k, is_causal=True)
    assert torch.allclose(exact, _logits(q, k, causal), rtol=1e-6)
    att = torch.nn.Module()
    out = dmuon.qk_clip.scaled_dot_product_attention(q, k, v, module=att, is_causal=True, enable_gqa=True, bound="lse")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5)
    bound = getattr(att, RECORD_ATTR)
    assert (bound >= exact - 1e-4).all() and (bound <= exact + math.log(64) + 1e-4).all(), (bound, exact)
    with torch.no_grad():  # an eval forward does not report
        dmuon.qk_clip.scaled_dot_product_attention(q * 10, k, v, module=att, is_causal=True, enable_gqa=True)
    assert torch.equal(getattr(att, RECORD_ATTR), bound)


def test_hf_attention_reports_and_matches_sdpa():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dmuon.integrations.hf import use_qk_clip_attention
    from dmuon.optim.qk_clip import find_heads

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    tok = torch.randint(0, 64, (2, 16))
    ref = model(tok).logits
    use_qk_clip_attention(model)
    got = model(tok).logits
    assert torch.allclose(got, ref, atol=1e-5)
    att = model.model.layers[0].self_attn
    assert getattr(att, RECORD_ATTR).shape == (4,)
    heads = find_heads(model, {})
    assert [(h.module, h.n_heads, h.n_kv_heads, h.head_dim) for h in heads] == [
        (f"model.layers.{i}.self_attn", 4, 2, 16) for i in range(2)]


def test_torchtitan_attention_reports_and_its_fused_heads_are_found():
    """torchtitan's debug Llama (fused, per-group interleaved wqkv): the pre-hook's maxima are the logits of the
    query and key rows QKHeads points at."""
    pytest.importorskip("torchtitan")
    from dmuon.integrations.torchtitan import report_max_logits
    from dmuon.optim.qk_clip import find_heads
    from tests.test_torchtitan import N_HEADS, N_KV_HEADS, SEQ, _cpu_torchtitan, tiny_llama3_config

    _cpu_torchtitan()
    torch.manual_seed(0)
    model = tiny_llama3_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    report_max_logits(model)
    tok = torch.randint(0, 64, (2, SEQ))
    inputs = {}
    att = model.layers["0"].attention if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[0].attention
    att.inner_attention.register_forward_pre_hook(lambda m, a: inputs.update(q=a[0], k=a[1]))
    model(tok)
    got = getattr(att, RECORD_ATTR)
    want = dmuon.qk_clip.max_logits(inputs["q"].transpose(1, 2), inputs["k"].transpose(1, 2), is_causal=True)
    assert torch.equal(got, want) and got.shape == (N_HEADS,)
    (heads, *_) = [h for h in find_heads(model, {}) if h.module.endswith("0.attention")]
    assert (heads.n_heads, heads.n_kv_heads) == (N_HEADS, N_KV_HEADS) and heads.q == heads.k
    w = att.qkv_linear.wqkv.weight
    hd, per = heads.head_dim, N_HEADS // N_KV_HEADS
    rows = w.view(N_KV_HEADS, per + 2, hd, -1)  # torchtitan's layout: per group, its query heads, k, v
    assert torch.equal(w[heads.query_rows()[per]:heads.query_rows()[per] + hd], rows[1, 0])
    assert torch.equal(w[heads.key_rows()[1]:heads.key_rows()[1] + hd], rows[1, per])
