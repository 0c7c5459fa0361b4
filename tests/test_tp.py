"""Tensor parallel x dmuon (issue 16, first runtime part): 4 gloo ranks as dp=2 x tp=2, clipped every step.

Each block's MLP is split with torch's own ``ColwiseParallel`` (``w1``, rows) / ``RowwiseParallel`` (``w2``,
columns) over "tp"; dmuon owns each matrix over "dp" (every tp rank of the owner's dp slot keeps its shard);
FSDP2 shards the norms, the embedding and the head over "dp". The oracle is one process with
``torch.optim.Muon`` + ``torch.optim.AdamW`` on the unsplit model and the same global batches. A run whose
Muon orthogonalises each shard by itself (the design the issue rules out) must miss the oracle.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests._asserts import WEIGHT_RTOL, assert_bitwise, assert_close_to, rel_err
from tests._dist import rank_threads, run_distributed
from tests._training import full_weights

VOCAB, DIM, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 96, 2, 16, 8
STEPS, DP, TP = 10, 2, 2
MAX_NORM = 0.5  # below the gradient norm of every step here: clipping acts in each
LR, WD, ADAMW_LR = 0.02, 0.01, 1e-3
KJ = (3.4445, -4.7750, 2.0315)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.emb(tok)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), tgt.flatten())


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    return name.endswith(("w1.weight", "w2.weight"))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    tok = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tok]


def _split_mlps(model: Net, tp_mesh) -> Net:
    """torch's own TP plan on every block: w1 rows (``ColwiseParallel``), w2 columns (``RowwiseParallel``)."""
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


def _tp_model(mesh, fsdp_mesh, model: Net | None = None, *, z3: bool = True, mp_policy=None, **dedicate) -> Net:
    """The recipe: TP split -> ``dedicate_params`` on ``mesh`` -> ``fully_shard`` per block and root on
    ``fsdp_mesh``."""
    model = _split_mlps(_net() if model is None else model, mesh["tp"])
    dmuon.dedicate_params(model, mesh, _is_matrix, reshard_after_forward=z3, **dedicate)
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy  # FSDP2's own default
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3, mp_policy=mp_policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3, mp_policy=mp_policy)
    return model


@rank_threads()
def oracle() -> dict:
    model = _net()
    named = dict(model.named_parameters())
    opt_m = torch.optim.Muon([p for n, p in named.items() if _is_matrix(n, p)], lr=LR, weight_decay=WD,
                             ns_coefficients=KJ)
    opt_a = torch.optim.AdamW([p for n, p in named.items() if not _is_matrix(n, p)], lr=ADAMW_LR)
    losses, norms = [], []
    for tok, tgt in _batches():
        for o in (opt_m, opt_a):
            o.zero_grad()
        loss = model(tok, tgt)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        for o in (opt_m, opt_a):
            o.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def tp_job(rank: int, world: int, *, z3: bool = True, per_shard_ns: bool = False, accum: int = 1,
           replicate: int = 1) -> dict:
    """``replicate > 1``: HSDP x TP on the 3-D mesh ("replicate", "shard", "tp")."""
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, DP, TP), mesh_dim_names=("replicate", "shard", "tp"))
        fsdp_mesh = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        fsdp_mesh = mesh["dp"]
    model = _tp_model(mesh, fsdp_mesh, z3=z3)
    opt = dmuon.Muon(model, lr=LR, weight_decay=WD, ns_coefficients=KJ, ns_backend="direct", adamw_lr=ADAMW_LR,
                     adamw_weight_decay=0.01)
    if per_shard_ns:  # the deliberately wrong variant: NS of each shard by itself, nothing exchanged over "tp"
        import dmuon.optim.tp_update as tp_update_module

        tp_update_module.muon_update_tp_ = _per_shard_update  # (every rule looks its update up at call time)
    coord = mesh.get_coordinate()
    dp_rank = coord[0] * DP + coord[1] if replicate > 1 else coord[0]
    per = BATCH // (DP * replicate)
    losses, norms = [], []
    dmuon.diagnostics.reset_comm_counts(model)
    for tok, tgt in _batches():
        opt.zero_grad()
        tok, tgt = tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per]
        m = per // accum
        loss = torch.zeros(())
        for i in range(accum):  # micro-batches 1..accum-1 under dmuon.no_sync, the last one reduces
            with dmuon.no_sync(model) if i < accum - 1 else contextlib.nullcontext():
                part = model(tok[i * m:(i + 1) * m], tgt[i * m:(i + 1) * m]) / accum
                part.backward()
            loss = loss + part.detach()
        norms.append(dmuon.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    counts = dmuon.diagnostics.comm_counts(model)
    summary = dmuon.diagnostics.summarize(model, optimizer=opt)
    return {"losses": losses, "norms": norms, "weights": full_weights(model), "counts": counts,
            "owned": sorted(dmuon.get_owned_params(model)), "summary": summary.as_dict(), "table": str(summary)}


def _per_shard_update(params, grads, bufs, hp, *, full_shape, **_) -> None:
    """What the issue rules out: each shard orthogonalised alone (the lr still the full matrix's)."""
    from dmuon.optim.update import _apply_update_, _orthogonalise, _stacked_updates
    from dmuon.runtime.blocks import Blocks

    for p, o in zip(params, _orthogonalise(_stacked_updates(grads, bufs, hp), hp).unbind(0)):
        _apply_update_(p, o, hp, Blocks.of(full_shape))


def tp_jobs(rank: int, world: int) -> dict:
    import dmuon.optim.tp_update as tp_update_module

    out = {"z3": tp_job(rank, world), "z2": tp_job(rank, world, z3=False), "accum": tp_job(rank, world, accum=2)}
    real = tp_update_module.muon_update_tp_
    try:
        out["per_shard"] = tp_job(rank, world, per_shard_ns=True)
    finally:
        tp_update_module.muon_update_tp_ = real  # the wrong variant's patch must not outlive its run
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(tp_jobs, DP * TP)


def test_tp_matches_the_single_process_oracle(runs):
    ref = oracle()
    assert_close_to(runs[0]["z3"], ref, "dp=2 x tp=2, Z3")
    # the clip norm is the whole model's: dedicated TP shards summed over tp, FSDP2 / plain ones once
    assert ref["norms"][0] > MAX_NORM
    for got, want in zip(runs[0]["z3"]["norms"], ref["norms"]):
        assert abs(got - want) <= 1e-4 * want, (runs[0]["z3"]["norms"], ref["norms"])
    # the matrices moved far beyond the parity bound (random tokens: the loss itself has little to learn)
    init = _net().state_dict()
    for name in ("layers.0.w1.weight", "layers.1.w2.weight"):
        assert rel_err(runs[0]["z3"]["weights"][name], init[name]) > 10 * WEIGHT_RTOL, name


def test_no_sync_accumulation_matches_the_oracle(runs):
    """Two micro-batches per step, the first under dmuon.no_sync: each TP shard's gradient is reduced once."""
    assert_close_to(runs[0]["accum"], oracle(), "dp=2 x tp=2, 2 micro-batches")


def test_per_shard_orthogonalisation_misses_the_oracle(runs):
    ref = oracle()
    with pytest.raises(AssertionError):
        assert_close_to(runs[0]["per_shard"], ref, "per-shard NS")


def test_z2_equals_z3_and_every_rank_agrees(runs):
    for rank, res in enumerate(runs):
        assert_bitwise(res["z2"], res["z3"], f"rank {rank} Z2 vs Z3")
        assert_bitwise(res["z3"], runs[0]["z3"], f"rank {rank} vs rank 0")


def test_each_shard_crosses_tp_once_each_way(runs):
    """[Note: TP update]: per step and shape group, one all-to-all over "tp" brings each matrix's shards to
    the tp rank that runs its NS, one takes the result back. At tp=2 a rank sends the shards of the other
    rank's matrices out and, of its own matrices' results, the other rank's shards: one shard per owned
    matrix in all (w1 and w2 shards both DIM x HIDDEN / 2); ranks owning nothing send nothing."""
    for res in runs:
        owned, tp = res["z3"]["owned"], res["z3"]["counts"].get("tp_exchange", {"elements": 0, "calls": 0})
        assert tp["elements"] == STEPS * len(owned) * DIM * HIDDEN // TP, (owned, tp)
        groups = len({name.rsplit(".", 2)[-2] for name in owned})  # w1 and w2: one shape group each
        assert tp["calls"] == STEPS * 2 * groups, (owned, tp)


def test_diagnostics_count_the_tp_bytes_and_deal_the_ns(runs):
    """``summarize`` knows what a step sends over "tp" and which full matrices each tp rank orthogonalises:
    the two tp ranks of an owner slot split its NS flops evenly here (2 matrices of each shape per slot)."""
    from dmuon.partition import ns_cost

    rows = runs[0]["z3"]["summary"]["ranks"]
    assert [r["rank"] for r in rows] == list(range(DP * TP))  # every tp index's rows, not one dp row's
    for res, row in zip(runs, rows):
        assert res["z3"]["counts"]["tp_exchange"]["elements"] == STEPS * row["expected"]["tp_exchange"], row
        assert all(tuple(g["shape"][1:]) in ((HIDDEN, DIM), (DIM, HIDDEN)) for g in row["ns_backends"]), row
    slot_flops = {}
    for row in rows:
        slot_flops.setdefault(row["slot"], []).append(row["ns_flops"])
    for slot, flops in slot_flops.items():
        owners = [r for r in rows if r["slot"] == slot][0]["owned"]
        assert sum(flops) == pytest.approx(sum(ns_cost(tuple(s)) for s in [(HIDDEN, DIM), (DIM, HIDDEN)]) * len(owners) / 2)
        assert flops[0] == pytest.approx(flops[1])
    assert "tp_exchange expected/measured" in runs[0]["z3"]["table"]


def hsdp_tp_job(rank: int, world: int) -> dict:
    return tp_job(rank, world, replicate=2)


def test_hsdp_x_tp_matches_the_oracle_on_8_ranks():
    """replicate=2 x shard=2 x tp=2: owners over the 4 data-parallel ranks of each tp index, their shard
    columns keep copies, the update is published over "replicate"; FSDP2 is HSDP over ("replicate", "shard").
    Z3 only: Z2 = Z3 is the 4-rank runs' check, and 8 processes on 2 CPU cores cost ~20 s a run."""
    runs = run_distributed(hsdp_tp_job, 2 * DP * TP)
    ref = oracle()
    assert_close_to(runs[0], ref, "HSDP 2 x 2 x tp 2, Z3")
    for got, want in zip(runs[0]["norms"], ref["norms"]):  # the clip norm counts each shard and copy once
        assert abs(got - want) <= 1e-4 * want, (runs[0]["norms"], ref["norms"])
    for rank, res in enumerate(runs):
        assert_bitwise(res, runs[0], f"rank {rank} vs rank 0")
        assert res["counts"]["replicate_publish"]["elements"] > 0 or not res["owned"], res["counts"]


def tp_master_job(rank: int, world: int) -> dict:
    """dp=2 x tp=2 in both mixed-precision forms: a bf16 model with fp32 masters of the owned shards
    (``master_dtype``), and an fp32 model computing in bf16 (``param_dtype``, FSDP2's MixedPrecisionPolicy
    alike); the reduce in fp32 in both."""
    from dmuon.runtime.hooks import get_state
    from dmuon.runtime.param import local

    out = {}
    for form in ("master_dtype", "param_dtype"):
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        pd = torch.bfloat16 if form == "param_dtype" else None
        model = _tp_model(mesh, mesh["dp"], _net().bfloat16() if form == "master_dtype" else None,
                          mp_policy=MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=torch.float32),
                          param_dtype=pd, reduce_dtype=torch.float32)
        opt = dmuon.Muon(model, lr=LR, weight_decay=WD, ns_coefficients=KJ, adamw_lr=ADAMW_LR,
                         master_dtype=torch.float32 if form == "master_dtype" else None)
        dp_rank, per = mesh.get_coordinate()[0], BATCH // DP
        losses = []
        for tok, tgt in _batches()[:4]:
            opt.zero_grad()
            loss = model(tok[dp_rank * per:(dp_rank + 1) * per], tgt[dp_rank * per:(dp_rank + 1) * per])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        named = dict(model.named_parameters())
        dps = {dp.fqn: dp for dp in get_state(model).dedicated()}
        res = {"losses": losses, "masters": {}}
        for name in dmuon.get_owned_params(model):
            p, st = named[name], opt.state[named[name]]
            master = st["master"] if form == "master_dtype" else dps[name].master
            res["masters"][name] = {"master": master.clone(), "shard": local(p).detach().clone(),
                                    "momentum": st["momentum_buffer"].dtype, "param": (type(p).__name__, p.dtype)}
        out[form] = res
    return out


def test_tp_shards_keep_fp32_masters_in_both_mixed_precision_forms():
    """Each owner tp rank keeps an fp32 master of its bf16 shard (optimizer state under ``master_dtype``, the
    param's own value under ``param_dtype``); the bf16 shard is that master rounded, and the master holds the
    bits bf16 drops (the updates accumulate there, not in the bf16 shard)."""
    for res in run_distributed(tp_master_job, DP * TP):
        for form, r in res.items():
            assert r["masters"] and all(math.isfinite(v) for v in r["losses"]), (form, r)
            for name, m in r["masters"].items():
                master, shard = m["master"], m["shard"]
                assert m["param"] == ("DTensor", torch.bfloat16), (form, name, m["param"])
                assert master.dtype == torch.float32 and m["momentum"] == torch.float32, (form, name)
                assert master.shape == shard.shape, (form, name, master.shape)  # the shard's, not the matrix's
                assert torch.equal(master.to(torch.bfloat16), shard), (form, name)
                # a master made from a bf16 value equals it until updates add bits bf16 drops
                assert (master - shard.float()).abs().max() > 0, (form, name)


def tp_guard_job(rank: int, world: int) -> dict:
    """After a step (Z3): what reading a tensor-parallel matrix does on a rank of the other dp slot."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = _tp_model(mesh, mesh["dp"])
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR)
    tok, tgt = _batches()[0]
    model(tok, tgt).backward()
    opt.step()
    owned = set(dmuon.get_owned_params(model))
    name = next(n for n in dmuon.get_dedicated_params(model) if n not in owned)
    w = dict(model.named_parameters())[name]
    out = {"name": name, "meta": (tuple(w.shape), w.dtype, str(w.placements), isinstance(w, nn.Parameter)),
           "repr": repr(w)}
    for op, fn in {"sum": lambda: w.sum(), "full_tensor": lambda: w.full_tensor(), "to_local": lambda: w.to_local(),
                   "matmul": lambda: torch.randn(3, DIM) @ w.mT if w.shape[1] == DIM else w @ torch.randn(HIDDEN, 3)
                   }.items():
        try:
            fn()
            out[op] = None
        except dmuon.NotHeldError as e:
            out[op] = str(e)
    model(tok, tgt).backward()  # and training goes on: the class comes back for the forward
    opt.step()
    return out


def test_reading_an_unheld_tp_matrix_raises_instead_of_reading_freed_memory():
    """A rank of the other dp slot holds no bytes of the matrix between steps; its DTensor refuses value
    reads with NotHeldError (metadata and repr still work), as plain dedicated params do."""
    for res in run_distributed(tp_guard_job, DP * TP):
        shape, dtype, placements, is_param = res["meta"]
        assert is_param and dtype == torch.float32 and placements in ("(Shard(dim=0),)", "(Shard(dim=1),)"), res
        assert res["name"] in res["repr"] and "not by this rank" in res["repr"], res["repr"]
        for op in ("sum", "full_tensor", "to_local", "matmul"):
            assert res[op] is not None and res["name"] in res[op] and "does not hold" in res[op], (op, res)


def tp_misuse_job(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    out = {}
    for case, kwargs in {"one_d_mesh": {"mesh": init_device_mesh("cpu", (world,))},
                         "replicated": {"mesh": mesh}}.items():
        model = _split_mlps(_net(), mesh["tp"])
        if case == "replicated":  # a DTensor over "tp" that is not split: not a TP matrix dmuon can own
            w = model.layers[0].w1.weight
            model.layers[0].w1.weight = nn.Parameter(distribute_tensor(w.full_tensor().detach(), mesh["tp"], [Replicate()]))
        try:
            dmuon.dedicate_params(model, predicate=_is_matrix, **kwargs)
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


def test_tp_weights_need_the_dp_tp_mesh_and_a_row_or_column_split():
    for res in run_distributed(tp_misuse_job, 2):
        assert "is a DTensor" in res["one_d_mesh"] and "('dp', 'tp')" in res["one_d_mesh"], res
        assert "placed (Replicate(),)" in res["replicated"] and "ColwiseParallel" in res["replicated"], res
