"""Mixture of experts: 3-D expert weights on Muon, each expert (and each row block of it) its own matrix.

The oracle is single-process ``torch.optim.Muon`` on one 2-D parameter per expert slice and row block, with
``torch.optim.AdamW`` for the rest (``tests/_moe.py``). Both routes of a batch of matrices are compared with it
at 2 and 4 gloo ranks, Z3 and Z2: experts on one owner each (``route="muon"``) and experts on FSDP2's dim-0
shards (``"muon_sharded"``, the default here since every rank gets an expert). Wrong implementations (experts
flattened into one ``[E m, n]`` matrix, experts on AdamW, a fused gate/up orthogonalised as one matrix) must
miss the oracle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests._asserts import LOSS_RTOL, WEIGHT_RTOL, assert_bitwise, assert_close_to, worst_weight
from tests._dist import run_distributed
from tests._moe import MOE_CFG, MoERun, moe_cfg, train_moe, train_moe_oracle

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS = 10
FUSED = moe_cfg(layout="fused", dead_expert=1)

#: variant -> (run, whether it is a correct implementation)
RUNS = {
    "owner_z3": MoERun(steps=STEPS, expert_route="muon"),
    "owner_z2": MoERun(steps=STEPS, expert_route="muon", reshard_after_forward=False),
    "sharded_z3": MoERun(steps=STEPS),
    "sharded_z2": MoERun(steps=STEPS, reshard_after_forward=False),
    "fused_dead": MoERun(steps=STEPS, cfg=FUSED),
    "fused_dead_owner": MoERun(steps=STEPS, cfg=FUSED, expert_route="muon"),
    # expert parallelism over 2 ranks (tools/moe.apply_expert_parallel), FSDP2 over the rest for the experts
    "ep_z3": MoERun(steps=STEPS, ep=2),
    "ep_z2": MoERun(steps=STEPS, ep=2, reshard_after_forward=False),
    "ep_fused_dead": MoERun(steps=STEPS, cfg=FUSED, ep=2),
    # the recipe's other habits on experts: accumulation under no_sync, clipping, the experts' own param group
    "extras_sharded": MoERun(steps=STEPS, accum=2, clip=0.5, expert_lr=0.02),
    "extras_owner": MoERun(steps=STEPS, accum=2, clip=0.5, expert_lr=0.02, expert_route="muon"),
}
#: mixed precision: an fp32 model computing in bf16 (the engine's-shards route must do exactly what the owner
#: route does), and a bf16 model with float32 masters
MIXED = {"mp_owner": MoERun(steps=STEPS, mixed="fp32_params", expert_route="muon"),
         "mp_sharded": MoERun(steps=STEPS, mixed="fp32_params", expert_route="muon_sharded"),
         "bf16_sharded": MoERun(steps=STEPS, mixed="bf16_model", expert_route="muon_sharded")}
WRONG = ("flattened", "flattened_owner", "experts_on_adamw", "fused_as_one")


def _flattened(real):
    """What the tests must catch: every parameter's matrices as one ``[E m, n]`` matrix (and its lr)."""
    def update(params, grads, bufs, hp, blocks=None):
        flat = [[t.reshape(-1, t.shape[-1]) for t in ts] for ts in (params, grads, bufs)]
        real(*flat, hp)
    return update


def moe_job(rank: int, world: int) -> dict:
    import dmuon.optim.update as update_module  # every route's rule looks its update up here at call time

    out = {name: train_moe(rank, world, run) for name, run in RUNS.items()}
    if world != 2:
        return out
    out.update({name: train_moe(rank, world, run) for name, run in MIXED.items()})
    out["experts_on_adamw"] = train_moe(rank, world, MoERun(steps=STEPS, experts_on_adamw=True))
    out["fused_as_one"] = train_moe(rank, world, MoERun(steps=STEPS, cfg=replace(FUSED, layout="fused"),
                                                        ignore_blocks=True))
    real = update_module.muon_update_batch_
    update_module.muon_update_batch_ = _flattened(real)
    try:
        out["flattened"] = train_moe(rank, world, RUNS["sharded_z3"])
        out["flattened_owner"] = train_moe(rank, world, RUNS["owner_z3"])
    finally:
        update_module.muon_update_batch_ = real
    return out


@pytest.fixture(scope="module")
def oracles() -> dict:
    return {"separate": train_moe_oracle(STEPS), "fused": train_moe_oracle(STEPS, FUSED),
            "extras": train_moe_oracle(STEPS, accum=2, clip=0.5, expert_lr=0.02)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(moe_job, request.param)


def _oracle_of(name: str, oracles: dict) -> dict:
    return oracles["fused" if "fused" in name else "extras" if "extras" in name else "separate"]


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_per_expert_oracle(runs, oracles, name):
    world, results = runs
    r = results[0][name]
    assert_close_to(r, _oracle_of(name, oracles), f"world {world} {name}")
    for rank, res in enumerate(results[1:], start=1):  # every rank computes with the same weights
        assert_bitwise(res[name], r, f"world {world} {name} rank {rank} vs 0")


@pytest.mark.parametrize("route", ["owner", "sharded", "ep"])
def test_z2_equals_z3_bitwise(runs, route):
    world, results = runs
    for rank, res in enumerate(results):
        assert_bitwise(res[f"{route}_z2"], res[f"{route}_z3"], f"world {world} rank {rank} {route}")


def test_expert_routes_own_what_they_should(runs):
    """One owner per expert param on the owner route; on the engine's shards no rank owns an expert param (each
    holds E / W whole experts of every one), and every rank owns some dense matrix either way."""
    world, results = runs
    owned = [set(res["owner_z3"]["owned"]) for res in results]
    experts = {n for o in owned for n in o if ".experts." in n}
    assert len(experts) == 6 and sum(len(o & experts) for o in owned) == 6, owned
    for rank, res in enumerate(results):
        assert not [n for n in res["sharded_z3"]["owned"] if ".experts." in n], (rank, res["sharded_z3"]["owned"])
        assert res["sharded_z3"]["owned"], f"rank {rank} owns no dense matrix"
        assert res["sharded_z3"]["expert_shapes"] == {n: (4 // world, *s[1:]) for n, s in MOE_EXPERTS.items()}


def test_newton_schulz_calls_batch_experts_never_flatten_them(runs):
    """What ``diagnostics.ns_backends`` reports is what step() runs: per rank, the experts of each layout in one
    batched call of ``(m, n)`` matrices (w1 and w3 share a layout, and both layers' params batch together), a
    fused gate/up as ``2 E`` matrices of ``(F, D)``, never an ``(E m) x n`` matrix."""
    world, results = runs
    D, F = MOE_CFG.dim, MOE_CFG.expert_dim
    for rank, res in enumerate(results):
        calls = res["sharded_z3"]["ns_calls"]
        local = MOE_CFG.n_experts // world
        assert (2 * 2 * local, F, D) in calls and (2 * local, D, F) in calls, (rank, calls)
        assert not [c for c in calls if c[1] > max(D, F, MOE_CFG.hidden_dim)], (rank, calls)
        fused = res["fused_dead"]["ns_calls"]
        assert (2 * 2 * local, F, D) in fused and (2 * local, D, F) in fused, (rank, fused)
        owners = [c for r in results for c in r["owner_z3"]["ns_calls"]]
        assert sum(b for b, m, n in owners if (m, n) == (F, D)) == 2 * 2 * MOE_CFG.n_experts, owners


MOE_EXPERTS = {f"layers.{i}.moe.experts.{w}": (MOE_CFG.n_experts, MOE_CFG.expert_dim, MOE_CFG.dim)
               if w != "w2" else (MOE_CFG.n_experts, MOE_CFG.dim, MOE_CFG.expert_dim)
               for i in range(MOE_CFG.n_layers) for w in ("w1", "w2", "w3")}


def test_dead_expert_decays_like_torch_with_a_zero_gradient(runs, oracles):
    """An expert that never gets a token: torch's Muon with a zero gradient leaves only the decay (Newton-Schulz
    of zero is zero), and dmuon's weights for it equal the oracle's, bit for bit on every rank."""
    world, results = runs
    want = oracles["fused"]["weights"]
    decay = (1 - RUNS["fused_dead"].hp.lr * RUNS["fused_dead"].hp.weight_decay)
    for name in ("fused_dead", "fused_dead_owner", "ep_fused_dead"):
        for key in ("layers.0.moe.experts.gate_up_proj", "layers.1.moe.experts.down_proj"):
            got = results[0][name]["weights"][key][FUSED.dead_expert]
            assert torch.equal(got, want[key][FUSED.dead_expert]), (world, name, key)
            init = results[0][name]["initial"][key][FUSED.dead_expert]
            assert torch.allclose(got, init * decay**STEPS, rtol=1e-6, atol=0), (world, name, key)


def test_mixed_precision_on_the_engines_shards(runs):
    """An fp32 model computing in bf16 with float32 reduces: the experts' update on FSDP2's shards is bit for bit
    the owners' (whose mixed precision tests/test_mixed_precision.py checks against a hand-written loop). A bf16
    model with ``master_dtype=float32``: the experts keep float32 masters and momenta in the optimizer state,
    and train. (FSDP2 keeps a bf16 param's reduced gradient in bf16, so that run is not the owners' bit for bit:
    an owner keeps the float32 average.)"""
    world, results = runs
    if world != 2:
        pytest.skip("the mixed-precision runs are at 2 ranks")
    for rank, res in enumerate(results):
        assert_bitwise(res["mp_sharded"], res["mp_owner"], f"rank {rank} fp32 params, bf16 compute")
        r = res["bf16_sharded"]
        assert r["expert_state"]["layers.0.moe.experts.w1"] == {"master": "torch.float32",
                                                                 "momentum_buffer": "torch.float32"}, r["expert_state"]
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0], r["losses"]


def test_wrong_implementations_miss_the_oracle(runs, oracles):
    """The parity test can fail: each wrong variant misses the loss or the weight bound (numbers in the message)."""
    world, results = runs
    if world != 2:
        pytest.skip("the wrong variants run at 2 ranks")
    for name in WRONG:
        r, ref = results[0][name], _oracle_of(name, oracles)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        weight_err, key = worst_weight(r["weights"], ref["weights"])
        assert loss_err > LOSS_RTOL or weight_err > WEIGHT_RTOL, (name, loss_err, weight_err, key)
        assert weight_err > 2 * WEIGHT_RTOL, f"{name} only {weight_err:.2e} off ({key}); too close to the bound"


def moe_misuse_job(rank: int, world: int) -> dict:
    """Each misuse on every rank: its error, and whether anything was left changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import dmuon
    from dmuon.tools.moe import expert_predicate
    from tests._dist import DEVICE_TYPE, device
    from tests._moe import build_moe

    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    errors: dict[str, str | None] = {}

    def attempt(case: str, model, fn) -> None:
        try:
            fn(model)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
        errors[case + "/untouched"] = str(not any(hasattr(p, "_dedicated_owner_rank") for p in model.parameters()))

    fused = build_moe(FUSED).to(device())
    attempt("blocks_do_not_tile", fused, lambda m: dmuon.dedicate_params(
        m, mesh, expert_predicate, blocks=lambda n, p: 5 if n.endswith("gate_up_proj") else None))
    attempt("sharded_2d", build_moe().to(device()), lambda m: dmuon.dedicate_params(
        m, mesh, expert_predicate, route=lambda n, p: "muon_sharded" if n.endswith("q_proj.weight") else None))
    ep = build_moe().to(device())
    for layer in ep.layers:  # an expert-parallel placement that splits each expert's rows, not the experts
        w = layer.moe.experts.w1
        layer.moe.experts.w1 = torch.nn.Parameter(distribute_tensor(w.detach(), mesh, [Shard(1)]))
    attempt("ep_not_dim0", ep, lambda m: dmuon.dedicate_params(m, mesh, expert_predicate))
    sharded_first = build_moe().to(device())
    fully_shard(sharded_first.layers[0], mesh=mesh)
    attempt("fully_shard_first", sharded_first, lambda m: dmuon.dedicate_params(m, mesh, expert_predicate))
    unwrapped = build_moe().to(device())  # experts left to an engine that never shards them (no fully_shard)
    dmuon.dedicate_params(unwrapped, mesh, expert_predicate, verbose=False)
    try:
        dmuon.Muon(unwrapped)
        errors["sharded_not_sharded"] = None
    except ValueError as e:
        errors["sharded_not_sharded"] = str(e)
    return errors


def test_moe_misuse_raises_on_every_rank_before_anything_changes():
    results = run_distributed(moe_misuse_job, 2)
    expected = {
        "blocks_do_not_tile": "5 row blocks do not tile the 192 rows",
        "sharded_2d": "only a batch of matrices (3-D or more",
        "ep_not_dim0": "must be split along dim 0 only",
        "fully_shard_first": "must run before fully_shard",
        "sharded_not_sharded": "is routed 'muon_sharded', Muon on the engine's shards of dim 0, but it is not sharded",
    }
    for rank, errors in enumerate(results):
        for case, text in expected.items():
            assert errors[case] is not None and text in errors[case], (rank, case, errors[case])
            if case != "sharded_not_sharded":
                assert errors[case + "/untouched"] == "True", (rank, case)
