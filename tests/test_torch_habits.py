"""Ordinary PyTorch code on a dmuon model works or raises a clear error; it never crashes or lies (issue 13).

Each row runs on 2 gloo ranks in freshly forked processes (``run_distributed``), so a segfault fails its row
instead of killing the suite. The reference is the same model on one process (``build_model``, no dmuon).

| what the user does | now | tested in |
|---|---|---|
| ``p.norm()`` / ``print(p)`` / ``p.detach().numpy()`` of a weight this rank does not hold | ``NotHeldError`` naming the param, its owner and the dmuon functions to use; ``repr`` says where it lives; the owner reads the true value | ``test_reading_a_weight`` (here) |
| ``torch.save(model.state_dict(), f)``; ``model.load_state_dict(sd)`` | both raise on every rank, naming ``dmuon.get_model_state_dict`` / ``set_model_state_dict``; that route's file loads with ``torch.load`` into a plain model | ``test_state_dict`` (here) |
| ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` | the true global norm, clipped, on every rank; ``get_total_norm`` over the gradients (or a ``clip_grad_norm_`` bound before ``import dmuon``) raises on every rank | ``test_torch_clip`` (here), and ``test_clip.py`` (``via="torch"``) against the oracle over 4 steps |
| EMA over ``model.parameters()``, ``copy.deepcopy(model)``, ``model.to(torch.float64)``, ``parameters_to_vector``, ``torch.save(param)`` | each raises on every rank; ``model.to`` changes nothing; training afterwards still matches the reference | ``test_whole_model_habits`` (here) |
| ``dmuon.Muon`` built before ``fully_shard`` | raises at its first step / zero_grad / state dict | ``test_misuse.py`` |
| a dedicated ``.grad`` read right after ``loss.backward()`` | the average, on the owner | ``test_accumulation.py::test_owner_grad_holds_the_average_when_backward_returns`` |
| HSDP replicate and shard meshes swapped | ``ValueError`` before any change | ``test_misuse.py`` |
| a matrix used in a ``no_sync`` micro-batch but not in the last one | averaged exactly once, like FSDP2 | ``test_accumulation.py::test_matrix_unused_in_the_last_micro_batch_is_averaged_once`` |
| a tied weight selected by its second name | ``ValueError`` | ``test_misuse.py`` |
| ``dmuon.clip_grad_norm_(..., norm_type=inf)`` with a NaN on rank 1 | NaN on every rank | ``test_clip.py::test_a_nonfinite_gradient_on_one_rank_reaches_every_rank`` |
| the checkpoint recipe killed mid-``torch.save`` | the previous file survives (temporary name, then rename) | ``test_faults.py`` |
| one flipped byte in a checkpoint; a torn DCP save | ``set_*_state_dict`` refuses it on every rank | ``test_checksum.py`` |
| a dedicated matrix used by two boundaries | one module at two paths: ``ValueError`` at ``dedicate_params``; a matrix called from outside its boundary: the same ``OutsideBoundaryError`` (a ``NotHeldError``) on every rank, the owner's too | ``test_two_boundaries`` (here), ``test_boundary_misuse.py`` |
"""

from __future__ import annotations

import copy
import io
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests._asserts import WEIGHT_RTOL, rel_err
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, full_weights, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
WORLD = 2
FIXES = ("dmuon.get_owned_params", "dmuon.get_model_state_dict", "dmuon.clip_grad_norm_")


def _model(*, fsdp: bool = True):
    mesh = init_device_mesh(DEVICE_TYPE, (WORLD,))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    if fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3)


def _backward(model, rank: int, step: int = 0) -> torch.Tensor:
    tok, tgt = batches(step + 1)[step]
    per = GLOBAL_BATCH // WORLD
    loss = model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss
    loss.backward()
    return loss


def _train(model, opt, rank: int, steps: int) -> None:
    for step in range(steps):
        opt.zero_grad()
        _backward(model, rank, step)
        opt.step()


def _error(fn) -> str:
    """The message of the exception ``fn()`` raises ("" if it returns)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the row records which error, the test judges it
        return f"{type(e).__name__}: {e}"
    return ""


@rank_threads()
def _reference(steps: int = 0) -> dict:
    """The model on one process: init weights, optionally ``steps`` of torch.optim.Muon + AdamW."""
    model = build_model().to(device())
    muon = [p for n, p in model.named_parameters() if projection_predicate(n, p)]
    other = [p for n, p in model.named_parameters() if not projection_predicate(n, p)]
    om = torch.optim.Muon(muon, lr=0.01, weight_decay=0.01, ns_coefficients=KJ)
    oa = torch.optim.AdamW(other, lr=1e-3)
    for tok, tgt in batches(steps):
        om.zero_grad()
        oa.zero_grad()
        model(tok.to(device()), tgt.to(device())).loss.backward()
        om.step()
        oa.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- #
# Reading one weight                                                       #
# ---------------------------------------------------------------------- #
def read_job(rank: int, world: int) -> dict:
    model, opt = _model()
    owned = set(dmuon.get_owned_params(model))
    out: dict = {"owned": {}, "unheld": {}}
    for name, p in dmuon.get_dedicated_params(model).items():
        if name in owned:
            out["owned"][name] = p.detach().cpu().clone()
            continue
        reads = {"norm": lambda: p.norm(), "numpy": lambda: p.detach().numpy(), "item": lambda: p[0, 0].item(),
                 "add": lambda: p + 1, "matmul": lambda: torch.ones(3, p.shape[0], device=p.device) @ p,
                 "tolist": lambda: p.tolist(), "data": lambda: p.data.sum(), "clone": lambda: p.clone()}
        out["unheld"][name] = {
            "errors": {k: _error(f) for k, f in reads.items()},
            "repr": repr(p), "str": f"{p}",
            "meta": (tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad, p.is_floating_point(), p.numel()),
        }
    _train(model, opt, rank, 2)  # the refused reads changed nothing
    out["trained"] = full_weights(model)
    return out


def test_reading_a_weight():
    results = run_distributed(read_job, WORLD)
    init, trained = _reference(0), _reference(2)
    owners = {name: rank for rank, r in enumerate(results) for name in r["owned"]}
    assert len(owners) == 14 and all(0 < len(r["owned"]) < 14 for r in results), "each rank owns some, not all"
    for rank, r in enumerate(results):
        for name, value in r["owned"].items():
            assert torch.equal(value, init[name]), f"owner's {name} is not the init value"
        assert set(r["unheld"]) == set(owners) - set(r["owned"])
        for name, row in r["unheld"].items():
            for op, err in row["errors"].items():
                assert err.startswith("NotHeldError"), f"rank {rank}: {op} of {name} gave {err!r}"
                assert name in err and f"its owner is rank {owners[name]}" in err, err
                assert all(fix in err for fix in FIXES), err
            assert name in row["repr"] and f"held by rank {owners[name]}" in row["repr"], row["repr"]
            assert name in row["str"]
            assert row["meta"] == (tuple(init[name].shape), str(init[name].dtype), "cpu" if DEVICE_TYPE == "cpu"
                                   else "cuda", True, True, init[name].numel())
        for k, want in trained.items():
            assert rel_err(r["trained"][k], want) <= WEIGHT_RTOL, k


# ---------------------------------------------------------------------- #
# model.state_dict() / load_state_dict()                                   #
# ---------------------------------------------------------------------- #
def state_dict_job(rank: int, world: int, path: str) -> dict:
    model, opt = _model()
    before = full_weights(model)
    out = {"state_dict": _error(lambda: model.state_dict()),
           "layer_state_dict": _error(lambda: model.layers[0].state_dict()),
           "load": _error(lambda: model.load_state_dict(before)),
           "keep_vars": sorted(model.state_dict(keep_vars=True))}
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in full_weights(model).items())
    sd = dmuon.get_model_state_dict(model)  # the documented route
    if rank == 0:
        torch.save(sd, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    dmuon.set_model_state_dict(model, torch.load(path))  # every rank reads the one file back
    out["reloaded"] = all(torch.equal(before[k], v) for k, v in full_weights(model).items())
    return out


def test_state_dict():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.pt")
        results = run_distributed(state_dict_job, WORLD, path)
        loaded = torch.load(path)  # weights_only=True, torch's default
    init = _reference(0)
    plain = build_model()
    plain.load_state_dict(loaded, strict=True)
    assert all(torch.equal(loaded[k], v) for k, v in init.items()), "the saved file is not the model"
    for r in results:
        assert r["state_dict"].startswith("NotHeldError") and "dmuon.get_model_state_dict" in r["state_dict"]
        assert r["layer_state_dict"].startswith("NotHeldError"), r["layer_state_dict"]
        assert r["load"].startswith("NotHeldError") and "dmuon.set_model_state_dict" in r["load"], r["load"]
        assert r["keep_vars"] == sorted(init), "state_dict(keep_vars=True) lists the parameter objects"
        assert r["unchanged"] and r["reloaded"]


# ---------------------------------------------------------------------- #
# torch's clip functions                                                   #
# ---------------------------------------------------------------------- #
def torch_clip_job(rank: int, world: int) -> dict:
    model, opt = _model()
    _backward(model, rank)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    prebound = torch.nn.utils.clip_grad.clip_grad_norm_._dmuon_original  # as bound before `import dmuon`
    out = {"get_total_norm": _error(lambda: torch.nn.utils.get_total_norm(grads)),
           "prebound": _error(lambda: prebound(model.parameters(), 1e9)),
           "routed": torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item(),
           "dmuon": dmuon.clip_grad_norm_(model, 1e9).item()}
    return out


def test_torch_clip():
    results = run_distributed(torch_clip_job, WORLD)
    with rank_threads():
        model = build_model().to(device())
        tok, tgt = batches(1)[0]
        model(tok.to(device()), tgt.to(device())).loss.backward()
        want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    for r in results:
        assert r["routed"] == r["dmuon"] == results[0]["routed"], "torch's clip is routed to dmuon's, on every rank"
        assert abs(r["routed"] - want) <= 1e-5 * want, (r["routed"], want)
        for case in ("get_total_norm", "prebound"):
            assert r[case].startswith("RuntimeError") and "dmuon.clip_grad_norm_" in r[case], r[case]


# ---------------------------------------------------------------------- #
# Whole-model habits                                                       #
# ---------------------------------------------------------------------- #
def habits_job(rank: int, world: int) -> dict:
    model, opt = _model()
    plain_model, _ = _model(fsdp=False)
    dedicated = set(dmuon.get_dedicated_params(model).values())
    unheld = next(p for n, p in dmuon.get_dedicated_params(model).items() if n not in dmuon.get_owned_params(model))
    ema = [torch.zeros(p.shape, device=p.device) if p in dedicated else torch.zeros_like(p)
           for p in model.parameters()]

    def ema_update() -> None:
        for e, p in zip(ema, model.parameters()):
            e.lerp_(p.detach(), 0.01)

    out = {"ema_init": _error(lambda: [p.detach().clone() for p in model.parameters()]),
           "ema": _error(ema_update),
           "foreach_ema": _error(lambda: torch._foreach_lerp_(ema, list(model.parameters()), 0.01)),
           "deepcopy": _error(lambda: copy.deepcopy(model)),
           "deepcopy_no_fsdp": _error(lambda: copy.deepcopy(plain_model)),
           "to_float64": _error(lambda: model.to(torch.float64)),
           "layer_to_float64": _error(lambda: model.layers[0].double()),
           "to_own_device": _error(lambda: model.to(device())),
           "parameters_to_vector": _error(lambda: torch.nn.utils.parameters_to_vector(model.parameters())),
           "save_param": _error(lambda: torch.save(unheld, io.BytesIO()))}
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    _train(model, opt, rank, 2)
    out["trained"] = full_weights(model)
    return out


def test_whole_model_habits():
    results = run_distributed(habits_job, WORLD)
    trained = _reference(2)
    for rank, r in enumerate(results):
        for case in ("ema_init", "ema", "foreach_ema", "deepcopy_no_fsdp", "parameters_to_vector", "save_param"):
            assert r[case].startswith("NotHeldError") and all(f in r[case] for f in FIXES), (rank, case, r[case])
        assert r["deepcopy"], "FSDP2 refuses deepcopy itself"
        for case in ("to_float64", "layer_to_float64"):
            assert r[case].startswith("RuntimeError") and "before dedicate_params" in r[case], (case, r[case])
        assert r["to_own_device"] == "", r["to_own_device"]
        assert r["dtypes"] == ["torch.float32"], "a refused model.to changed nothing"
        for k, want in trained.items():
            assert rel_err(r["trained"][k], want) <= WEIGHT_RTOL, k


# ---------------------------------------------------------------------- #
# A matrix used by two boundaries                                          #
# ---------------------------------------------------------------------- #
class _ReusedQ(torch.nn.Module):
    """After the layers, the root applies layer 0's q_proj once more: outside its hook boundary."""

    def __init__(self):
        super().__init__()
        self.inner = build_model()

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        m = self.inner
        h = m.tok_embeddings(tok)
        for layer in m.layers:
            h = layer(h)
        return m.lm_head(m.norm(m.layers[0].attention.q_proj(h)))


def two_boundaries_job(rank: int, world: int) -> dict:
    mesh = init_device_mesh(DEVICE_TYPE, (WORLD,))
    shared = build_model().to(device())
    shared.layers[1].attention.q_proj = shared.layers[0].attention.q_proj  # one module, two layers
    out = {"shared_module": _error(lambda: dmuon.dedicate_params(shared, mesh, projection_predicate))}
    model = _ReusedQ().to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    q = "inner.layers.0.attention.q_proj.weight"
    out["owner"] = q in dmuon.get_owned_params(model)
    tok, _ = batches(1)[0]
    out["reused"] = _error(lambda: model(tok[:2].to(device())))
    return out


def test_two_boundaries():
    results = run_distributed(two_boundaries_job, WORLD)
    assert sum(r["owner"] for r in results) == 1
    for r in results:
        assert r["shared_module"].startswith("ValueError") and "shared" in r["shared_module"], r["shared_module"]
        # the owner too: computing on, it would wait for the others in the next collective
        assert r["reused"] == results[0]["reused"], "every rank raises the same error"
        assert r["reused"].startswith("OutsideBoundaryError"), r["reused"]
        assert "hook boundary 'inner.layers.0'" in r["reused"], r["reused"]
        assert "in the model's forward (in no hook boundary)" in r["reused"], r["reused"]
