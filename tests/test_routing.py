"""Routing (issue 15, item 2): ``dedicate_params(route=...)`` sends each param's update to Muon on its
owner, AdamW on an owner, AdamW on FSDP2 shards or AdamW replicated.

The variants route the layer norms (1-D weights inside ``layers.N``) differently while everything else
stays as in the recipe: FSDP2 shards (per-layer and root units, the default), ``adamw_owner`` (the layers
then hold no FSDP2 params, so only the root is ``fully_shard``-ed) and ``adamw_replicated`` (likewise).
Every variant also passes one param group (no weight decay for those norms), so an ``adamw_owner``
param in a user group is covered. The math is the same in all three: AdamW is elementwise, and at 2
ranks every average is ``(a + b) / 2`` rounded once (FSDP2 halves each gradient then sums, dmuon sums
then halves: scaling by 2 is exact), so the runs are compared bit for bit (also for a bfloat16 model
averaged in float32), and at 4 ranks (flat and HSDP 2x2) against the single-process oracle.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.tools.models import projection_predicate
from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, batches, build_model, full_weights, muon_kwargs, train_oracle

STEPS, RESTART_AT = 8, 4
VARIANTS = ("default", "adamw_owner", "adamw_replicated")


def _layer_norm(fqn: str, p: torch.Tensor) -> bool:
    return fqn.startswith("layers.") and p.ndim == 1


def _build(world: int, variant: str, seed: int = 0, *, hsdp: bool = False, bf16: bool = False):
    """``bf16``: a bfloat16 model whose gradients are averaged in float32 (FSDP2's ``reduce_dtype`` and
    dmuon's), Muon on float32 masters."""
    if hsdp:
        grid = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        mesh, extra = grid, {"replicate_mesh": grid["replicate"]}
    else:
        mesh, extra = init_device_mesh(DEVICE_TYPE, (world,)), {}
    model = build_model(seed=seed).to(device())
    fsdp_kw = {}
    if bf16:
        model = model.to(torch.bfloat16)
        extra["reduce_dtype"] = torch.float32
        fsdp_kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    route = None if variant == "default" else (lambda n, p: variant if _layer_norm(n, p) else None)
    dmuon.dedicate_params(model, mesh["shard"] if hsdp else mesh, projection_predicate, route=route, **extra)
    if variant == "default":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **fsdp_kw)
    fully_shard(model, mesh=mesh, **fsdp_kw)
    norms = [n for n, p in model.named_parameters() if _layer_norm(n, p)]
    opt = dmuon.Muon(model, **muon_kwargs(), master_dtype=torch.float32 if bf16 else None,
                     param_groups=[{"params": norms, "weight_decay": 0.0, "name": "norms"}])
    return model, opt


def _train(model, opt, rank: int, world: int, first: int, last: int, losses: list) -> None:
    per = GLOBAL_BATCH // world
    for step, (tok, tgt) in enumerate(batches(last)):
        if step < first:
            continue
        opt.zero_grad()
        loss = model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())


def run_variant(rank: int, world: int, variant: str, restart: str | None = None, ckpt_dir: str | None = None,
                **build: bool) -> dict:
    model, opt = _build(world, variant, **build)
    layout = {
        "fsdp_units": sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        "kinds": [(g["name"], g["kind"], list(names)) for g, names in zip(opt.param_groups, opt.group_fqns())],
        "dedicated": sorted(dmuon.get_dedicated_params(model)),
        "owned_norm_state": {dp_name: sorted(opt.state[p]) for dp_name, p in dmuon.get_owned_params(model).items()
                             if _layer_norm(dp_name, p)},
    }
    losses: list[float] = []
    if restart is None:
        _train(model, opt, rank, world, 0, STEPS, losses)
    else:
        _train(model, opt, rank, world, 0, RESTART_AT, losses)
        model, opt = _restart(model, opt, world, variant, restart, ckpt_dir)
        _train(model, opt, rank, world, RESTART_AT, STEPS, losses)
    layout["owned_norm_state"] = {n: sorted(opt.state[p]) for n, p in dmuon.get_owned_params(model).items()
                                  if _layer_norm(n, p)}
    summary = dmuon.diagnostics.summarize(model, optimizer=opt).as_dict()
    return {"losses": losses, "weights": full_weights(model), "layout": layout, "summary": summary}


def _restart(model, opt, world: int, variant: str, route: str, ckpt_dir: str):
    path = os.path.join(ckpt_dir, f"{variant}-{route}")
    if route == "dcp":
        dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                  "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}, checkpoint_id=path)
    else:
        sd = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
        if dist.get_rank() == 0:
            torch.save(sd, path)
        dist.barrier()
    del model, opt
    model, opt = _build(world, variant, seed=3)
    if route == "dcp":  # a staged target: owner-held AdamW state (adamw_owner) goes through the copies too
        sd = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
        dcp.load(sd, checkpoint_id=path)
    else:
        sd = torch.load(path, weights_only=True)
    dmuon.set_state_dict(model, opt, sd)
    return model, opt


def routing_job(rank: int, world: int) -> dict:
    out = {v: run_variant(rank, world, v) for v in VARIANTS}
    if world == 4:
        out["adamw_owner_hsdp"] = run_variant(rank, world, "adamw_owner", hsdp=True)
    if world == 2:
        for v in ("default", "adamw_owner"):  # the owner's AdamW reads a gradient averaged in float32
            out[f"bf16_{v}"] = run_variant(rank, world, v, bf16=True)
        with tempfile.TemporaryDirectory() as d:
            box = [d]
            dist.broadcast_object_list(box, src=0)
            for route in ("full", "dcp"):
                out[f"restart_{route}"] = run_variant(rank, world, "adamw_owner", route, box[0])
            dist.barrier()
    return out


def oracle_norms_without_decay() -> dict:
    """One process: torch.optim.Muon on the projections, AdamW on the rest with no decay on the layer norms."""
    return train_oracle(STEPS, no_decay=_layer_norm)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(routing_job, request.param)


def test_routes_change_who_holds_the_norms(runs):
    world, results = runs
    for rank, res in enumerate(results):
        default, owner, replicated = (res[v]["layout"] for v in VARIANTS)
        assert default["fsdp_units"] == ["<root>", "layers.0", "layers.1"]
        # no param of a layer is left to FSDP2: the layers need no unit of their own
        assert owner["fsdp_units"] == replicated["fsdp_units"] == ["<root>"]
        norms = sorted(n for n in owner["dedicated"] if n not in default["dedicated"])
        assert norms and all(n.startswith("layers.") and "norm" in n for n in norms), norms
        assert replicated["dedicated"] == default["dedicated"]
        kinds = {(name, kind): names for name, kind, names in owner["kinds"]}
        assert kinds[("norms", "adamw_owned")] == norms and kinds[("norms", "adamw")] == []
        assert {(name, kind): names for name, kind, names in replicated["kinds"]}[("norms", "adamw_replicated")] == norms
        # AdamW state of an owner-routed norm exists on its owner only, and is AdamW's
        for n, keys in owner["owned_norm_state"].items():
            assert keys == ["exp_avg", "exp_avg_sq", "step"], (rank, n, keys)
        owned = {p["fqn"]: p for p in res["adamw_owner"]["summary"]["ranks"][rank]["owned"]}
        assert all(owned[n]["route"] == "adamw_owner" and owned[n]["ns_flops"] == 0.0 for n in owner["owned_norm_state"])
    owners = [set(res["adamw_owner"]["layout"]["owned_norm_state"]) for res in results]
    assert sum(len(o) for o in owners) == len(set().union(*owners)) > 0, "a norm with two owners, or none"


def test_routing_variants_are_bit_identical_at_two_ranks(runs):
    world, results = runs
    if world != 2:
        pytest.skip("at 4 ranks the averages are summed in other orders; compared with the oracle below")
    for rank, res in enumerate(results):
        for variant in VARIANTS[1:]:
            assert_bitwise(res[variant], res["default"], f"rank {rank} {variant} vs default")
        assert_bitwise(res["bf16_adamw_owner"], res["bf16_default"], f"rank {rank} bf16 adamw_owner vs default")
        assert res["bf16_default"]["weights"]["norm.weight"].dtype == torch.bfloat16
        assert res["bf16_default"]["losses"] != res["default"]["losses"]  # the bf16 runs are runs of their own


def test_owner_routed_norms_under_hsdp_match_the_oracle(runs):
    world, results = runs
    if world != 4:
        pytest.skip("HSDP 2x2 needs 4 ranks")
    assert_close_to(results[0]["adamw_owner_hsdp"], oracle_norms_without_decay(), "HSDP 2x2 adamw_owner")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_route_matches_the_oracle(runs, variant):
    world, results = runs
    assert_close_to(results[0][variant], oracle_norms_without_decay(), f"world {world} {variant}")


@pytest.mark.parametrize("route", ["full", "dcp"])
def test_owner_routed_state_survives_a_restart_bit_for_bit(runs, route):
    world, results = runs
    if world != 2:
        pytest.skip("restarts run at 2 ranks")
    for rank, res in enumerate(results):
        assert_bitwise(res[f"restart_{route}"], res["adamw_owner"], f"rank {rank} restart through {route}")


# --------------------------------------------------------------------------------------------------- #
# Bad routes raise on every rank before anything changes; adamw_sharded overrides the predicate         #
# --------------------------------------------------------------------------------------------------- #
NORM = "layers.0.attention_norm.weight"
DOWN = "layers.1.mlp.down_proj.weight"


def route_misuse_job(rank: int, world: int) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    model.layers[0].scale = torch.nn.Parameter(torch.tensor(1.0))
    cases = {
        "scalar_on_owner": (lambda n, p: "adamw_owner" if n == "layers.0.scale" else None, {}),
        "owner_with_param_dtype": (lambda n, p: "adamw_owner" if n == NORM else None, {"param_dtype": torch.bfloat16}),
        "unknown_route": (lambda n, p: "owner" if n == NORM else None, {}),
        "muon_for_a_norm": (lambda n, p: "muon" if n == NORM else None, {}),
    }
    errors = {}
    for case, (route, extra) in cases.items():
        try:
            dmuon.dedicate_params(model, mesh, projection_predicate, route=route, **extra)
            errors[case] = None
        except ValueError as e:
            errors[case] = str(e)
    untouched = not any(hasattr(p, "_dedicated_owner_rank") or hasattr(p, "_dmuon_replicated")
                        for p in model.parameters())
    del model.layers[0].scale
    route = {NORM: "adamw_owner", DOWN: "adamw_sharded"}.get
    dmuon.dedicate_params(model, mesh, projection_predicate, route=lambda n, p: route(n))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        dmuon.Muon(model, param_groups=[{"params": [NORM], "use_muon": True}])
        errors["owner_param_in_muon_group"] = None
    except ValueError as e:
        errors["owner_param_in_muon_group"] = str(e)
    opt = dmuon.Muon(model, **muon_kwargs())
    kinds = {n: (g["name"], g["kind"]) for g, names in zip(opt.param_groups, opt.group_fqns()) for n in names}
    params = dict(model.named_parameters())
    return dict(errors=errors, untouched=untouched, kinds=kinds, down_is_dtensor=type(params[DOWN]).__name__,
                dedicated=sorted(dmuon.get_dedicated_params(model)))


def test_bad_routes_raise_on_every_rank_and_change_nothing(two_rank_checks):
    results = [r["misuse"] for r in two_rank_checks]
    expected = {
        "scalar_on_owner": "route 'adamw_owner' for the scalar 'layers.0.scale'",
        "owner_with_param_dtype": f"route 'adamw_owner' for {NORM!r} with param_dtype=torch.bfloat16",
        "unknown_route": "route must be a dmuon.Route, one of ['muon', 'muon_sharded', 'adamw_owner', 'adamw_sharded', "
                         "'adamw_replicated'] or None, got 'owner'",
        "muon_for_a_norm": "only weight matrices (2-D, or batches of them",
        "owner_param_in_muon_group": "routed it 'adamw_owner'",
    }
    for rank, res in enumerate(results):
        for case, text in expected.items():
            assert res["errors"][case] is not None and text in res["errors"][case], (rank, case, res["errors"][case])
        assert res["untouched"], "a refused dedicate_params left dedicated params behind"
        # adamw_sharded overrides the predicate: the matrix stays with FSDP2 and AdamW
        assert DOWN not in res["dedicated"] and NORM in res["dedicated"]
        assert res["down_is_dtensor"] == "DTensor" and res["kinds"][DOWN] == ("default_adamw", "adamw")
        assert res["kinds"][NORM] == ("default_adamw", "adamw_owned")


# --------------------------------------------------------------------------------------------------- #
# One boundary, two dtypes: float64 MLP matrices beside float32 attention matrices                     #
# --------------------------------------------------------------------------------------------------- #
def _float64_mlps(model) -> None:
    """Every block's MLP in float64 (its input cast up, its output back): a boundary whose dedicated
    matrices have two dtypes, as a float32 head beside bfloat16 blocks would."""
    for layer in model.layers:
        layer.mlp.double()
        layer.mlp.forward = (lambda f: lambda x: f(x.double()).float())(layer.mlp.forward)


def oracle_float64_mlps() -> dict:
    return train_oracle(STEPS, adapt=_float64_mlps)


def mixed_dtype_job(rank: int, world: int) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    _float64_mlps(model)
    dmuon.dedicate_params(model, mesh, projection_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **muon_kwargs())
    losses: list[float] = []
    _train(model, opt, rank, world, 0, STEPS, losses)
    state = dmuon.diagnostics.summarize(model).as_dict()
    return {"losses": losses, "weights": full_weights(model),
            "dtypes": {n: str(p.dtype) for n, p in dmuon.get_dedicated_params(model).items()}, "summary": state}


def two_rank_checks_job(rank: int, world: int) -> dict:
    """The two-dtype training, then the bad routes: one launch of 2 ranks."""
    return {"mixed_dtype": mixed_dtype_job(rank, world), "misuse": route_misuse_job(rank, world)}


@pytest.fixture(scope="module")
def two_rank_checks() -> list[dict]:
    return run_distributed(two_rank_checks_job, 2)


def test_a_boundary_with_two_dtypes_matches_the_oracle(two_rank_checks):
    results = [r["mixed_dtype"] for r in two_rank_checks]
    dtypes = results[0]["dtypes"]
    assert {d for n, d in dtypes.items() if ".mlp." in n} == {"torch.float64"}
    assert {d for n, d in dtypes.items() if ".attention." in n} == {"torch.float32"}
    assert_close_to(results[0], oracle_float64_mlps(), "float64 MLPs beside float32 attention")
    for name, w in results[0]["weights"].items():
        assert w.dtype == (torch.float64 if ".mlp." in name else torch.float32), name
