"""The mixed-precision tests' shared setup: the oracle, its rounding bounds, and the dmuon side's builder,
step and job (tests/test_mixed_precision.py, tests/test_mixed_precision_checkpoint.py).

[Note: the mixed-precision oracle] A bf16 forward is not invariant to how the batch is split (bf16 gradients
of two halves averaged are not the bf16 gradient of the whole), and Newton-Schulz turns such last-bit
differences into visibly different updates: a full-batch oracle differs from any 2-rank run by ~4e-2 in the
weights after 10 steps, as much as separates training with and without masters. So the oracle
here is the textbook data-parallel mixed-precision loop written out on one process: the same per-rank
batch halves, each rank's bf16 gradient taken to fp32 (summed there over micro-batches), averaged as
``(g0 + g1) / 2`` in fp32, ``torch.optim.Muon`` stepping fp32 copies that are rounded back into the bf16
model, ``torch.optim.AdamW`` on the other params, on the ranks' thread count. Nothing in it comes from dmuon,
except that the clipped run clips with the norm dmuon reported, once the test has checked that norm
against the oracle's own (test_clip_sees_the_fp32_gradients says why).

Each CPU's bf16 kernels round differently (oneDNN's AMX, AVX512-BF16 and AVX512 matmuls and ATen's
AVX2 fallback give step-0 gradient norms up to 6e-4 apart here), so the oracle is never compared with
numbers from another machine: it runs the ranks' kernels on the ranks' shapes in the same process
tree, which is what makes its bits the ranks' bits on any CPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dmuon
from dmuon.runtime.hooks import STATE_ATTR
from dmuon.tools.models import TinyLlama
from tests._dist import rank_threads
from tests._training import (
    CFG,
    GLOBAL_BATCH,
    KJ,
    batches,
    build_model,
    projection_predicate,
)

BF16, FP32 = torch.bfloat16, torch.float32
WORLD = 2
STEPS = 6
MUON = dict(lr=0.01, weight_decay=0.01, momentum=0.95, nesterov=True)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


@dataclass(frozen=True)
class MP:
    #: "bf16": a bf16 model (FSDP2 reduces its params' gradients in fp32); "fsdp_mp": an fp32 model under
    #: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), dedicated params with param_dtype=bf16
    recipe: str = "bf16"
    #: bf16 recipe: Muon(master_dtype=torch.float32)
    master: bool = True
    reduce_fp32: bool = True
    steps: int = STEPS
    #: micro-batches per step, all but the last under dmuon.no_sync
    accum: int = 1
    max_norm: float | None = None
    #: build on the meta device, materialise with to_empty() + init after fully_shard
    meta: bool = False


# --------------------------------------------------------------------------------------------------- #
# Oracle: one process, written from the definition (see the module note)                              #
# --------------------------------------------------------------------------------------------------- #
#: unit roundoff (round to nearest) of float32 (24-bit significand) and bfloat16 (8-bit significand)
U32, U16 = 2.0**-24, 2.0**-8


def _exact_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of these gradients' exact values (float64 squares of fp32/bf16 numbers: error ~1e-16)."""
    return sum(g.double().square().sum().item() for g in grads) ** 0.5


def fp32_norm_rtol(grads: list[torch.Tensor], world: int) -> float:
    """A bound on |n - exact| / exact for any fp32 norm n of ``grads`` computed as dmuon.clip_grad_norm_ does:
    torch.linalg.vector_norm of each gradient (or of each rank's shard of it), those norms squared and
    summed over the params and the ranks, the root taken.

    Every square x_i^2 reaches the sum through d_i rounded fp32 operations, each multiplying it by some
    (1 + e), |e| <= U32, so |computed sum - sum| <= sum_p S_p ((1 + U32)^d_p - 1) with S_p the gradient's
    exact squared norm. torch's CPU vector_norm of a contiguous fp32 tensor of m elements squares each
    element (1 rounding), adds it into one of L SIMD lanes (ceil(m / L) additions), folds the L lanes
    left to right (L - 1) and adds the < L leftover elements (L - 1): d <= ceil(m / L) + 2L. L is 8 with
    256-bit vectors (ATen's DEFAULT and AVX2 builds), 16 with AVX512, so L = 8 bounds any x86 CPU; m is
    the whole gradient (a shard is shorter). Then the root and the square of each norm (3), at most
    len(grads) additions on a rank and world - 1 in the all-reduce. The root halves the relative error
    e of the sum (sqrt(1 - e) >= 1 - e/2 - e^2/2) and rounds once more. The error is only dmuon's: the
    reference is _exact_norm. For the test model this is ~6.4e-5 (dmuon measured 4.5e-7..7.3e-7 from the
    exact norm, the same with oneDNN and ATen capped by ONEDNN_MAX_CPU_ISA=AVX512_CORE / AVX2 and
    ATEN_CPU_CAPABILITY=avx2 / default); dropping its smallest dedicated gradient would move the norm by
    4e-4. A constant 32768-vector, the worst input for one accumulator, errs by 1.2e-5 in vector_norm
    against the 1.2e-4 this gives it, with ATen's AVX512, AVX2 and DEFAULT kernels alike."""
    squares = [g.double().square().sum().item() for g in grads]
    depth = 16 + 3 + len(grads) + world - 1
    e = sum(s * ((1 + U32) ** (-(-g.numel() // 8) + depth) - 1) for g, s in zip(grads, squares)) / sum(squares)
    return e / 2 + e * e / 2 + 2 * U32


@rank_threads()
def oracle(opts: MP, world: int = WORLD, clip_norms: list[float] | None = None) -> dict:
    """``clip_norms``: the norms dmuon reported, one a step; the oracle clips with those instead of its own
    (see test_clip_sees_the_fp32_gradients), and records the exact norm of its gradients to check them by."""
    torch.manual_seed(0)
    compute = build_model().to(BF16)  # what every forward runs on
    params = dict(compute.named_parameters())
    proj = [n for n, p in params.items() if projection_predicate(n, p)]
    if opts.recipe == "fsdp_mp":
        values = {n: p.detach().clone() for n, p in build_model().named_parameters()}  # fp32 everything
    else:
        values = {n: (p.detach().float().clone() if n in proj and opts.master else p) for n, p in params.items()}
    om = torch.optim.Muon([values[n] for n in proj], ns_coefficients=KJ, **MUON)
    oa = torch.optim.AdamW([values[n] for n in params if n not in proj], **ADAMW)
    per = GLOBAL_BATCH // world
    micro = per // opts.accum
    losses, norms, bounds, after, after_bounds, bf16_shares = [], [], [], [], [], []
    for step, (tok, tgt) in enumerate(batches(opts.steps)):
        with torch.no_grad():
            for n, p in params.items():
                if values[n] is not p:
                    p.copy_(values[n])  # round the fp32 values into the bf16 compute model
        total = {n: torch.zeros(p.shape, dtype=FP32) for n, p in params.items()}
        step_loss = 0.0
        for r in range(world):
            local = {n: torch.zeros(p.shape, dtype=FP32) for n, p in params.items()}
            rank_loss = 0.0
            for i in range(opts.accum):
                lo = r * per + i * micro
                compute.zero_grad()
                loss = compute(tok[lo : lo + micro], tgt[lo : lo + micro]).loss / opts.accum
                loss.backward()
                rank_loss += loss.item()
                for n, p in params.items():
                    local[n] += p.grad.float()
            for n in params:
                total[n] += local[n]
            step_loss += rank_loss / world
        for n in params:
            values[n].grad = (total[n] / world).to(values[n].dtype)
        if opts.max_norm is not None:
            grads = [values[n].grad for n in params]
            norms.append(_exact_norm(grads))
            bounds.append(fp32_norm_rtol(grads, world))
            bf16_shares.append(sum(g.double().square().sum().item() for g in grads if g.dtype == BF16)
                               / norms[-1] ** 2)
            # torch.nn.utils.clip_grad_norm_'s formula in fp32, with dmuon's norm when given
            norm = (torch.tensor(clip_norms[step], dtype=FP32) if clip_norms is not None
                    else torch.stack([g.float().norm() for g in grads]).norm())
            coef = torch.clamp(opts.max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
            after.append(_exact_norm(grads))
            after_bounds.append(fp32_norm_rtol(grads, world))
        om.step()
        oa.step()
        losses.append(step_loss)
    # what the model holds: the bf16 params of a bf16 model (its masters are optimizer state), the fp32
    # values under param_dtype (as FSDP2 keeps its fp32 params)
    dtype = FP32 if opts.recipe == "fsdp_mp" else BF16
    weights = {n: values[n].detach().to(dtype, copy=True) for n in params}
    return {"losses": losses, "weights": weights, "norms": norms, "norm_rtols": bounds, "after_clip": after,
            "after_clip_rtols": after_bounds, "bf16_shares": bf16_shares}


# --------------------------------------------------------------------------------------------------- #
# dmuon side                                                                                           #
# --------------------------------------------------------------------------------------------------- #
def build(world: int, opts: MP, seed: int = 0, hsdp: bool = False):
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if opts.meta:
        with torch.device("meta"):
            model = TinyLlama(CFG)
    else:
        model = build_model(seed)
    fsdp_mp = opts.recipe == "fsdp_mp"
    if not fsdp_mp:
        model = model.to(BF16)
    dmuon.dedicate_params(model, mesh, projection_predicate, param_dtype=BF16 if fsdp_mp else None,
                          reduce_dtype=FP32 if opts.reduce_fp32 else None)
    policy = MixedPrecisionPolicy(param_dtype=BF16 if fsdp_mp else None, reduce_dtype=FP32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if opts.meta:  # the owners' masters come from these fp32 values when dmuon.Muon binds the params
        model.to_empty(device="cpu")
        model.init_weights(seed)
    opt = dmuon.Muon(model, ns_coefficients=KJ, ns_backend="direct", master_dtype=FP32 if opts.master else None,
                     adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                     adamw_weight_decay=ADAMW["weight_decay"], **MUON)
    return model, opt


def train_step(model, opt, opts: MP, rank: int, world: int, tok, tgt, record: dict | None = None) -> float:
    per = GLOBAL_BATCH // world
    micro = per // opts.accum
    opt.zero_grad()
    total = 0.0
    for i in range(opts.accum):
        lo = rank * per + i * micro
        with dmuon.no_sync(model) if i < opts.accum - 1 else nullcontext():
            loss = model(tok[lo : lo + micro], tgt[lo : lo + micro]).loss / opts.accum
            loss.backward()
        total += loss.item()
    if record is not None:
        record.setdefault("grad_dtypes", []).append(
            sorted({str(g.dtype) for g in dmuon.get_owned_grads(model).values() if g is not None}))
    if opts.max_norm is not None:
        record["norms"].append(dmuon.clip_grad_norm_(model, opts.max_norm).item())
        record["after_clip"].append(dmuon.clip_grad_norm_(model, 1e9).item())  # clips nothing, measures
    opt.step()
    logged = torch.tensor(total)
    dist.all_reduce(logged, op=dist.ReduceOp.AVG)
    return logged.item()


def masters_consistent(model, opt) -> bool:
    """Every owned master, rounded to the param's dtype, is exactly the param (what is broadcast)."""
    state = getattr(model, STATE_ATTR)
    ok = True
    for dp in state.dedicated():
        if dp.owner != state.rank():
            continue
        master = dp.master if dp.master is not None else opt.state[dp.param].get("master")
        ok &= master is not None and master.dtype == FP32 and torch.equal(master.to(dp.param.dtype), dp.param)
    return bool(ok)


def train_job(rank: int, world: int, runs: dict[str, MP]) -> dict:
    out = {}
    for name, opts in runs.items():
        model, opt = build(world, opts)
        record: dict = {"norms": [], "after_clip": []}
        losses = [train_step(model, opt, opts, rank, world, tok, tgt, record) for tok, tgt in batches(opts.steps)]
        state = getattr(model, STATE_ATTR)
        out[name] = {
            "losses": losses,
            "weights": dmuon.get_model_state_dict(model),
            "masters_consistent": masters_consistent(model, opt) if opts.master or opts.recipe == "fsdp_mp" else None,
            "momentum_dtypes": sorted({str(opt.state[dp.param]["momentum_buffer"].dtype)
                                       for dp in state.dedicated() if dp.owner == rank}),
            "owned": len([dp for dp in state.dedicated() if dp.owner == rank]),
            **record,
        }
    return out


def loss_gap(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


# The runs below reproduce their oracles bit for bit (every sum has the same operands in the same order on
# one machine: gloo's fp32 average of two ranks is (g0 + g1) / 2, FSDP2's pre-divided g0/2 + g1/2 is the
# same number), so the weights are compared exactly; losses differ only by the logging: both sides add the
# same fp32 micro-batch losses in Python floats, the oracle averages the ranks in float64 (~1e-16), dmuon
# rounds each rank's sum to fp32 and gloo adds them in fp32, at most `world` roundings of positive terms.
# Training with and without masters lands ~5e-3 apart after 6 steps (test_master_is_what_makes_the_difference).
def loss_rtol(world: int) -> float:
    return (1 + U32) ** world - 1 + 1e-15  # 1.2e-7 on 2 ranks (measured <= 5.6e-8), 2.4e-7 on 4 (6.6e-8)


LOSS_RTOL = loss_rtol(WORLD)

