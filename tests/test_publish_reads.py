"""HSDP: a holder's read of a dedicated matrix right after ``step()`` sees the step (issue 23, item 1).

With HSDP and ``replicate_async=True`` (the default) each owner publishes its updated matrix to the holders
of the other replicate rows asynchronously after ``step()``. A holder that read its copy before the publish
landed (an EMA, a weight-norm log) got a partly old tensor: gloo writes from its own thread, NCCL from its
stream. Now a holder's params are guarded while their bucket's publish is in flight, and the first value
read waits for it ([Note: guarded parameters] in ``dmuon/runtime/guard.py``).

The race is widened deterministically: every replicate publish of a process runs on one worker thread, in
issue order (so the ranks' broadcasts still pair up), ``DELAY_S`` late. On 4 gloo ranks (2 x 2) every rank
reads each matrix it holds right after each ``step()``, with a different first op per step, and the
holders' results are compared bit for bit with the owner's. A second arm takes the publish guard away (the
group's class rule no longer sees the pending publish) and must read stale values, so the test can fail.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
import dmuon.runtime.comm as C
from dmuon.runtime.comm import CommKind
from dmuon.runtime.group import BoundaryGroup
from dmuon.runtime.param import is_dedicated
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, projection_predicate

STEPS = 8
#: How late each publish broadcast starts on every rank: far longer than reading 14 small matrices.
DELAY_S = 0.1
WORLD = 4


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


#: The first op a rank applies to each matrix right after step(), one per step in turn: each must see the step.
READS: dict[str, Callable[[torch.Tensor], object]] = {
    "detach_clone": lambda p: _digest(p.detach().clone()),
    "sum": lambda p: p.sum().item(),
    "vector_norm": lambda p: torch.linalg.vector_norm(p).item(),
    "data": lambda p: _digest(p.data),
    "lerp_into_ema": lambda p: _digest(torch.zeros_like(p).lerp_(p, 0.5)),
}


class _LateWork:
    """The ``Work`` of a publish broadcast the worker thread runs later: ``wait()`` blocks until it ran."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout: object = None) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _LatePublishes:
    """Replaces ``comm.broadcast`` for ``REPLICATE_PUBLISH``: one thread runs this process's publishes in issue
    order, each ``DELAY_S`` late, so the holders' copies land well after ``step()`` returned."""

    def __init__(self) -> None:
        self.original = C.broadcast
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def broadcast(self, ctx, tensor, src, kind, label="", dim=C.Dim.SHARD):
        if kind is not CommKind.REPLICATE_PUBLISH or ctx.size(dim) == 1:
            return self.original(ctx, tensor, src, kind, label, dim)
        ctx.counter.record(kind, tensor, dim.value)
        work = _LateWork()
        self.jobs.put((tensor, ctx.global_rank(dim, src), ctx.groups[dim], work))
        return C.PendingComm(work, tensor)

    def _run(self) -> None:
        while True:
            tensor, src, group, work = self.jobs.get()
            time.sleep(DELAY_S)
            try:
                dist.broadcast(tensor, src=src, group=group)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                work.error = e
            work.done.set()


def _without_publish_guard() -> None:
    """The broken arm: the group's class rule does not see a publish in flight, so holders stay plain."""
    access = BoundaryGroup.access

    def access_ignoring_publishes(self, b):
        pending, b.pending_publish = b.pending_publish, []
        try:
            return access(self, b)
        finally:
            b.pending_publish = pending

    BoundaryGroup.access = access_ignoring_publishes


def _build():
    mesh = init_device_mesh(DEVICE_TYPE, (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    model = build_model().to(device())
    dmuon.dedicate_params(model, mesh["shard"], projection_predicate, replicate_mesh=mesh["replicate"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct")


def reads_job(rank: int, world: int, guarded: bool) -> dict:
    late = _LatePublishes()
    C.broadcast = late.broadcast
    if not guarded:
        _without_publish_guard()
    model, opt = _build()
    per = GLOBAL_BATCH // world
    dp_rank = rank  # the (2, 2) mesh's ranks in row-major order: one batch slice per rank
    reads, norms = [], []
    for step, (tok, tgt) in enumerate(batches(STEPS)):
        opt.zero_grad()
        model(tok[dp_rank * per:(dp_rank + 1) * per].to(device()),
              tgt[dp_rank * per:(dp_rank + 1) * per].to(device())).loss.backward()
        opt.step()
        name, read = list(READS.items())[step % len(READS)]
        # right after step(): every matrix this rank holds (its owner's shard column), through model.parameters()
        held = {n: read(p) for n, p in model.named_parameters()
                if is_dedicated(p) and p.untyped_storage().nbytes() > 0}
        reads.append((name, held))
        norms.append(dmuon.clip_grad_norm_(model, 1e9).item())  # after step() too: reads gradients only
    return {"reads": reads, "norms": norms, "owned": sorted(dmuon.get_owned_params(model))}


def _mismatches(results: list[dict]) -> tuple[int, int]:
    """(holder reads that differ from the owner's, holder reads compared) over every step and matrix."""
    owner_of = {n: rank for rank, r in enumerate(results) for n in r["owned"]}
    bad = total = 0
    for step in range(STEPS):
        for rank, r in enumerate(results):
            op, held = r["reads"][step]
            for n, value in held.items():
                if owner_of[n] == rank:
                    continue
                total += 1
                owner_op, owner_held = results[owner_of[n]]["reads"][step]
                assert owner_op == op
                bad += value != owner_held[n]
    return bad, total


def test_a_read_right_after_step_sees_the_published_weight():
    results = run_distributed(reads_job, WORLD, True)
    bad, total = _mismatches(results)
    print(f"guarded: {bad} of {total} holder reads differ from the owner's")
    assert total == STEPS * 14, total  # each of the 14 matrices has one holder besides its owner
    assert bad == 0, f"{bad} of {total} holder reads right after step() missed the step"
    for r in results:
        assert r["norms"] == results[0]["norms"], "clip after step(): the same norm on every rank"


def test_without_the_guard_the_same_reads_miss_the_step():
    """The same job with the publish guard taken away: the reads must go wrong, or the test above proves nothing."""
    results = run_distributed(reads_job, WORLD, False)
    bad, total = _mismatches(results)
    print(f"unguarded: {bad} of {total} holder reads differ from the owner's")
    assert bad > 0, "without the guard every read still matched: the race was not widened"


# ---------------------------------------------------------------------- #
# Tensor parallelism: the DTensor flavour of the guard                     #
# ---------------------------------------------------------------------- #
TP_STEPS = 3
#: The first op on a TP matrix's DTensor right after step(); each reads this rank's shard.
TP_READS: dict[str, Callable[[torch.Tensor], object]] = {
    "to_local": lambda p: _digest(p.to_local().clone()),
    "detach": lambda p: _digest(p.detach().to_local()),
    "mul": lambda p: _digest((p * 1.0).to_local()),
}


def tp_reads_job(rank: int, world: int, guarded: bool) -> dict:
    """HSDP x TP on 8 ranks (replicate 2 x shard 2 x tp 2): the reads above on each held TP shard."""
    from tests.test_tp import DP, TP, _batches, _tp_model

    late = _LatePublishes()
    C.broadcast = late.broadcast
    if not guarded:
        _without_publish_guard()
    mesh = init_device_mesh("cpu", (2, DP, TP), mesh_dim_names=("replicate", "shard", "tp"))
    model = _tp_model(mesh, mesh["replicate", "shard"])
    opt = dmuon.Muon(model, lr=0.02, ns_coefficients=KJ, ns_backend="direct")
    coord = mesh.get_coordinate()
    dp_rank, tp_rank = coord[0] * DP + coord[1], coord[2]
    reads = []
    for step, (tok, tgt) in enumerate(_batches()[:TP_STEPS]):
        per = tok.shape[0] // (2 * DP)
        opt.zero_grad()
        model(tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]).backward()
        opt.step()
        name, read = list(TP_READS.items())[step % len(TP_READS)]
        held = {n: read(p) for n, p in model.named_parameters()
                if is_dedicated(p) and p._local_tensor.untyped_storage().nbytes() > 0}
        reads.append((name, held))
    return {"reads": reads, "tp_rank": tp_rank, "owned": sorted(dmuon.get_owned_params(model))}


def _tp_mismatches(results: list[dict]) -> tuple[int, int]:
    owner_of = {(n, r["tp_rank"]): rank for rank, r in enumerate(results) for n in r["owned"]}
    bad = total = 0
    for step in range(TP_STEPS):
        for rank, r in enumerate(results):
            _, held = r["reads"][step]
            for n, value in held.items():
                owner = owner_of[n, r["tp_rank"]]
                if owner != rank:
                    total += 1
                    bad += value != results[owner]["reads"][step][1][n]
    return bad, total


def test_tp_shards_read_right_after_step_see_the_published_weight():
    """The DTensor flavour (``GuardedDTensor``): ``to_local()`` (a Python method) and torch ops alike wait."""
    guarded = _tp_mismatches(run_distributed(tp_reads_job, 8, True))
    unguarded = _tp_mismatches(run_distributed(tp_reads_job, 8, False))
    print(f"tensor parallel: guarded {guarded[0]} of {guarded[1]}, unguarded {unguarded[0]} of {unguarded[1]} "
          "holder reads differ from the owner's")
    assert guarded[1] > 0 and guarded[0] == 0, guarded
    assert unguarded[0] > 0, "without the guard every TP read still matched: the race was not widened"
