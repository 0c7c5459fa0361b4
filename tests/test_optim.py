"""dmuon.Muon as a torch optimizer: its Muon math equals torch.optim.Muon's, schedulers drive both kinds
of groups, state_dict round trips keep AdamW wired in, and non-default options match torch end to end."""

from __future__ import annotations

import pytest
import torch

import dmuon
from dmuon.optim import AdjustLR, MuonHParams, adjusted_lr, muon_update_
from tests._dist import rank_threads, run_distributed
from tests._training import KJ, batches, build_model, projection_predicate


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (32, 32)])
def test_adjusted_lr_matches_torch(fn, shape):
    from torch.optim._muon import _adjust_lr

    assert adjusted_lr(0.02, AdjustLR.parse(fn), shape) == _adjust_lr(0.02, fn, torch.Size(shape))


@pytest.mark.parametrize("wd", [0.1, 0.0])  # 0.0: dmuon skips the multiply by exactly 1
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("fn", ["original", "match_rms_adamw"])
def test_muon_update_is_bitwise_torch(nesterov, fn, wd):
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(48, 24, generator=gen)
    grads = [torch.randn(48, 24, generator=gen) for _ in range(3)]
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([ref], lr=0.03, weight_decay=wd, momentum=0.9, nesterov=nesterov,
                           ns_coefficients=KJ, ns_steps=4, adjust_lr_fn=fn)
    mine, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        muon_update_(mine, g.clone(), buf, MuonHParams(lr=0.03, weight_decay=wd, momentum=0.9, nesterov=nesterov,
                                                       ns_steps=4, ns_coefficients=KJ, eps=1e-7, adjust_lr_fn=fn))
    assert torch.equal(mine, ref.detach())
    assert torch.equal(buf, opt.state[ref]["momentum_buffer"])


def test_adjust_lr_fn_rejects_unknown_names():
    with pytest.raises(ValueError, match="'rms'"):
        AdjustLR.parse("rms")


HP = dict(lr=0.015, momentum=0.9, nesterov=False, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
ADAMW = dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02)
STEPS = 5


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


@rank_threads()  # compared with a 1-rank run bit for bit
def _oracle() -> list[float]:
    model = build_model()
    muon = [p for n, p in model.named_parameters() if projection_predicate(n, p)]
    other = [p for n, p in model.named_parameters() if not projection_predicate(n, p)]
    om = torch.optim.Muon(muon, ns_coefficients=KJ, **HP)
    oa = torch.optim.AdamW(other, **ADAMW)
    sm = torch.optim.lr_scheduler.LambdaLR(om, _schedule)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, _schedule)
    losses = []
    for tok, tgt in batches(STEPS):
        om.zero_grad()
        oa.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        om.step()
        oa.step()
        sm.step()
        sa.step()
        losses.append(loss.item())
    return losses


def _sharded_model_and_muon(world: int, **ns) -> tuple[torch.nn.Module, dmuon.Muon]:
    """The test model under dmuon + FSDP2 (per layer and root) with HP/ADAMW; ``ns``: Newton-Schulz options."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    dmuon.dedicate_params(model, mesh, projection_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **HP, **(ns or dict(ns_coefficients=KJ, ns_backend="direct")), adamw_lr=ADAMW["lr"],
                     adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"])
    return model, opt


def optim_job(rank: int, world: int) -> dict:
    model, opt = _sharded_model_and_muon(world)
    kinds = [g["kind"] for g in opt.param_groups]
    names = [list(g["param_names"]) for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    losses, lrs = [], []
    for step, (tok, tgt) in enumerate(batches(STEPS)):
        opt.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        opt.step()
        sched.step()
        if step == 2:  # a round trip through state_dict must keep AdamW's state and groups wired in
            opt.load_state_dict(opt.state_dict())
        lrs.append([g["lr"] for g in opt.param_groups])
        losses.append(loss.item())
    adamw_groups_shared = all(a is b for a, b in zip(opt._adamw.param_groups, opt.param_groups[1:]))
    grads_cleared = None
    opt.zero_grad()
    grads_cleared = all(p.grad is None for p in model.parameters())
    return dict(losses=losses, lrs=lrs, kinds=kinds, names=names, shared=adamw_groups_shared,
                state_shared=opt._adamw.state is opt.state, grads_cleared=grads_cleared,
                n_state=len(opt.state_dict()["state"]))


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return run_distributed(optim_job, 1)[0]


def test_options_and_scheduler_match_torch_bitwise(single_rank):
    assert single_rank["losses"] == _oracle()


def test_scheduler_scales_muon_and_adamw_groups(single_rank):
    for step, lrs in enumerate(single_rank["lrs"]):
        scale = _schedule(step + 1)
        assert lrs == pytest.approx([HP["lr"] * scale, ADAMW["lr"] * scale, ADAMW["lr"] * scale])


def test_param_groups_layout(single_rank):
    assert single_rank["kinds"] == ["muon", "adamw", "adamw_replicated"]
    muon_names, sharded_names, plain_names = single_rank["names"]
    assert len(muon_names) == 14 and all("proj" in n for n in muon_names)
    assert sorted(sharded_names) == sorted(
        n for n, p in build_model().named_parameters() if not projection_predicate(n, p))
    assert plain_names == []


def test_state_dict_round_trip_keeps_adamw_wired(single_rank):
    assert single_rank["shared"] and single_rank["state_shared"]
    # 14 Muon momenta + AdamW moments of embeddings, 4 block norms, final norm and head, in one dict
    assert single_rank["n_state"] == 14 + 7
    assert single_rank["grads_cleared"]


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_update_is_bitwise_one_by_one(nesterov):
    from dmuon.optim import muon_update_batch_

    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(40, 24, generator=gen) for _ in range(3)]
    gs = [torch.randn(40, 24, generator=gen) for _ in range(3)]
    one = [w.clone() for w in ws]
    bufs_one = [torch.zeros_like(w) for w in ws]
    batch = [w.clone() for w in ws]
    bufs_batch = [torch.zeros_like(w) for w in ws]
    hp = MuonHParams(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5, ns_coefficients=KJ,
                     eps=1e-7, adjust_lr_fn=AdjustLR.ORIGINAL)
    for _ in range(2):
        for w, g, b in zip(one, gs, bufs_one):
            muon_update_(w, g, b, hp)
        muon_update_batch_(batch, gs, bufs_batch, hp)
    for a, b in zip(one, batch):
        assert torch.equal(a, b)
    for a, b in zip(bufs_one, bufs_batch):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [None, (16, 8, 16)])
def test_chunked_updates_are_bitwise_unchunked(monkeypatch, rows):
    """[Note: NS memory]: with the chunk bound below one param (and below one expert batch), each matrix's update
    is still the unchunked one, bit for bit: experts of 3-D params, row blocks, several params per group."""
    import dmuon.optim.update as U
    from dmuon.runtime.blocks import Blocks

    gen = torch.Generator().manual_seed(6)
    ws = [torch.randn(5, 40, 24, generator=gen) for _ in range(3)]
    gs = [torch.randn(5, 40, 24, generator=gen) for _ in range(3)]
    blocks = Blocks.of((5, 40, 24), rows)
    hp = MuonHParams(lr=0.02, weight_decay=0.1, ns_coefficients=KJ)
    results = []
    for chunk in (U.NS_CHUNK_ELEMENTS, 2 * 40 * 24, 1):  # everything at once; two experts; one matrix a call
        monkeypatch.setattr(U, "NS_CHUNK_ELEMENTS", chunk)
        w, b = [x.clone() for x in ws], [torch.zeros_like(x) for x in ws]
        for _ in range(2):
            U.muon_update_batch_(w, gs, b, hp, blocks)
        results.append(w)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    # and each matrix is torch's 2-D update of that slice: expert 2, or its middle row block
    idx = (2,) if rows is None else (2, slice(16, 24))
    one, buf = ws[0][idx].clone(), torch.zeros_like(ws[0][idx])
    for _ in range(2):
        muon_update_(one, gs[0][idx], buf, hp)
    assert torch.equal(results[0][0][idx], one)


NS_FAST = dict(ns_backend="gram", ns_coefficients="polar_express")


def fast_ns_job(rank: int, world: int) -> list[float]:
    model, opt = _sharded_model_and_muon(world, **NS_FAST)
    assert opt.param_groups[0]["ns_coefficients"] == "polar_express"
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)  # as the oracle
    losses = []
    for tok, tgt in batches(STEPS):
        opt.zero_grad()
        loss = model(tok, tgt).loss
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_ns_backend_and_schedule_reach_the_update(monkeypatch):
    # Oracle: torch.optim.Muon (momentum, lr scaling, decay) with its NS swapped for ours in the same mode.
    from torch.optim import _muon

    from dmuon.optim.newton_schulz import newton_schulz_native

    def ours(grad, coefficients, steps, eps):  # float16 out: dmuon adds the Gram form's result uncast
        return newton_schulz_native(grad, steps, "polar_express", eps, backend="gram")

    got = run_distributed(fast_ns_job, 1)[0]
    default = _oracle()
    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", ours)
    assert got == _oracle()
    assert got != default  # the options changed the trajectory, so the comparison above means something


@pytest.mark.parametrize("kw,match", [
    (dict(ns_backend="fastest"), "ns_backend"),
    (dict(ns_coefficients="polar"), "ns_coefficients"),
    (dict(ns_coefficients=[(1.0, 2.0)]), "ns_coefficients"),
])
def test_bad_ns_options_raise(kw, match):
    model = build_model()
    with pytest.raises(ValueError, match=match):
        dmuon.Muon(model, **kw)


def ns_backends_job(rank: int, world: int) -> list:
    from tests._training import root_sharded

    model, _ = root_sharded(world)
    return dmuon.diagnostics.ns_backends(dmuon.Muon(model, lr=0.01))  # the default backend


def test_diagnostics_report_the_ns_call_of_each_shape_group():
    rows = run_distributed(ns_backends_job, 1)[0]
    # the test model at one rank: every projection owned, grouped by shape
    model = build_model()
    shapes: dict = {}
    for n, p in model.named_parameters():
        if projection_predicate(n, p):
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    assert [r["shape"] for r in rows] == [(k, *s) for s, k in sorted(shapes.items())]
    for r in rows:  # on the CPU the default is torch's bfloat16 form, with a reason
        assert (r["form"], r["dtype"], r["symmetric_products"]) == ("direct", "bfloat16", "torch"), r
        assert "cpu" in r["why"], r


def test_explain_names_the_form_kernel_and_reason_per_device():
    from dmuon.optim import _quack, _symmetric
    from dmuon.optim.newton_schulz import explain

    # a CUDA-typed shape needs no GPU to be explained
    wide, square, small = (4, 2048, 8192), (8, 4096, 4096), (4, 512, 2048)
    assert explain(wide, device="cuda")["form"] == "gram" and explain(square, device="cuda")["form"] == "direct_fp16"
    assert explain(small, device="cuda") == {"form": "direct_fp16", "dtype": "float16", "symmetric_products": "torch",
                                             "why": "m = 512 < 2048: cuBLAS's full products are faster"}
    big = explain(square, device="cuda")
    if _quack.gemm_symmetric is None:
        assert "quack-kernels is not installed" in big["why"]
        assert big["symmetric_products"] == ("triton" if _symmetric.triton is not None else "torch")
    assert explain(square, "direct", device="cuda")["symmetric_products"] == "torch"
    assert explain(wide)["form"] == "direct" and "cpu" in explain(wide)["why"]
