"""Checkpoints: restart is bit-identical, saved models load into plain single-process models, a 2-rank
checkpoint resumes on 1, 3 and 4 ranks like an uninterrupted run there, DCP round-trips exact bytes across
world sizes, and corrupted inputs are rejected with nothing changed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import TinyLlama, TinyLlamaConfig
from tests._asserts import assert_close_to
from tests._dist import DEVICE_TYPE, device, run_distributed, world_available
from tests._training import CFG, KJ, batches, build_model, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS, SAVE_AT = 10, 5
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


# --------------------------------------------------------------------------------------------------- #
# Worker side                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _setup(world: int, init_seed: int = 0, cfg: TinyLlamaConfig = CFG, z3: bool = True):
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = TinyLlama(cfg).to(device())
    model.init_weights(init_seed)
    dmuon.dedicate_params(model, mesh, projection_predicate, reshard_after_forward=z3)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct",
                     adamw_lr=1e-3, adamw_betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def _step(model, opt, sched, rank: int, world: int, step: int) -> float:
    tok, tgt = batches(STEPS, global_batch=GLOBAL_BATCH)[step]
    per = GLOBAL_BATCH // world
    opt.zero_grad()
    lo, hi = rank * per, (rank + 1) * per
    loss = model(tok[lo:hi].to(device()), tgt[lo:hi].to(device())).loss
    loss.backward()
    opt.step()
    sched.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def _eval_loss(model) -> float:
    tok, tgt = batches(1, seed=5, global_batch=4)[0]
    with torch.no_grad():
        dev = next(model.parameters()).device  # a plain model in pytest's process stays on the CPU
        return model(tok.to(dev), tgt.to(dev)).loss.item()


def uninterrupted_job(rank: int, world: int, ckpt_dir: str | None) -> dict:
    """10 steps; with ckpt_dir, also save at step 5 (torch.save on rank 0, as docs/guides/checkpoints.md does) and with DCP."""
    model, opt, sched = _setup(world)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT and ckpt_dir is not None:
            model_sd = dmuon.get_model_state_dict(model)
            optim_sd = dmuon.get_optimizer_state_dict(model, opt)
            eval_loss = _eval_loss(model)  # a forward is collective: every rank runs it
            if rank == 0:
                torch.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
                            "eval_loss": eval_loss}, os.path.join(ckpt_dir, "checkpoint.pt"))
            dist.barrier()
            dcp.save(dmuon.get_state_dict(model, opt, sharded=True), checkpoint_id=os.path.join(ckpt_dir, "dcp"))
        losses.append(_step(model, opt, sched, rank, world, step))
    return {"losses": losses, "model": dmuon.get_model_state_dict(model)}


def resume_job(rank: int, world: int, ckpt_dir: str, model_rank0: bool, optim_rank0: bool) -> dict:
    """Fresh processes: load the step-5 checkpoint (different init first, to prove the load), train 6-10.
    Also run the uninterrupted baseline on this world size when it is not 2, and a DCP load."""
    model, opt, sched = _setup(world, init_seed=123)
    ckpt = torch.load(os.path.join(ckpt_dir, "checkpoint.pt"), map_location="cpu", weights_only=False)
    if model_rank0 and optim_rank0:  # both halves at once, from rank 0 ({} elsewhere)
        dmuon.set_state_dict(model, opt, ckpt if rank == 0 else {})
    else:
        dmuon.set_model_state_dict(model, ckpt["model"] if (rank == 0 or not model_rank0) else {})
        dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"] if (rank == 0 or not optim_rank0) else {})
    sched.load_state_dict(ckpt["sched"])
    lrs = [g["lr"] for g in opt.param_groups]
    resumed = [_step(model, opt, sched, rank, world, step) for step in range(SAVE_AT, STEPS)]
    out = {"resumed": resumed, "model": dmuon.get_model_state_dict(model), "lrs": lrs}

    # DCP: load into a fresh model/optimizer of this world size (the documented recipe: a staged target,
    # resharded by DCP from the 2-rank layout), compare with the full dicts saved
    model2, opt2, _ = _setup(world, init_seed=456)
    target = dmuon.get_state_dict(model2, opt2, sharded=True, staged=True)
    dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    dmuon.set_state_dict(model2, opt2, target)
    out["dcp_model"] = dmuon.get_model_state_dict(model2)
    out["dcp_optim"] = dmuon.get_optimizer_state_dict(model2, opt2)
    if world != 2:
        out["baseline"] = uninterrupted_job(rank, world, None)
    return out


def corrupt_job(rank: int, world: int, ckpt_dir: str) -> dict:
    ckpt = torch.load(os.path.join(ckpt_dir, "checkpoint.pt"), map_location="cpu", weights_only=False)
    victim, v_opt, v_sched = _setup(world)
    twin, t_opt, t_sched = _setup(world)
    for step in range(2):  # give both some optimizer state
        _step(victim, v_opt, v_sched, rank, world, step)
        _step(twin, t_opt, t_sched, rank, world, step)
    msd, osd = ckpt["model"], ckpt["optim"]
    key = "layers.0.attention.q_proj.weight"
    cases = {
        "model_missing": ("model", {k: v for k, v in msd.items() if k != key}),
        "model_extra": ("model", {**msd, "layers.9.bogus.weight": torch.zeros(2)}),
        "model_shape": ("model", {**msd, key: torch.zeros(3, 3)}),
        "model_dtype": ("model", {**msd, "norm.weight": msd["norm.weight"].double()}),
        "model_not_a_tensor": ("model", {**msd, key: [1, 2, 3]}),
    }
    # an optimizer dict from a different model: 3 layers instead of 2
    other_model, other_opt, other_sched = _setup(world, cfg=TinyLlamaConfig(**{**CFG.__dict__, "n_layers": 3}))
    _step(other_model, other_opt, other_sched, rank, world, 0)
    cases["optim_other_model"] = ("optim", dmuon.get_optimizer_state_dict(other_model, other_opt))
    bad_state = {k: dict(v) for k, v in osd["state"].items()}
    bad_state[key] = {"momentum_buffer": torch.zeros(5, 5)}
    cases["optim_shape"] = ("optim", {"state": bad_state, "param_groups": osd["param_groups"]})
    cases["optim_missing_groups"] = ("optim", {"state": osd["state"]})
    # both halves at once: a dict without its optimizer half; a good model half with a bad optimizer half
    # (the model half must not be written: the victim is compared with its twin afterwards)
    cases["both_missing_optim"] = ("both", {"model": msd})
    cases["both_bad_optim"] = ("both", {"model": msd, "optim": {"state": bad_state, "param_groups": osd["param_groups"]}})
    errors = {}
    for name, (kind, sd) in cases.items():
        try:
            if kind == "model":
                dmuon.set_model_state_dict(victim, sd)
            elif kind == "both":
                dmuon.set_state_dict(victim, v_opt, sd)
            else:
                dmuon.set_optimizer_state_dict(victim, v_opt, sd)
            errors[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - recorded and asserted by the test
            errors[name] = (type(e).__name__, str(e))
    # the follow-up step: the victim must still be exactly the twin
    losses = (_step(victim, v_opt, v_sched, rank, world, 2), _step(twin, t_opt, t_sched, rank, world, 2))
    same_model = all(torch.equal(a, b) for a, b in zip(dmuon.get_model_state_dict(victim).values(),
                                                       dmuon.get_model_state_dict(twin).values()))
    return {"errors": errors, "losses": losses, "same_model": same_model}


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def original(ckpt_dir) -> dict:
    return run_distributed(uninterrupted_job, 2, ckpt_dir)[0]


@pytest.fixture(scope="module")
def saved(ckpt_dir, original) -> dict:
    """The step-5 checkpoint the 2-rank run wrote with torch.save on rank 0."""
    return torch.load(os.path.join(ckpt_dir, "checkpoint.pt"), map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def resumed(ckpt_dir, original) -> dict:
    # world: (model dict on rank 0 only?, optimizer dict on rank 0 only?)
    modes = {1: (False, False), 2: (True, True), 3: (True, False), 4: (False, True)}
    # (the NCCL pass runs the world sizes it has GPUs for; the tests of the others skip)
    return {w: run_distributed(resume_job, w, ckpt_dir, *modes[w])[0] for w in (2, 1, 3, 4) if world_available(w)}


def _at(resumed: dict, world: int) -> dict:
    if world not in resumed:
        pytest.skip(f"{world} ranks need {world} GPUs")
    return resumed[world]


def test_restart_is_bit_identical(original, resumed):
    r = _at(resumed, 2)
    assert r["resumed"] == original["losses"][SAVE_AT:]
    for k, v in original["model"].items():
        assert torch.equal(r["model"][k], v), k


def test_scheduler_lr_survives(resumed):
    lrs = _at(resumed, 2)["lrs"]
    scale = 1.0 / (1 + 0.1 * SAVE_AT)
    assert lrs == pytest.approx([0.01 * scale, 1e-3 * scale, 1e-3 * scale])


def test_saved_model_loads_into_plain_model(saved):
    ckpt = saved
    plain = build_model(seed=77)
    plain.load_state_dict(ckpt["model"], strict=True)
    assert sorted(ckpt["model"]) == sorted(plain.state_dict())
    got = _eval_loss(plain)
    assert abs(got - ckpt["eval_loss"]) <= 1e-6 * abs(ckpt["eval_loss"]), (got, ckpt["eval_loss"])


def test_saved_model_is_safetensors_compatible(saved, tmp_path):
    import safetensors.torch as safetensors

    ckpt = saved
    path = str(tmp_path / "model.safetensors")
    safetensors.save_file(ckpt["model"], path)
    back = safetensors.load_file(path)
    assert all(torch.equal(back[k], v) for k, v in ckpt["model"].items())


@pytest.mark.parametrize("world", [1, 3, 4])
def test_cross_topology_resume_matches_uninterrupted_run(resumed, world):
    r = _at(resumed, world)
    base = r["baseline"]
    assert_close_to({"losses": r["resumed"], "weights": r["model"]},
                    {"losses": base["losses"][SAVE_AT:], "weights": base["model"]},
                    f"world {world}, resumed from step {SAVE_AT}")


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_round_trip_is_exact(saved, resumed, world):
    ckpt = saved
    r = _at(resumed, world)
    assert sorted(r["dcp_model"]) == sorted(ckpt["model"])
    for k, v in ckpt["model"].items():
        assert torch.equal(r["dcp_model"][k], v), k
    saved, loaded = ckpt["optim"], r["dcp_optim"]
    assert sorted(loaded["state"]) == sorted(saved["state"])
    for name, entry in saved["state"].items():
        for k, v in entry.items():
            assert torch.equal(loaded["state"][name][k], v), f"{name}.{k}"
    for g_saved, g_loaded in zip(saved["param_groups"], loaded["param_groups"]):
        assert g_saved == g_loaded


@pytest.fixture(scope="module")
def corrupted(ckpt_dir, original) -> dict:
    return run_distributed(corrupt_job, 2, ckpt_dir)[0]


@pytest.mark.parametrize(
    "case, error, needle",
    [
        ("model_missing", "ValueError", "missing keys: [layers.0.attention.q_proj.weight]"),
        ("model_extra", "ValueError", "unexpected keys: [layers.9.bogus.weight]"),
        ("model_shape", "ValueError", "layers.0.attention.q_proj.weight (3, 3) != (128, 128)"),
        ("model_dtype", "ValueError", "norm.weight torch.float64 != torch.float32"),
        ("model_not_a_tensor", "ValueError", "not a tensor"),
        ("optim_other_model", "ValueError", "unexpected params: [layers.2."),
        ("optim_shape", "ValueError", "momentum_buffer shape (5, 5) != (128, 128)"),
        ("optim_missing_groups", "ValueError", "'state' and 'param_groups'"),
        ("both_missing_optim", "ValueError", "expected a dict with 'model' and 'optim' entries"),
        ("both_bad_optim", "ValueError", "set_state_dict ('optim'): the state dict does not match; nothing was changed"),
    ],
)
def test_corrupted_inputs_are_rejected(corrupted, case, error, needle):
    got, message = corrupted["errors"][case]
    assert got == error, f"{case}: {got}: {message}"
    assert needle in message, f"{case}: {message!r}"


def test_rejected_loads_change_nothing(corrupted):
    victim_loss, twin_loss = corrupted["losses"]
    assert victim_loss == twin_loss
    assert corrupted["same_model"]
