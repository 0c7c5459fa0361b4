"""Prefetch: the next boundary's broadcast is issued before the current one is waited for, in forward
(following the order the previous pass recorded) and in backward (Z3, the reverse of this step's forward).

Prefetch only moves *when* a broadcast is issued, so with it on or off every run here must give the same
bits (losses, weights, eval logits) and, where the order did not change, the same traffic. Probes inside
the layers show that the next boundary is really in flight while the current one computes, and that
under Z3 no more than two boundaries hold non-owner copies. A model whose layer order changes between
steps (a skipped layer, a reversed pass, an eval pass on another path) checks that a wrong guess costs at
most one broadcast per pass and never a hang or a different result. A host-read guard checks that
dmuon's hooks, reduces and ``step()`` never read a tensor on the host.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.runtime.hooks import STATE_ATTR
from dmuon.runtime.prefetch import _OrderCursor
from dmuon.tools.models import projection_predicate
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import CFG4, GLOBAL_BATCH, KJ, RoutedLlama, RunOptions, batches, full_weights, train_dmuon

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS = 4
KINDS = ("forward_broadcast", "backward_broadcast", "reduce", "replicate_publish", "replicated_grad_all_reduce")

# --------------------------------------------------------------------------------------------------- #
# Pure: the cursor that follows a pass along a recorded order                                            #
# --------------------------------------------------------------------------------------------------- #


def test_order_cursor_follows_resynchronises_and_ignores_unknown():
    a, b, c, d, x = (object() for _ in range(5))
    cur = _OrderCursor([a, b, c, d])
    assert cur.advance(a) is b and cur.advance(b) is c
    assert cur.advance(d) is None  # c skipped: resynchronised on d, the end of the order
    cur = _OrderCursor([a, b, c, d])
    assert cur.advance(x) is None and cur.pos == 0  # never recorded: no guess, cursor stays
    assert cur.advance(a) is b
    cur = _OrderCursor([a, b, a, b])  # a boundary called twice per pass
    assert [cur.advance(g) for g in (a, b, a, b)] == [b, a, b, None]
    cur = _OrderCursor([a, b, c])  # this pass runs in reverse
    assert [cur.advance(g) for g in (c, b, a)] == [None, c, b]
    assert _OrderCursor([]).advance(a) is None


# --------------------------------------------------------------------------------------------------- #
# The shared training scenarios (2 layers), prefetch on vs off                                          #
# --------------------------------------------------------------------------------------------------- #

SCENARIOS = {
    "z3": RunOptions(steps=STEPS),
    "z2": RunOptions(steps=STEPS, reshard_after_forward=False),
    "checkpoint_z3": RunOptions(steps=STEPS, checkpoint=True),
    "checkpoint_z2": RunOptions(steps=STEPS, checkpoint=True, reshard_after_forward=False),
    "accum_z3": RunOptions(steps=STEPS, accum=2),
    "two_forwards_z3": RunOptions(steps=STEPS, two_forwards=True),
    "eval_between_z3": RunOptions(steps=STEPS, eval_between=True),
}


def _counts(c: dict) -> dict:
    return {k: (c[k]["elements"], c[k]["calls"]) for k in KINDS}


def _assert_same_bits(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} vs {b['losses']}"
    for k in b["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), f"{what}: {k} differs"


# --------------------------------------------------------------------------------------------------- #
# A model whose layer order can change per call                                                         #
# --------------------------------------------------------------------------------------------------- #

ALL = (0, 1, 2, 3)
#: train routes per step (every rank the same): stable, a skipped layer, stable, reversed, stable
ROUTES = (ALL, ALL, (0, 1, 3), ALL, (3, 2, 1, 0), ALL, ALL)
#: an eval (no_grad) pass after every step, on other paths, that change too
EVAL_ROUTES = ((0, 2, 3), (0, 2, 3), (0, 2, 3), (0, 1), (0, 2, 3), (3, 1), (0, 2, 3))


def _order_held(step: int) -> bool:
    """Whether step ``step`` runs the same train and eval orders as the step before (so no guess is wrong)."""
    return step == 0 or (ROUTES[step], EVAL_ROUTES[step]) == (ROUTES[step - 1], EVAL_ROUTES[step - 1])


@dataclass(frozen=True)
class Setup:
    prefetch: bool = True
    z3: bool = True
    fsdp: bool = True
    hsdp: bool = False
    checkpoint: bool = False
    routes: tuple[tuple[int, ...], ...] = ROUTES
    eval_routes: tuple[tuple[int, ...], ...] | None = EVAL_ROUTES
    #: record group states inside every layer's forward and backward
    probe: bool = False
    #: count host reads of tensors made from dmuon's own code during the training loop
    guard: bool = False


class HostReads:
    """Counts ``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``, ``.numpy()`` on tensors called
    from dmuon's package (each is a device synchronisation on CUDA)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []
        self._pkg = os.path.dirname(os.path.abspath(dmuon.__file__)) + os.sep

    def _wrap(self, name, real):
        def read(t, *args, **kwargs):
            frame = sys._getframe(1)
            if os.path.abspath(frame.f_code.co_filename).startswith(self._pkg):
                self.calls.append((name, os.path.basename(frame.f_code.co_filename), frame.f_lineno))
            return real(t, *args, **kwargs)

        return read

    def __enter__(self) -> HostReads:
        self._own = {n: n in torch.Tensor.__dict__ for n in self.NAMES}
        self._real = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for n, f in self._real.items():
            setattr(torch.Tensor, n, self._wrap(n, f))
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self._real.items():
            if self._own[n]:
                setattr(torch.Tensor, n, f)
            else:
                delattr(torch.Tensor, n)


def _checkpointed(fwd):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    return run


def _build_routed(world: int, s: Setup):
    """The routed model under dmuon (and FSDP2 unless ``s.fsdp`` is off) and its optimizer."""
    torch.manual_seed(0)
    if s.hsdp:
        mesh = init_device_mesh(DEVICE_TYPE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE_TYPE, (world,))
    model = RoutedLlama(CFG4).to(device())
    model.init_weights(0)
    dmuon.dedicate_params(model, mesh, projection_predicate, reshard_after_forward=s.z3, prefetch=s.prefetch)
    if s.fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if s.checkpoint:
        for layer in model.layers:
            layer.forward = _checkpointed(layer.forward)
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.01, ns_coefficients=KJ, ns_backend="direct",
                     adamw_lr=1e-3, adamw_betas=(0.9, 0.95))
    return model, opt


def routed_train(rank: int, world: int, s: Setup) -> dict:
    model, opt = _build_routed(world, s)
    state = getattr(model, STATE_ATTR)
    groups = [next(g for g in state.groups if g.fqn == f"layers.{i}") for i in range(CFG4.n_layers)]
    step_box = [0]
    probes: list[tuple] = []

    def probe(phase: str, i: int) -> None:
        if phase == "fwd" and not torch.is_grad_enabled():
            phase = "eval"
        probes.append((phase, step_box[0], i, tuple(g.state.value for g in groups),
                       sum(g.holds_weight_storage() for g in groups)))

    if s.probe:
        for i, layer in enumerate(model.layers):
            layer.attention.register_forward_pre_hook(lambda m, a, i=i: probe("fwd", i))
            layer.mlp.register_forward_pre_hook(lambda m, a, i=i: probe("fwd", i))
            layer.mlp.register_full_backward_pre_hook(lambda m, g, i=i: probe("bwd", i))
            layer.attention.register_full_backward_pre_hook(lambda m, g, i=i: probe("bwd", i))
    per = GLOBAL_BATCH // world
    data = batches(len(s.routes))
    losses, counts, holding_after, eval_logits, skipped_grad_none = [], [], [], [], []
    guard = HostReads() if s.guard else None
    if guard is not None:
        guard.__enter__()
    try:
        for step, route in enumerate(s.routes):
            step_box[0] = step
            tok, tgt = (t[rank * per : (rank + 1) * per].to(device()) for t in data[step])
            dmuon.diagnostics.reset_comm_counts(model)
            opt.zero_grad()
            model.route = route
            loss = model(tok, tgt).loss
            loss.backward()
            if not s.fsdp:  # plain params of a layer no rank ran must keep grad=None
                skipped = [i for i in ALL if i not in route]
                skipped_grad_none.append([model.layers[i].attention_norm.weight.grad is None for i in skipped])
            opt.step()
            if s.eval_routes is not None:
                model.route = s.eval_routes[step]
                model.eval()
                with torch.no_grad():
                    eval_logits.append(model(tok).logits.clone())
                model.train()
                if s.fsdp:
                    model.reshard()  # FSDP2 keeps the root unsharded after a no_grad forward
            counts.append(dmuon.diagnostics.comm_counts(model))
            holding_after.append(any(g.holds_weight_storage() for g in state.groups))
            logged = loss.detach().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.AVG)
            losses.append(logged.item())
        if guard is not None:
            # positive control: clip with error_if_nonfinite must read its norm on the host
            controls = len(guard.calls)
            dmuon.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
            control_seen = len(guard.calls) > controls
            guard.calls = guard.calls[:controls]
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
    boundary = sum(dp.shape.numel() for dp in groups[0].params)
    return {
        "losses": losses, "weights": full_weights(model), "counts": counts, "holding_after": holding_after,
        "eval_logits": eval_logits, "probes": probes, "boundary_numel": boundary,
        "host_reads": guard.calls if guard is not None else None,
        "guard_control_seen": control_seen if guard is not None else None,
        "skipped_grad_none": skipped_grad_none,
    }


# --------------------------------------------------------------------------------------------------- #
# Jobs                                                                                                  #
# --------------------------------------------------------------------------------------------------- #


def two_rank_job(rank: int, world: int) -> dict:
    out = {}
    for name, opts in SCENARIOS.items():
        for on in (True, False):
            out[(name, on)] = train_dmuon(rank, world, dataclasses.replace(opts, prefetch=on))
    for on in (True, False):
        out[("routed_z3", on)] = routed_train(rank, world, Setup(prefetch=on, probe=True))
        out[("routed_z2", on)] = routed_train(rank, world, Setup(prefetch=on, z3=False, probe=True))
        out[("routed_nofsdp", on)] = routed_train(rank, world, Setup(prefetch=on, fsdp=False))
    out["guard_fsdp"] = routed_train(rank, world, Setup(routes=(ALL,) * 3, guard=True))
    out["guard_nofsdp"] = routed_train(rank, world, Setup(routes=(ALL,) * 3, fsdp=False, guard=True))
    return out


FOUR_RANK = {
    "hsdp_z3": Setup(hsdp=True),
    "hsdp_z2": Setup(hsdp=True, z3=False),
    "flat_checkpoint_z3": Setup(checkpoint=True),
}


def four_rank_job(rank: int, world: int) -> dict:
    return {(name, on): routed_train(rank, world, dataclasses.replace(s, prefetch=on))
            for name, s in FOUR_RANK.items() for on in (True, False)}


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_distributed(two_rank_job, 2)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_distributed(four_rank_job, 4)


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                 #
# --------------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_prefetch_changes_neither_bits_nor_traffic(two, name):
    for rank, res in enumerate(two):
        on, off = res[(name, True)], res[(name, False)]
        _assert_same_bits(on, off, f"rank {rank} {name}")
        for a, b in zip(on["eval_logits"], off["eval_logits"]):
            assert torch.equal(a, b), f"rank {rank} {name}: eval logits differ"
        assert [_counts(c) for c in on["counts"]] == [_counts(c) for c in off["counts"]], f"rank {rank} {name}"
        assert on["micro_counts"] == off["micro_counts"], f"rank {rank} {name}"
        assert all(b == 0 for b in on["storage_after_step"]), f"rank {rank} {name}: copies left after step"
    # Z3 still frees every copy between forward and backward (the last boundary prefetches nothing)
    if name in ("z3", "checkpoint_z3"):
        assert all(b == 0 for b in two[0][(name, True)]["storage_between_fwd_bwd"])


def _phase(probes: list[tuple], phase: str = "fwd") -> list[tuple]:
    """Probe records of one phase: "fwd" (grad-enabled forward), "eval" (no_grad forward) or "bwd"."""
    return [p for p in probes if p[0] == phase]


def test_next_boundary_is_in_flight_while_the_current_one_computes(two):
    for rank, res in enumerate(two):
        on, off = res[("routed_z3", True)]["probes"], res[("routed_z3", False)]["probes"]
        # step 1 follows step 0's order: inside layer i, layer i+1's broadcast is issued and not yet waited
        for _, step, i, states, _ in _phase(on):
            if step == 1 and i < 3:
                assert states[i] == "unsharded" and states[i + 1] == "unsharding", (rank, i, states)
            if step == 0:  # nothing recorded yet: no guess
                assert states[i + 1 :] == ("sharded",) * (3 - i), (rank, i, states)
        # backward (Z3) follows the reverse of this step's forward, from the first step on
        for _, step, i, states, _ in _phase(on, "bwd"):
            if step in (0, 1) and i > 0:
                assert states[i - 1] == "unsharding", (rank, "bwd", step, i, states)
        # without prefetch the next boundary rests until its own hook
        for phase, step, i, states, _ in off:
            j = i + 1 if phase != "bwd" else i - 1
            if 0 <= j < 4 and step in (0, 1):
                assert states[j] == "sharded", (rank, phase, step, i, states)
        # and prefetch holds up in eval (its own recorded order) too
        assert any(p[3][2] == "unsharding" for p in _phase(on, "eval") if p[1] >= 1 and p[2] == 0), rank


def test_z3_holds_at_most_two_boundaries(two):
    for rank, res in enumerate(two):
        on, off = res[("routed_z3", True)]["probes"], res[("routed_z3", False)]["probes"]
        for phase in ("fwd", "eval", "bwd"):
            held_on = [p[4] for p in _phase(on, phase)]
            held_off = [p[4] for p in _phase(off, phase)]
            assert held_on and max(held_on) == 2, (rank, phase, held_on)
            assert max(held_off) == 1, (rank, phase, held_off)


@pytest.mark.parametrize("name", ["routed_z3", "routed_z2", "routed_nofsdp"])
def test_order_changing_between_steps(two, name):
    for rank, res in enumerate(two):
        on, off = res[(name, True)], res[(name, False)]
        _assert_same_bits(on, off, f"rank {rank} {name}")
        for a, b in zip(on["eval_logits"], off["eval_logits"]):
            assert torch.equal(a, b), f"rank {rank} {name}: eval logits differ"
        _assert_same_bits(on, two[0][(name, True)], f"rank {rank} vs rank 0 {name}")
        # a wrong guess is released at the end of its pass: nothing left over after any step (the last
        # pass of each step is an eval pass, which no backward or step() cleans up after)
        assert not any(on["holding_after"]), (rank, name, on["holding_after"])
        B = on["boundary_numel"]
        for step, (c_on, c_off) in enumerate(zip(on["counts"], off["counts"])):
            a, b = _counts(c_on), _counts(c_off)
            for k in KINDS:
                if k != "forward_broadcast":
                    assert a[k] == b[k], (rank, name, step, k, a[k], b[k])
            extra = a["forward_broadcast"][0] - b["forward_broadcast"][0]
            if _order_held(step):
                assert extra == 0, (rank, name, step, extra)  # the orders held: the same traffic
            else:
                # at most one wasted guess per pass (a training pass and an eval pass per step)
                assert 0 <= extra <= 2 * B, (rank, name, step, extra / B)
        # the reversed pass (step 4) did cost a wrong guess under Z3 (the test sees divergence at all)
        if name == "routed_z3":
            assert _counts(on["counts"][4])["forward_broadcast"][0] > _counts(off["counts"][4])["forward_broadcast"][0]
    if name == "routed_nofsdp":  # layer 2's plain params, run by no rank at step 2, keep grad=None
        assert two[0][(name, True)]["skipped_grad_none"][2] == [True]


@pytest.mark.parametrize("name", ["guard_fsdp", "guard_nofsdp"])
def test_no_host_reads_on_the_hot_path(two, name):
    for rank, res in enumerate(two):
        r = res[name]
        assert r["guard_control_seen"], "the guard missed a known host read"
        assert r["host_reads"] == [], (rank, name, r["host_reads"])


@pytest.mark.parametrize("name", list(FOUR_RANK))
def test_four_ranks_hsdp_and_checkpointing(four, name):
    for rank, res in enumerate(four):
        on, off = res[(name, True)], res[(name, False)]
        _assert_same_bits(on, off, f"rank {rank} {name}")
        _assert_same_bits(on, four[0][(name, True)], f"rank {rank} vs rank 0 {name}")
        assert not any(on["holding_after"]), (rank, name)
        for step, (c_on, c_off) in enumerate(zip(on["counts"], off["counts"])):
            a, b = _counts(c_on), _counts(c_off)
            if _order_held(step):
                assert a == b, (rank, name, step, a, b)
            else:
                assert {k: v for k, v in a.items() if k != "forward_broadcast"} == \
                       {k: v for k, v in b.items() if k != "forward_broadcast"}, (rank, name, step)
