"""Mixed precision: fp32 masters for a bf16 model (``Muon(master_dtype=...)``), gradients reduced in fp32
(``dedicate_params(reduce_dtype=...)``), the FSDP2 ``MixedPrecisionPolicy`` recipe for an fp32 model
(``dedicate_params(param_dtype=...)``), no_sync accumulation and clipping on fp32 gradients, 2 x 2 HSDP,
masters in every kind of checkpoint, and bad input.

The oracle and the builders are in tests/_mixed_precision.py ([Note: the mixed-precision oracle]); the
restarts are in tests/test_mixed_precision_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.runtime.hooks import STATE_ATTR
from tests._asserts import rel_err
from tests._dist import run_distributed
from tests._mixed_precision import (
    BF16,
    FP32,
    LOSS_RTOL,
    MP,
    U16,
    U32,
    WORLD,
    build,
    loss_gap,
    loss_rtol,
    masters_consistent,
    oracle,
    train_job,
    train_step,
)
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, projection_predicate

RUNS = {
    "master": MP(),
    "no_master": MP(master=False),
    "accum": MP(accum=4),
    "clip": MP(max_norm=0.5),
    "fsdp_mp": MP(recipe="fsdp_mp", master=False),
    # meta-device init, and master_dtype on top of param_dtype (which already keeps fp32 values: a no-op)
    "fsdp_mp_meta": MP(recipe="fsdp_mp", master=True, meta=True),
}


def mixed_precision_jobs(rank: int, world: int) -> dict:
    """The trainings and then the mechanics below, in one launch of ``WORLD`` ranks."""
    return {"trained": train_job(rank, world, RUNS), "mechanics": mechanics_job(rank, world)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(mixed_precision_jobs, WORLD)


@pytest.fixture(scope="module")
def trained(runs) -> list[dict]:
    return [r["trained"] for r in runs]


@pytest.fixture(scope="module")
def oracles(trained) -> dict[str, dict]:
    out = {name: oracle(RUNS[name]) for name in ("master", "no_master", "accum", "fsdp_mp")}
    out["clip"] = oracle(RUNS["clip"], clip_norms=trained[0]["clip"]["norms"])
    out["fsdp_mp_meta"] = out["fsdp_mp"]  # the same values, initialised after to_empty instead
    return out




@pytest.mark.parametrize("run", ["master", "no_master", "accum", "fsdp_mp", "fsdp_mp_meta"])
def test_matches_mixed_precision_oracle(trained, oracles, run):
    got, want = trained[0][run], oracles[run]
    assert loss_gap(got["losses"], want["losses"]) <= LOSS_RTOL, (got["losses"], want["losses"])
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
    assert loss_gap(got["losses"], want["losses"]) <= LOSS_RTOL, (got["losses"], want["losses"])
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
        assert loss_gap(got["losses"], want["losses"]) <= loss_rtol(4), (name, got["losses"], want["losses"])
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
    without = dmuon.Muon(bf16_model, ns_coefficients=KJ, ns_backend="direct")
    sd = dmuon.get_optimizer_state_dict(bf16_model, with_master)
    for name, fn in {"load_masters_dmuon": lambda: dmuon.set_optimizer_state_dict(bf16_model, without, sd),
                     "load_masters_torch": lambda: without.load_state_dict(with_master.state_dict())}.items():
        try:
            fn()
            out[name] = ("no error", "", True)
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e), len(without.state) == 0)
    # and the model still trains after all of it
    train_step(model, dmuon.Muon(model, ns_coefficients=KJ, ns_backend="direct"), MP(), rank, world, *batches(1)[0])
    return out


def mechanics_job(rank: int, world: int) -> dict:
    return {"reduce32": _reduce_case(rank, world, True), "reduce16": _reduce_case(rank, world, False),
            "stale": _stale_master_case(rank, world), "misuse": _misuse_cases(rank, world)}


@pytest.fixture(scope="module")
def mechanics(runs) -> list[dict]:
    return [r["mechanics"] for r in runs]


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


