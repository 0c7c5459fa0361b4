"""Mixed precision: fp32 masters for a bf16 model (``Muon(master_dtype=...)``), gradients reduced in fp32
(``dedicate_params(reduce_dtype=...)``), the FSDP2 ``MixedPrecisionPolicy`` recipe for an fp32 model
(``dedicate_params(param_dtype=...)``), no_sync accumulation and clipping on fp32 gradients, 2 x 2 HSDP,
masters in every kind of checkpoint, and bad input.

[Note: the mixed-precision oracle] A bf16 forward is not invariant to how the batch is split (bf16 gradients
of two halves averaged are not the bf16 gradient of the whole), and Newton-Schulz turns such last-bit
differences into visibly different updates: a full-batch oracle differs from any 2-rank run by ~4e-2 in the
weights after 10 steps, as much as separates training with and without masters. So the oracle
here is the textbook data-parallel mixed-precision loop written out on one process: the same per-rank
batch halves, each rank's bf16 gradient taken to fp32 (summed there over micro-batches), averaged as
``(g0 + g1) / 2`` in fp32, ``torch.optim.Muon`` stepping fp32 copies that are rounded back into the bf16
model, ``torch.optim.AdamW`` on the other params, on the ranks' thread count. Nothing in it comes from dmuon,
except that the clipped run clips with the norm dmuon reported, once the test has checked that norm
against the oracle's own (test_clip_sees_the_fp32_gradients says why).

Each CPU's bf16 kernels round differently (oneDNN's AMX, AVX512-BF16 and AVX512 matmuls and ATen's
AVX2 fallback give step-0 gradient norms up to 6e-4 apart here), so the oracle is never compared with
numbers from another machine: it runs the ranks' kernels on the ranks' shapes in the same process
tree, which is what makes its bits the ranks' bits on any CPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.runtime.hooks import STATE_ATTR
from dmuon.tools.models import TinyLlama
from tests._asserts import rel_err
from tests._dist import rank_threads, run_distributed
from tests._training import CFG, GLOBAL_BATCH, KJ, batches, build_model, projection_predicate

BF16, FP32 = torch.bfloat16, torch.float32
WORLD = 2
STEPS = 6
MUON = dict(lr=0.01, weight_decay=0.01, momentum=0.95, nesterov=True)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


@dataclass(frozen=True)
class MP:
    #: "bf16": a bf16 model (FSDP2 reduces its params' gradients in fp32); "fsdp_mp": an fp32 model under
    #: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), dedicated params with param_dtype=bf16
    recipe: str = "bf16"
    #: bf16 recipe: Muon(master_dtype=torch.float32)
    master: bool = True
    reduce_fp32: bool = True
    steps: int = STEPS
    #: micro-batches per step, all but the last under dmuon.no_sync
    accum: int = 1
    max_norm: float | None = None
    #: build on the meta device, materialise with to_empty() + init after fully_shard
    meta: bool = False


# --------------------------------------------------------------------------------------------------- #
# Oracle: one process, written from the definition (see the module note)                              #
# --------------------------------------------------------------------------------------------------- #
#: unit roundoff (round to nearest) of float32 (24-bit significand) and bfloat16 (8-bit significand)
U32, U16 = 2.0**-24, 2.0**-8


def _exact_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of these gradients' exact values (float64 squares of fp32/bf16 numbers: error ~1e-16)."""
    return sum(g.double().square().sum().item() for g in grads) ** 0.5


def fp32_norm_rtol(grads: list[torch.Tensor], world: int) -> float:
    """A bound on |n - exact| / exact for any fp32 norm n of ``grads`` computed as dmuon.clip_grad_norm_ does:
    torch.linalg.vector_norm of each gradient (or of each rank's shard of it), those norms squared and
    summed over the params and the ranks, the root taken.

    Every square x_i^2 reaches the sum through d_i rounded fp32 operations, each multiplying it by some
    (1 + e), |e| <= U32, so |computed sum - sum| <= sum_p S_p ((1 + U32)^d_p - 1) with S_p the gradient's
    exact squared norm. torch's CPU vector_norm of a contiguous fp32 tensor of m elements squares each
    element (1 rounding), adds it into one of L SIMD lanes (ceil(m / L) additions), folds the L lanes
    left to right (L - 1) and adds the < L leftover elements (L - 1): d <= ceil(m / L) + 2L. L is 8 with
    256-bit vectors (ATen's DEFAULT and AVX2 builds), 16 with AVX512, so L = 8 bounds any x86 CPU; m is
    the whole gradient (a shard is shorter). Then the root and the square of each norm (3), at most
    len(grads) additions on a rank and world - 1 in the all-reduce. The root halves the relative error
    e of the sum (sqrt(1 - e) >= 1 - e/2 - e^2/2) and rounds once more. The error is only dmuon's: the
    reference is _exact_norm. For the test model this is ~6.4e-5 (dmuon measured 4.5e-7..7.3e-7 from the
    exact norm, the same with oneDNN and ATen capped by ONEDNN_MAX_CPU_ISA=AVX512_CORE / AVX2 and
    ATEN_CPU_CAPABILITY=avx2 / default); dropping its smallest dedicated gradient would move the norm by
    4e-4. A constant 32768-vector, the worst input for one accumulator, errs by 1.2e-5 in vector_norm
    against the 1.2e-4 this gives it, with ATen's AVX512, AVX2 and DEFAULT kernels alike."""
    squares = [g.double().square().sum().item() for g in grads]
    depth = 16 + 3 + len(grads) + world - 1
    e = sum(s * ((1 + U32) ** (-(-g.numel() // 8) + depth) - 1) for g, s in zip(grads, squares)) / sum(squares)
    return e / 2 + e * e / 2 + 2 * U32


@rank_threads()
def oracle(opts: MP, world: int = WORLD, clip_norms: list[float] | None = None) -> dict:
    """``clip_norms``: the norms dmuon reported, one a step; the oracle clips with those instead of its own
    (see test_clip_sees_the_fp32_gradients), and records the exact norm of its gradients to check them by."""
    torch.manual_seed(0)
    compute = build_model().to(BF16)  # what every forward runs on
    params = dict(compute.named_parameters())
    proj = [n for n, p in params.items() if projection_predicate(n, p)]
    if opts.recipe == "fsdp_mp":
        values = {n: p.detach().clone() for n, p in build_model().named_parameters()}  # fp32 everything
    else:
        values = {n: (p.detach().float().clone() if n in proj and opts.master else p) for n, p in params.items()}
    om = torch.optim.Muon([values[n] for n in proj], ns_coefficients=KJ, **MUON)
    oa = torch.optim.AdamW([values[n] for n in params if n not in proj], **ADAMW)
    per = GLOBAL_BATCH // world
    micro = per // opts.accum
    losses, norms, bounds, after, after_bounds, bf16_shares = [], [], [], [], [], []
    for step, (tok, tgt) in enumerate(batches(opts.steps)):
        with torch.no_grad():
            for n, p in params.items():
                if values[n] is not p:
                    p.copy_(values[n])  # round the fp32 values into the bf16 compute model
        total = {n: torch.zeros(p.shape, dtype=FP32) for n, p in params.items()}
        step_loss = 0.0
        for r in range(world):
            local = {n: torch.zeros(p.shape, dtype=FP32) for n, p in params.items()}
            rank_loss = 0.0
            for i in range(opts.accum):
                lo = r * per + i * micro
                compute.zero_grad()
                loss = compute(tok[lo : lo + micro], tgt[lo : lo + micro]).loss / opts.accum
                loss.backward()
                rank_loss += loss.item()
                for n, p in params.items():
                    local[n] += p.grad.float()
            for n in params:
                total[n] += local[n]
            step_loss += rank_loss / world
        for n in params:
            values[n].grad = (total[n] / world).to(values[n].dtype)
        if opts.max_norm is not None:
            grads = [values[n].grad for n in params]
            norms.append(_exact_norm(grads))
            bounds.append(fp32_norm_rtol(grads, world))
            bf16_shares.append(sum(g.double().square().sum().item() for g in grads if g.dtype == BF16)
                               / norms[-1] ** 2)
            # torch.nn.utils.clip_grad_norm_'s formula in fp32, with dmuon's norm when given
            norm = (torch.tensor(clip_norms[step], dtype=FP32) if clip_norms is not None
                    else torch.stack([g.float().norm() for g in grads]).norm())
            coef = torch.clamp(opts.max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
            after.append(_exact_norm(grads))
            after_bounds.append(fp32_norm_rtol(grads, world))
        om.step()
        oa.step()
        losses.append(step_loss)
    # what the model holds: the bf16 params of a bf16 model (its masters are optimizer state), the fp32
    # values under param_dtype (as FSDP2 keeps its fp32 params)
    dtype = FP32 if opts.recipe == "fsdp_mp" else BF16
    weights = {n: values[n].detach().to(dtype, copy=True) for n in params}
    return {"losses": losses, "weights": weights, "norms": norms, "norm_rtols": bounds, "after_clip": after,
            "after_clip_rtols": after_bounds, "bf16_shares": bf16_shares}


# --------------------------------------------------------------------------------------------------- #
# dmuon side                                                                                           #
# --------------------------------------------------------------------------------------------------- #
def build(world: int, opts: MP, seed: int = 0, hsdp: bool = False):
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if opts.meta:
        with torch.device("meta"):
            model = TinyLlama(CFG)
    else:
        model = build_model(seed)
    fsdp_mp = opts.recipe == "fsdp_mp"
    if not fsdp_mp:
        model = model.to(BF16)
    dmuon.dedicate_params(model, mesh, projection_predicate, param_dtype=BF16 if fsdp_mp else None,
                          reduce_dtype=FP32 if opts.reduce_fp32 else None)
    policy = MixedPrecisionPolicy(param_dtype=BF16 if fsdp_mp else None, reduce_dtype=FP32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if opts.meta:  # the owners' masters come from these fp32 values when dmuon.Muon binds the params
        model.to_empty(device="cpu")
        model.init_weights(seed)
    opt = dmuon.Muon(model, ns_coefficients=KJ, master_dtype=FP32 if opts.master else None,
                     adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                     adamw_weight_decay=ADAMW["weight_decay"], **MUON)
    return model, opt


def train_step(model, opt, opts: MP, rank: int, world: int, tok, tgt, record: dict | None = None) -> float:
    per = GLOBAL_BATCH // world
    micro = per // opts.accum
    opt.zero_grad()
    total = 0.0
    for i in range(opts.accum):
        lo = rank * per + i * micro
        with dmuon.no_sync(model) if i < opts.accum - 1 else nullcontext():
            loss = model(tok[lo : lo + micro], tgt[lo : lo + micro]).loss / opts.accum
            loss.backward()
        total += loss.item()
    if record is not None:
        record.setdefault("grad_dtypes", []).append(
            sorted({str(g.dtype) for g in dmuon.get_owned_grads(model).values() if g is not None}))
    if opts.max_norm is not None:
        record["norms"].append(dmuon.clip_grad_norm_(model, opts.max_norm).item())
        record["after_clip"].append(dmuon.clip_grad_norm_(model, 1e9).item())  # clips nothing, measures
    opt.step()
    logged = torch.tensor(total)
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def masters_consistent(model, opt) -> bool:
    """Every owned master, rounded to the param's dtype, is exactly the param (what is broadcast)."""
    state = getattr(model, STATE_ATTR)
    ok = True
    for dp in state.dedicated():
        if dp.owner != state.rank():
            continue
        master = dp.master if dp.master is not None else opt.state[dp.param].get("master")
        ok &= master is not None and master.dtype == FP32 and torch.equal(master.to(dp.param.dtype), dp.param)
    return bool(ok)


def train_job(rank: int, world: int, runs: dict[str, MP]) -> dict:
    out = {}
    for name, opts in runs.items():
        model, opt = build(world, opts)
        record: dict = {"norms": [], "after_clip": []}
        losses = [train_step(model, opt, opts, rank, world, tok, tgt, record) for tok, tgt in batches(opts.steps)]
        state = getattr(model, STATE_ATTR)
        out[name] = {
            "losses": losses,
            "weights": dmuon.get_model_state_dict(model),
            "masters_consistent": masters_consistent(model, opt) if opts.master or opts.recipe == "fsdp_mp" else None,
            "momentum_dtypes": sorted({str(opt.state[dp.param]["momentum_buffer"].dtype)
                                       for dp in state.dedicated() if dp.owner == rank}),
            "owned": len([dp for dp in state.dedicated() if dp.owner == rank]),
            **record,
        }
    return out


RUNS = {
    "master": MP(),
    "no_master": MP(master=False),
    "accum": MP(accum=4),
    "clip": MP(max_norm=0.5),
    "fsdp_mp": MP(recipe="fsdp_mp", master=False),
    # meta-device init, and master_dtype on top of param_dtype (which already keeps fp32 values: a no-op)
    "fsdp_mp_meta": MP(recipe="fsdp_mp", master=True, meta=True),
}


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_distributed(train_job, WORLD, RUNS)


@pytest.fixture(scope="module")
def oracles(trained) -> dict[str, dict]:
    out = {name: oracle(RUNS[name]) for name in ("master", "no_master", "accum", "fsdp_mp")}
    out["clip"] = oracle(RUNS["clip"], clip_norms=trained[0]["clip"]["norms"])
    out["fsdp_mp_meta"] = out["fsdp_mp"]  # the same values, initialised after to_empty instead
    return out


def _loss_gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


# The runs below reproduce their oracles bit for bit (every sum has the same operands in the same order on
# one machine: gloo's fp32 average of two ranks is (g0 + g1) / 2, FSDP2's pre-divided g0/2 + g1/2 is the
# same number), so the weights are compared exactly; losses differ only by the logging: both sides add the
# same fp32 micro-batch losses in Python floats, the oracle averages the ranks in float64 (~1e-16), dmuon
# rounds each rank's sum to fp32 and gloo adds them in fp32, at most `world` roundings of positive terms.
# Training with and without masters lands ~5e-3 apart after 6 steps (test_master_is_what_makes_the_difference).
def loss_rtol(world: int) -> float:
    return (1 + U32) ** world - 1 + 1e-15  # 1.2e-7 on 2 ranks (measured <= 5.6e-8), 2.4e-7 on 4 (6.6e-8)


LOSS_RTOL = loss_rtol(WORLD)


@pytest.mark.parametrize("run", ["master", "no_master", "accum", "fsdp_mp", "fsdp_mp_meta"])
def test_matches_mixed_precision_oracle(trained, oracles, run):
    got, want = trained[0][run], oracles[run]
    assert _loss_gap(got["losses"], want["losses"]) <= LOSS_RTOL, (got["losses"], want["losses"])
    assert got["losses"][-1] < got["losses"][0] - 0.05, "training did not make progress"
    assert set(got["weights"]) == set(want["weights"])
    for k, v in want["weights"].items():
        assert got["weights"][k].dtype == v.dtype and torch.equal(got["weights"][k], v), (
            f"{run}: {k} off by {rel_err(got['weights'][k], v):.2e}")
    for res in trained[1:]:  # every rank saw the same weights
        assert res[run]["losses"] == got["losses"]


def test_master_is_what_makes_the_difference(trained, oracles):
    """Without masters training lands ~5e-3 (measured 4.7e-3) away from the master oracle, which the master
    run reproduces exactly: a run that ignored its masters could not pass test_matches_mixed_precision_oracle."""
    with_master, without = oracles["master"]["weights"], oracles["no_master"]["weights"]
    proj = [k for k in with_master if projection_predicate(k, with_master[k])]
    gap = max(rel_err(without[k], with_master[k]) for k in proj)
    assert gap > 1e-3, gap
    got = trained[0]["no_master"]["weights"]
    assert max(rel_err(got[k], with_master[k]) for k in proj) > 1e-3


def test_masters_and_momentum_are_fp32_and_round_to_the_param(trained):
    for rank, res in enumerate(trained):
        for run in ("master", "accum", "clip", "fsdp_mp", "fsdp_mp_meta"):
            r = res[run]
            assert r["owned"] > 0, f"rank {rank} owns nothing"
            assert r["masters_consistent"], (rank, run)
            assert r["momentum_dtypes"] == ["torch.float32"], (rank, run, r["momentum_dtypes"])
            # the fp32-reduced gradient reaches the optimizer unrounded
            assert all(d == ["torch.float32"] for d in r["grad_dtypes"]), (rank, run, r["grad_dtypes"])
        assert res["no_master"]["momentum_dtypes"] == ["torch.bfloat16"]
    master, fsdp_mp = trained[0]["master"]["weights"], trained[0]["fsdp_mp"]["weights"]
    key = "layers.0.attention.q_proj.weight"
    assert master[key].dtype == BF16  # a bf16 model's state dict is bf16; its masters are optimizer state
    assert fsdp_mp[key].dtype == FP32  # param_dtype: the model's own (fp32) value, as FSDP2's params
    assert not torch.equal(fsdp_mp[key], fsdp_mp[key].to(BF16).float()), "the fp32 value carries no extra bits"


def test_clip_sees_the_fp32_gradients(trained, oracles):
    """The norm covers the owners' fp32 main_grads and clipping scales them: a clip that looked at
    ``param.grad`` only would miss every dedicated gradient (and leave them unscaled).

    The oracle clips with the norm dmuon reported, after this test has checked it against the exact norm of
    the same gradients. With its own fp32 norm it would not reproduce the run: the two norms differ in the
    last bits (summation order; 6.3e-7 at step 0, so the clip factors by 6 ulps), bf16 rounding (of the
    weights, and of the gradient in Newton-Schulz) turns that into other weights, and from the first step
    that rounds a weight differently the runs see different gradients. Which step that is depends on the
    gradients' bits, so on the CPU's bf16 kernels: on an AMX CPU the norms were 3.2e-4 apart at step 1
    (2.3e-4 with oneDNN capped at AVX2, ONEDNN_MAX_CPU_ISA=AVX2), where the first version of this test had
    measured 8e-7 on its CPU; here a 1-ulp change of the step-0 factor alone leaves step 1 alone and moves
    step 2 by 5.5e-4. Clipping with dmuon's norm, the oracle's gradients are dmuon's bit for bit at every
    step on any CPU, so the norms are compared within their rounding bound and the weights exactly."""
    want = oracles["clip"]
    assert min(want["norms"]) > 10 * 0.5, "the bound must actually clip"
    for res in trained:
        r = res["clip"]
        assert r["norms"] == trained[0]["clip"]["norms"] and r["after_clip"] == trained[0]["clip"]["after_clip"]
        for step, (got, exp, rtol) in enumerate(zip(r["norms"], want["norms"], want["norm_rtols"], strict=True)):
            assert abs(got - exp) <= rtol * exp, (step, got, exp, rtol)
        # After clipping: dmuon's norm of the clipped gradients within the same fp32 bound of their exact
        # norm, and that is max_norm up to the clip factor's error (c = 0.5 / (n + 1e-6): the norm's bound,
        # 1e-6 / norm, 2 roundings) and each scaled element's rounding, U16 relative in the bf16 gradients
        # (a share W of the norm^2, ~0.87 here) and U32 in the rest, U16^2 covering second-order terms:
        # 0.5 (W U16 + ...) ~ 1.7e-3 absolute (measured <= 6e-5: the roundings mostly cancel).
        for step, (got, exp, rtol) in enumerate(zip(r["after_clip"], want["after_clip"], want["after_clip_rtols"],
                                                    strict=True)):
            assert abs(got - exp) <= rtol * exp, (step, got, exp, rtol)
            slack = (want["bf16_shares"][step] * U16 + U16**2 + want["norm_rtols"][step]
                     + 1e-6 / want["norms"][step] + 3 * U32)
            assert abs(exp - 0.5) <= 0.5 * slack, (step, exp, slack)
    got = trained[0]["clip"]
    assert _loss_gap(got["losses"], want["losses"]) <= LOSS_RTOL, (got["losses"], want["losses"])
    assert set(got["weights"]) == set(want["weights"])
    for k, v in want["weights"].items():
        assert got["weights"][k].dtype == v.dtype and torch.equal(got["weights"][k], v), (
            f"clip: {k} off by {rel_err(got['weights'][k], v):.2e}")


def hsdp_job(rank: int, world: int, runs: dict[str, MP]) -> dict:
    out = {}
    for name, opts in runs.items():
        model, opt = build(world, opts, hsdp=True)
        losses = [train_step(model, opt, opts, rank, world, tok, tgt) for tok, tgt in batches(opts.steps)]
        out[name] = {"losses": losses, "weights": dmuon.get_model_state_dict(model),
                     "masters_consistent": masters_consistent(model, opt)}
    return out


def test_hsdp_matches_mixed_precision_oracle():
    """2 x 2 HSDP: the fp32 gradient goes through both reduce stages (shard group, then replicate group)
    unrounded, and the owners' masters still reproduce the 4-rank oracle exactly."""
    runs = {"master": MP(steps=3), "fsdp_mp": MP(recipe="fsdp_mp", master=False, steps=3)}
    results = run_distributed(hsdp_job, 4, runs)
    for name, opts in runs.items():
        want = oracle(opts, world=4)
        got = results[0][name]
        assert _loss_gap(got["losses"], want["losses"]) <= loss_rtol(4), (name, got["losses"], want["losses"])
        for k, v in want["weights"].items():
            assert torch.equal(got["weights"][k], v), (name, k, rel_err(got["weights"][k], v))
        assert all(res[name]["masters_consistent"] for res in results), name


# --------------------------------------------------------------------------------------------------- #
# What is reduced, stale masters, bad input                                                            #
# --------------------------------------------------------------------------------------------------- #
def _capture_local_grads(model) -> dict:
    captured: dict[str, torch.Tensor] = {}
    for name, p in dmuon.get_dedicated_params(model).items():
        p.register_hook(lambda g, name=name: captured.__setitem__(name, g.detach().clone()))
    return captured


def _reduce_case(rank: int, world: int, reduce_fp32: bool) -> dict:
    opts = MP(reduce_fp32=reduce_fp32, master=False)
    model, opt = build(world, opts)
    captured = _capture_local_grads(model)
    tok, tgt = batches(1)[0]
    dmuon.diagnostics.reset_comm_counts(model)
    per = GLOBAL_BATCH // world
    model(tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]).loss.backward()
    grads = dmuon.get_owned_grads(model)
    counts = dmuon.diagnostics.comm_counts(model)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, captured)
    owned = dmuon.get_owned_params(model)
    exact, differs_from_bf16 = True, False
    for name, g in grads.items():
        mean32 = sum(local[name].float() for local in everyone) / world
        want = mean32 if reduce_fp32 else mean32.to(BF16)
        exact &= g.dtype == want.dtype and torch.equal(g, want)
        differs_from_bf16 |= not torch.equal(mean32, mean32.to(BF16).float())
        exact &= (owned[name].grad is None) == reduce_fp32  # main_grad replaces .grad
    opt.step()
    return {"counts": counts, "exact": bool(exact), "differs_from_bf16": differs_from_bf16,
            "P": sum(p.numel() for p in dmuon.get_dedicated_params(model).values())}


def _stale_master_case(rank: int, world: int) -> dict:
    """A direct write to an owned bf16 param (then broadcast_all_updates) must win over its master."""
    model, opt = build(world, MP())
    for tok, tgt in batches(2):
        train_step(model, opt, MP(), rank, world, tok, tgt)
    owned = dmuon.get_owned_params(model)
    before = {n: opt.state[p]["master"].clone() for n, p in owned.items()}
    with torch.no_grad():
        for p in owned.values():
            p.mul_(0.5)
    dmuon.broadcast_all_updates(model)
    tok, tgt = batches(3)[2]
    train_step(model, opt, MP(), rank, world, tok, tgt)
    follows_edit = all(
        (opt.state[p]["master"] - 0.5 * before[n]).norm() < 0.1 * (opt.state[p]["master"] - before[n]).norm()
        for n, p in owned.items())
    return {"follows_edit": follows_edit, "consistent": masters_consistent(model, opt)}


def _fingerprint(model) -> dict:
    return {n: (p.dtype, p.untyped_storage().nbytes(), hasattr(p, "_dedicated_owner_rank"),
                p.detach().clone() if p.untyped_storage().nbytes() else None)
            for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x[:3] == y[:3] and (x[3] is None) == (y[3] is None) and (x[3] is None or torch.equal(x[3], y[3]))
        for x, y in ((a[k], b[k]) for k in a))


def _misuse_cases(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, tuple] = {}

    def attempt(name, fn, model):
        before = _fingerprint(model)
        try:
            fn()
            out[name] = ("no error", "", True)
        except Exception as e:  # noqa: BLE001 - recorded and asserted by the test
            out[name] = (type(e).__name__, str(e), _same(before, _fingerprint(model))
                         and getattr(model, STATE_ATTR, None) is None)

    model = build_model()
    for name, kwargs in {
        "param_dtype_int": dict(param_dtype=torch.int32),
        "param_dtype_str": dict(param_dtype="bfloat16"),
        "reduce_dtype_bool": dict(reduce_dtype=torch.bool),
        "param_dtype_wider": dict(param_dtype=torch.float64),
    }.items():
        attempt(name, lambda kw=kwargs: dmuon.dedicate_params(model, mesh, projection_predicate, **kw), model)
    # after all that the model still dedicates (and trains, below)
    dmuon.dedicate_params(model, mesh, projection_predicate)
    for name, kwargs in {"master_dtype_int": dict(master_dtype=torch.int64),
                         "master_dtype_str": dict(master_dtype="float32")}.items():
        try:
            dmuon.Muon(model, **kwargs)
            out[name] = ("no error", "", True)
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e), getattr(model, STATE_ATTR).replicated_params == [])

    # an fp32 model under FSDP2's bf16 policy without param_dtype: refused when building the optimizer
    plain = build_model()
    dmuon.dedicate_params(plain, mesh, projection_predicate)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    for layer in plain.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(plain, mesh=mesh, mp_policy=policy)
    try:
        dmuon.Muon(plain)
        out["fsdp_policy_mismatch"] = ("no error", "", True)
    except Exception as e:  # noqa: BLE001
        out["fsdp_policy_mismatch"] = (type(e).__name__, str(e), getattr(plain, STATE_ATTR).replicated_params == [])

    # optimizer state with masters into an optimizer without master_dtype: refused, nothing loaded
    bf16_model, with_master = build(world, MP())
    for tok, tgt in batches(1):
        train_step(bf16_model, with_master, MP(), rank, world, tok, tgt)
    without = dmuon.Muon(bf16_model, ns_coefficients=KJ)
    sd = dmuon.get_optimizer_state_dict(bf16_model, with_master)
    for name, fn in {"load_masters_dmuon": lambda: dmuon.set_optimizer_state_dict(bf16_model, without, sd),
                     "load_masters_torch": lambda: without.load_state_dict(with_master.state_dict())}.items():
        try:
            fn()
            out[name] = ("no error", "", True)
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e), len(without.state) == 0)
    # and the model still trains after all of it
    train_step(model, dmuon.Muon(model, ns_coefficients=KJ), MP(), rank, world, *batches(1)[0])
    return out


def mechanics_job(rank: int, world: int) -> dict:
    return {"reduce32": _reduce_case(rank, world, True), "reduce16": _reduce_case(rank, world, False),
            "stale": _stale_master_case(rank, world), "misuse": _misuse_cases(rank, world)}


@pytest.fixture(scope="module")
def mechanics() -> list[dict]:
    return run_distributed(mechanics_job, WORLD)


def test_reduce_dtype_changes_what_is_reduced(mechanics):
    for res in mechanics:
        r32, r16 = res["reduce32"], res["reduce16"]
        P = r32["P"]
        # fp32: the owner holds exactly the fp32 mean of the ranks' bf16 gradients, not its bf16 rounding
        assert r32["exact"] and r32["differs_from_bf16"]
        assert r16["exact"]  # default: reduced in bf16, in param.grad
        assert r32["counts"]["reduce"]["elements"] == r16["counts"]["reduce"]["elements"] == P
        assert r32["counts"]["reduce"]["bytes"] == 4 * P and r16["counts"]["reduce"]["bytes"] == 2 * P
        # broadcasts stay in the compute dtype either way
        assert r32["counts"]["forward_broadcast"]["bytes"] == r16["counts"]["forward_broadcast"]["bytes"] == 2 * P


def test_direct_param_writes_win_over_masters(mechanics):
    for res in mechanics:
        assert res["stale"]["follows_edit"] and res["stale"]["consistent"]


@pytest.mark.parametrize(
    "case, error, needle",
    [
        ("param_dtype_int", "ValueError", "param_dtype must be a floating-point dtype"),
        ("param_dtype_str", "TypeError", "param_dtype must be a torch.dtype"),
        ("reduce_dtype_bool", "ValueError", "reduce_dtype must be a floating-point dtype"),
        ("param_dtype_wider", "ValueError", "param_dtype=torch.float64 is wider than"),
        ("master_dtype_int", "ValueError", "master_dtype must be a floating-point dtype"),
        ("master_dtype_str", "TypeError", "master_dtype must be a torch.dtype"),
        ("fsdp_policy_mismatch", "ValueError", "param_dtype=torch.bfloat16"),
        ("load_masters_dmuon", "ValueError", "master_dtype it was saved with"),
        ("load_masters_torch", "ValueError", "master_dtype the state was saved with"),
    ],
)
def test_bad_input_raises_before_anything_changes(mechanics, case, error, needle):
    for res in mechanics:
        got, message, unchanged = res["misuse"][case]
        assert got == error, f"{case}: {got}: {message}"
        assert needle in message, f"{case}: {message!r}"
        assert unchanged, f"{case}: state changed"


# --------------------------------------------------------------------------------------------------- #
# Checkpoints                                                                                          #
# --------------------------------------------------------------------------------------------------- #
SAVE_AT = 3


def save_job(rank: int, world: int, ckpt_dir: str, opts: MP) -> dict:
    model, opt = build(world, opts)
    data = batches(opts.steps)
    losses = []
    for step, (tok, tgt) in enumerate(data):
        if step == SAVE_AT:
            model_sd = dmuon.get_model_state_dict(model)
            optim_sd = dmuon.get_optimizer_state_dict(model, opt)
            if rank == 0:
                torch.save({"model": model_sd, "optim": optim_sd}, os.path.join(ckpt_dir, "full.pt"))
            torch.save(opt.state_dict(), os.path.join(ckpt_dir, f"native{rank}.pt"))
            dist.barrier()
            dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                      "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)},
                     checkpoint_id=os.path.join(ckpt_dir, "dcp"))
        losses.append(train_step(model, opt, opts, rank, world, tok, tgt))
    return {"losses": losses, "model": dmuon.get_model_state_dict(model)}


def resume_job(rank: int, world: int, ckpt_dir: str, opts: MP, modes: list[str]) -> dict:
    out = {}
    data = batches(opts.steps)
    for mode in modes:
        model, opt = build(world, opts, seed=123)  # a different init: the load must replace it
        ckpt = torch.load(os.path.join(ckpt_dir, "full.pt"), map_location="cpu", weights_only=False)
        if mode == "dcp":
            target = {"model": dmuon.get_model_state_dict(model, sharded=True),
                      "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}
            dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
            dmuon.set_model_state_dict(model, target["model"])
            dmuon.set_optimizer_state_dict(model, opt, target["optim"])
        elif mode == "rank0":
            dmuon.set_model_state_dict(model, ckpt["model"] if rank == 0 else {})
            dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"] if rank == 0 else {})
        elif mode == "native":
            dmuon.set_model_state_dict(model, ckpt["model"])
            opt.load_state_dict(torch.load(os.path.join(ckpt_dir, f"native{rank}.pt"), weights_only=False))
        else:
            optim_sd = ckpt["optim"]
            if mode == "no_master":  # what a checkpoint that forgot the masters would resume to
                optim_sd = {"param_groups": optim_sd["param_groups"],
                            "state": {n: {k: v for k, v in e.items() if k != "master"}
                                      for n, e in optim_sd["state"].items()}}
            dmuon.set_model_state_dict(model, ckpt["model"])
            dmuon.set_optimizer_state_dict(model, opt, optim_sd)
        losses = [train_step(model, opt, opts, rank, world, tok, tgt) for tok, tgt in data[SAVE_AT:]]
        out[mode] = {"losses": losses, "model": dmuon.get_model_state_dict(model)}
    return out


CKPT_RUNS = {"bf16": (MP(), ["full", "rank0", "dcp", "native", "no_master"]),
             "fsdp_mp": (MP(recipe="fsdp_mp", master=False), ["full", "dcp", "native"])}


@pytest.fixture(scope="module", params=sorted(CKPT_RUNS))
def restarted(request, tmp_path_factory) -> tuple[str, dict, dict, dict]:
    opts, modes = CKPT_RUNS[request.param]
    ckpt_dir = str(tmp_path_factory.mktemp(f"mp_ckpt_{request.param}"))
    original = run_distributed(save_job, WORLD, ckpt_dir, opts)[0]
    resumed = run_distributed(resume_job, WORLD, ckpt_dir, opts, modes)[0]
    saved = torch.load(os.path.join(ckpt_dir, "full.pt"), map_location="cpu", weights_only=False)
    return request.param, original, resumed, saved


def test_restart_with_masters_is_bit_identical(restarted):
    recipe, original, resumed, _ = restarted
    for mode, r in resumed.items():
        if mode == "no_master":
            continue
        assert r["losses"] == original["losses"][SAVE_AT:], (recipe, mode)
        for k, v in original["model"].items():
            assert torch.equal(r["model"][k], v), (recipe, mode, k)


def test_checkpoints_hold_the_masters(restarted):
    recipe, original, resumed, saved = restarted
    key = "layers.0.attention.q_proj.weight"
    if recipe == "bf16":
        entry = saved["optim"]["state"][key]
        assert entry["master"].dtype == entry["momentum_buffer"].dtype == FP32
        assert saved["model"][key].dtype == BF16 and torch.equal(entry["master"].to(BF16), saved["model"][key])
        assert not torch.equal(entry["master"], saved["model"][key].float()), "the master carries no extra bits"
        # and those bits matter: resuming without them leaves the uninterrupted trajectory
        assert resumed["no_master"]["losses"] != original["losses"][SAVE_AT:]
    else:
        # the model dict holds the fp32 values (loadable into the plain fp32 model); no optimizer masters
        assert saved["model"][key].dtype == FP32
        assert not torch.equal(saved["model"][key], saved["model"][key].to(BF16).float())
        assert "master" not in saved["optim"]["state"][key]
        assert saved["optim"]["state"][key]["momentum_buffer"].dtype == FP32
        plain = build_model(seed=5)
        plain.load_state_dict(saved["model"], strict=True)


def test_refresh_skips_the_check_until_the_param_is_written():
    """The per-step master check costs nothing while the param's version counter shows no write."""
    from dmuon.runtime.precision import refresh_master_

    p = torch.nn.Parameter(torch.randn(4, 6).bfloat16())
    master = p.detach().float() * (1 + 2**-12)  # low bits only the master knows: rounds back to p
    assert torch.equal(master.bfloat16(), p.detach())
    v = refresh_master_(master, p)  # unknown version: compares, they agree, master kept
    keep = master.clone()
    master[0, 0] += 1.0  # a master p does not match any more...
    assert refresh_master_(master, p, v) == v  # ...is kept: nothing wrote p, so nothing is checked
    assert master[0, 0] == keep[0, 0] + 1.0
    with torch.no_grad():
        p[1, 1] = 7.0  # a direct write bumps the counter: the check runs and the param wins
    v2 = refresh_master_(master, p, v)
    assert v2 != v and torch.equal(master, p.detach().float())
