"""A dedicated matrix used outside its hook boundary during a training pass: every rank raises the same
``OutsideBoundaryError`` at once, the owner and the HSDP holders too (issue 23, item 2).

Before, only the ranks that hold no copy raised (``NotHeldError``); the owner (and under HSDP the other
holders of its shard column) computed on and waited in the next collective for them, until the
process-group timeout (NCCL) or a "connection closed" (gloo), with an error naming nothing. Each job here
runs with a short process-group timeout (``PG_TIMEOUT``); every rank measures the time from the misuse to
its exception, and the tests bound it by half that timeout: a rank that waited in a collective for the
others cannot pass (a correctness bound, not a speed check). After the error every rank trains on, and
the weights stay identical everywhere, since every rank stopped at the same point.

The two misuses: a loss term on a dedicated matrix after the model's forward (Z3: the copies are gone by
then; under Z2 it is legal and trains like a plain weight decay term, checked here too), and layer 1's
matrix used inside layer 0's forward (layer 1's window has not opened yet; with prefetch it is in flight).
See [Note: boundary windows] in ``dmuon/runtime/guard.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from tests._asserts import WEIGHT_RTOL, rel_err
from tests._dist import DEVICE_TYPE, device, rank_threads, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, full_weights, projection_predicate

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
PG_TIMEOUT = timedelta(seconds=10)
#: The matrix misused: layer 1's query projection (boundary "layers.1").
W = "layers.1.attention.q_proj.weight"


def _build(world: int, hsdp: bool, z3: bool = True):
    if hsdp:
        mesh = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        dmuon_mesh = {"mesh": mesh["shard"], "replicate_mesh": mesh["replicate"]}
    else:
        mesh = init_device_mesh(DEVICE_TYPE, (world,))
        dmuon_mesh = {"mesh": mesh}
    model = build_model().to(device())
    dmuon.dedicate_params(model, predicate=projection_predicate, reshard_after_forward=z3, **dmuon_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct")


def _local_batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok, tgt = batches(step + 1)[step]
    per = GLOBAL_BATCH // world
    return tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())


def _step(model, opt, rank: int, world: int, step: int, extra=None) -> None:
    """One training step; ``extra(loss)`` may add a term to the loss after the model's forward."""
    opt.zero_grad()
    loss = model(*_local_batch(rank, world, step)).loss
    if extra is not None:
        loss = extra(loss)
    loss.backward()
    opt.step()


class _Clock:
    """The time from the misuse to the exception, on this rank."""

    def __init__(self) -> None:
        self.start: float | None = None

    def tick(self) -> None:
        self.start = time.monotonic()

    def result(self, error: BaseException | None) -> dict:
        waited = None if self.start is None else time.monotonic() - self.start
        if error is None:
            return {"error": None, "message": "", "seconds": waited}
        return {"error": type(error).__name__, "message": str(error), "seconds": waited,
                "is_not_held": isinstance(error, dmuon.NotHeldError)}


def _loss_term(model, opt, rank: int, world: int, clock: _Clock) -> None:
    w = dict(model.named_parameters())[W]

    def extra(loss: torch.Tensor) -> torch.Tensor:
        clock.tick()
        return loss + 1e-4 * w.pow(2).sum()

    _step(model, opt, rank, world, 1, extra)


def _other_boundary(model, opt, rank: int, world: int, clock: _Clock) -> None:
    w = dict(model.named_parameters())[W]
    layer0 = model.layers[0]
    forward = layer0.forward

    def forward_using_layer1(*args, **kwargs):
        out = forward(*args, **kwargs)
        clock.tick()
        return out + 0.0 * w.sum()

    layer0.forward = forward_using_layer1
    try:
        _step(model, opt, rank, world, 1)
    finally:
        del layer0.forward


MISUSES = {"loss_term": _loss_term, "other_boundary": _other_boundary}


def misuse_job(rank: int, world: int, hsdp: bool, misuse: str) -> dict:
    model, opt = _build(world, hsdp)
    _step(model, opt, rank, world, 0)  # a first step: prefetch has an order to follow, HSDP a publish behind it
    clock = _Clock()
    try:
        MISUSES[misuse](model, opt, rank, world, clock)
        out = clock.result(None)
    except Exception as e:  # noqa: BLE001 - the test judges which error each rank got
        out = clock.result(e)
    out["owner"] = W in dmuon.get_owned_params(model)
    _step(model, opt, rank, world, 2)  # every rank stopped at the same point: training goes on
    out["weights"] = full_weights(model)
    return out


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, True)], ids=["2 ranks", "4 ranks HSDP 2x2"])
@pytest.mark.parametrize("misuse", sorted(MISUSES))
def test_every_rank_raises_the_same_error_at_once(world, hsdp, misuse):
    results = run_distributed(misuse_job, world, hsdp, misuse, pg_timeout=PG_TIMEOUT)
    bound = PG_TIMEOUT.total_seconds() / 2
    summary = [(r["error"], r["owner"], None if r["seconds"] is None else round(r["seconds"], 3)) for r in results]
    assert sum(r["owner"] for r in results) == 1, summary
    for rank, r in enumerate(results):
        assert r["error"] == "OutsideBoundaryError" and r["is_not_held"], (rank, summary, r["message"])
        assert r["seconds"] is not None and r["seconds"] < bound, f"rank {rank} waited: {summary}"
        assert r["message"] == results[0]["message"], f"rank {rank} says something else:\n{r['message']}"
    message = results[0]["message"]
    assert repr(W) in message and "'layers.1'" in message, message
    where = "in the forward of hook boundary 'layers.0'" if misuse == "other_boundary" else "after the model's forward"
    assert where in message, message
    for rank, r in enumerate(results[1:], start=1):
        for k, v in r["weights"].items():
            assert torch.equal(v, results[0]["weights"][k]), f"rank {rank} {k} after the error"


def z2_loss_term_job(rank: int, world: int, scale: float = 1e-2) -> dict:
    """Under Z2 the copies stay from forward to backward: a loss term on the matrix there is legal."""
    model, opt = _build(world, hsdp=False, z3=False)
    w = dict(model.named_parameters())[W]
    for step in range(2):
        _step(model, opt, rank, world, step, lambda loss: loss + scale * w.pow(2).sum())
    return full_weights(model)


@rank_threads()
def _z2_oracle() -> dict[str, torch.Tensor]:
    """One process, torch.optim.Muon + AdamW with dmuon.Muon's settings above, the same loss term."""
    model = build_model().to(device())
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named.items() if projection_predicate(n, p)], lr=0.01, weight_decay=0.0,
                            ns_coefficients=KJ)
    adamw = torch.optim.AdamW([p for n, p in named.items() if not projection_predicate(n, p)], lr=1e-3)
    for tok, tgt in batches(2):
        muon.zero_grad()
        adamw.zero_grad()
        (model(tok.to(device()), tgt.to(device())).loss + 1e-2 * named[W].pow(2).sum()).backward()
        muon.step()
        adamw.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_a_loss_term_under_z2_stays_legal_and_trains_like_one_process():
    results = run_distributed(z2_loss_term_job, 2, pg_timeout=PG_TIMEOUT)
    oracle = _z2_oracle()
    for k, v in results[1].items():
        assert torch.equal(v, results[0][k]), k
    for k, want in oracle.items():
        assert rel_err(results[0][k], want) <= WEIGHT_RTOL, k
    without_term = run_distributed(z2_loss_term_job, 2, 0.0, pg_timeout=PG_TIMEOUT)[0]
    assert rel_err(without_term[W], oracle[W]) > WEIGHT_RTOL, "the term must matter, or this proves nothing"


def tp_misuse_job(rank: int, world: int) -> dict:
    """dp 2 x tp 2: a loss term on a tensor-parallel matrix after the model's forward (``GuardedDTensor`` on the
    owner slot's tp ranks, ``UnheldDTensor`` on the others)."""
    from tests.test_tp import DP, TP, _batches, _tp_model

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _tp_model(mesh, mesh["dp"])
    opt = dmuon.Muon(model, lr=0.02, ns_coefficients=KJ, ns_backend="direct")
    dp_rank, data = mesh.get_coordinate()[0], _batches()
    w = dict(model.named_parameters())["layers.1.w1.weight"]
    clock = _Clock()

    def step(i: int, misuse: bool = False) -> None:
        tok, tgt = data[i]
        per = tok.shape[0] // DP
        opt.zero_grad()
        loss = model(tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per])
        if misuse:
            clock.tick()
            loss = loss + 1e-4 * w.pow(2).sum()
        loss.backward()
        opt.step()

    step(0)
    try:
        step(1, misuse=True)
        out = clock.result(None)
    except Exception as e:  # noqa: BLE001 - the test judges which error each rank got
        out = clock.result(e)
    out["owner"] = "layers.1.w1.weight" in dmuon.get_owned_params(model)
    step(2)
    out["weights"] = full_weights(model)
    return out


def test_a_tensor_parallel_matrix_misused_raises_on_every_rank():
    if DEVICE_TYPE != "cpu":
        pytest.skip("the TP model builds CPU meshes (tests/test_tp.py)")
    results = run_distributed(tp_misuse_job, 4, pg_timeout=PG_TIMEOUT)
    summary = [(r["error"], r["owner"], r["seconds"]) for r in results]
    assert sum(r["owner"] for r in results) == 2, summary  # both tp ranks of the owner slot
    for rank, r in enumerate(results):
        assert r["error"] == "OutsideBoundaryError", (rank, summary, r["message"])
        assert r["seconds"] < PG_TIMEOUT.total_seconds() / 2, summary
        assert r["message"] == results[0]["message"] and "'layers.1.w1.weight'" in r["message"], r["message"]
        for k, v in r["weights"].items():
            assert torch.equal(v, results[0]["weights"][k]), f"rank {rank} {k} after the error"


# ---------------------------------------------------------------------- #
# What the guards cost a training step                                     #
# ---------------------------------------------------------------------- #
_COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "all_gather_object", "broadcast_object_list", "barrier")


def hot_path_job(rank: int, world: int, hsdp: bool, guards: bool) -> dict:
    """Three ordinary steps after a first one, counting per phase: calls into the guards' torch-function layer,
    waits it did, class writes, and every torch.distributed collective (by name and group size). ``guards=False``:
    the classes of before this work (holders always plain), the baseline for the collectives."""
    import collections

    import torch.distributed as dist

    import dmuon.runtime.group as group_module
    import dmuon.runtime.guard as guard_module
    from dmuon.runtime.guard import Access
    from dmuon.runtime.group import BoundaryGroup, GroupState

    phase = ["setup"]
    counts: collections.Counter = collections.Counter()
    collectives: dict[str, list] = collections.defaultdict(list)
    guard, set_access, admit = guard_module._guard, group_module.set_access, BoundaryGroup.admit

    def counting_guard(func, args, kwargs):
        counts["guard", phase[0]] += 1
        return guard(func, args, kwargs)

    def counting_set(p, access):
        before = type(p)
        set_access(p, access)
        counts["class_writes", phase[0]] += type(p) is not before

    def counting_admit(self, index):
        counts["admit", phase[0]] += 1
        return admit(self, index)

    guard_module._guard, group_module.set_access, BoundaryGroup.admit = counting_guard, counting_set, counting_admit
    if not guards:
        def old_access(self, b):
            unheld = self.state is not GroupState.UNSHARDED and not self.is_holder(b)
            return Access.UNHELD if unheld else Access.OPEN

        BoundaryGroup.access = old_access
    for name in _COLLECTIVES:
        def counted(*args, __f=getattr(dist, name), __name=name, **kwargs):
            group = kwargs.get("group")
            collectives[phase[0]].append((__name, dist.get_world_size(group)))
            return __f(*args, **kwargs)
        setattr(dist, name, counted)
    model, opt = _build(world, hsdp)
    _step(model, opt, rank, world, 0)
    for step in range(1, 4):
        phase[0] = "zero_grad"
        opt.zero_grad()
        phase[0] = "forward"
        loss = model(*_local_batch(rank, world, step)).loss
        phase[0] = "backward"
        loss.backward()
        phase[0] = "step"
        opt.step()
        phase[0] = "after"
    dedicated = len(dmuon.get_dedicated_params(model))
    return {"counts": {f"{k}/{p}": v for (k, p), v in counts.items() if p != "setup"},
            "collectives": dict(collectives), "dedicated": dedicated}


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, True)], ids=["2 ranks", "4 ranks HSDP 2x2"])
def test_the_hot_path_meets_no_guard_and_issues_the_same_collectives(world, hsdp):
    """Forward, backward and step never call into a guard (every op there runs on plain params: torch's
    fast path), nothing waits, and every rank issues exactly the collectives it issued with holders always
    plain; the guards' whole cost is class writes (pointer assignments) at the group transitions."""
    guarded = run_distributed(hot_path_job, world, hsdp, True)
    plain = run_distributed(hot_path_job, world, hsdp, False)
    for rank, (g, p) in enumerate(zip(guarded, plain)):
        counts = g["counts"]
        print(f"rank {rank}: {counts} (before this work: {p['counts']})")
        for phase in ("forward", "backward", "step"):
            assert counts.get(f"guard/{phase}", 0) == 0, (rank, phase, counts)
        assert not any(k.startswith("admit/") and v for k, v in counts.items()), (rank, counts)
        assert g["collectives"] == p["collectives"], f"rank {rank}: the guards changed the collectives"
        writes = sum(v for k, v in counts.items() if k.startswith("class_writes/")) / 3
        assert writes <= 8 * g["dedicated"], (rank, writes, counts)  # a few per matrix and step, nothing per op
