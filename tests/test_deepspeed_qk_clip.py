"""QK-clip under DeepSpeed ZeRO-2 (issue 31): ``engine.step()`` runs ``dmuon.Muon.apply_update``, the update
``Muon.step`` runs, so the clip applies as it does under FSDP2. Ten steps of ``tests/test_qk_clip.py``'s model (query
head 0 of every layer far above tau) on 2 gloo ranks match that file's single process, which trains with torch's
Muon and AdamW and clips by hand; the same run with the clip skipped (what the engine did before) misses it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from tests._asserts import assert_close_to, worst_weight
from tests._deepspeed import config, setup
from tests._dist import run_distributed
from tests._training import full_weights, muon_kwargs, projection_predicate
from tests.test_qk_clip import ALPHA, QCFG, STEPS, TAU, _batch, _model, hand_clipped_oracle

pytest.importorskip("deepspeed")

#: the skipped clip's distance from the oracle, measured: weights 1.7 (q_proj); the parity bound (WEIGHT_RTOL) is 5e-3
MISS = 1e-2


def train_job(rank: int, world: int, skip_clip: bool) -> dict:
    import deepspeed

    setup(rank)
    torch.manual_seed(0)
    model = _model()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), projection_predicate, verbose=False)
    opt = dmuon.Muon(model, **muon_kwargs(), qk_clip=dmuon.QKClip(tau=TAU, alpha=ALPHA))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(world, stage=2, accum=1))
    if skip_clip:
        opt.qk_clip = None  # the update without the clip, as DeepSpeed's step ran it before issue 31
    losses, clipped = [], []
    for step in range(STEPS):
        tok, tgt = _batch(rank, world, step)
        loss = engine(tok, tgt).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        clipped.append(None if skip_clip else opt.qk_clip.stats.clipped_heads)
    return {"losses": losses, "weights": full_weights(model), "clipped": clipped}


def test_zero2_clips_like_the_hand_clipped_single_process_run():
    ref = hand_clipped_oracle()
    clipped = run_distributed(train_job, 2, False)
    for r in clipped:
        assert_close_to(r, ref, "DeepSpeed ZeRO-2, 2 ranks, QK-clip every step")
    assert clipped[0]["clipped"][0] == QCFG.n_layers  # it did clip, every layer's head 0 at the first step
    skipped = run_distributed(train_job, 2, True)[0]
    weights, key = worst_weight(skipped["weights"], ref["weights"])
    print(f"clip skipped: weights {weights:.1e} ({key})")
    assert weights > MISS, (weights, key)
