"""The runtime under the ways real loops call a model: activation checkpointing, meta-device init with
``to_empty``, eval / no_grad forwards, two forwards before one backward, unused params, no FSDP2 at all,
and a single rank. Where the math is the same as the plain run, results must be bit-identical."""

from __future__ import annotations

import pytest
import torch

from tests._asserts import assert_bitwise, assert_close_to
from tests._dist import run_distributed
from tests._training import RunOptions, train_dmuon, train_oracle

RUNS_ON_CUDA = True  # DMUON_TEST_DEVICE=cuda runs these jobs on NCCL (tests/_dist.py)
STEPS = 6

SCENARIOS = {
    "base_z3": RunOptions(steps=STEPS),
    "base_z2": RunOptions(steps=STEPS, reshard_after_forward=False),
    "checkpoint_z3": RunOptions(steps=STEPS, checkpoint=True),
    "checkpoint_z2": RunOptions(steps=STEPS, checkpoint=True, reshard_after_forward=False),
    "meta_init": RunOptions(steps=STEPS, meta_init=True),
    "eval_between_z3": RunOptions(steps=STEPS, eval_between=True),
    "eval_between_z2": RunOptions(steps=STEPS, eval_between=True, reshard_after_forward=False),
    "two_forwards_z3": RunOptions(steps=STEPS, two_forwards=True),
    "two_forwards_z2": RunOptions(steps=STEPS, two_forwards=True, reshard_after_forward=False),
    "unused_param": RunOptions(steps=STEPS, extra_unused=True),
    "no_fsdp": RunOptions(steps=STEPS, fsdp=False),
    "root_boundary_z3": RunOptions(steps=STEPS, root_boundary=True),
    "root_boundary_z2": RunOptions(steps=STEPS, root_boundary=True, reshard_after_forward=False),
}


def lifecycle_job(rank: int, world: int) -> dict:
    return {name: train_dmuon(rank, world, opts) for name, opts in SCENARIOS.items()}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(lifecycle_job, 2)


@pytest.fixture(scope="module")
def oracle() -> dict:
    return train_oracle(STEPS)


@pytest.mark.parametrize("zero", ["z3", "z2"])
def test_activation_checkpointing_is_exact(runs, zero):
    for rank, res in enumerate(runs):
        assert_bitwise(res[f"checkpoint_{zero}"], res[f"base_{zero}"], f"rank {rank} checkpoint {zero}")
        c, P = res[f"checkpoint_{zero}"]["counts"], res[f"checkpoint_{zero}"]["P"]
        # recomputation inside backward finds the weights already there: no extra traffic
        assert all(x["forward_broadcast"]["elements"] == P for x in c)
        assert all(x["backward_broadcast"]["elements"] == (P if zero == "z3" else 0) for x in c)
        assert all(x["reduce"]["elements"] == P for x in c)
    assert all(b == 0 for b in runs[0]["checkpoint_z3"]["storage_between_fwd_bwd"])


def test_meta_init_then_to_empty_is_exact(runs):
    for rank, res in enumerate(runs):
        assert_bitwise(res["meta_init"], res["base_z3"], f"rank {rank} meta init")
        assert all(b == 0 for b in res["meta_init"]["storage_after_step"])


@pytest.mark.parametrize("zero", ["z3", "z2"])
def test_eval_and_no_grad_forwards_change_nothing(runs, zero):
    for rank, res in enumerate(runs):
        assert_bitwise(res[f"eval_between_{zero}"], res[f"base_{zero}"], f"rank {rank} eval {zero}")
        # after the trailing no_grad forward the copies were freed again
        assert all(b == 0 for b in res[f"eval_between_{zero}"]["storage_after_step"])


@pytest.mark.parametrize("zero", ["z3", "z2"])
def test_two_forwards_before_one_backward(runs, oracle, zero):
    r = runs[0][f"two_forwards_{zero}"]
    assert_close_to(r, oracle, f"two forwards {zero}")
    P = r["P"]
    for c in r["counts"]:
        assert c["forward_broadcast"]["elements"] == (2 * P if zero == "z3" else P), c
        assert c["backward_broadcast"]["elements"] == (P if zero == "z3" else 0), c
        assert c["reduce"]["elements"] == P, c


def test_unused_param_gets_no_update(runs):
    # its own oracle: torch.optim.Muon skips a param whose grad is None, so must we
    oracle = train_oracle(STEPS, extra_unused=True)
    r = runs[0]["unused_param"]
    assert_close_to(r, oracle, "unused param")
    name = "layers.1.mlp.unused_proj.weight"
    assert torch.equal(r["weights"][name], oracle["weights"][name])
    before = train_oracle(0, extra_unused=True)["weights"][name]
    assert torch.equal(r["weights"][name], before), "a param without gradient was updated"
    for c in r["counts"]:  # only the used params travel back
        assert c["reduce"]["elements"] == r["P"] - before.numel()


@pytest.mark.parametrize("zero", ["z3", "z2"])
def test_boundary_returning_a_dataclass(runs, zero):
    # the whole model as one boundary: its output is a CausalLMOutput dataclass, not a tensor
    for rank, res in enumerate(runs):
        assert_bitwise(res[f"root_boundary_{zero}"], res[f"base_{zero}"], f"rank {rank} root boundary {zero}")
        c = res[f"root_boundary_{zero}"]["counts"]
        # one bucket per owner, both in one launch ([Note: one launch per boundary])
        assert all(x["forward_broadcast"]["calls"] == 1 for x in c), c


def test_model_without_fully_shard(runs, oracle):
    r = runs[0]["no_fsdp"]
    assert_close_to(r, oracle, "no fully_shard")
    # the plain params (embeddings, norms, head) are averaged by dmuon once per backward
    assert all(c["replicated_grad_all_reduce"]["calls"] >= 1 for c in r["counts"])
    assert all(c["fsdp_all_gather_elements"] == 0 for c in r["counts"])
    for res in runs[1:]:
        assert_bitwise(res["no_fsdp"], r, "no fully_shard ranks agree")


def _single_rank_job(rank: int, world: int) -> dict:
    return {"fsdp": train_dmuon(rank, world, RunOptions(steps=STEPS)),
            "plain": train_dmuon(rank, world, RunOptions(steps=STEPS, fsdp=False))}


def test_world_size_one_is_bitwise_torch(oracle):
    (res,) = run_distributed(_single_rank_job, 1)
    for name in ("fsdp", "plain"):
        assert_bitwise(res[name], oracle, f"world 1 {name}")


def dropped_model_job(rank: int, world: int) -> dict:
    import gc
    import weakref

    import dmuon
    from tests._dist import device
    from tests._training import batches, root_sharded

    model, opt = root_sharded(world)  # root only: per-layer FSDP2 units would keep the model alive themselves
    for tok, tgt in batches(2):  # no zero_grad between them: the stash hooks get armed too
        model(tok.to(device()), tgt.to(device())).loss.backward()
        opt.step()
    owned = next(iter(dmuon.get_owned_params(model).values()))
    refs = [weakref.ref(model), weakref.ref(owned), weakref.ref(model._dmuon_state)]
    del model, opt, owned
    gc.collect()
    return dict(alive=[r() is not None for r in refs])


def test_a_dropped_model_is_freed():
    # parameter hooks must not keep the state (and with it every weight) alive after the user drops the model
    for res in run_distributed(dropped_model_job, 2):
        assert res["alive"] == [False, False, False]
