"""docs/guides/torchtitan.md as a program, runnable as is.

    torchrun --nproc_per_node 2 examples/torchtitan_dmuon.py            # FSDP over 2 ranks
    torchrun --nproc_per_node 2 examples/torchtitan_dmuon.py --tp 2     # tensor parallel, dp=1 x tp=2
    torchrun --nproc_per_node 4 examples/torchtitan_dmuon.py --tp 2     # dp=2 x tp=2
    torchrun --nproc_per_node 2 examples/torchtitan_dmuon.py --moe --ep 2  # qwen3 MoE, expert parallel
    torchrun --nproc_per_node 2 examples/torchtitan_dmuon.py --pp 2     # pipeline, 2 stages (1F1B)
    torchrun --nproc_per_node 2 examples/torchtitan_dmuon.py --moe --pp 2  # qwen3 MoE, 2 stages
    torchrun --nproc_per_node 4 examples/torchtitan_dmuon.py --pp 2 --pp-schedule Interleaved1F1B  # pp=2 x dp=2,
                                                                        # 2 stages per rank

torchtitan's debug Llama 3 (``llama3_configs["debugmodel"]``: fused QKV, complex RoPE), or with ``--moe`` its
debug qwen3 MoE (``qwen3_configs["debugmodel_moe"]``: 64 experts, top-8 routing, fused QKV with qk-norm),
goes through torchtitan's own components, wired the way its Trainer wires them, with dmuon plugged in at
three points:

1. ``with_dmuon(parallelize_llama)``: dmuon dedicates the blocks' matrices, then torchtitan's FSDP2 path
   (``apply_fsdp_to_decoder`` -> ``fully_shard``) shards everything else; with ``--tp N``
   (``parallelism.tensor_parallel_degree``) torchtitan's own TP plan splits the model first and dmuon
   dedicates the TP-sharded matrices right after it (owners over the data-parallel ranks); with ``--ep N``
   (``parallelism.expert_parallel_degree``, with ``--moe``) torchtitan places the experts over N ranks and
   dmuon runs Muon on each rank's experts where they are (the fused ``wqkv`` always as its q, k and v); with
   ``--pp N`` (``parallelism.pipeline_parallel_degree``) torchtitan's ``pipeline_llm`` splits the model into
   stages and runs the wrapped parallelize on each of this rank's model parts, so dmuon dedicates each part
   over its stage's data-parallel ranks;
2. ``DMuonOptimizersContainer.Config(...)`` where torchtitan builds its optimizers (Muon on the owned
   matrices, AdamW for the rest; one ``dmuon.Muon`` per model part), driven by torchtitan's
   ``LRSchedulersContainer``;
3. ``DMuonCheckpointManager.Config(...)`` where torchtitan builds its DCP checkpointer.

The loop is ``Trainer.train_step``'s: loss summed per rank and divided by the global token count, backward,
``torchtitan.distributed.utils.clip_grad_norm_`` (made dmuon-aware by the container; one norm over every
stage), step. Under ``--pp`` the schedule runs the forward and backward of the microbatches, given the whole
local batch as torch's ``schedule.step(tokens, target=..., losses=..., loss_kwargs=...)`` takes it: torchtitan
0.3.0's own ``Trainer.forward_backward_step`` passes ``arg_mbs=`` / ``kwarg_mbs=`` / ``target_mbs=`` to
``schedule.step``, which torch 2.13's schedules do not take (the model gets them as keywords:
``Decoder.forward() got an unexpected keyword argument 'arg_mbs'``), with or without dmuon. With ``--resume``
the last step runs twice: once in the loop, then again after ``checkpointer.load`` restored the step before
it (model parts, optimizers, LR schedule), and the two losses must agree bit for bit (also with several
stages per rank, ``--pp-schedule Interleaved1F1B`` / ``LoopedBFS``). With torchtitan's
``Trainer`` itself, set ``model_spec=dmuon_model_spec(...)`` and the two configs above instead (see the
docstring of ``dmuon.integrations.torchtitan``).

Runs on CUDA (NCCL) when available, otherwise CPU (gloo); only the CPU path has been run. Attention is
causal SDPA instead of torchtitan's default flex attention (which has no CPU backward). CPU workarounds:
torchtitan's device type is set to "cpu" (it assumes CUDA when no accelerator is visible); by default only
2 of the 6 layers are built (1 of the MoE's 8; Newton–Schulz runs in bf16, slow on CPU, and the MoE layer has
192 expert matrices) and the model computes in fp32 instead
of torchtitan's default bf16 (bf16 matmuls are slow on CPU too; ``--mixed-precision-param bfloat16`` turns
it on). The checkpoint goes to a temporary folder unless ``--out`` is given. Exits non-zero if the loss did
not fall by the margin its last line states (``dmuon.tools.verdict``).

With ``--tp 2`` torch logs, once per rank, "While redistributing from (_StridedShard(dim=0, sf=2),
Shard(dim=0)) to (Replicate(), Replicate()), 2 sequential all_gather operations will be performed. This is
suboptimal: ... may give inconsistent results between ranks due to different reduction orders". It comes
from the checksums of dmuon's sharded state dict (``DMuonCheckpointManager``), which gather each FSDP2 x TP
parameter (the embedding, the output layer) whole with ``DTensor.full_tensor()``. A gather copies bytes and
adds nothing, so no reduction order is involved and every rank gets the same bits (the TP resume in
``tests/test_torchtitan_tp.py`` is bit-identical); the warning is about the cost of two gathers where one
would do.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

try:
    import dmuon
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import dmuon
from dmuon.tools.launch import main_or_spawn
from dmuon.tools.verdict import loss_fell

try:
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    from torchtitan.models.qwen3 import parallelize_qwen3, qwen3_configs
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
except ImportError as e:
    sys.exit(f"torchtitan_dmuon: needs the [torchtitan] extra (torchtitan 0.3.0, triton): "
             f"pip install torch==2.13.0 -e \".[torchtitan]\" (missing: {(e.name or str(e)).split('.')[0]})")

from dmuon.integrations.torchtitan import DMuonCheckpointManager, DMuonOptimizersContainer, with_dmuon

BATCH_PER_RANK = 4
SEQ_LEN = 64
#: the data uses only the first TOKENS ids of the model's 2048: a successor map over all 2048 is more than
#: a few hundred tokens per step can teach in 8 steps (the loss stayed near ln 2048 = 7.62, the uniform guess)
TOKENS = 64


def markov_batch(step: int, global_batch: int, vocab: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences over ``vocab`` ids following a fixed random successor map 90% of the time: quick to
    learn, and the same global batch on every rank for a given step (each rank then takes its slice)."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(step)
    tok = torch.empty(global_batch, SEQ_LEN + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, vocab, (global_batch,), generator=gen)
    noise = torch.randint(0, vocab, (global_batch, SEQ_LEN), generator=gen)
    keep = torch.rand(global_batch, SEQ_LEN, generator=gen) < 0.9
    for i in range(SEQ_LEN):
        tok[:, i + 1] = torch.where(keep[:, i], successor[tok[:, i]], noise[:, i])
    return tok[:, :-1], tok[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read before any rank starts (``main_or_spawn``): ``--help`` and a wrong argument end here, once."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the debug model (default: all 6 on CUDA, 2 on CPU)")
    parser.add_argument("--mixed-precision-param", choices=("bfloat16", "float32"), default=None,
                        help="torchtitan's training.mixed_precision_param (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--tp", type=int, default=1, help="parallelism.tensor_parallel_degree (divides the ranks)")
    parser.add_argument("--moe", action="store_true", help="qwen3's debugmodel_moe instead of the debug Llama 3")
    parser.add_argument("--ep", type=int, default=1, help="parallelism.expert_parallel_degree (with --moe)")
    parser.add_argument("--pp", type=int, default=1, help="parallelism.pipeline_parallel_degree (divides the ranks)")
    parser.add_argument("--pp-schedule", default="1F1B", choices=("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"),
                        help="parallelism.pipeline_parallel_schedule (default 1F1B; the last two: 2 stages per rank)")
    parser.add_argument("--resume", action="store_true", help="after the run, restore the checkpoint of the step "
                        "before the last and run the last step again: its loss must equal the first run's bit for bit")
    parser.add_argument("--out", default=None, help="keep the checkpoint in this folder (default: a temporary "
                        "folder, removed at exit)")
    args = parser.parse_args(argv)
    if args.ep > 1 and not args.moe:
        parser.error("--ep needs --moe (the debug Llama 3 has no experts)")
    if args.pp > 1 and (args.tp > 1 or args.ep > 1):
        parser.error("--pp runs with FSDP inside each stage only (no --tp, --ep)")
    return args


def stage_modules(n_stages: int, n_layers: int) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: the layers split evenly over the stages, the embeddings on
    the first, the norm and head on the last. Every stage holds a layer: one without a matrix for Muon is
    refused by dmuon (torchtitan's own split can leave the norm and head alone on the last stage)."""
    if n_layers < n_stages:
        raise SystemExit(f"torchtitan_dmuon: {n_stages} pipeline stages need at least {n_stages} layers (--layers)")
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    out = [[f"layers.{j}" for j in range(bounds[i], bounds[i + 1])] for i in range(n_stages)]
    out[0].insert(0, "tok_embeddings")
    out[-1] += ["norm", "lm_head"]
    return out


def main(args: argparse.Namespace) -> int:

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        tt_parallel_dims.device_type = tt_utils.device_type = "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    tt_dist_utils.set_spmd_backend("partial_dtensor")

    # torchtitan: meshes and the debug model, built on the meta device
    # "partial_dtensor": dmuon keeps some params whole, the other backends want every param a DTensor
    multi = args.pp_schedule in ("Interleaved1F1B", "LoopedBFS")  # two stages per rank
    n_stages = args.pp * (2 if multi else 1)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=args.tp,
                                    expert_parallel_degree=args.ep, pipeline_parallel_degree=args.pp,
                                    pipeline_parallel_schedule=args.pp_schedule,
                                    pipeline_parallel_microbatch_size=BATCH_PER_RANK // 2)  # 2 microbatches
    # torchtitan's mixed precision (fp32 weights, bf16 compute, fp32 gradient reduce) covers the dedicated
    # matrices too (tensor-parallel ones included); on CPU the default is fp32 compute, since bf16 matmuls
    # are slow there
    mp_param = args.mixed_precision_param or ("bfloat16" if use_cuda else "float32")
    training = TrainingConfig(mixed_precision_param=mp_param, disable_cuda_graphs=True, steps=args.steps)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    configs, parallelize_fn = (qwen3_configs, parallelize_qwen3) if args.moe else (llama3_configs, parallelize_llama)
    model_config = configs["debugmodel_moe" if args.moe else "debugmodel"](attn_backend="flex")
    n_layers = args.layers if args.layers is not None else (len(model_config.layers) if use_cuda else
                                                            max(1 if args.moe else 2, n_stages))
    model_config.layers = model_config.layers[:n_layers]
    for layer in model_config.layers:  # causal SDPA: runs on CPU too (flex attention has no CPU backward)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # what the Trainer's model_config.update_from_config does: the TP / EP plan (used only when tp or ep > 1)
    if args.moe:
        set_qwen3_sharding_config(model_config, enable_sp=parallelism.enable_sequence_parallel,
                                  enable_ep=args.ep > 1)
    else:
        set_llama3_sharding_config(model_config, enable_sp=parallelism.enable_sequence_parallel)
    dp_mesh = parallel_dims.get_mesh("fsdp")  # this rank's data-parallel group (its tp ranks share the batch)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = CrossEntropyLoss.Config().build(compile_config=None)

    # 1. dmuon dedicates the matrices, then torchtitan's own parallelize (FSDP2) shards the rest; under
    # pipeline parallelism torchtitan's pipeline_llm splits the model first and runs both on each model part
    parallelize = dict(parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                       compile_config=CompileConfig(), ac_config=None, dump_folder="outputs")
    schedule, first, last = None, True, True
    if args.pp > 1:
        parallelism.module_fqns_per_model_part = stage_modules(n_stages, n_layers)
        schedule, parts, first, last = pipeline_llm(model, **parallelize, device=device, model_config=model_config,
                                                    parallelize_fn=with_dmuon(parallelize_fn), loss_fn=loss_fn)
    else:
        parts = [with_dmuon(parallelize_fn)(model, **parallelize)]
    torch.manual_seed(0)
    for part in parts:
        part.to_empty(device=device)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    model = parts[0]

    # 2. optimizers and LR schedule where torchtitan builds them
    optimizers = DMuonOptimizersContainer.Config(lr=0.02, adamw_lr=3e-3).build(model_parts=parts)
    if args.moe:  # the qwen3 spec's post_optimizer_build_fn: MoE load balancing before each step
        register_moe_load_balancing_hook(optimizers, parts, parallel_dims)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                       training_steps=args.steps)
    # 3. torchtitan's DCP checkpointer, saving through dmuon
    holder = [args.out or (tempfile.mkdtemp(prefix="torchtitan_dmuon_") if rank == 0 else None)]
    dist.broadcast_object_list(holder, src=0)  # one folder for all ranks
    base_folder = holder[0]
    checkpointer = DMuonCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=max(1, args.steps - 1) if args.resume else args.steps,
        last_save_model_only=False,
        keep_latest_k=0, initial_load_model_only=False,
    ).build(dataloader=None, model_parts=parts, optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={}, sd_adapter=None, base_folder=base_folder)
    if rank == 0:
        dedicated = [n for part in parts for n in dmuon.get_dedicated_params(part)]
        experts = [n for n, p in model.named_parameters() if p.ndim == 3]
        print(f"torchtitan_dmuon: {len(dedicated)} dedicated matrices over {dp} data-parallel x {args.tp} "
              f"tensor-parallel ranks, {sum(len(dmuon.get_owned_params(p)) for p in parts)} on rank 0"
              + (f"; {len(experts)} expert weights over {args.ep} expert-parallel ranks" if args.moe else "")
              + (f"; {len(parts)} model parts of {n_stages} stages on rank 0" if schedule else ""),
              flush=True)

    def train_step(step: int) -> tuple[float, torch.Tensor]:
        tok, tgt = markov_batch(step, BATCH_PER_RANK * dp)
        tok = tok[dp_rank * BATCH_PER_RANK : (dp_rank + 1) * BATCH_PER_RANK].to(device)
        tgt = tgt[dp_rank * BATCH_PER_RANK : (dp_rank + 1) * BATCH_PER_RANK].to(device)
        global_valid_tokens = torch.tensor(tgt.numel() * dp, device=device)
        optimizers.zero_grad()
        if schedule is None:
            loss, _ = loss_fn(model(tok), tgt, global_valid_tokens)  # local sum / global token count
            loss.backward()
        else:  # the microbatches' forwards and backwards; each loss: its sum / the global token count
            mb_losses: list[torch.Tensor] = []
            schedule.step(*((tok,) if first else ()), target=tgt if last else None, losses=mb_losses if last else None,
                          loss_kwargs={"global_valid_tokens": global_valid_tokens}, return_outputs=False)
            loss = torch.stack(mb_losses).sum() if last else torch.zeros((), device=device)
        grad_norm = tt_dist_utils.clip_grad_norm_([p for part in parts for p in part.parameters()], max_norm=1.0,
                                                  foreach=True, pp_mesh=parallel_dims.get_optional_mesh("pp"),
                                                  ep_enabled=parallel_dims.ep_enabled)
        optimizers.step()
        lr_schedulers.step()
        logged = loss.detach().clone()
        # the dp ranks' parts add up to the global mean (under pp: the last stage's; the others add 0)
        dist.all_reduce(logged, group=None if schedule is not None else dp_mesh.get_group())
        return logged.item(), grad_norm

    losses: list[float] = []
    for step in range(1, args.steps + 1):
        loss_value, grad_norm = train_step(step)
        checkpointer.save(step, last_step=step == args.steps)
        losses.append(loss_value)
        if rank == 0:
            print(f"step {step:>2}/{args.steps}  loss {losses[-1]:.4f}  grad_norm {grad_norm.item():.4f}", flush=True)

    ok, text = loss_fell(losses, by=0.1)  # on 2 CPU ranks: -16% after 4 steps, -42% after 8
    if args.resume and args.steps > 1:  # the step before the last, restored through torchtitan's checkpointer
        checkpointer.load(step=args.steps - 1)
        again, _ = train_step(args.steps)
        same = again == losses[-1]
        ok = ok and same
        if rank == 0:
            print(f"torchtitan_dmuon: resumed step {args.steps - 1}, step {args.steps} loss {again!r} "
                  f"{'equals' if same else 'differs from'} the uninterrupted {losses[-1]!r}", flush=True)
    checkpointer.close()
    dist.barrier()
    if rank == 0:
        ckpt = os.path.join(base_folder, "checkpoint", f"step-{args.steps}")
        print(f"torchtitan_dmuon: saved {ckpt} ({len(os.listdir(ckpt))} files)"
              + ("" if args.out else "; pass --out DIR to keep it"), flush=True)
    if rank == 0 and not args.out:
        shutil.rmtree(base_folder, ignore_errors=True)
    if rank == 0:
        print(f"torchtitan_dmuon: {'OK' if ok else 'FAILED'} {text}", flush=True)
    # Free the FSDP2 modules first: they keep the process group alive past destroy_process_group(), where a
    # gloo worker still finishing the barrier above can meet the interpreter's exit (SIGABRT on
    # torch 2.13, with or without dmuon; dmuon frees its own groups itself: docs/troubleshooting.md).
    del model, parts, schedule, optimizers, lr_schedulers, checkpointer
    gc.collect()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_spawn(main, parse_args=parse_args))  # plain `python` starts 2 local ranks itself
