"""torchtitan integration: a torchtitan Llama trained with dmuon through torchtitan's own components.

Every run uses torchtitan's pieces as its Trainer wires them: ``parallelize_llama`` (FSDP2 via
``fully_shard``) wrapped by ``with_dmuon``, ``to_empty`` + ``init_weights``, the optimizer container and
``LRSchedulersContainer`` built from their configs, torchtitan's cross-entropy loss scaled by the global
token count, the Trainer's ``clip_grad_norm_`` call (``torchtitan.distributed.utils``) and the DCP
``CheckpointManager``. The oracle is the same torchtitan model in one process with ``torch.optim.Muon`` +
``torch.optim.AdamW``. Skipped when torchtitan or triton (which its llama3 module imports) are missing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("torchtitan")
pytest.importorskip("torchtitan.models.llama3")

import torch.distributed as dist  # noqa: E402

import dmuon  # noqa: E402
from tests._asserts import differences, torchrun  # noqa: E402
from tests._dist import rank_threads, run_distributed  # noqa: E402

WORLD = 2
STEPS, SAVE_AT = 6, 3
GLOBAL_BATCH, SEQ = 4, 32
VOCAB, DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HIDDEN = 256, 64, 2, 4, 2, 192
MAX_NORM = 0.5  # below every step's gradient norm here, so clipping acts in every step
NO_CLIP = 1e9
WARMUP = 2
HP: dict[str, Any] = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, adamw_lr=3e-3,
                          adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.1)
LOSS_RTOL, NORM_RTOL, WEIGHT_RTOL = 1e-4, 1e-4, 5e-3  # loss and weight bounds as tests/test_parity.py
# Param groups (torchtitan's ParamGroupConfig): norms without weight decay, the attention matrices on a
# second Muon lr; the loop sets the attention group's momentum to EDITED_MOMENTUM before step EDIT_STEP
# (before the save), so a restart only matches if the checkpoint carried it.
NORMS, ATTENTION = r"norm", r"\.attention\."
ATTENTION_LR, EDIT_STEP, EDITED_MOMENTUM = 0.01, 2, 0.9


def _param_group_configs() -> list[Any]:
    from torchtitan.components.optimizer import ParamGroupConfig

    return [ParamGroupConfig(pattern=NORMS, optimizer_name="AdamW", optimizer_kwargs={"weight_decay": 0.0}),
            ParamGroupConfig(pattern=ATTENTION, optimizer_name="Muon", optimizer_kwargs={"lr": ATTENTION_LR})]


def _edit(groups: list[dict], step: int) -> None:
    if step == EDIT_STEP:
        for g in groups:
            g["momentum"] = EDITED_MOMENTUM


# --------------------------------------------------------------------------------------------------- #
# torchtitan setup shared by the ranks and the oracle                                                  #
# --------------------------------------------------------------------------------------------------- #
def _cpu_torchtitan() -> None:
    """torchtitan reads its device type at import time (CUDA unless one is visible); this is a CPU run."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torchtitan.distributed import utils as tt_dist_utils

    parallel_dims.device_type = "cpu"
    tt_utils.device_type = "cpu"
    tt_dist_utils.set_spmd_backend("partial_dtensor")


def tiny_llama3_config() -> Any:
    """torchtitan's debug Llama 3 recipe (fused QKV, depth-scaled init, complex RoPE; its own layer builder),
    scaled down so Newton–Schulz in bf16 stays cheap on CPU (the 6-layer debugmodel takes ~10 s a step
    here); SDPA attention because flex attention has no CPU backward."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(
        n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, hidden_dim=HIDDEN, fuse_qkv=True,
        rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    norm_init = {"weight": nn.init.ones_}
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": partial(nn.init.trunc_normal_, std=DIM**-0.5)}),
        layers=layers,
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (1-based), the same on every rank and in the oracle: token
    sequences from a fixed random bigram map (90% of transitions), so there is something to learn."""
    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(1000 + step)
    tok = torch.empty(GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=gen)
    noise = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    keep = torch.rand(GLOBAL_BATCH, SEQ, generator=gen) < 0.9
    for i in range(SEQ):
        tok[:, i + 1] = torch.where(keep[:, i], successor[tok[:, i]], noise[:, i])
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _loss_fn() -> Any:
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss.Config().build(compile_config=None)


class TrainState:
    """The Trainer's own ``train_state`` entry: the step counter travels with the checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


# --------------------------------------------------------------------------------------------------- #
# Worker side                                                                                          #
# --------------------------------------------------------------------------------------------------- #
def _build(
    world: int, seed: int, dump_folder: str, replicate: int = 1, mixed_precision: bool = False, *, tp: int = 1,
    sequence_parallel: bool = True,
) -> tuple[Any, Any, Any, Any]:
    """Model, optimizers, LR schedulers and ParallelDims exactly as ``Trainer.__init__`` builds them from a
    config whose ``model_spec`` went through ``dmuon_model_spec`` (activation checkpointing: the Trainer's
    default SAC). ``replicate > 1``: HSDP (``data_parallel_replicate_degree``). ``tp > 1``: torchtitan's
    tensor parallelism (``tensor_parallel_degree``, with ``enable_sequence_parallel=sequence_parallel``; the
    Trainer's ``update_from_config`` sets the model's sharding config). Training runs in fp32 (as the fp32
    oracle) unless ``mixed_precision``: torchtitan's default ``TrainingConfig`` (fp32 model, bf16 compute,
    fp32 reduce)."""
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.protocols.model_spec import ModelSpec

    from dmuon.integrations import torchtitan as dmuon_tt

    _cpu_torchtitan()
    config = tiny_llama3_config()
    if tp > 1:
        set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    spec = dmuon_tt.dmuon_model_spec(ModelSpec(
        name="llama3", flavor="tiny", model=config, parallelize_fn=parallelize_llama,
        pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None,
    ))
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_replicate_degree=replicate,
                                    tensor_parallel_degree=tp, enable_sequence_parallel=sequence_parallel)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    training = TrainingConfig() if mixed_precision else TrainingConfig(mixed_precision_param="float32")
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=training,
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=SelectiveAC.Config(),
        dump_folder=dump_folder,
    )
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = dmuon_tt.DMuonOptimizersContainer.Config(implementation="for-loop", param_groups=_param_group_configs(),
                                                          **HP).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=optimizers,
                                                                            training_steps=STEPS)
    return model, optimizers, lr_schedulers, parallel_dims


def _train_step(
    model: Any, optimizers: Any, lr_schedulers: Any, rank: int, world: int, step: int, max_norm: float = MAX_NORM
) -> tuple[float, float]:
    """What ``Trainer.train_step`` does, for one local batch slice."""
    from torchtitan.distributed import utils as tt_dist_utils

    tok, tgt = batch(step)
    per = GLOBAL_BATCH // world
    tok, tgt = tok[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]
    global_valid_tokens = torch.tensor(tgt.numel() * world)
    _edit([g for g in optimizers.muon.param_groups if g["name"] == ATTENTION], step)
    optimizers.zero_grad()
    loss, _ = _loss_fn()(model(tok), tgt, global_valid_tokens)
    loss.backward()
    grad_norm = tt_dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True, pp_mesh=None,
                                              ep_enabled=False)
    optimizers.step()
    lr_schedulers.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)  # local sum / global tokens, summed: the global mean
    return logged.item(), grad_norm.item()


def train_job(rank: int, world: int, root: str, seed: int, load_step: int | None) -> dict:
    """Train to STEPS with torchtitan's CheckpointManager saving every SAVE_AT steps; with ``load_step``,
    first restore that checkpoint (fresh processes, different init) and train only the remaining steps.
    The uninterrupted run then also trains a mixed-precision model (``"mixed"``; folded in here to spare
    CI a job)."""
    from dmuon.integrations import torchtitan as dmuon_tt

    model, optimizers, lr_schedulers, _ = _build(world, seed, root)
    out: dict[str, Any] = {"owned": sorted(dmuon.get_owned_params(model))}
    if load_step is None:
        # full tensors for the oracle (cloned: on one rank full_tensor() can alias the live shard)
        out["init"] = {k: v.clone() for k, v in dmuon.get_model_state_dict(model).items()}
    train_state = TrainState()
    checkpointer = dmuon_tt.DMuonCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0, last_save_model_only=False,
        initial_load_model_only=False,
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=root)
    if load_step is not None:
        out["before_load"] = dmuon.get_model_state_dict(model)
        out["refused"] = _refused_loads(rank, root, model, optimizers, lr_schedulers, train_state)
        assert checkpointer.load(step=load_step)
        out["loaded_step"] = train_state.step
    losses, norms = [], []
    while train_state.step < STEPS:
        train_state.step += 1
        loss, norm = _train_step(model, optimizers, lr_schedulers, rank, world, train_state.step)
        losses.append(loss)
        norms.append(norm)
        checkpointer.save(train_state.step)
        if train_state.step == SAVE_AT and load_step is None:
            out["at_save"] = dmuon.get_model_state_dict(model)
            out["optim_at_save"] = dmuon.get_optimizer_state_dict(model, optimizers.muon)
    checkpointer.close()
    out.update(losses=losses, norms=norms, final=dmuon.get_model_state_dict(model),
               hyper=[{k: v for k, v in g.items() if k not in ("params", "param_names")}
                      for g in optimizers.muon.param_groups])
    if load_step is None:
        del model, optimizers, lr_schedulers, checkpointer
        out["mixed"] = _mixed_precision_run(rank, world, root)
    return out


def _refused_loads(rank: int, root: str, model: Any, optimizers: Any, lr_schedulers: Any, train_state: Any) -> dict:
    """Bad copies of the step-SAVE_AT checkpoint (see the test) into DMuonCheckpointManager.load: what each did."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    from dmuon.integrations import torchtitan as dmuon_tt
    from tests.test_checkpoint_refusal import bad_copies, outcome

    fqn, ckpt = canonical_fqn(sorted(dmuon.get_dedicated_params(model))[0]), f"{root}/checkpoint/step-"
    if rank == 0:
        bad_copies(f"{ckpt}{SAVE_AT}", f"{ckpt}{STEPS}", lambda name: f"{root}/{name}/step-{SAVE_AT}",
                   {"optim_byte": f"optimizer.state.{fqn}.momentum_buffer"})
    dist.barrier()
    muon = optimizers.muon
    dmuon.get_optimizer_state_dict(model, muon, sharded=True)  # (the zero state a load target creates)
    snapshot = lambda: (dmuon.get_model_state_dict(model), dmuon.get_optimizer_state_dict(model, muon),  # noqa: E731
                        lr_schedulers.state_dict(), train_state.step)
    before, out = snapshot(), {"flipped": fqn}
    for name in ("optim_byte", "torn"):
        checkpointer = dmuon_tt.DMuonCheckpointManager.Config(enable=True, folder=name, keep_latest_k=0).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=root)
        out[name] = outcome(lambda: checkpointer.load(step=SAVE_AT))
        checkpointer.close()
        parts = zip(("model", "optim", "lr_schedulers", "train_state"), before, snapshot())
        out[f"{name} changed"] = [part for part, a, b in parts if differences(a, b)]
    return out


def _mixed_precision_run(rank: int, world: int, root: str) -> dict:
    """STEPS steps under torchtitan's default mixed precision, with what the dedicated matrices' forward
    computes in (input and weight dtype) and the dtypes of the owners' reduced gradients. No clipping (see
    [Note: mixed-precision oracle]); the Trainer's clip call still computes the norm."""
    model, optimizers, lr_schedulers, _ = _build(world, 0, root, mixed_precision=True)
    init = {k: v.clone() for k, v in dmuon.get_model_state_dict(model).items()}
    seen: set[tuple[str, str]] = set()

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.add((str(args[0].dtype), str(module.weight.dtype)))

    for fqn in dmuon.get_dedicated_params(model):
        model.get_submodule(fqn.rsplit(".", 1)[0]).register_forward_pre_hook(record)
    results = [_train_step(model, optimizers, lr_schedulers, rank, world, step, max_norm=NO_CLIP)
               for step in range(1, STEPS + 1)]
    return {"init": init, "losses": [r[0] for r in results], "norms": [r[1] for r in results],
            "final": dmuon.get_model_state_dict(model), "compute": sorted(seen),
            "grad_dtypes": sorted({str(g.dtype) for g in dmuon.get_owned_grads(model).values()}),
            "owned": sorted(dmuon.get_owned_params(model))}


def parity_job(rank: int, world: int, root: str, replicate: int) -> dict:
    """STEPS steps on a (replicate x shard) HSDP grid, no checkpoint."""
    model, optimizers, lr_schedulers, _ = _build(world, 0, root, replicate)
    init = {k: v.clone() for k, v in dmuon.get_model_state_dict(model).items()}
    results = [_train_step(model, optimizers, lr_schedulers, rank, world, step) for step in range(1, STEPS + 1)]
    return {"init": init, "losses": [r[0] for r in results], "norms": [r[1] for r in results]}


# --------------------------------------------------------------------------------------------------- #
# Oracle: one process, torch.optim.Muon + torch.optim.AdamW                                            #
# --------------------------------------------------------------------------------------------------- #
@rank_threads()  # the mixed-precision run is compared with it bit for bit
def train_oracle(
    init: dict[str, torch.Tensor], split: int = 1, compute_dtype: torch.dtype | None = None,
    max_norm: float = MAX_NORM,
) -> dict:
    """The same model and steps in one process. ``split > 1`` feeds each global batch as ``split`` slices
    (the ranks' slices), their fp32 gradients summed, which measures how far bf16 Newton–Schulz carries
    summation-order noise. ``compute_dtype``: the model computes in it while the optimizers step fp32
    copies rounded back into it before every step, as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
    (parameters cast, buffers not). The fused ``wqkv``'s q, k and v are parameters of their own to torch's Muon."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from dmuon.integrations.torchtitan import default_predicate
    from tests.test_torchtitan_qkv import FusedQKVShadows

    _cpu_torchtitan()
    torch.manual_seed(0)
    model = tiny_llama3_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.load_state_dict(init)
    params = dict(model.named_parameters())
    values = params  # what the optimizers step: the model's own params, or fp32 copies of them
    if compute_dtype is not None:
        values = {n: p.detach().clone() for n, p in params.items()}
        for p in params.values():
            p.data = p.data.to(compute_dtype)
    muon = [n for n, p in params.items() if default_predicate(n, p)]
    rest = [n for n, p in params.items() if not default_predicate(n, p)]
    attention = [n for n in muon if re.search(ATTENTION, n)]
    norms = [n for n in rest if re.search(NORMS, n)]
    shadows = FusedQKVShadows(model, values)
    opt_m = torch.optim.Muon(
        [{"params": shadows.matrices(attention), "lr": ATTENTION_LR},
         {"params": shadows.matrices([n for n in muon if n not in attention])}],
        lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"], weight_decay=HP["weight_decay"])
    opt_a = torch.optim.AdamW(
        [{"params": [values[n] for n in norms], "weight_decay": 0.0},
         {"params": [values[n] for n in rest if n not in norms]}],
        lr=HP["adamw_lr"], betas=HP["adamw_betas"], eps=HP["adamw_eps"], weight_decay=HP["adamw_weight_decay"])
    assert attention and norms and len(attention) < len(muon) and len(shadows.parts) == N_LAYERS
    scheds = LRSchedulersContainer.Config(warmup_steps=WARMUP).build(optimizers=[opt_m, opt_a], training_steps=STEPS)
    losses, norms = [], []
    per = GLOBAL_BATCH // split
    for step in range(1, STEPS + 1):
        tok, tgt = batch(step)
        _edit(opt_m.param_groups[:1], step)
        if values is not params:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(values[n])
        grads, total = {n: torch.zeros_like(v) for n, v in values.items()}, 0.0
        for i in range(split):
            model.zero_grad()
            loss, _ = _loss_fn()(model(tok[i * per : (i + 1) * per]), tgt[i * per : (i + 1) * per],
                                 torch.tensor(tgt.numel()))
            loss.backward()
            total += loss.item()
            for n, p in params.items():
                grads[n] += p.grad.float()  # torchtitan's FSDP2 sums the ranks' gradients, in fp32
        for n, v in values.items():
            v.grad = grads[n]
        norms.append(torch.nn.utils.clip_grad_norm_(list(values.values()), max_norm).item())
        shadows.step(opt_m)
        opt_a.step()
        scheds.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "final": {k: v.detach().clone() for k, v in values.items()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------------- #
# Tests                                                                                                #
# --------------------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted 2-rank run (saving at SAVE_AT; then a mixed-precision run in the same processes), one
    resumed 2-rank run, and the oracle."""
    root = str(tmp_path_factory.mktemp("torchtitan"))
    full = run_distributed(train_job, WORLD, root, 0, None)
    resumed = run_distributed(train_job, WORLD, root, 123, SAVE_AT)
    oracle = train_oracle(full[0]["init"])
    oracle_split = train_oracle(full[0]["init"], split=WORLD)
    return {"root": root, "full": full, "resumed": resumed, "oracle": oracle, "oracle_split": oracle_split}


def test_loss_falls_and_matches_single_process_oracle(runs: dict[str, Any]) -> None:
    full, oracle = runs["full"][0], runs["oracle"]
    losses = full["losses"]
    assert losses[-1] < losses[0], losses
    for got, want in zip(losses, oracle["losses"], strict=True):
        assert abs(got - want) <= LOSS_RTOL * want, (losses, oracle["losses"])
    # torchtitan sums gradients over ranks; the norm (and so the clipping) must see the dedicated
    # gradients at that same scale, not dmuon's average.
    for got, want in zip(full["norms"], oracle["norms"], strict=True):
        assert abs(got - want) <= NORM_RTOL * want, (full["norms"], oracle["norms"])
    assert min(oracle["norms"]) > MAX_NORM  # clipping acted in every step
    # [Note: bf16 floor] Newton–Schulz runs in bf16 (as torch.optim.Muon's), which amplifies last-bit
    # differences of the fp32 gradients: the oracle fed its batches as the ranks' two slices moves the small
    # depth-scaled ``wo`` matrices by ~2% in 6 steps (losses still agree to ~1e-6). The weight bound is that
    # measured floor, doubled, or WEIGHT_RTOL when the floor is lower.
    floor = max(_rel(runs["oracle_split"]["final"][k], w) for k, w in oracle["final"].items())
    rel = {k: _rel(full["final"][k], w) for k, w in oracle["final"].items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= max(WEIGHT_RTOL, 2 * floor), (worst, rel[worst], floor)


def test_hsdp_matches_single_process_oracle(tmp_path: Path) -> None:
    """torchtitan's HSDP (2 replicas x 2 shards): dmuon's mesh comes from ``dp_replicate`` x ``fsdp``, and
    the gradient scale follows FSDP2's sum over all four ranks."""
    run = run_distributed(parity_job, 4, str(tmp_path), 2)[0]
    oracle = train_oracle(run["init"])
    for got, want in zip(run["losses"], oracle["losses"], strict=True):
        assert abs(got - want) <= LOSS_RTOL * want, (run["losses"], oracle["losses"])
    for got, want in zip(run["norms"], oracle["norms"], strict=True):
        assert abs(got - want) <= NORM_RTOL * want, (run["norms"], oracle["norms"])


def test_unsupported_settings_are_refused() -> None:
    """Settings dmuon cannot honour fail before anything is sharded, with a ValueError naming them."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from dmuon.integrations import torchtitan as dmuon_tt

    def parallel_dims(**kw: Any) -> ParallelDims:
        args = dict(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2, spmd_backend="partial_dtensor")
        args.update(kw)
        return ParallelDims(**args)

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="context_parallel_degree"):
        dmuon_tt.dedicate(model, parallel_dims(dp_shard=1, cp=2))
    with pytest.raises(ValueError, match="spmd_types"):
        dmuon_tt.dedicate(model, parallel_dims(spmd_backend="spmd_types"))
    never_called = dmuon_tt.with_dmuon(lambda model, **kw: pytest.fail("parallelize_fn ran"))
    for training, match in [
        # bf16 weights computed in fp32: FSDP2 would upcast, dmuon computes a matrix in at most its own dtype
        (TrainingConfig(dtype="bfloat16", mixed_precision_param="float32"), "mixed_precision_param='float32' is wider"),
        (TrainingConfig(mixed_precision_reduce="float64"), "mixed_precision_reduce='float64'"),
    ]:
        # a ValueError, not dedicate_params' RuntimeError (no process group here): refused before dmuon runs
        with pytest.raises(ValueError, match=match):
            never_called(model, parallel_dims=parallel_dims(), training=training, parallelism=ParallelismConfig())
    with pytest.raises(ValueError, match="param_groups"):
        dmuon_tt.DMuonOptimizersContainer.Config(param_groups=[object()])
    from torchtitan.components.optimizer import ParamGroupConfig

    with pytest.raises(ValueError, match="optimizer_name must be one of"):
        dmuon_tt.DMuonOptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern="norm", optimizer_name="Adam")])
    with pytest.raises(ValueError, match="fused_opt_states_bf16"):
        dmuon_tt.DMuonOptimizersContainer.Config(implementation="fused_opt_states_bf16")
    with pytest.raises(ValueError, match="last_save_in_hf"):
        dmuon_tt.DMuonCheckpointManager.Config(last_save_in_hf=True)


def test_mixed_precision_settings_map_like_fsdp2() -> None:
    """torchtitan hands ``mixed_precision_param`` / ``_reduce`` to FSDP2 unconditionally, and FSDP2 drops a
    param dtype equal to the weights' and a reduce dtype equal to the compute dtype; dmuon gets the same."""
    from torchtitan.config import TrainingConfig

    from dmuon.integrations.torchtitan import mixed_precision_dtypes

    bf16, fp32 = torch.bfloat16, torch.float32
    assert mixed_precision_dtypes(TrainingConfig()) == (bf16, fp32)  # torchtitan's default
    assert mixed_precision_dtypes(TrainingConfig(mixed_precision_param="float32")) == (None, None)
    assert mixed_precision_dtypes(TrainingConfig(dtype="bfloat16")) == (None, fp32)  # bf16 weights, fp32 reduce


def test_default_mixed_precision_matches_per_rank_oracle(runs: dict[str, Any]) -> None:
    """torchtitan's default ``TrainingConfig`` (fp32 model, ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``): on every rank the dedicated matrices compute in bf16, their owners get fp32
    gradients and keep fp32 values, and training reproduces a bf16 oracle exactly.

    [Note: mixed-precision oracle] As in tests/test_mixed_precision.py, a bf16 forward depends on how the
    batch is split: the full-batch bf16 oracle lands ~5e-2 from this run in the weights after 6 steps (so
    does the fp32 one), so no loose bound against it would catch a real error. The oracle here is the
    ranks' computation written out in one process: each rank's slice through the bf16 model, the bf16
    gradients summed in fp32 (torchtitan's FSDP2 sums), torch.optim.Muon / AdamW on fp32 copies rounded
    into the model every step. Clipping is off: the norm's summation order differs from the oracle's in
    the last bits (measured 3e-7), and with every step clipped bf16 Newton–Schulz amplifies that to
    1.6e-2 in the weights; without it the weights agree bit for bit."""
    mixed = [r["mixed"] for r in runs["full"]]
    got = mixed[0]
    oracle = train_oracle(got["init"], split=WORLD, compute_dtype=torch.bfloat16, max_norm=NO_CLIP)
    for rank, r in enumerate(mixed):
        assert r["compute"] == [("torch.bfloat16", "torch.bfloat16")], (rank, r["compute"])  # (input, weight)
        assert r["owned"] and r["grad_dtypes"] == ["torch.float32"], (rank, r["owned"], r["grad_dtypes"])
        assert r["losses"] == got["losses"], rank
    dedicated = [fqn for r in mixed for fqn in r["owned"]]
    for state in (got["init"], got["final"]):  # fp32 values with bits below bf16: the owners' masters
        assert all(state[k].dtype == torch.float32 for k in dedicated)
        assert any(not torch.equal(state[k], state[k].to(torch.bfloat16).float()) for k in dedicated)
    for a, b in zip(got["losses"], oracle["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * b, (got["losses"], oracle["losses"])  # the oracle logs in float64
    for a, b in zip(got["norms"], oracle["norms"], strict=True):
        assert abs(a - b) <= 1e-5 * b, (got["norms"], oracle["norms"])
    for k, want in oracle["final"].items():
        assert torch.equal(got["final"][k], want), (k, _rel(got["final"][k], want))
    # as much progress as fp32 training (the same oracle without the bf16 cast; measured 2.6e-4 apart)
    fp32 = train_oracle(got["init"], split=WORLD, max_norm=NO_CLIP)
    assert got["losses"][-1] < got["losses"][0] - 0.1, got["losses"]
    for a, b in zip(got["losses"], fp32["losses"], strict=True):
        assert abs(a - b) <= 2e-3 * b, (got["losses"], fp32["losses"])


def test_restore_from_torchtitan_checkpoint_is_bitwise(runs: dict[str, Any]) -> None:
    for full, resumed in zip(runs["full"], runs["resumed"], strict=True):
        assert resumed["loaded_step"] == SAVE_AT
        assert resumed["losses"] == full["losses"][SAVE_AT:]
        assert resumed["norms"] == full["norms"][SAVE_AT:]
        for key, value in full["final"].items():
            assert torch.equal(resumed["final"][key], value), key
        # every group's settings came back (the fresh optimizer was built with the constructor's momentum)
        assert resumed["hyper"] == full["hyper"]
        assert [g["momentum"] for g in full["hyper"] if g["name"] == ATTENTION] == [EDITED_MOMENTUM]
        # the fresh run started elsewhere, so the load did the work
        assert any(not torch.equal(resumed["before_load"][k], v) for k, v in full["at_save"].items())


def test_corrupt_checkpoint_is_refused_with_nothing_changed(runs: dict[str, Any]) -> None:
    """Before the resumed run loads, copies of its checkpoint with one flipped byte in a Muon momentum, and torn,
    are refused on every rank with the model, optimizer, LR schedulers and train state unchanged."""
    for rank, r in enumerate(r["refused"] for r in runs["resumed"]):
        assert f"{r['flipped']}.momentum_buffer" in r["optim_byte"], (rank, r["optim_byte"])
        for name in ("optim_byte", "torn"):
            assert "checksums do not match" in r[name] and "nothing was changed" in r[name], (rank, r[name])
            assert not r[f"{name} changed"], f"rank {rank}: the refused {name} load changed {r[f'{name} changed']}"


def test_checkpoint_holds_each_dedicated_tensor_once_from_its_owner(runs: dict[str, Any]) -> None:
    """What torchtitan's checkpointer wrote: every dedicated tensor (and its Muon momentum) exactly once, in
    the owner's file, with the owner's values; in torchtitan's stock key layout (fused QKV as wq/wk/wv), so a
    plain single-process torchtitan model loads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _cpu_torchtitan()
    ckpt = Path(runs["root"]) / "checkpoint" / f"step-{SAVE_AT}"
    meta = FileSystemReader(str(ckpt)).read_metadata()
    owner_of = {fqn: rank for rank, r in enumerate(runs["full"]) for fqn in r["owned"]}
    assert len(owner_of) == 5 * N_LAYERS == sum(len(r["owned"]) for r in runs["full"])
    saved, optim = runs["full"][0]["at_save"], runs["full"][0]["optim_at_save"]
    converted = ckpt.parent / "converted.pt"
    dcp_to_torch_save(str(ckpt), str(converted))
    written = torch.load(converted, weights_only=False)

    def check_once(key: str, owner: int, shape: torch.Size) -> torch.Tensor:
        md = meta.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata) and tuple(md.size) == tuple(shape), key
        assert len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(shape), key
        files = {info.relative_path for idx, info in meta.storage_data.items() if idx.fqn == key}
        assert files == {f"__{owner}_0.distcp"}, (key, files, owner)  # written once, by the owner
        value = written["optimizer"][key[len("optimizer."):]] if key.startswith("optimizer.") else written[key]
        assert value.abs().sum() > 0, key  # real values, not an empty placeholder
        return value

    plain = tiny_llama3_config().build()  # stock torchtitan module, its own state-dict hooks intact
    model_keys = {k for k in meta.state_dict_metadata if k in plain.state_dict()}
    assert model_keys == set(plain.state_dict()), set(plain.state_dict()) ^ model_keys
    for fqn, owner in owner_of.items():
        momentum = optim["state"][fqn]["momentum_buffer"]
        assert torch.equal(check_once(f"optimizer.state.{fqn}.momentum_buffer", owner, momentum.shape), momentum)
        if fqn.endswith("qkv_linear.wqkv.weight"):
            prefix = fqn[: -len("wqkv.weight")]
            for w in ("wq", "wk", "wv"):
                check_once(f"{prefix}{w}.weight", owner, written[f"{prefix}{w}.weight"].shape)
        else:
            assert torch.equal(check_once(fqn, owner, saved[fqn].shape), saved[fqn])
    # the whole model loads into the plain module (its hooks merge wq/wk/wv) with the owners' values
    plain.load_state_dict({k: written[k] for k in model_keys})
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_example_script_runs_under_torchrun() -> None:
    proc = torchrun("examples/torchtitan_dmuon.py", "--steps", "4", timeout=300)
    assert "torchtitan_dmuon: OK loss" in proc.stdout, proc.stdout
