"""torchtitan's own tensor-parallel plan with dmuon: ``tensor_parallel_degree=2`` through ``dmuon_model_spec``.

torchtitan 0.3.0's ``parallelize_llama`` runs the model's TP step (``model.parallelize(parallel_dims)``:
colwise ``wqkv`` / ``w1`` / ``w3``, rowwise ``wo`` / ``w2``, vocab-sharded embedding and head with the
vocab-parallel loss, sequence-parallel norms), then selective activation checkpointing and FSDP2 over
"fsdp" (or HSDP); the integration dedicates the TP-sharded matrices in between ([Note: tensor
parallelism]). Each run trains torchtitan's debug Llama (tests/test_torchtitan.py's tiny recipe, its param
groups, schedule, momentum edit and clipping every step) and is compared with that file's single-process
oracle (``torch.optim.Muon`` + ``torch.optim.AdamW``) within its bounds: dp=1 x tp=2 (2 gloo ranks), dp=2
x tp=2 and 2 replicas x 1 shard x tp=2 (4), dp=1 x tp=2 without sequence parallelism. The dp=1 x tp=2 run
also saves through torchtitan's CheckpointManager, and fresh processes resume it bit for bit; the same
processes also train under torchtitan's default bf16 mixed precision. 40-50 s on this 2-core machine. Skipped without torchtitan
/ triton.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("torchtitan")
pytest.importorskip("torchtitan.models.llama3")

import torch.distributed as dist  # noqa: E402

import dmuon  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests.test_torchtitan import (  # noqa: E402
    ATTENTION, GLOBAL_BATCH, LOSS_RTOL, MAX_NORM, NORM_RTOL, SAVE_AT, STEPS, WEIGHT_RTOL, TrainState, _build,
    _cpu_torchtitan, _edit, _loss_fn, _rel, batch, tiny_llama3_config, train_oracle,
)

TP = 2


def tp_job(rank: int, world: int, root: str, *, checkpoint: bool = False, load_step: int | None = None,
           **build: Any) -> dict:
    """STEPS steps of ``Trainer.train_step`` on a dp x tp grid: each dp slot takes its slice of the global
    batch, its tp ranks the same slice; the loss is logged over the dp ranks. ``checkpoint``: torchtitan's
    CheckpointManager (``DMuonCheckpointManager``) saves at step SAVE_AT; ``load_step``: fresh processes
    with another init restore that step first and train the remaining steps; ``build``: the options of
    tests/test_torchtitan.py's ``_build`` (``replicate``, ``mixed_precision``, ``sequence_parallel``)."""
    from torchtitan.distributed import utils as tt_dist_utils

    from dmuon.integrations import torchtitan as dmuon_tt

    model, optimizers, lr_schedulers, parallel_dims = _build(world, 0 if load_step is None else 123, root, tp=TP,
                                                             **build)
    # torchtitan's data-loading and loss meshes (None where of size 1)
    batch_mesh, loss_mesh = parallel_dims.get_optional_mesh("batch"), parallel_dims.get_optional_mesh("loss")
    dp, dp_rank = parallel_dims.dp_replicate * parallel_dims.dp_shard, batch_mesh.get_local_rank() if batch_mesh else 0
    per = GLOBAL_BATCH // dp
    dedicated = dmuon.get_dedicated_params(model)
    out: dict[str, Any] = {"init": dmuon.get_model_state_dict(model), "losses": [], "norms": [],
                           "tp": {n: str(p.placements) for n, p in dedicated.items()}}
    seen: set[tuple[str, str]] = set()  # (input, weight) dtypes the dedicated matrices' forward computes in
    for fqn in dedicated:
        model.get_submodule(fqn.rsplit(".", 1)[0]).register_forward_pre_hook(
            lambda m, args: seen.add((str(args[0].dtype), str(m.weight.dtype))))
    train_state = TrainState()
    checkpointer = dmuon_tt.DMuonCheckpointManager.Config(
        enable=checkpoint or load_step is not None, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0,
        last_save_model_only=False, initial_load_model_only=False,
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=root)
    if load_step is not None:
        assert checkpointer.load(step=load_step) and train_state.step == load_step
    while train_state.step < STEPS:
        train_state.step += 1
        step = train_state.step
        tok, tgt = batch(step)
        tok, tgt = tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]
        _edit([g for g in optimizers.muon.param_groups if g["name"] == ATTENTION], step)
        optimizers.zero_grad()
        loss, _ = _loss_fn()(model(tok), tgt, torch.tensor(tgt.numel() * dp))
        loss.backward()
        norm = tt_dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True, pp_mesh=None,
                                             ep_enabled=False)
        optimizers.step()
        lr_schedulers.step()
        if step <= SAVE_AT:  # the one save the resumed run needs (saves cost seconds on this CPU)
            checkpointer.save(step)
        if step == SAVE_AT and checkpoint:
            out["at_save"] = dmuon.get_model_state_dict(model)
        logged = loss.detach().clone()
        if loss_mesh is not None:  # local sum / global tokens, over the data-parallel ranks: the mean
            dist.all_reduce(logged, group=loss_mesh.get_group())
        out["losses"].append(logged.item())
        out["norms"].append(norm.item())
    checkpointer.close()
    out.update(final=dmuon.get_model_state_dict(model), compute=sorted(seen))
    return out


def _check_against_oracle(runs: list[dict]) -> dict[str, float]:
    """Every rank's losses and norms, and the final weights, against the oracle from the same init; returns
    the worst relative errors."""
    got = runs[0]
    for r in runs[1:]:
        assert r["losses"] == got["losses"] and r["norms"] == got["norms"]
    assert set(got["tp"].values()) == {"(Shard(dim=0),)", "(Shard(dim=1),)"}, got["tp"]
    oracle = train_oracle(got["init"])
    loss = [abs(a - b) / b for a, b in zip(got["losses"], oracle["losses"], strict=True)]
    norm = [abs(a - b) / b for a, b in zip(got["norms"], oracle["norms"], strict=True)]
    assert max(loss) <= LOSS_RTOL, (got["losses"], oracle["losses"])
    assert max(norm) <= NORM_RTOL, (got["norms"], oracle["norms"])  # every step clipped: a wrong norm shows
    # [Note: bf16 floor] of tests/test_torchtitan.py: the same bound, the oracle's own spread doubled
    floor = max(_rel(w, oracle["final"][k]) for k, w in train_oracle(got["init"], split=2)["final"].items())
    rel = {k: _rel(got["final"][k], w) for k, w in oracle["final"].items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= max(WEIGHT_RTOL, 2 * floor), (worst, rel[worst], floor)
    return {"loss": max(loss), "norm": max(norm), "weight": rel[worst], "floor": floor}


def two_rank_job(rank: int, world: int, root: str) -> dict[str, dict]:
    """dp=1 x tp=2 in fp32, saving; then without sequence parallelism, and under torchtitan's default mixed
    precision, in the same processes."""
    return {"full": tp_job(rank, world, root, checkpoint=True),
            "no_sp": tp_job(rank, world, root, sequence_parallel=False),
            "mixed": tp_job(rank, world, root, mixed_precision=True)}


@pytest.fixture(scope="module")
def dp1xtp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """dp=1 x tp=2 on 2 gloo ranks, saving at SAVE_AT through torchtitan's CheckpointManager; then fresh
    processes resuming from that step."""
    root = str(tmp_path_factory.mktemp("torchtitan_tp"))
    runs = run_distributed(two_rank_job, TP, root)
    resumed = run_distributed(functools.partial(tp_job, load_step=SAVE_AT), TP, root)
    return {"root": root, "resumed": resumed, **{k: [r[k] for r in runs] for k in runs[0]}}


def test_dp1xtp2_matches_single_process_oracle(dp1xtp2: dict[str, Any]) -> None:
    """dp=1 x tp=2: every block matrix is dedicated as a pair of TP shards on the one dp slot."""
    print(_check_against_oracle(dp1xtp2["full"]))


def four_rank_job(rank: int, world: int, root: str) -> dict[str, dict]:
    """dp=2 x tp=2 as FSDP (2 shards) and as HSDP (2 replicas of 1 shard), one after the other in the same
    processes (sparing CI a start-up)."""
    return {"fsdp": tp_job(rank, world, root), "hsdp": tp_job(rank, world, root, replicate=2)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_distributed(four_rank_job, 2 * TP, str(tmp_path_factory.mktemp("torchtitan_tp4")))


def test_without_sequence_parallel_matches_single_process_oracle(dp1xtp2: dict[str, Any]) -> None:
    """``enable_sequence_parallel=False``: norms and activations replicated over "tp", and the rowwise
    weights' gradients arrive as Partial DTensors, which the container reduces to their shards."""
    print(_check_against_oracle(dp1xtp2["no_sp"]))


def test_dp2xtp2_matches_single_process_oracle(four_ranks: list[dict[str, dict]]) -> None:
    """dp=2 x tp=2 (4 gloo ranks): owners over dp, each matrix's shards on both tp ranks of its owner slot."""
    print(_check_against_oracle([r["fsdp"] for r in four_ranks]))


def test_hsdp_x_tp_matches_single_process_oracle(four_ranks: list[dict[str, dict]]) -> None:
    """data_parallel_replicate_degree=2 x tp=2: dmuon's ("replicate", "shard", "tp") mesh from torchtitan's
    dp_replicate / fsdp / tp meshes, FSDP2's HSDP over TP; owners over the 2 replicate slots."""
    print(_check_against_oracle([r["hsdp"] for r in four_ranks]))


def test_resume_from_torchtitan_checkpoint_is_bitwise(dp1xtp2: dict[str, Any]) -> None:
    """Restart from torchtitan's DCP checkpoint (model through dmuon's sharded TP dicts, the container's
    optimizer state, LR schedule, step): the remaining steps repeat bit for bit."""
    for full, resumed in zip(dp1xtp2["full"], dp1xtp2["resumed"], strict=True):
        assert resumed["losses"] == full["losses"][SAVE_AT:]
        assert resumed["norms"] == full["norms"][SAVE_AT:]
        assert any(not torch.equal(resumed["init"][k], v) for k, v in full["init"].items())  # the load did it
        for key, value in full["final"].items():
            assert torch.equal(resumed["final"][key], value), key


def test_tp_checkpoint_loads_into_a_plain_torchtitan_model(dp1xtp2: dict[str, Any]) -> None:
    """The model part of the TP checkpoint is torchtitan's stock layout (fused QKV as wq/wk/wv, every tensor
    whole): a single-process torchtitan model with its own state-dict hooks loads it and holds the weights
    the ranks had at the save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _cpu_torchtitan()
    ckpt = Path(dp1xtp2["root"]) / "checkpoint" / f"step-{SAVE_AT}"
    dcp_to_torch_save(str(ckpt), str(ckpt.parent / "converted.pt"))
    written = torch.load(ckpt.parent / "converted.pt", weights_only=False)
    plain = tiny_llama3_config().build()
    plain.load_state_dict({k: written[k] for k in plain.state_dict()})
    saved = dp1xtp2["full"][0]["at_save"]
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_default_mixed_precision_trains_like_fp32(dp1xtp2: dict[str, Any]) -> None:
    """torchtitan's default ``TrainingConfig`` (fp32 model, bf16 compute, fp32 reduce) under TP: the TP
    matrices compute in bf16 from fp32 masters, and training follows the fp32 oracle as closely as it does
    without TP (tests/test_torchtitan.py: 2e-3 in the loss). Its bf16 forward depends on the TP split, so
    there is no bit-exact oracle here ([Note: mixed-precision oracle] there)."""
    mixed = dp1xtp2["mixed"]
    got = mixed[0]
    assert all(r["compute"] == [("torch.bfloat16", "torch.bfloat16")] for r in mixed), [r["compute"] for r in mixed]
    assert all(v.dtype == torch.float32 for v in got["final"].values())
    fp32 = train_oracle(got["init"])
    assert got["losses"][-1] < got["losses"][0] - 0.1, got["losses"]
    for a, b in zip(got["losses"], fp32["losses"], strict=True):
        assert abs(a - b) <= 2e-3 * b, (got["losses"], fp32["losses"])


def test_tensor_parallel_settings_dmuon_cannot_honour_are_refused() -> None:
    """Each raises a ValueError naming the setting, before anything is sharded (no process group here)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from dmuon.integrations import torchtitan as dmuon_tt

    def dims(**kw: Any) -> ParallelDims:
        args = dict(dp_replicate=1, dp_shard=1, cp=1, tp=TP, pp=1, ep=1, world_size=TP, spmd_backend="partial_dtensor")
        return ParallelDims(**{**args, **kw})

    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no parameter is a DTensor yet"):  # dedicate before torchtitan's TP step
        dmuon_tt.dedicate(plain, dims())
    never_called = dmuon_tt.with_dmuon(lambda model, **kw: pytest.fail("parallelize_fn ran"))
    fp32 = TrainingConfig(mixed_precision_param="float32")
    for kwargs, match in [
        (dict(training=fp32, compile_config=CompileConfig(enable=True, enable_async_tensor_parallel=True)),
         "enable_async_tensor_parallel=True"),
        (dict(training=fp32), "needs a torchtitan Module"),  # a plain nn.Module has no TP step to follow
    ]:
        with pytest.raises(ValueError, match=match):
            never_called(plain, parallel_dims=dims(), parallelism=ParallelismConfig(tensor_parallel_degree=TP,
                                                                                    spmd_backend="partial_dtensor"),
                         **kwargs)
    # a parallelize_fn without torchtitan's TP step (an older torchtitan's plan, say): named, not mis-trained
    with torch.device("meta"):
        model = tiny_llama3_config().build()
    no_tp_step = dmuon_tt.with_dmuon(lambda model, **kw: model)
    with pytest.raises(ValueError, match=r"never called model.parallelize\(parallel_dims\)"):
        no_tp_step(model, parallel_dims=dims(), training=fp32, parallelism=ParallelismConfig(
            tensor_parallel_degree=TP, spmd_backend="partial_dtensor"))
    assert "parallelize" not in vars(model)  # the hook is gone again
