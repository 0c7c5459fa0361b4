"""CUDA-graph replay of Newton–Schulz ([Note: NS graphs] in dmuon/optim/_graphs.py): bit-identical to the eager
call, new data on every replay, one graph per key. Needs a GPU: the CPU suite skips it (the NCCL pass runs it)."""

from __future__ import annotations

import pytest
import torch

from dmuon.optim import MuonHParams, muon_update_batch_
from dmuon.optim import _graphs
from dmuon.optim.newton_schulz import newton_schulz_native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SHAPES = [(4, 512, 2048), (3, 640, 640), (2, 2048, 8192), (1, 96, 384)]


def _eager(G: torch.Tensor, backend: str) -> torch.Tensor:
    return newton_schulz_native(G, 5, "keller_jordan", 1e-7, backend=backend)


@pytest.mark.parametrize("backend", ["direct", "direct_fp16", "gram", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_replay_is_bit_identical_to_eager_with_new_data_each_call(backend, shape):
    _graphs.clear()
    gen = torch.Generator("cuda").manual_seed(sum(shape))
    key = (5, "keller_jordan", 1e-7, backend)
    for _ in range(3):  # capture, then two replays on other inputs
        G = torch.randn(shape, device="cuda", generator=gen)
        got = _graphs.run(lambda X: _eager(X, backend), G, key).clone()
        assert torch.equal(got, _eager(G, backend)), (backend, shape)
    assert len(_graphs._graphs) == 1


def test_a_new_shape_or_dtype_is_a_new_graph_and_the_cache_is_bounded(monkeypatch):
    _graphs.clear()
    key = (5, "keller_jordan", 1e-7, "auto")
    for shape in [(2, 64, 256), (3, 64, 256)]:
        for dtype in (torch.float32, torch.bfloat16):
            G = torch.randn(shape, device="cuda").to(dtype)
            assert torch.equal(_graphs.run(lambda X: _eager(X, "auto"), G, key), _eager(G, "auto"))
    assert len(_graphs._graphs) == 4
    held = [i.nbytes + o.nbytes for _, i, o in _graphs._graphs.values()]
    # the byte budget, not a count: room for the newest two of these (5 x 64 x 256 float32 in, float16 out)
    monkeypatch.setattr(_graphs, "MAX_GRAPH_BYTES", 5 * 64 * 256 * (4 + 2) + held[-1])
    G = torch.randn(5, 64, 256, device="cuda")
    _graphs.run(lambda X: _eager(X, "auto"), G, key)
    assert len(_graphs._graphs) == 2
    monkeypatch.setattr(_graphs, "MAX_GRAPH_BYTES", 1)  # smaller than any graph: the newest one stays
    _graphs.run(lambda X: _eager(X, "auto"), torch.randn(6, 64, 256, device="cuda"), key)
    assert len(_graphs._graphs) == 1


def test_the_optimizer_update_is_the_same_with_and_without_graphs(monkeypatch):
    hp = MuonHParams(lr=0.02, weight_decay=0.01)
    gen = torch.Generator("cuda").manual_seed(0)
    ws = [torch.randn(512, 2048, device="cuda", generator=gen) for _ in range(3)]
    gs = [[torch.randn(512, 2048, device="cuda", generator=gen) for _ in ws] for _ in range(3)]
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DMUON_NS_CUDA_GRAPHS", flag)
        _graphs.clear()
        w, b = [x.clone() for x in ws], [torch.zeros_like(x) for x in ws]
        for step in gs:
            muon_update_batch_(w, step, b, hp)
        runs.append(w)
        assert (len(_graphs._graphs) > 0) == (flag == "1")
    assert all(torch.equal(a, b) for a, b in zip(*runs))
