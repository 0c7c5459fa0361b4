"""Torch-style param groups (issue 15, item 1): per-group hyperparameters, oracle parity, restarts, checks.

The groups: the embedding and the head on AdamW with their own lr and no weight decay (given as
parameter objects, after fully_shard); the layer norms on AdamW without weight decay (by FQN); the
attention matrices on Muon with their own lr and weight decay (as ``(name, param)`` pairs); the MLP
matrices and the final norm take the constructor's defaults. A ``LambdaLR`` warm-up scales every group,
and at step 4 the loop edits the attention group's momentum. The oracle is one process with
``torch.optim.Muon`` + ``torch.optim.AdamW`` built with the same groups, fed the same global batches.
Runs: Z3 and Z2 at 2 and 4 ranks, HSDP 2x2, DDP (groups named through the wrapper) at 2, and restarts
through the full, rank-0 and DCP state dicts at 2.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.models import projection_predicate
from tests._asserts import WEIGHT_RTOL, assert_bitwise, assert_close_to, worst_weight
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import (
    ADAMW_HP,
    GLOBAL_BATCH,
    MUON_HP,
    batches,
    build_model,
    full_weights,
    muon_kwargs,
    train_oracle,
)

STEPS = 10
RESTART_AT = 5
EMBED_HEAD = ("tok_embeddings.weight", "lm_head.weight")
ATTN = {"lr": 0.02, "weight_decay": 0.05}
EMBED = {"lr": 3e-3, "weight_decay": 0.0}
EDIT_AT, EDITED_MOMENTUM = 4, 0.9


def _schedule(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _layer_norms(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.ndim == 1 and n.removeprefix("module.").startswith("layers.")]


def _is_attn(name: str) -> bool:
    return projection_predicate(name, torch.empty(1, 1)) and ".attention." in name


def dmuon_groups(model) -> list[dict]:
    named = dict(model.named_parameters())
    prefix = "module." if isinstance(model, DistributedDataParallel) else ""
    return [
        {"params": [named[prefix + n] for n in EMBED_HEAD], "name": "embed_head", **EMBED},
        {"params": _layer_norms(model), "weight_decay": 0.0, "name": "norms"},
        {"params": [(n, p) for n, p in named.items() if _is_attn(n)], "name": "attn", **ATTN},
    ]


def _edit(groups, step: int) -> None:
    """The loop's own edit of a hyperparameter mid-run (the oracle does the same)."""
    if step == EDIT_AT:
        for g in groups:
            g["momentum"] = EDITED_MOMENTUM


@rank_threads()
def train_oracle_groups(steps: int) -> dict:
    torch.manual_seed(0)
    dev = device()
    model = build_model().to(dev)
    named = dict(model.named_parameters())
    attn = [p for n, p in named.items() if _is_attn(n)]
    mlp = [p for n, p in named.items() if projection_predicate(n, p) and not _is_attn(n)]
    hp = MUON_HP
    opt_m = torch.optim.Muon(
        [{"params": attn, **ATTN}, {"params": mlp}], lr=hp.lr, weight_decay=hp.weight_decay, momentum=hp.momentum,
        nesterov=hp.nesterov, ns_coefficients=hp.ns_coefficients, ns_steps=hp.ns_steps, eps=hp.eps,
        adjust_lr_fn=hp.adjust_lr_fn.value,
    )
    norms = _layer_norms(model)
    opt_a = torch.optim.AdamW([
        {"params": [named[n] for n in EMBED_HEAD], **EMBED},
        {"params": [named[n] for n in norms], "weight_decay": 0.0},
        {"params": [p for n, p in named.items() if not projection_predicate(n, p) and n not in EMBED_HEAD
                    and n not in norms]},
    ], **ADAMW_HP.group_entries())
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _schedule) for o in (opt_m, opt_a)]
    losses = []
    for step, (tok, tgt) in enumerate(batches(steps)):
        _edit(opt_m.param_groups[:1], step)
        for o in (opt_m, opt_a):
            o.zero_grad()
        loss = model(tok.to(dev), tgt.to(dev)).loss
        loss.backward()
        for o in (opt_m, opt_a):
            o.step()
        for s in scheds:
            s.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def _build(world: int, *, hsdp: bool, z3: bool, seed: int = 0, ddp: bool = False):
    if ddp:  # DistributedDataParallel instead of FSDP2; the groups name params as the wrapper does
        model = build_model(seed=seed).to(device())
        dmuon.dedicate_params(model, init_device_mesh(DEVICE_TYPE, (world,)), projection_predicate)
        wrapped = DistributedDataParallel(model)
        opt = dmuon.Muon(wrapped, **muon_kwargs(), param_groups=dmuon_groups(wrapped))
        return wrapped, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    if hsdp:
        mesh = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard, fsdp_mesh = mesh["shard"], mesh
        extra = {"replicate_mesh": mesh["replicate"]}
    else:
        shard = fsdp_mesh = init_device_mesh(DEVICE_TYPE, (world,))
        extra = {}
    model = build_model(seed=seed).to(device())
    dmuon.dedicate_params(model, shard, projection_predicate, reshard_after_forward=z3, **extra)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, **muon_kwargs(), param_groups=dmuon_groups(model))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _hyper(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in opt.param_groups]


def _steps(model, opt, sched, rank: int, world: int, first: int, last: int, losses: list, lrs: list) -> None:
    per = GLOBAL_BATCH // world
    for step, (tok, tgt) in enumerate(batches(last)):
        if step < first:
            continue
        _edit([g for g in opt.param_groups if g["name"] == "attn"], step)
        if step == 2:  # torch's own state-dict round trip keeps the groups, their state and AdamW's wiring
            opt.load_state_dict(opt.state_dict())
        opt.zero_grad()
        loss = model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss
        loss.backward()
        opt.step()
        sched.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
        lrs.append([(g["name"], g["kind"], g["lr"]) for g in opt.param_groups])


def train_groups(rank: int, world: int, *, hsdp: bool = False, z3: bool = True, restart: str | None = None,
                 ckpt_dir: str | None = None, ddp: bool = False) -> dict:
    model, opt, sched = _build(world, hsdp=hsdp, z3=z3, ddp=ddp)
    losses, lrs = [], []
    out = {"layout": [(g["name"], g["kind"], list(names)) for g, names in zip(opt.param_groups, opt.group_fqns())]}
    if restart is None:
        _steps(model, opt, sched, rank, world, 0, STEPS, losses, lrs)
    else:
        _steps(model, opt, sched, rank, world, 0, RESTART_AT, losses, lrs)
        saved_hyper = _hyper(opt)
        model, opt, sched = _restart(model, opt, sched, world, restart, ckpt_dir, hsdp=hsdp, z3=z3)
        out["hyper_after_load"], out["hyper_saved"] = _hyper(opt), saved_hyper
        _steps(model, opt, sched, rank, world, RESTART_AT, STEPS, losses, lrs)
    out.update(losses=losses, lrs=lrs, weights=full_weights(getattr(model, "module", model)), hyper=_hyper(opt))
    return out


def _restart(model, opt, sched, world: int, route: str, ckpt_dir: str, *, hsdp: bool, z3: bool):
    """Save through ``route``, build everything anew (another init), load."""
    path = os.path.join(ckpt_dir, route)
    sched_sd = sched.state_dict()
    if route == "dcp":
        dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                  "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}, checkpoint_id=path)
    else:
        rank0 = route == "rank0"
        sd = {"model": dmuon.get_model_state_dict(model, rank0_only=rank0),
              "optim": dmuon.get_optimizer_state_dict(model, opt, rank0_only=rank0)}
        if dist.get_rank() == 0:
            torch.save(sd, path)
        dist.barrier()
    del model, opt
    model, opt, sched = _build(world, hsdp=hsdp, z3=z3, seed=3)
    if route == "dcp":
        target = {"model": dmuon.get_model_state_dict(model, sharded=True),
                  "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}
        dcp.load(target, checkpoint_id=path)
        sd = target
    elif route == "rank0":
        sd = torch.load(path, weights_only=True) if dist.get_rank() == 0 else {"model": {}, "optim": {}}
    else:
        sd = torch.load(path, weights_only=True)
    dmuon.set_model_state_dict(model, sd["model"])
    dmuon.set_optimizer_state_dict(model, opt, sd["optim"])
    sched.load_state_dict(sched_sd)
    return model, opt, sched


def groups_job(rank: int, world: int) -> dict:
    out = {"z3": train_groups(rank, world), "z2": train_groups(rank, world, z3=False)}
    if world == 4:
        out["hsdp"] = train_groups(rank, world, hsdp=True)
    else:
        out["ddp"] = train_groups(rank, world, ddp=True)
        with tempfile.TemporaryDirectory() as d:
            box = [d]
            dist.broadcast_object_list(box, src=0)
            for route in ("full", "rank0", "dcp"):
                out[f"restart_{route}"] = train_groups(rank, world, restart=route, ckpt_dir=box[0])
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def oracle() -> dict:
    return train_oracle_groups(STEPS)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(groups_job, request.param)


def test_layout_puts_user_groups_first_then_the_defaults(runs):
    world, results = runs
    layout = results[0]["z3"]["layout"]
    assert [(n, k) for n, k, _ in layout] == [
        ("embed_head", "adamw"), ("embed_head", "adamw_replicated"), ("norms", "adamw"), ("norms", "adamw_replicated"),
        ("attn", "muon"), ("default_muon", "muon"), ("default_adamw", "adamw"), ("default_adamw", "adamw_replicated"),
    ]
    names = dict(((n, k), fqns) for n, k, fqns in layout)
    assert names[("embed_head", "adamw")] == list(EMBED_HEAD)
    assert names[("attn", "muon")] == [n for n in names[("attn", "muon")] if ".attention." in n] != []
    assert names[("default_muon", "muon")] and all(".mlp." in n for n in names[("default_muon", "muon")])
    assert names[("default_adamw", "adamw")] == ["norm.weight"]
    for rank, res in enumerate(results[1:], start=1):
        assert res["z3"]["layout"] == layout, f"rank {rank} has another layout"


@pytest.mark.parametrize("variant", ["z3", "z2", "hsdp", "ddp"])
def test_matches_oracle_with_per_group_hyperparameters(runs, oracle, variant):
    world, results = runs
    if variant not in results[0]:
        pytest.skip("HSDP 2x2 needs 4 ranks; DDP runs at 2")
    assert_close_to(results[0][variant], oracle, f"world {world} {variant} with param groups")
    assert results[0][variant]["losses"][-1] < results[0][variant]["losses"][0] - 0.03, "no progress"


def test_the_groups_change_the_training(oracle):
    """Control: the oracle without groups (one lr and weight decay per algorithm, no schedule) ends far
    outside the parity bound of the grouped one, so the parity above cannot pass with the groups ignored."""
    err, key = worst_weight(train_oracle(STEPS)["weights"], oracle["weights"])
    assert err > 10 * WEIGHT_RTOL, (err, key)


def test_scheduler_scales_every_group_from_its_own_lr(runs):
    world, results = runs
    base = {"embed_head": EMBED["lr"], "norms": ADAMW_HP.lr, "attn": ATTN["lr"], "default_muon": MUON_HP.lr,
            "default_adamw": ADAMW_HP.lr}
    for step, row in enumerate(results[0]["z3"]["lrs"]):
        for name, kind, lr in row:
            assert lr == pytest.approx(base[name] * _schedule(step + 1)), (step, name, kind)


def test_z2_equals_z3_bitwise(runs):
    world, results = runs
    for rank, res in enumerate(results):
        assert_bitwise(res["z2"], res["z3"], f"world {world} rank {rank} Z2 vs Z3")
        assert res["z3"]["hyper"] == res["z2"]["hyper"]


@pytest.mark.parametrize("route", ["full", "rank0", "dcp"])
def test_restart_is_bit_identical_and_keeps_every_group_setting(runs, route):
    world, results = runs
    if world != 2:
        pytest.skip("restarts run at 2 ranks")
    for rank, res in enumerate(results):
        r = res[f"restart_{route}"]
        # the rebuilt optimizer started from the constructor's values; the loaded groups are the saved ones
        assert r["hyper_after_load"] == r["hyper_saved"], f"rank {rank} {route}"
        assert any(h.get("momentum") == EDITED_MOMENTUM for h in r["hyper_saved"])
        assert_bitwise(r, res["z3"], f"rank {rank} restart through {route}")


# --------------------------------------------------------------------------------------------------- #
# Checks: every bad group list raises on every rank, before anything is built                          #
# --------------------------------------------------------------------------------------------------- #
Q = "layers.0.attention.q_proj.weight"


def _bad_cases(model, stale, rank: int) -> dict[str, object]:
    return {
        "two_groups": [{"params": ["norm.weight"]}, {"params": [model.norm.weight]}],
        "dedicated_in_adamw": [{"params": [Q], "use_muon": False}],
        "norm_in_muon": [{"params": ["norm.weight"], "use_muon": True}],
        "undedicated_matrix_in_muon": [{"params": ["tok_embeddings.weight"], "use_muon": True}],
        "mixed": [{"params": [Q, "norm.weight"]}],
        "muon_key_in_adamw_group": [{"params": ["norm.weight"], "momentum": 0.9}],
        "unknown_fqn": [{"params": ["layers.0.attention.q_proj.wieght"]}],
        "stale_object": [{"params": [stale]}],
        "bad_value": [{"params": [Q], "lr": -1.0}],
        "duplicate_name": [{"params": [Q], "name": "a"}, {"params": ["norm.weight"], "name": "a"}],
        "not_a_list": {"params": [Q]},
        "no_params": [{"lr": 0.1}],
        "rank1_only": [{"params": ["norm.weight" if rank == 0 else "norm.wieght"]}],
        "ranks_differ": [{"params": [Q], "lr": 0.01 * (rank + 1)}],
        # a gather entered by rank 0 only would leave rank 1 waiting: both must raise instead
        "groups_on_rank0_only": [{"params": [Q], "lr": 0.01}] if rank == 0 else None,
    }


def misuse_job(rank: int, world: int) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    stale = model.norm.weight  # fully_shard replaces it with a DTensor parameter
    model.tok_embeddings.weight.requires_grad_(False)  # frozen now, trained after add_param_group below
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    before = full_weights(model)
    errors = {}
    for case, groups in _bad_cases(model, stale, rank).items():
        try:
            dmuon.Muon(model, **muon_kwargs(), param_groups=groups)
            errors[case] = None
        except (TypeError, ValueError) as e:
            errors[case] = f"{type(e).__name__}: {e}"
    unchanged = all(torch.equal(v, full_weights(model)[k]) for k, v in before.items())
    # after all that, a good optimizer builds and trains; a frozen param joins later through add_param_group
    opt = dmuon.Muon(model, **muon_kwargs(), param_groups=[{"params": ["norm.weight"], "weight_decay": 0.0}])
    n_groups = len(opt.param_groups)
    model.tok_embeddings.weight.requires_grad_(True)
    emb_before = full_weights(model)["tok_embeddings.weight"]
    opt.add_param_group({"params": ["tok_embeddings.weight"], "lr": 1e-2, "name": "unfrozen"})
    add_errors = {}
    for case, group in {"again": {"params": ["tok_embeddings.weight"]},
                        "dedicated": {"params": [Q]}}.items():
        try:
            opt.add_param_group(group)
            add_errors[case] = None
        except ValueError as e:
            add_errors[case] = str(e)
    per = GLOBAL_BATCH // world
    tok, tgt = batches(1)[0]
    opt.zero_grad()
    model(tok[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]).loss.backward()
    opt.step()
    emb_after = full_weights(model)["tok_embeddings.weight"]
    sd = dmuon.get_optimizer_state_dict(model, opt)
    return dict(errors=errors, unchanged=unchanged, n_groups=n_groups, added=len(opt.param_groups) - n_groups,
                add_errors=add_errors, added_kinds=[g["kind"] for g in opt.param_groups[n_groups:]],
                emb_lr=[g["lr"] for g in opt.param_groups if g["name"] == "unfrozen"],
                emb_step=(emb_after - emb_before).abs().max().item(),
                saved_groups=[(g["name"], g["kind"], g["param_names"]) for g in sd["param_groups"]])


@pytest.fixture(scope="module")
def misuse() -> list[dict]:
    return run_distributed(misuse_job, 2)


EXPECTED = {
    "two_groups": ("ValueError", "'norm.weight' is already in param group 0"),
    "dedicated_in_adamw": ("ValueError", f"use_muon=False but {Q!r} is dedicated"),
    "norm_in_muon": ("ValueError", "it is 1-D; Muon updates matrices only"),
    "undedicated_matrix_in_muon": ("ValueError", "is not dedicated"),
    "mixed": ("ValueError", "mixes dedicated matrices"),
    "muon_key_in_adamw_group": ("ValueError", "unknown key(s) ['momentum'] for an AdamW group (momentum is Muon's)"),
    "unknown_fqn": ("ValueError", f"no parameter named 'layers.0.attention.q_proj.wieght'. Did you mean {Q!r}"),
    "stale_object": ("ValueError", "collect the groups after fully_shard"),
    "bad_value": ("ValueError", "lr must be a finite number >= 0"),
    "duplicate_name": ("ValueError", "two param groups have the same 'name'"),
    "not_a_list": ("TypeError", "param_groups must be a list of dicts"),
    "no_params": ("ValueError", "needs a 'params' entry"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_groups_raise_a_clear_error_on_every_rank(misuse, case):
    kind, text = EXPECTED[case]
    for rank, res in enumerate(misuse):
        got = res["errors"][case]
        assert got is not None and got.startswith(kind) and text in got, (rank, got)


def test_a_group_list_bad_on_one_rank_or_different_between_ranks_raises_everywhere(misuse):
    assert "no parameter named 'norm.wieght'" in misuse[1]["errors"]["rank1_only"]
    assert "param_groups refused on rank 1" in misuse[0]["errors"]["rank1_only"]
    for res in misuse:
        assert "the ranks disagree on param group 'group0': lr: rank 0: 0.01; rank 1: 0.02" in res["errors"]["ranks_differ"]
        assert ("the ranks disagree on param group names: rank 0: ['group0', 'default_muon', 'default_adamw']; "
                "rank 1: ['default_muon', 'default_adamw']") in res["errors"]["groups_on_rank0_only"]


def test_nothing_changed_and_a_good_optimizer_still_builds(misuse):
    for res in misuse:
        assert res["unchanged"]
        assert res["n_groups"] == 5  # norm.weight's group (2 kinds) + the three defaults


def test_add_param_group_trains_a_param_unfrozen_later(misuse):
    for res in misuse:
        assert res["added"] == 2 and res["added_kinds"] == ["adamw", "adamw_replicated"]
        assert res["emb_lr"] == [1e-2, 1e-2]
        assert res["emb_step"] > 0, "the unfrozen embedding did not move"
        assert "is already in an existing param group" in res["add_errors"]["again"]
        assert "is already in an existing param group" in res["add_errors"]["dedicated"]
        assert ("unfrozen", "adamw", ["tok_embeddings.weight"]) in res["saved_groups"]
