"""The runtime's state machines on one process: a dedicated matrix's gradient cycle (``GradState``) and a
boundary group's memory states (``GroupState``). Every transition checks the state it starts from; an
out-of-order call raises ``DMuonInternalError`` naming the matrix or boundary, the state and the expected
ones -- also under ``python -O``, which strips ``assert`` statements."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from dmuon.runtime.comm import CommContext, CommCounter, CommKind, Dim
from dmuon.runtime.config import RuntimeConfig
from dmuon.runtime.errors import DMuonInternalError
from dmuon.runtime.group import BoundaryGroup, GroupState
from dmuon.runtime.param import DedicatedParam, GradState
from tests._asserts import child_env


def _one_rank_ctx() -> CommContext:
    """A (1 x 1) grid: every collective is a no-op, so no process group is needed."""
    return CommContext(((0,),), 0, 0, {Dim.SHARD: None, Dim.REPLICATE: None, Dim.WORLD: None},
                       torch.device("cpu"), CommCounter())


def _bound_param(shape=(4, 3)) -> tuple[nn.Linear, DedicatedParam]:
    lin = nn.Linear(shape[1], shape[0], bias=False)
    dp = DedicatedParam("layer.weight", lin, "weight", owner=0, shape=torch.Size(shape), dtype=torch.float32,
                        is_owner=True)
    dp.bind(lin.weight, torch.zeros(shape), master=None)
    return lin, dp


def test_gradient_cycle_with_accumulation_adds_the_average_once():
    lin, dp = _bound_param()
    p = lin.weight
    assert dp.grad_state is GradState.EMPTY
    p.grad = torch.ones(4, 3)
    dp.hand_over(None)
    assert dp.grad_state is GradState.READY and p.grad is None
    g = dp.take_for_reduce()
    assert dp.grad_state is GradState.REDUCING and torch.equal(g, torch.ones(4, 3))
    assert dp.deliver(torch.full((4, 3), 2.0), None)  # narrow: the caller arms the stash hook
    assert dp.grad_state is GradState.REDUCED and torch.equal(p.grad, torch.full((4, 3), 2.0))
    # a second backward before step(): the average is set aside, the fresh local gradient reduced alone
    dp.stash_reduced()
    assert dp.grad_state is GradState.EMPTY and p.grad is None
    p.grad = torch.ones(4, 3)
    dp.hand_over(None)
    dp.take_for_reduce()
    dp.deliver(torch.full((4, 3), 3.0), None)
    assert torch.equal(p.grad, torch.full((4, 3), 5.0))
    dp.clear(set_to_none=True)
    assert dp.grad_state is GradState.EMPTY and p.grad is None and dp.stashed_grad is None


def test_no_sync_sums_in_the_wide_dtype_and_hands_over_the_sum():
    lin, dp = _bound_param()
    p = lin.weight
    for _ in range(3):
        p.grad = torch.ones(4, 3)
        dp.accumulate_unsynced(torch.float64)
        assert dp.grad_state is GradState.UNSYNCED and p.grad is None
    p.grad = torch.ones(4, 3)
    dp.hand_over(torch.float64)
    local = dp.take_for_reduce()
    assert local.dtype == torch.float64 and torch.equal(local, torch.full((4, 3), 4.0, dtype=torch.float64))
    assert not dp.deliver(local, torch.float64)  # wide: the average lives in main_grad, no stash hook
    assert dp.reduced_grad() is dp.main_grad and p.grad is None


@pytest.mark.parametrize("op, start", [
    ("take_for_reduce", GradState.EMPTY),
    ("release", GradState.READY),
    ("deliver", GradState.EMPTY),
    ("hand_over", GradState.REDUCING),
    ("clear", GradState.REDUCING),
])
def test_out_of_order_gradient_call_names_the_matrix_and_states(op, start):
    lin, dp = _bound_param()
    lin.weight.grad = torch.ones(4, 3)
    dp.grad_state = start  # put it there directly: the point is the guard of the next call
    calls = {"take_for_reduce": lambda: dp.take_for_reduce(), "release": lambda: dp.release(),
             "deliver": lambda: dp.deliver(torch.ones(4, 3), None), "hand_over": lambda: dp.hand_over(None),
             "clear": lambda: dp.clear(set_to_none=True)}
    with pytest.raises(DMuonInternalError, match=rf"'layer.weight'.*state {start.value}, expected"):
        calls[op]()
    assert dp.grad_state is start, "a refused transition must not change the state"


def test_an_average_left_in_param_grad_is_never_reduced_again():
    """REDUCED with the average in ``.grad`` (the stash hook did not run) must not be handed over: the local
    gradient autograd added to it would carry the average into a second reduce."""
    lin, dp = _bound_param()
    lin.weight.grad = torch.ones(4, 3)
    dp.hand_over(None)
    dp.take_for_reduce()
    dp.deliver(torch.ones(4, 3), None)
    with pytest.raises(DMuonInternalError, match="not set aside"):
        dp.hand_over(None)


def _group() -> tuple[nn.Linear, BoundaryGroup]:
    lin, dp = _bound_param()
    dp.param = None  # let the group bind it
    g = BoundaryGroup("layers.0", [dp], _one_rank_ctx(), RuntimeConfig())
    g.bind(lambda dp: None)
    return lin, g


def test_group_lifecycle_on_one_rank():
    lin, g = _group()
    assert g.state is GroupState.SHARDED
    g.unshard(CommKind.FORWARD_BROADCAST)
    assert g.state is GroupState.UNSHARDING
    g.unshard(CommKind.FORWARD_BROADCAST)  # prefetched: nothing more to issue
    g.wait_for_unshard()
    assert g.state is GroupState.UNSHARDED
    lin.weight.grad = torch.ones(4, 3)
    g.params[0].hand_over(None)
    g.reduce_grads()
    assert g.state is GroupState.REDUCING and g.params[0].grad_state is GradState.REDUCING
    g.finish_reduce()
    assert g.state is GroupState.SHARDED and g.params[0].grad_state is GradState.REDUCED
    assert torch.equal(lin.weight.grad, torch.ones(4, 3))


@pytest.mark.parametrize("op, start", [
    ("wait_for_unshard", GroupState.SHARDED),
    ("reshard", GroupState.REDUCING),
    ("bind", GroupState.UNSHARDED),
])
def test_out_of_order_group_call_names_the_boundary_and_states(op, start):
    _, g = _group()
    g.state = start
    calls = {"wait_for_unshard": g.wait_for_unshard, "reshard": g.reshard, "bind": lambda: g.bind(lambda dp: None)}
    with pytest.raises(DMuonInternalError, match=rf"'layers.0'.*in state {start.value}, expected"):
        calls[op]()


def test_guards_survive_python_dash_O():
    probe = (
        "import torch, torch.nn as nn\n"
        "from dmuon.runtime.param import DedicatedParam\n"
        "from dmuon.runtime.errors import DMuonInternalError\n"
        "lin = nn.Linear(3, 4, bias=False)\n"
        "dp = DedicatedParam('w', lin, 'weight', 0, torch.Size((4, 3)), torch.float32, is_owner=True)\n"
        "dp.bind(lin.weight, torch.zeros(4, 3), None)\n"
        "assert False, 'asserts must be stripped under -O for this probe to mean anything'\n"
    )
    check = probe + (
        "try:\n    dp.take_for_reduce()\nexcept DMuonInternalError as e:\n    print('refused:', e)\n"
        "else:\n    raise SystemExit('not refused')\n"
    )
    proc = subprocess.run([sys.executable, "-O", "-c", check], env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused: dmuon internal error on rank 0" in proc.stdout, proc.stdout
