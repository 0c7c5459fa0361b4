"""Tensor-parallel checkpoints (issue 16): 4 gloo ranks as dp=2 x tp=2, the model and oracle of
tests/test_tp.py.

One distributed job runs every case on the same 4 processes (a dp-only model is a 1-D mesh over all 4):
an uninterrupted TP run that saves at step ``SAVE_AT`` (full on every rank, rank-0 only, DCP), its
restarts from each form into a model built with another init (bit-identical to the uninterrupted run),
resumes across layouts dp=2 x tp=2 -> dp=4 x tp=1 (a dp-only model), dp=1 x tp=4, and dp-only -> dp=2 x
tp=2 (within the oracle parity bounds), and refused loads (every rank raises the same error, nothing
changes).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.checkpoint.checksum import checksum_part, chunk_part
from tests._asserts import assert_bitwise, assert_close_to, worst_weight
from tests._dist import run_distributed
from tests._training import full_weights
from tests.test_tp import (
    ADAMW_LR,
    BATCH,
    DP,
    KJ,
    LR,
    MAX_NORM,
    STEPS,
    TP,
    WD,
    Net,
    _batches,
    _is_matrix,
    _split_mlps,
    oracle,
)

SAVE_AT = 5
WORLD = DP * TP
FORMS = ("full", "rank0", "dcp")
#: (dp, tp) of each layout; tp=1 is a dp-only model (a 1-D mesh, no parallelize_module)
LAYOUTS = {"tp": (DP, TP), "dp": (WORLD, 1), "tp4": (1, WORLD)}


# --------------------------------------------------------------------------------------------------- #
# Worker side                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _build(layout: str, seed: int = 0, predicate=_is_matrix):
    """The model of tests/test_tp.py on one of :data:`LAYOUTS` (its TP plan), and its optimizer."""
    torch.manual_seed(seed)
    model = Net()
    dp, tp = LAYOUTS[layout]
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        _split_mlps(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    else:
        mesh = dp_mesh = init_device_mesh("cpu", (WORLD,))
    dmuon.dedicate_params(model, mesh, predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = dmuon.Muon(model, lr=LR, weight_decay=WD, ns_coefficients=KJ, ns_backend="direct", adamw_lr=ADAMW_LR,
                     adamw_weight_decay=0.01)
    return model, opt, dp_mesh


def _step(model, opt, dp_mesh, step: int) -> float:
    """One step of tests/test_tp.py's loop: this dp slot's share of the global batch, clipped."""
    tok, tgt = _batches()[step]
    per, i = BATCH // dp_mesh.size(), dp_mesh.get_local_rank()
    opt.zero_grad()
    loss = model(tok[i * per:(i + 1) * per], tgt[i * per:(i + 1) * per])
    loss.backward()
    dmuon.clip_grad_norm_(model, MAX_NORM)
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def _save(model, opt, where: str) -> dict:
    """Step-``SAVE_AT`` checkpoints: full dicts (torch.save on rank 0), rank-0-only dicts, DCP."""
    full = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    rank0 = {"model": dmuon.get_model_state_dict(model, rank0_only=True),
             "optim": dmuon.get_optimizer_state_dict(model, opt, rank0_only=True)}
    if dist.get_rank() == 0:
        torch.save(full, f"{where}.full.pt")
        torch.save(rank0, f"{where}.rank0.pt")
    dist.barrier()
    dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
              "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)}, checkpoint_id=f"{where}.dcp")
    return full


def _run(layout: str, where: str | None = None) -> tuple[dict, dict | None]:
    """``STEPS`` uninterrupted steps; with ``where``, save at ``SAVE_AT`` there (returns the full dicts)."""
    model, opt, dp_mesh = _build(layout)
    losses, saved = [], None
    for step in range(STEPS):
        if step == SAVE_AT and where is not None:
            saved = _save(model, opt, where)
        losses.append(_step(model, opt, dp_mesh, step))
    run = {"losses": losses, "weights": dmuon.get_model_state_dict(model)}
    if layout == "tp":  # the full dict's gather against tests._training's own (broadcast over "dp", gather over "tp")
        run["independent"] = full_weights(model)
    return run, saved


def _load(model, opt, where: str, form: str) -> None:
    if form == "dcp":
        target = dmuon.get_state_dict(model, opt, sharded=True, staged=True)
        dcp.load(target, checkpoint_id=f"{where}.dcp")
        dmuon.set_state_dict(model, opt, target)
        return
    ckpt = {"model": {}, "optim": {}}
    if form == "full" or dist.get_rank() == 0:
        ckpt = torch.load(f"{where}.{form}.pt", map_location="cpu", weights_only=False)
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, opt, ckpt["optim"])


def _resume(layout: str, where: str, form: str) -> dict:
    """Fresh model (another init, so only the load can make it right), load, train the remaining steps."""
    model, opt, dp_mesh = _build(layout, seed=123)
    _load(model, opt, where, form)
    losses = [_step(model, opt, dp_mesh, step) for step in range(SAVE_AT, STEPS)]
    return {"losses": losses, "weights": dmuon.get_model_state_dict(model)}


def _refusals(where: str) -> dict:
    """Bad dicts into a TP model: every rank raises the same ValueError; full dicts change nothing."""
    model, opt, _ = _build("tp", seed=7)
    before = dmuon.get_model_state_dict(model)
    ckpt = torch.load(f"{where}.full.pt", map_location="cpu", weights_only=False)
    key = "layers.0.w2.weight"  # columns split: the shards are not one range of the matrix
    flipped = ckpt["model"][key].clone()
    flipped[3, 50] += 1.0  # in tp rank 1's half
    flipped._dmuon_checksum = ckpt["model"][key]._dmuon_checksum
    momentum = {k: dict(v) for k, v in ckpt["optim"]["state"].items()}
    momentum[key] = {"momentum_buffer": torch.zeros(32, 48)}  # a shard's shape, not the matrix's
    cases = {"model_shape": lambda: dmuon.set_model_state_dict(model, {**ckpt["model"], key: flipped[:, :48]}),
             "model_checksum": lambda: dmuon.set_model_state_dict(model, {**ckpt["model"], key: flipped}),
             "optim_shape": lambda: dmuon.set_optimizer_state_dict(model, opt, {**ckpt["optim"], "state": momentum}),
             "dcp_checksum": lambda: _torn_dcp_load(model, where, key)}
    errors, unchanged = {}, None
    for name, load in cases.items():
        if name == "dcp_checksum":
            after = dmuon.get_model_state_dict(model)
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
        try:
            load()
            errors[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - recorded and asserted by the test
            errors[name] = (type(e).__name__, str(e))
    return {"errors": errors, "unchanged": unchanged}


def _torn_dcp_load(model, where: str, key: str) -> None:
    """``dcp.load``, then one value of tp rank 1's shard changes on its owner (as a torn save would)."""
    target = dmuon.get_model_state_dict(model, sharded=True)
    dcp.load({"model": target}, checkpoint_id=f"{where}.dcp")
    if key in target and dist.get_rank() % TP == 1:
        with torch.no_grad():
            target[key].to_local()[0, 0] += 1.0
    dmuon.set_model_state_dict(model, target)


def _undedicated_tp_weights(tp_at: str, ckpt_dir: str) -> dict:
    """Only ``w1`` dedicated: ``w2`` stays a TP weight that FSDP2 shards over "dp" (a DTensor over both
    dims). The TP full dict loads into it (checksums checked), and its DCP save loads back into it through a
    staged target (the 2-D DTensor's copy checked and copied in) and into a dp-only model."""
    from torch.distributed.tensor import DTensor

    model, _, _ = _build("tp", seed=11, predicate=lambda n, p: n.endswith("w1.weight"))
    w2 = model.layers[0].w2.weight
    ckpt = torch.load(f"{tp_at}.full.pt", map_location="cpu", weights_only=False)
    dmuon.set_model_state_dict(model, ckpt["model"])
    out = {"w2_mesh_dims": w2.device_mesh.ndim if isinstance(w2, DTensor) else 0,
           "full": dmuon.get_model_state_dict(model)}
    dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True)},
             checkpoint_id=os.path.join(ckpt_dir, "undedicated.dcp"))
    plain, _, _ = _build("dp", seed=12)
    for name, into in (("dcp_self", model), ("dcp", plain)):
        target = {"model": dmuon.get_model_state_dict(into, sharded=True, staged=True)}
        if into is model:  # make the load do the work: change the live weights first
            with torch.no_grad():
                model.layers[0].w2.weight.to_local().add_(1.0)
        dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, "undedicated.dcp"))
        dmuon.set_model_state_dict(into, target["model"])
        out[name] = dmuon.get_model_state_dict(into)
    return out


def tp_checkpoint_job(rank: int, world: int, ckpt_dir: str) -> dict:
    tp_at, dp_at = os.path.join(ckpt_dir, "tp"), os.path.join(ckpt_dir, "dp")
    out: dict = {}
    out["tp"], saved = _run("tp", tp_at)
    out["dp"], dp_saved = _run("dp", dp_at)
    if rank == 0:
        out["saved"] = {"tp": saved, "dp": dp_saved}
    for form in FORMS:
        out[f"tp<-tp {form}"] = _resume("tp", tp_at, form)
    for form in ("full", "dcp"):
        for target, source in (("dp", "tp"), ("tp4", "tp"), ("tp", "dp")):
            out[f"{target}<-{source} {form}"] = _resume(target, os.path.join(ckpt_dir, source), form)
    out["refusals"] = _refusals(tp_at)
    out["undedicated"] = _undedicated_tp_weights(tp_at, ckpt_dir)
    return out


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_distributed(tp_checkpoint_job, WORLD, str(tmp_path_factory.mktemp("tp_ckpt")))


def _tail(run: dict) -> dict:
    return {"losses": run["losses"][SAVE_AT:], "weights": run["weights"]}


def test_chunk_checksums_add_up_to_the_whole():
    """The parts of a matrix's row and column shards (any dtype's words) sum to its checksum mod P."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        full = torch.randn(6, 10, generator=gen).to(dtype)
        for dim, n in ((0, 2), (1, 2), (1, 5)):
            parts = full.chunk(n, dim=dim)
            offsets = [[0, 0] for _ in parts]
            for i, o in enumerate(offsets):
                o[dim] = i * parts[0].shape[dim]
            got = sum(int(chunk_part(p, full.shape, o)) for p, o in zip(parts, offsets)) % (2**31 - 1)
            assert got == int(checksum_part(full)), (dtype, dim, n)


@pytest.mark.parametrize("form", FORMS)
def test_restart_is_bit_identical(runs, form):
    for rank, res in enumerate(runs):
        assert_bitwise(res[f"tp<-tp {form}"], _tail(res["tp"]), f"rank {rank}, restart through the {form} form")


def test_full_dict_is_the_single_process_models(runs):
    """The TP full dict has the plain model's keys, shapes and dtypes; its matrices are the shards gathered
    in order (tests/test_tp.py's own gather agrees bit for bit); the optimizer dict is a dp-only run's."""
    plain = Net().state_dict()
    saved = runs[0]["saved"]
    tp_model = saved["tp"]["model"]
    assert {k: (v.shape, v.dtype) for k, v in tp_model.items()} == {k: (v.shape, v.dtype) for k, v in plain.items()}
    Net().load_state_dict(tp_model, strict=True)
    final = runs[0]["tp"]
    for k, v in final["independent"].items():
        assert torch.equal(final["weights"][k], v), k

    def layout(optim_sd: dict) -> tuple:
        state = {n: {k: (tuple(v.shape), v.dtype) for k, v in e.items()} for n, e in optim_sd["state"].items()}
        return state, optim_sd["param_groups"]

    assert layout(saved["tp"]["optim"]) == layout(saved["dp"]["optim"])
    assert saved["tp"]["optim"]["state"]["layers.1.w2.weight"]["momentum_buffer"].shape == (32, 96)


def test_tp_weights_left_to_fsdp2_round_trip(runs):
    """A TP weight dmuon does not own (FSDP2 over "dp" on top of the "tp" split) takes the TP full dict and
    gives it back through DCP into a dp-only model, bit for bit."""
    want = runs[0]["saved"]["tp"]["model"]
    for rank, res in enumerate(runs):
        got = res["undedicated"]
        assert got["w2_mesh_dims"] == 2, rank
        for form in ("full", "dcp_self", "dcp"):
            assert sorted(got[form]) == sorted(want), (rank, form)
            for k, v in want.items():
                assert torch.equal(got[form][k], v), (rank, form, k)


@pytest.mark.parametrize("form", ["full", "dcp"])
def test_cross_layout_resume_matches_the_uninterrupted_runs(runs, form):
    """dp=2 x tp=2 -> dp=4, -> dp=1 x tp=4, and dp=4 -> dp=2 x tp=2, against the uninterrupted run of the
    source layout and the oracle."""
    ref = oracle()
    directions = [f"{t}<-{s} {form}" for t, s in (("dp", "tp"), ("tp4", "tp"), ("tp", "dp"))]
    for rank, res in enumerate(runs):
        for direction in directions:
            base = direction.split("<-")[1].split()[0]
            assert_close_to(res[direction], _tail(res[base]), f"rank {rank}, {direction}")
            assert_close_to(res[direction], _tail(ref), f"rank {rank}, {direction} vs the oracle")
    for direction in directions:
        err, key = worst_weight(runs[0][direction]["weights"], ref["weights"])
        base = direction.split("<-")[1].split()[0]
        err_b, key_b = worst_weight(runs[0][direction]["weights"], runs[0][base]["weights"])
        loss = max(abs(a - b) / abs(b) for a, b in zip(runs[0][direction]["losses"], ref["losses"][SAVE_AT:]))
        print(f"{direction}: worst weight vs oracle {err:.2e} ({key}), vs uninterrupted {base} {err_b:.2e} "
              f"({key_b}); worst loss vs oracle {loss:.1e}")


@pytest.mark.parametrize("case, needle", [
    ("model_shape", "layers.0.w2.weight (32, 48) != (32, 96)"),
    ("model_checksum", "checksums do not match: [layers.0.w2.weight]"),
    ("optim_shape", "layers.0.w2.weight.momentum_buffer shape (32, 48) != (32, 96)"),
    ("dcp_checksum", "checksums do not match: [layers.0.w2.weight]"),
])
def test_bad_dicts_are_refused_on_every_rank(runs, case, needle):
    for rank, res in enumerate(runs):
        got, message = res["refusals"]["errors"][case]
        assert got == "ValueError" and needle in message, f"rank {rank} {case}: {got}: {message}"
        assert res["refusals"]["unchanged"], rank
