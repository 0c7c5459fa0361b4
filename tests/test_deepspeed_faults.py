"""A DeepSpeed checkpoint that cannot load changes nothing (issue 31; [Note: atomic DeepSpeed loads] in
``dmuon/integrations/deepspeed/_load.py``).

ZeRO-2 with clipping and a torch scheduler on 2 gloo ranks saves with ``engine.save_checkpoint`` after 2 steps;
then, one more step before each, ``engine.load_checkpoint`` meets damaged copies of that checkpoint, each touching
rank 1's ZeRO file only:

* ``byte``: one flipped byte inside a dedicated momentum (``torch.load`` checks no CRC; dmuon's checksum does);
* ``missing``: the file deleted;
* ``ds_version``: the file without its DeepSpeed version, which DeepSpeed itself asserts on only after it wrote
  the model (the staged copy goes back on every rank);

and on 4 ranks the 2-rank checkpoint. Each load must raise a ``ValueError`` on every rank and leave every rank's
live state bit for bit as it was: params, Muon momenta and groups, ZeRO's fp32 slices and AdamW moments, the
scheduler, the engine's counters. The intact checkpoint then loads to exactly the state that was saved.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dmuon
from tests._deepspeed import Run, build, setup, train
from tests._dist import run_distributed

pytest.importorskip("deepspeed")

RUN = Run(2, 1, 0.5)
TAG = "t"
ZERO_FILE = f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
#: each damaged copy, and what every rank's error must say
CASES = {
    "byte": "do not match what was saved",
    "missing": "zero_pp_rank_1_mp_rank_00_optim_states.pt does not exist",
    "ds_version": "failed inside DeepSpeed's load (rank 1: AssertionError: Empty ds_version",
}
ON_4_RANKS = "the checkpoint was saved on 2 data-parallel ranks and this job has 4"


def _schedule(opt: dmuon.Muon) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def live(engine: Any, model: torch.nn.Module, opt: dmuon.Muon) -> dict[str, Any]:
    """This rank's live state, copied: every param it holds, its owners' Muon state, ZeRO's slices and moments."""
    dedicated, owned = dmuon.get_dedicated_params(model), dmuon.get_owned_params(model)
    zero = engine.optimizer
    out: dict[str, Any] = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()
                           if n not in dedicated or n in owned}
    out |= {f"muon.{n}.{k}": v.clone() for n, p in owned.items() for k, v in opt.state.get(p, {}).items()}
    out |= {f"fp32.{i}": t.clone() for i, t in enumerate(zero.single_partition_of_fp32_groups)}
    out |= {f"adamw.{i}.{k}": v.clone() for i, g in enumerate(zero.optimizer.param_groups)
            for k, v in zero.optimizer.state[g["params"][0]].items()}
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out["scheduler"] = engine.lr_scheduler.state_dict()
    out["counters"] = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values differ (tensors bit for bit)."""
    if a.keys() != b.keys():
        return [f"keys {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def _damage(root: str) -> None:
    """Rank 0 makes each damaged copy of ``root/good``."""
    good = os.path.join(root, "good")
    for case in CASES:
        shutil.copytree(good, os.path.join(root, case))
    path = os.path.join(root, "byte", ZERO_FILE)
    part = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["dmuon"]
    momentum = next(st["momentum_buffer"] for st in part["state"].values())
    raw, data = momentum.numpy().tobytes(), bytearray(open(path, "rb").read())
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the momentum's bytes are not stored once, as they are"
    data[at + len(raw) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    os.remove(os.path.join(root, "missing", ZERO_FILE))
    path = os.path.join(root, "ds_version", ZERO_FILE)
    sd = torch.load(path, weights_only=False)
    del sd["optimizer_state_dict"]["ds_version"]
    torch.save(sd, path)


def _try_load(engine: Any, model: torch.nn.Module, opt: dmuon.Muon, path: str) -> dict[str, Any]:
    before = live(engine, model, opt)
    try:
        engine.load_checkpoint(path, tag=TAG)
        error = None
    except Exception as e:  # noqa: BLE001 - each rank's outcome is the result
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "changed": differences(before, live(engine, model, opt))}


def two_ranks_job(rank: int, world: int, root: str) -> dict[str, Any]:
    setup(rank)
    engine, model, opt = build(world, RUN, schedule=_schedule)
    train(engine, model, rank, world, RUN, range(2))
    engine.save_checkpoint(os.path.join(root, "good"), tag=TAG)
    saved = live(engine, model, opt)
    dist.barrier()
    if rank == 0:
        _damage(root)
    dist.barrier()
    out = {}
    for i, case in enumerate(CASES):  # a step first: the live state differs from the checkpoint's, whatever came before
        train(engine, model, rank, world, RUN, range(2 + i, 3 + i))
        out[case] = _try_load(engine, model, opt, os.path.join(root, case))
    engine.load_checkpoint(os.path.join(root, "good"), tag=TAG)
    out["intact"] = differences(saved, live(engine, model, opt))
    return out


def four_ranks_job(rank: int, world: int, root: str) -> dict[str, Any]:
    setup(rank)
    engine, model, opt = build(world, RUN, schedule=_schedule)
    train(engine, model, rank, world, RUN, range(1))
    return _try_load(engine, model, opt, os.path.join(root, "good"))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    root = str(tmp_path_factory.mktemp("ds_faults"))
    two = run_distributed(two_ranks_job, 2, root)
    return two, run_distributed(four_ranks_job, 4, root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_checkpoint_is_refused_on_every_rank_and_changes_nothing(outcomes, case):
    for rank, r in enumerate(outcomes[0]):
        got = r[case]
        assert got["error"] is not None and got["error"].startswith("ValueError: dmuon: engine.load_checkpoint("), \
            (rank, got["error"])
        assert CASES[case] in got["error"], (rank, got["error"])
        assert got["changed"] == [], (rank, got["changed"])


def test_a_checkpoint_of_another_world_size_is_refused_and_changes_nothing(outcomes):
    for rank, got in enumerate(outcomes[1]):
        assert got["error"] is not None and ON_4_RANKS in got["error"], (rank, got["error"])
        assert got["changed"] == [], (rank, got["changed"])


def test_the_intact_checkpoint_then_loads_the_saved_state_exactly(outcomes):
    for rank, r in enumerate(outcomes[0]):
        assert r["intact"] == [], (rank, r["intact"])
