"""Checkpoint checksums ([Note: checkpoint checksums] in dmuon/checkpoint/checksum.py): exact, independent of
the sharding, changed by any byte; and set_*_state_dict refusing a file with one flipped byte and a torn DCP
save (data files of two saves) on every rank, while intact dicts, rank-0-only dicts and dicts without
checksums still load."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.checkpoint.checksum import CHECKSUM_ATTR, L, P, _words, checksum_part
from tests._dist import DEVICE_TYPE, device, run_distributed
from tests._training import GLOBAL_BATCH, KJ, batches, build_model, full_weights, projection_predicate

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool]


def _tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 250, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _reference(t: torch.Tensor, offset: int = 0) -> int:
    """The definition, in Python integers."""
    return sum(int(w) * (((offset + i) % L) + 1) for i, w in enumerate(_words(t).tolist())) % P


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_checksum_is_exact_and_independent_of_the_split(dtype):
    t = _tensor(dtype, 2 * L + 37)
    if dtype == torch.float32:  # the extreme words: no int64 overflow anywhere
        t.view(torch.int32)[:4] = torch.tensor([2**31 - 1, -(2**31), -1, 2**31 - 1], dtype=torch.int32)
    for offset in (0, 3, L - 1, L + 5):
        assert int(checksum_part(t, offset)) == _reference(t, offset), offset
    words = 1 if t.element_size() <= 4 else t.element_size() // 4
    cuts = [0, 1, 19, L + 2, 2 * L, t.numel()]
    parts = sum(int(checksum_part(t[a:b], a * words)) for a, b in zip(cuts, cuts[1:]))
    assert parts % P == int(checksum_part(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8], ids=str)
def test_every_changed_byte_changes_the_checksum(dtype):
    t = _tensor(dtype, 24)
    want = int(checksum_part(t))
    raw = t.view(torch.uint8)
    for i in range(raw.numel()):
        for mask in (0x01, 0x80, 0xFF, 0x5A):
            bad = raw.clone()
            bad[i] ^= mask
            assert int(checksum_part(bad.view(dtype))) != want, (i, mask)


# ---------------------------------------------------------------------- #
# set_*_state_dict                                                          #
# ---------------------------------------------------------------------- #
def _build(seed: int):
    mesh = init_device_mesh(DEVICE_TYPE, (2,))
    model = build_model(seed).to(device())
    dmuon.dedicate_params(model, mesh, projection_predicate)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, ns_coefficients=KJ, ns_backend="direct", adamw_lr=1e-3)
    rank, per = dist.get_rank(), GLOBAL_BATCH // 2
    tok, tgt = batches(1, seed=seed)[0]
    model(tok[rank * per:(rank + 1) * per].to(device()), tgt[rank * per:(rank + 1) * per].to(device())).loss.backward()
    opt.step()
    return model, opt


def _flip_in_file(path: str, t: torch.Tensor) -> None:
    """Flip one bit inside ``t``'s bytes where ``torch.save`` wrote them."""
    data = bytearray(open(path, "rb").read())
    raw = bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes must be findable once"
    data[at + len(raw) // 2] ^= 0x04
    open(path, "wb").write(data)


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "loaded"


def refusal_job(rank: int, world: int, root: str) -> dict:
    model, opt = _build(0)
    other, other_opt = _build(1)
    before = full_weights(other)
    ckpt = {"model": dmuon.get_model_state_dict(model), "optim": dmuon.get_optimizer_state_dict(model, opt)}
    out = {"attrs": all(hasattr(v, CHECKSUM_ATTR) for v in ckpt["model"].values())}
    path = os.path.join(root, "ckpt.pt")
    if rank == 0:
        torch.save(ckpt, path)
        shutil.copy(path, path + ".optim")
        _flip_in_file(path, ckpt["model"]["layers.1.mlp.down_proj.weight"])
        _flip_in_file(path + ".optim", ckpt["optim"]["state"]["tok_embeddings.weight"]["exp_avg_sq"])
    dist.barrier()
    flipped, flipped_optim = torch.load(path), torch.load(path + ".optim")
    out["model_flip"] = _outcome(lambda: dmuon.set_model_state_dict(other, flipped["model"]))
    out["model_flip_rank0"] = _outcome(lambda: dmuon.set_model_state_dict(other, flipped["model"] if rank == 0 else {}))
    out["optim_flip"] = _outcome(lambda: dmuon.set_optimizer_state_dict(other, other_opt, flipped_optim["optim"]))
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in full_weights(other).items())
    no_sums = {k: v.clone() for k, v in flipped["model"].items()}  # copies carry no checksum: not checked
    out["without_checksums"] = _outcome(lambda: dmuon.set_model_state_dict(other, no_sums))
    out["intact"] = _outcome(lambda: (dmuon.set_model_state_dict(other, ckpt["model"]),
                                      dmuon.set_optimizer_state_dict(other, other_opt, ckpt["optim"])))
    out["restored"] = all(torch.equal(v, full_weights(model)[k]) for k, v in full_weights(other).items())
    out["torn"] = _torn_dcp(model, opt, rank, root)
    return out


def _torn_dcp(model, opt, rank: int, root: str) -> dict:
    """Saves A and B (one step apart); T = A's metadata, rank 0's data file from B, rank 1's from A."""
    for name in ("A", "B"):
        dcp.save({"model": dmuon.get_model_state_dict(model, sharded=True),
                  "optim": dmuon.get_optimizer_state_dict(model, opt, sharded=True)},
                 checkpoint_id=os.path.join(root, name))
        opt.step()  # the gradients are still there: B's weights and momenta differ from A's
    if rank == 0:
        os.makedirs(os.path.join(root, "T"))
        shutil.copy(os.path.join(root, "A", ".metadata"), os.path.join(root, "T"))
        shutil.copy(os.path.join(root, "B", "__0_0.distcp"), os.path.join(root, "T"))
        shutil.copy(os.path.join(root, "A", "__1_0.distcp"), os.path.join(root, "T"))
    dist.barrier()
    out = {}
    for name in ("A", "T"):
        fresh, fresh_opt = _build(2)
        sd = {"model": dmuon.get_model_state_dict(fresh, sharded=True),
              "optim": dmuon.get_optimizer_state_dict(fresh, fresh_opt, sharded=True)}
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        out[name] = (_outcome(lambda: dmuon.set_model_state_dict(fresh, sd["model"])),
                     _outcome(lambda: dmuon.set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])))
    return out


def test_flipped_bytes_and_torn_saves_are_refused_on_every_rank():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(refusal_job, 2, root)
    for r in results:
        assert r["attrs"]
        for case, key in (("model_flip", "layers.1.mlp.down_proj.weight"),
                          ("model_flip_rank0", "layers.1.mlp.down_proj.weight"),
                          ("optim_flip", "tok_embeddings.weight.exp_avg_sq")):
            assert "checksums do not match" in r[case] and key in r[case], (case, r[case])
            assert "nothing was changed" in r[case] or "was not changed" in r[case], (case, r[case])
        assert r["unchanged"], "a refused dict changed the model"
        assert r["without_checksums"] == "loaded" and r["intact"] == "loaded" and r["restored"]
        assert r["torn"]["A"] == ("loaded", "loaded"), r["torn"]["A"]
        model_msg, optim_msg = r["torn"]["T"]
        assert "checksums do not match" in model_msg and "torn" in model_msg, model_msg
        assert "checksums do not match" in optim_msg, optim_msg


def shard_layouts_job(rank: int, world: int) -> dict:
    """Row shards, an empty row shard (1 row over 2 ranks) and a column shard (every rank gathers):
    each rank's parts add up to the full tensor's checksum, and no rank is left alone in a collective."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Shard

    from dmuon.checkpoint.checksum import dtensor_part

    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    out = {}
    for name, shape, dim in (("rows", (7, 5), 0), ("one_row", (1, 6), 0), ("columns", (4, 9), 1)):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(name))).to(device())
        part = dtensor_part(distribute_tensor(full, mesh, [Shard(dim)]))
        torch.distributed.all_reduce(part)
        out[name] = (int(part) % P, int(checksum_part(full)))
    return out


def test_shards_of_any_layout_add_up_to_the_full_checksum():
    for r in run_distributed(shard_layouts_job, 2):
        for name, (parts, whole) in r.items():
            assert parts == whole, name
