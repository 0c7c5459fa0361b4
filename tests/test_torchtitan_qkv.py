"""torchtitan's fused ``wqkv`` under Muon: q, k and v orthogonalised alone by default, per head or whole on request
([Note: fused QKV blocks] in dmuon/integrations/torchtitan/_fused_qkv.py).

One process, no process group: dmuon's update of a ``FusedQKVLinear`` weight (``dmuon.optim.update.muon_update_``,
what the owner runs, with the blocks the integration declares) against ``torch.optim.Muon`` on the stock ``wq`` /
``wk`` / ``wv`` that torchtitan's own checkpoint split (``FusedQKVLinear._split_qkv_on_save``) cuts out of the
weight and its gradient, merged back by torchtitan's ``_merge_qkv_on_load``: no row arithmetic of dmuon's on the
oracle side. The distributed runs (tests/test_torchtitan.py, _tp.py, _moe.py) train with the default through
``dmuon_model_spec``; their oracles take q, k and v apart with :func:`qkv_rows` / :class:`FusedQKVShadows` here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("torchtitan")
pytest.importorskip("torchtitan.models.llama3")

from dmuon.optim import MuonHParams  # noqa: E402
from dmuon.optim.update import _apply_update_, muon_update_, orthogonalise  # noqa: E402
from dmuon.runtime.blocks import Blocks, Interleaved  # noqa: E402

HP = MuonHParams(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
#: (n_heads, n_kv_heads, head_dim, dim): grouped-query attention; multi-head (a k and a v per q head); one KV
#: group (the layout is then [q; k; v]); heads wider than the model (qwen3's head_dim=128 at dim=256), where q,
#: k and v take different lrs under the "original" rule
LAYOUTS = [(4, 2, 16, 64), (4, 4, 8, 32), (4, 1, 16, 32), (4, 2, 32, 32)]


def qkv_rows(module: Any, mode: str = "qkv") -> list[torch.Tensor]:
    """Row indices of the matrices Muon orthogonalises in a FusedQKVLinear's ``wqkv`` ([Note: fused QKV
    blocks] in dmuon/integrations/torchtitan/_fused_qkv.py), from torchtitan's layout (``n_kv`` groups of
    ``heads_per_kv`` q heads, a k head, a v head): ``"qkv"`` q, k and v gathered from every group (the stock
    wq / wk / wv), ``"heads"`` each head, ``"whole"`` every row; ``"contiguous"`` the wrong split
    ``[q_rows, k_rows, v_rows]`` of a ``[q; k; v]`` layout torchtitan does not have."""
    hd, hpk, r = module.head_dim, module.heads_per_kv, module.r_dim
    rows = torch.arange(module.wqkv.weight.shape[0]).view(-1, r, hd)
    if mode == "whole":
        return [rows.reshape(-1)]
    if mode == "heads":
        return list(rows.reshape(-1, hd))
    if mode == "contiguous":
        flat, q, kv = rows.reshape(-1), rows.shape[0] * hpk * hd, rows.shape[0] * hd
        return [flat[:q], flat[q:q + kv], flat[q + kv:]]
    assert mode == "qkv", mode
    return [rows[:, :hpk].reshape(-1), rows[:, hpk].reshape(-1), rows[:, hpk + 1].reshape(-1)]


class FusedQKVShadows:
    """The oracles' side of the default: one ``torch.optim.Muon`` parameter per q, k and v of every
    FusedQKVLinear ``wqkv`` of ``model``, whose values live in ``values`` (name -> the tensor its optimizer
    steps)."""

    def __init__(self, model: torch.nn.Module, values: dict[str, torch.Tensor], mode: str = "qkv") -> None:
        from torchtitan.models.common.attention import FusedQKVLinear

        self.values = values
        fused = {f"{n}.wqkv.weight": m for n, m in model.named_modules() if isinstance(m, FusedQKVLinear)}
        self.parts = {n: [(rows, torch.nn.Parameter(values[n].detach()[rows].clone())) for rows in qkv_rows(m, mode)]
                      for n, m in fused.items()}

    def matrices(self, names: list[str]) -> list[torch.Tensor]:
        """What torch's Muon steps for ``names``: the q, k, v parts of a ``wqkv``, every other tensor itself."""
        return [m for n in names for m in ([s for _, s in self.parts[n]] if n in self.parts else [self.values[n]])]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, each part's gradient copied in from its rows first and its value back after."""
        for n, parts in self.parts.items():
            for rows, s in parts:
                s.grad = self.values[n].grad[rows]
        optimizer.step()
        with torch.no_grad():
            for n, parts in self.parts.items():
                for rows, s in parts:
                    self.values[n][rows] = s


def fused_qkv(n_heads: int, n_kv: int, head_dim: int, dim: int) -> Any:
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.common.linear import Linear

    return FusedQKVLinear.Config(head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv, wqkv=Linear.Config(
        in_features=dim, out_features=(n_heads + 2 * n_kv) * head_dim)).build()


def _split(module: Any, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """torchtitan's checkpoint split of a ``wqkv``-shaped tensor: the stock ``wq``, ``wk``, ``wv``."""
    sd = {"wqkv.weight": t.clone()}
    type(module)._split_qkv_on_save(module, sd, "", {})
    return {k.split(".")[0]: v for k, v in sd.items()}


def _merge(module: Any, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    sd = {f"{k}.weight": v for k, v in parts.items()}
    type(module)._merge_qkv_on_load(module, sd, "")
    return sd["wqkv.weight"]


def _steps(w: torch.Tensor, grads: list[torch.Tensor], blocks: Blocks, hp: MuonHParams = HP) -> torch.Tensor:
    """dmuon's owner update, ``len(grads)`` steps."""
    w, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        muon_update_(w, g, buf, hp, blocks)
    return w


def _torch_muon(parts: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], hp: MuonHParams = HP
                ) -> dict[str, torch.Tensor]:
    """``torch.optim.Muon`` with each entry of ``parts`` a parameter of its own."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in parts.items()}
    opt = torch.optim.Muon(list(params.values()), lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov,
                           weight_decay=hp.weight_decay, adjust_lr_fn=hp.adjust_lr_fn.value)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def _case(layout: tuple[int, int, int, int]) -> tuple[Any, torch.Tensor, list[torch.Tensor]]:
    module = fused_qkv(*layout)
    gen = torch.Generator().manual_seed(sum(layout))
    shape = module.wqkv.weight.shape
    return module, torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(3)]


def _blocks(module: Any, mode: str) -> Blocks:
    from dmuon.integrations.torchtitan._fused_qkv import QKVBlocks, qkv_row_blocks

    rows = module.wqkv.weight.shape[0]
    return Blocks.of((rows, module.wqkv.weight.shape[1]), qkv_row_blocks(module, QKVBlocks(mode), rows))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_blocks_are_torch_muon_on_torchtitans_wq_wk_wv(layout: tuple[int, int, int, int]) -> None:
    """The default ("qkv"): three matrices, exactly torch's Muon on the stock wq / wk / wv of torchtitan's own
    split (the same bits: the owner's Newton–Schulz batches k and v, same shape, in one call)."""
    module, w, grads = _case(layout)
    blocks = _blocks(module, "qkv")
    n_heads, n_kv, hd, dim = layout
    assert Counter(dict(blocks.matrices())) == Counter({(n_heads * hd, dim): 1}) + Counter({(n_kv * hd, dim): 2})
    want = _merge(module, _torch_muon(_split(module, w), [_split(module, g) for g in grads]))
    assert torch.equal(_steps(w, grads, blocks), want)


@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_heads_and_whole_options(layout: tuple[int, int, int, int]) -> None:
    """``qkv_blocks="heads"``: one matrix per head (head_dim rows of the fused weight, in torchtitan's order);
    ``"whole"``: torch's Muon on the fused weight as one matrix. Neither is the default's update."""
    module, w, grads = _case(layout)
    hd = layout[2]
    heads = _blocks(module, "heads")
    assert heads.matrices() == [((hd, layout[3]), w.shape[0] // hd)]
    per_head = _torch_muon(dict(enumerate(w.split(hd))), [dict(enumerate(g.split(hd))) for g in grads])
    assert torch.equal(_steps(w, grads, heads), torch.cat([per_head[i] for i in range(len(per_head))]))
    whole = _blocks(module, "whole")
    assert whole.is_single
    assert torch.equal(_steps(w, grads, whole), _torch_muon({"w": w}, [{"w": g} for g in grads])["w"])
    default = _steps(w, grads, _blocks(module, "qkv"))
    assert not torch.allclose(default, _steps(w, grads, heads), atol=1e-3)
    assert not torch.allclose(default, _steps(w, grads, whole), atol=1e-3)


def test_a_contiguous_qkv_split_is_not_q_k_and_v() -> None:
    """``blocks=[q_rows, k_rows, v_rows]``, the split a ``[q; k; v]`` layout would take, cuts through
    torchtitan's KV groups: its update is far from torch's Muon on wq / wk / wv."""
    module, w, grads = _case(LAYOUTS[0])
    n_heads, n_kv, hd, dim = LAYOUTS[0]
    contiguous = Blocks.of(w.shape, [n_heads * hd, n_kv * hd, n_kv * hd])
    want = _merge(module, _torch_muon(_split(module, w), [_split(module, g) for g in grads]))
    rel = ((_steps(w, grads, contiguous) - want).norm() / want.norm()).item()
    assert rel > 1e-3, rel


def test_tensor_parallel_shards_take_the_full_matrix_update() -> None:
    """Under TP (``wqkv`` split by rows over tp: whole KV groups per rank) the update is computed on the full
    matrix and each shard applies its rows with its own block's lr ([Note: TP update]): the shards of one
    update, row_start as each tp rank passes it, give the full matrix's step."""
    module, w, grads = _case(LAYOUTS[3])  # q, k and v take different lrs here
    blocks = _blocks(module, "qkv")
    assert len({m for (m, _), _ in blocks.matrices()}) == 2
    ortho = orthogonalise(grads[0], HP, blocks)
    full = w.clone()
    _apply_update_(full, ortho, HP, blocks)
    for tp in (2, 4):  # 2 KV groups: a shard holds one, or half of one
        rows = w.shape[0] // tp
        shards = [w[r * rows:(r + 1) * rows].clone() for r in range(tp)]
        for r, shard in enumerate(shards):
            _apply_update_(shard, ortho[r * rows:(r + 1) * rows], HP, blocks, start=r * rows)
        assert torch.equal(torch.cat(shards), full), tp


def test_the_integration_declares_blocks_for_every_fused_qkv() -> None:
    """``fused_qkv_blocks`` (what ``dedicate`` hands ``dedicate_params(blocks=...)``) answers for each layer's
    ``wqkv.weight`` by identity, ``None`` for the other params, nothing under ``"whole"``; a bad mode is a
    ValueError naming the choices."""
    from dmuon.integrations.torchtitan import with_dmuon
    from dmuon.integrations.torchtitan._fused_qkv import fused_qkv_blocks
    from tests.test_torchtitan import N_HEADS, N_KV_HEADS, N_LAYERS, tiny_llama3_config

    with torch.device("meta"):
        model = tiny_llama3_config().build()
    fn = fused_qkv_blocks(model, "qkv")
    answers = {n: fn(n, p) for n, p in model.named_parameters()}
    hd = model.layers["0"].attention.qkv_linear.head_dim
    hpk = N_HEADS // N_KV_HEADS
    fused = {n: a for n, a in answers.items() if a is not None}
    assert sorted(fused) == [f"layers.{i}.attention.qkv_linear.wqkv.weight" for i in range(N_LAYERS)]
    assert set(fused.values()) == {Interleaved((hpk * hd, hd, hd), N_KV_HEADS)}
    heads = fused_qkv_blocks(model, "heads")
    assert {heads(n, p) for n, p in model.named_parameters() if n in fused} == {(N_HEADS + 2 * N_KV_HEADS)}
    assert fused_qkv_blocks(model, "whole") is None
    with pytest.raises(ValueError, match=r"qkv_blocks must be one of \['qkv', 'heads', 'whole'\], got 'rows'"):
        fused_qkv_blocks(model, "rows")
    with pytest.raises(ValueError, match="qkv_blocks must be one of"):
        with_dmuon(lambda model, **kw: model, qkv_blocks="per_head")  # refused when wrapping, before any run
