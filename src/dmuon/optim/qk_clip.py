"""MuonClip's QK-clip (Kimi K2 report, 2025): after each step, attention heads whose largest pre-softmax logit
exceeded ``tau`` get their query and key weights scaled down.

[Note: QK-clip]
For a head ``h`` whose largest logit ``S_h = max scale * q_i . k_j`` of the step (over the batch, every
data-parallel rank and every micro-batch) exceeds ``tau``: ``gamma_h = tau / S_h``, the rows of ``W_q``
that make head ``h`` are multiplied by ``gamma_h ** alpha`` and the rows of ``W_k`` that make its key head by
``gamma ** (1 - alpha)``. Under grouped-query attention a key head serves several query heads, so it takes its
group's largest logit: ``gamma_g = tau / max_{h in g} S_h`` (each clipped query head still ends at or below
tau: ``S_h gamma_h^alpha gamma_g^(1 - alpha) <= S_h gamma_h = tau``; a query head of the group that did not
exceed tau keeps its rows, its logits fall with the shared key head). Heads at or below tau, and key heads
whose group stayed there, are not touched (not even multiplied by 1).

Where it runs: the maxima are reported by the attention modules in forward (``dmuon/qk_clip.py``), kept on
each module, and read by ``dmuon.Muon.step()`` after the updates and before HSDP's publish: one all-reduce
(max) of every head's maximum over the job, then each owner scales the rows of the matrices it owns (its
master where it keeps one, rounded into the parameter as a step's result is), so the next forward's broadcast
carries the clipped weights and every rank applies the same factors. The matrices must be dedicated to one
owner (``Route.MUON``): an owner holds W_q and W_k whole, so the per-head rescale needs no communication.
Under pipeline parallelism each stage holds other attention modules: the all-reduce runs over the stage's
data-parallel ranks only (the ranks that hold the same modules), so each stage clips its heads by its own
maxima, which are the whole job's maxima of those heads ([Note: pipeline stages] in
``dmuon/runtime/topology.py``); the stats and the log line are the stage's (logged by each stage's first rank).

Which rows belong to which head: :class:`QKHeads`, given or found (:func:`find_heads`): ``q_proj``/``k_proj``
(HF transformers, dmuon's tiny Llama), ``wq``/``wk`` (torchtitan, also under ``qkv_linear``), and fused
projections: torchtitan's ``FusedQKVLinear`` (heads interleaved per key-value group) and a ``qkv_proj`` /
``wqkv`` whose ``dedicate_params(blocks=...)`` row blocks put the query rows first, then the key rows, then
the value rows ([Note: matrix blocks] in ``dmuon/runtime/blocks.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from ..runtime import comm as C
from ..runtime.param import DedicatedParam, local
from ..runtime.route import Route

__all__ = ["QKClip", "QKHeads", "QKClipStats", "QKClipper", "RECORD_ATTR", "find_heads", "clip_layout",
           "agreement_view"]

#: The attribute an attention module keeps its running per-head maxima in, until ``step()`` reads them.
RECORD_ATTR = "_dmuon_max_logits"
logger = logging.getLogger("dmuon.qk_clip")


@dataclass(frozen=True)
class QKHeads:
    """Where one attention module's heads live. ``q_rows[h]``: the first row of query head ``h`` in ``q``;
    ``k_rows[g]``: of key head ``g`` in ``k`` (each ``head_dim`` rows). Query head ``h`` reads key head
    ``h // (n_heads // n_kv_heads)``. Example (a fused ``[q; k; v]`` projection, 8 query and 2 key heads)::

        QKHeads(module="layers.0.attn", q="layers.0.attn.qkv.weight", k="layers.0.attn.qkv.weight",
                n_heads=8, n_kv_heads=2, head_dim=64, k_rows=tuple(512 + 64 * g for g in range(2)))
    """

    #: FQN of the attention module that reports its maxima (``dmuon.qk_clip.record_max_logits``)
    module: str
    #: FQNs of the dedicated params holding the query and the key rows (the same for a fused projection)
    q: str
    k: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_rows: tuple[int, ...] | None = None  # default: head h at h * head_dim
    k_rows: tuple[int, ...] | None = None  # default: key head g at g * head_dim

    def query_rows(self) -> tuple[int, ...]:
        return self.q_rows if self.q_rows is not None else tuple(h * self.head_dim for h in range(self.n_heads))

    def key_rows(self) -> tuple[int, ...]:
        return self.k_rows if self.k_rows is not None else tuple(g * self.head_dim for g in range(self.n_kv_heads))


@dataclass(frozen=True)
class QKClip:
    """QK-clip's settings, for ``dmuon.Muon(model, ..., qk_clip=dmuon.QKClip(...))`` ([Note: QK-clip] in
    ``dmuon/optim/qk_clip.py``). Off unless given.

    Attributes:
        tau: the largest logit a head may keep (default 100, the Kimi K2 report's).
        alpha: the query's share of the rescale (default 0.5: ``sqrt(gamma)`` on each of W_q and W_k).
        heads: where each attention's heads live; ``None`` (default): found in the model (:func:`find_heads`).
        log: a log line (logger ``dmuon.qk_clip``, INFO, rank 0) for every step that clips a head.

    Example::

        optimizer = dmuon.Muon(model, lr=0.02, qk_clip=dmuon.QKClip(tau=100.0))
    """

    tau: float = 100.0
    alpha: float = 0.5
    heads: Sequence[QKHeads] | None = None
    log: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool) or not 0 < self.tau < math.inf:
            raise ValueError(f"dmuon.QKClip: tau must be a finite number > 0, got {self.tau!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not 0 <= self.alpha <= 1:
            raise ValueError(f"dmuon.QKClip: alpha must be a number in [0, 1], got {self.alpha!r}")
        if self.heads is not None:
            object.__setattr__(self, "heads", tuple(self.heads))


@dataclass
class QKClipStats:
    """What the last ``step()`` found: how many query heads it clipped, of how many, and the largest logit.

    Example::

        stats = optimizer.qk_clip.stats  # or dmuon.diagnostics.qk_clip(optimizer), as a dict
        print(stats.step, stats.clipped_heads, stats.heads, stats.max_logit)
    """

    step: int = 0
    clipped_heads: int = 0
    heads: int = 0
    max_logit: float = -math.inf
    #: per attention module: the query heads clipped
    clipped: dict[str, list[int]] = field(default_factory=dict)
    #: per attention module: each query head's largest logit of the step (over the job)
    max_logits: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "clipped_heads": self.clipped_heads, "heads": self.heads,
                "max_logit": self.max_logit, "clipped": {k: list(v) for k, v in self.clipped.items()},
                "max_logits": {k: list(v) for k, v in self.max_logits.items()}}


# --------------------------------------------------------------------------------------------------- #
# Finding the heads                                                                                    #
# --------------------------------------------------------------------------------------------------- #
def _attr(module: nn.Module, *names: str) -> Any:
    """The first of ``names`` found on ``module``, its ``config`` or its ``cfg`` (``None``: none)."""
    for owner in (module, getattr(module, "config", None), getattr(module, "cfg", None)):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _projections(module: nn.Module) -> tuple[str, str, str] | None:
    """``(kind, q child path, k child path)`` of an attention module, or ``None``: ``"split"`` (two linears) or
    ``"fused"`` (one)."""
    for q, k in (("q_proj", "k_proj"), ("wq", "wk"), ("qkv_linear.wq", "qkv_linear.wk")):
        if isinstance(_child(module, q), nn.Linear) and isinstance(_child(module, k), nn.Linear):
            return "split", q, k
    for fused in ("qkv_linear.wqkv", "wqkv", "qkv_proj"):
        if isinstance(_child(module, fused), nn.Linear):
            return "fused", fused, fused
    return None


def _child(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)  # type: ignore[assignment]
        if not isinstance(module, nn.Module):
            return None
    return module


def find_heads(model: nn.Module, dedicated: dict[str, DedicatedParam]) -> list[QKHeads]:
    """Every attention module of ``model`` whose query and key projections are found (module docstring), with
    its head layout read from its attributes (``n_heads`` / ``num_heads`` / ``num_attention_heads``,
    ``n_kv_heads`` / ``num_key_value_heads``, ``head_dim``; also on its ``config`` or ``cfg``). Raises
    ``ValueError`` for a module whose layout it cannot read. ``dedicated``: by FQN, for fused row blocks.

    Example::

        for heads in find_heads(model, {}):  # what dmuon.QKClip() would clip (fused projections need dedicated)
            print(heads.module, heads.n_heads, heads.n_kv_heads, heads.head_dim)
    """
    out, taken = [], []
    for name, module in model.named_modules():  # parents first: a projection container inside a found
        found = _projections(module)               # attention (torchtitan's qkv_linear) is not one itself
        if found is None or any(name.startswith(f"{t}.") for t in taken):
            continue
        taken.append(name)
        kind, q, k = found
        where = f"dmuon.QKClip: attention {name!r}"
        n_heads = _attr(module, "n_heads", "num_heads", "num_attention_heads")
        n_kv = _attr(module, "n_kv_heads", "num_key_value_heads", "num_kv_heads") or n_heads
        q_w = _child(module, q).weight  # type: ignore[union-attr]
        head_dim = _attr(module, "head_dim") or (q_w.shape[0] // n_heads if n_heads and kind == "split" else None)
        if not n_heads or not head_dim or n_heads % n_kv:
            raise ValueError(f"{where}: cannot read its head layout (heads {n_heads}, key heads {n_kv}, head_dim "
                             f"{head_dim}); pass dmuon.QKClip(heads=[dmuon.QKHeads(...)]) for it")
        prefix = f"{name}." if name else ""
        heads = QKHeads(prefix.removesuffix("."), f"{prefix}{q}.weight", f"{prefix}{k}.weight", n_heads, n_kv, head_dim)
        if kind == "fused":
            heads = _fused_layout(heads, module, dedicated.get(heads.q), where)
        out.append(heads)
    return out


def _fused_layout(heads: QKHeads, module: nn.Module, dp: DedicatedParam | None, where: str) -> QKHeads:
    """The rows of a fused projection: torchtitan's interleaved ``[n_kv, heads_per_kv + 2, head_dim]``, or
    ``[q; k; v]`` as its row blocks declare (query rows end and key rows end on block boundaries)."""
    h, g, d = heads.n_heads, heads.n_kv_heads, heads.head_dim
    per = h // g
    if isinstance(getattr(_child(module, "qkv_linear") or module, "heads_per_kv", None), int):
        r = per + 2
        q_rows = tuple((j // per * r + j % per) * d for j in range(h))
        return QKHeads(heads.module, heads.q, heads.k, h, g, d, q_rows, tuple((i * r + per) * d for i in range(g)))
    ends = set()
    if dp is not None and dp.blocks is not None and not dp.blocks.columns:
        total = 0
        for rows in dp.blocks.rows:
            total += rows
            ends.add(total)
    if h * d not in ends or (h + g) * d not in ends:
        raise ValueError(f"{where}: its fused projection {heads.q!r} needs row blocks that end where the query rows "
                         f"({h * d}) and the key rows ({(h + g) * d}) end: dmuon.dedicate_params(blocks=...) with "
                         f"e.g. [{h * d}, {g * d}, {g * d}], or pass dmuon.QKClip(heads=[...])")
    return QKHeads(heads.module, heads.q, heads.k, h, g, d, None, tuple(h * d + i * d for i in range(g)))


# --------------------------------------------------------------------------------------------------- #
# The clip                                                                                             #
# --------------------------------------------------------------------------------------------------- #
@dataclass
class _Attention:
    heads: QKHeads
    module: nn.Module
    q: DedicatedParam
    k: DedicatedParam


class QKClipper:
    """QK-clip bound to one model and optimizer (``Muon.qk_clip``): :meth:`gather` at the start of ``step()``,
    :meth:`apply_` after the updates; :attr:`stats` of the last step. ``dmuon.Muon`` builds it from the layout
    :func:`clip_layout` resolved, once every rank agreed on it ([Note: settings agreement] in ``groups.py``),
    and drives it.

    Example::

        optimizer = dmuon.Muon(model, qk_clip=dmuon.QKClip(tau=50.0))
        print(optimizer.qk_clip.config.tau, optimizer.qk_clip.stats.heads)
    """

    def __init__(self, config: QKClip, attentions: Sequence[_Attention], state: Any) -> None:
        self.config, self._ctx = config, state.ctx
        #: pipeline stages: the maxima are gathered over this rank's stage (the ranks holding these modules)
        self._pipelined: bool = state.topology.pipelined
        self._attentions: list[_Attention] = list(attentions)
        self.stats = QKClipStats(heads=sum(a.heads.n_heads for a in attentions))

    def gather(self) -> Tensor:
        """Every head's largest logit since the last step, over the whole job (one all-reduce; under pipeline
        stages over this stage's ranks, which hold these heads), and forget the reports. Raises on every rank if no attention module reported any (the forward side is not wired)."""
        parts = []
        for a in self._attentions:
            seen = getattr(a.module, RECORD_ATTR, None)
            if seen is not None and tuple(seen.shape) != (a.heads.n_heads,):
                raise ValueError(f"dmuon.QKClip: attention {a.heads.module!r} reported {tuple(seen.shape)} maxima, "
                                 f"expected one per query head ({a.heads.n_heads})")
            parts.append(torch.full((a.heads.n_heads,), -math.inf) if seen is None else seen.float().cpu())
            setattr(a.module, RECORD_ATTR, None)
        maxima = C.all_reduce_max(self._ctx, torch.cat(parts).to(self._ctx.device), stage=self._pipelined).cpu()
        silent = torch.tensor([float((maxima == -math.inf).all())], device=self._ctx.device)
        if self._pipelined:  # a stage whose modules reported nothing stops every stage, not only its own
            silent = C.all_reduce_max(self._ctx, silent)
        if bool(silent.item()):
            raise RuntimeError(
                "dmuon.QKClip: no attention module reported its largest logits since the last step, so nothing "
                "can be clipped. Compute attention with dmuon.qk_clip.scaled_dot_product_attention(..., "
                "module=self), call dmuon.qk_clip.record_max_logits in the attention's forward, or use the "
                "ready-made reporting (HF: dmuon.integrations.hf.use_qk_clip_attention(model); torchtitan: "
                "dmuon.integrations.torchtitan.report_max_logits(model))."
            )
        return maxima

    def apply_(self, maxima: Tensor, target: Any) -> QKClipStats:
        """Scale the rows of the clipped heads on their owners ([Note: QK-clip]); ``target(dp)``: the tensor the
        owner updates for ``dp`` (its master, or the parameter), written back into the parameter after."""
        tau, alpha = float(self.config.tau), float(self.config.alpha)
        stats = QKClipStats(step=self.stats.step + 1, heads=self.stats.heads, max_logit=float(maxima.max()))
        offset = 0
        for a in self._attentions:
            h = a.heads
            m = maxima[offset:offset + h.n_heads].tolist()
            offset += h.n_heads
            stats.max_logits[h.module] = m
            per = h.n_heads // h.n_kv_heads
            q_scale = {j: (tau / s) ** alpha for j, s in enumerate(m) if s > tau}
            k_scale = {}
            for g in range(h.n_kv_heads):
                top = max(m[g * per:(g + 1) * per])
                if top > tau:
                    k_scale[g] = (tau / top) ** (1 - alpha)
            if not q_scale:
                continue
            stats.clipped[h.module] = sorted(q_scale)
            stats.clipped_heads += len(q_scale)
            _scale_rows_(a.q, h.query_rows(), q_scale, h.head_dim, target)
            _scale_rows_(a.k, h.key_rows(), k_scale, h.head_dim, target)
        self.stats = stats
        if stats.clipped_heads and self.config.log and self._ctx.rank == 0:
            logger.info("dmuon QK-clip step %d: clipped %d of %d heads (largest logit %.4g > tau %g)", stats.step,
                        stats.clipped_heads, stats.heads, stats.max_logit, tau)
        return stats


def _scale_rows_(dp: DedicatedParam, starts: Sequence[int], factors: dict[int, float], head_dim: int,
                 target: Any) -> None:
    """Owner: rows ``starts[i] : starts[i] + head_dim`` of ``dp`` times ``factors[i]``."""
    if not dp.is_owner or not factors:
        return
    t = target(dp)
    with torch.no_grad():
        for i, f in factors.items():
            t[starts[i]:starts[i] + head_dim].mul_(f)
    if t is not local(dp.bound()):
        dp.write_back(t)


def clip_layout(config: object, model: nn.Module, state: Any) -> list[_Attention]:
    """Local, changes nothing: every attention ``config`` clips, with its dedicated query and key matrices;
    ``TypeError`` / ``ValueError`` for what cannot be clipped. ``dmuon.Muon`` gathers the verdict and
    :func:`agreement_view` of every rank before it builds the :class:`QKClipper`."""
    if not isinstance(config, QKClip):
        raise TypeError(f"dmuon.Muon: qk_clip must be a dmuon.QKClip or None, got {type(config).__name__}")
    return _resolve(config, model, state)


def agreement_view(config: QKClip | None, attentions: Sequence[_Attention]) -> dict[str, object]:
    """What every rank must agree on of QK-clip: on or off, ``tau``, ``alpha`` and each attention's head layout
    (``log`` only decides a log line on rank 0)."""
    if config is None:
        return {"qk_clip": "None"}
    view: dict[str, object] = {"qk_clip": "dmuon.QKClip", "qk_clip.tau": repr(float(config.tau)),
                               "qk_clip.alpha": repr(float(config.alpha))}
    view.update({f"qk_clip heads of {a.heads.module!r}": repr(a.heads) for a in attentions})
    return view


def _resolve(config: QKClip, model: nn.Module, state: Any) -> list[_Attention]:
    from .groups import canonical_name  # (groups.py needs nothing of this module)

    dedicated = {canonical_name(dp.fqn): dp for dp in state.dedicated()}
    heads = list(config.heads) if config.heads is not None else find_heads(model, dedicated)
    if not heads:
        raise ValueError(
            "dmuon.QKClip: found no attention module with query and key projections it knows (q_proj/k_proj, "
            "wq/wk, a fused wqkv/qkv_proj) in the model; pass dmuon.QKClip(heads=[dmuon.QKHeads(module=..., q=..., "
            "k=..., n_heads=..., n_kv_heads=..., head_dim=...)]) naming them"
        )
    modules = dict(model.named_modules())
    out = []
    for h in heads:
        where = f"dmuon.QKClip: attention {h.module!r}"
        module = modules.get(h.module)
        if module is None:
            raise ValueError(f"{where}: the model has no module of that name")
        if any(getattr(module, n, None) is not None for n in ("q_norm", "k_norm")):
            raise ValueError(f"{where} normalises q and k (q_norm / k_norm): scaling W_q and W_k does not change "
                             "its logits, so QK-clip cannot bound them; leave qk_clip off for this model")
        if h.n_heads < 1 or h.n_kv_heads < 1 or h.n_heads % h.n_kv_heads or h.head_dim < 1:
            raise ValueError(f"{where}: {h.n_heads} query heads, {h.n_kv_heads} key heads, head_dim {h.head_dim}: "
                             "the query heads must share the key heads evenly")
        pair = []
        for what, fqn, starts in (("query", h.q, h.query_rows()), ("key", h.k, h.key_rows())):
            dp = dedicated.get(canonical_name(fqn))
            if dp is None or dp.route is not Route.MUON:
                why = "routed 'adamw_owner'" if dp is not None else "not dedicated, so on FSDP2 + AdamW"
                raise ValueError(f"{where}: its {what} matrix {fqn!r} is {why}; QK-clip rescales Muon's "
                                 "dedicated matrices on their owners. Select it in dmuon.dedicate_params(predicate=...)")
            if dp.tp_dim is not None:
                raise ValueError(f"{where}: {fqn!r} is split over tensor-parallel ranks; QK-clip does not support "
                                 "tensor parallelism yet")
            if len(dp.shape) != 2 or any(s < 0 or s + h.head_dim > dp.shape[0] for s in starts):
                raise ValueError(f"{where}: the {what} heads' rows do not fit {fqn!r} of shape {tuple(dp.shape)}")
            bias = getattr(dp.module, "bias", None)
            if isinstance(bias, torch.Tensor) and dp.name == "weight":
                raise ValueError(f"{where}: {fqn!r}'s module has a bias, which the rescale of its weight would not "
                                 "scale; QK-clip supports bias-free query and key projections")
            pair.append(dp)
        out.append(_Attention(h, module, *pair))
    return out
