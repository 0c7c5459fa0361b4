"""What ``scripts/gpu_side_by_side.py`` shares with its test: the models it trains, the collectives it counts
and the check that Muon implementations agree.

* :func:`build_model`: the bench's Llama shapes (:func:`dmuon.tools.bench.build_model`) or one of
  :data:`MOE_PRESETS` (:class:`dmuon.tools.moe.TinyMoE`), the same weights in every process and build;
* :class:`CollectiveCounter`: the calls and bytes of every ``torch.distributed`` collective, by kind;
* :func:`matrix_agreement` / :func:`summarize_agreement`: a variant's Muon matrices against the reference's
  after the same steps from the same weights, within the bound of [Note: agreement bound].
"""

from __future__ import annotations

import inspect
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .bench import BENCH_PRESETS
from .bench import build_model as build_dense
from .models import projection_predicate
from .moe import TinyMoE, TinyMoEConfig, expert_predicate
from .presets import canonical_preset

__all__ = ["MOE_PRESETS", "PRESET_NAMES", "build_model", "CollectiveCounter", "NS_NOISE", "MARGIN", "analytic_bound",
           "tolerance", "MatrixAgreement", "matrix_agreement", "summarize_agreement"]

Predicate = Callable[[str, nn.Parameter], bool]

#: Mixture-of-experts shapes. Qwen3's MoE layers (no shared expert, top-8), with fixed routing (tokens go to
#: experts by sequence position, weighted by the router: every expert gets the same load, as a trained
#: router's would be, and the model is smooth in every weight, so that the agreement check is not thrown
#: off by a near-tie token that flips experts on a last-bit difference; see dmuon/tools/moe.py).
#: ``TinyLlama`` derives the head size from ``dim / n_heads``, so the attention matrices are square.
MOE_PRESETS = MappingProxyType({
    # the CPU smoke shape
    "moe-tiny": TinyMoEConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256,
                              max_seq_len=4096, n_experts=4, top_k=2, expert_dim=96, shared_expert=False,
                              routing="fixed"),
    # torchtitan's qwen3 "debugmodel_moe" flavour: 8 layers of 64 experts [768, 256]
    "qwen3-moe-debug": TinyMoEConfig(vocab_size=2048, dim=256, n_layers=8, n_heads=16, n_kv_heads=8,
                                     hidden_dim=768, max_seq_len=4096, n_experts=64, top_k=8, expert_dim=768,
                                     shared_expert=False, routing="fixed"),
    # Qwen3-30B-A3B's layers (128 experts [768, 2048], vocabulary 151936), 4 of its 48
    "qwen3-30b-a3b-4l": TinyMoEConfig(vocab_size=151936, dim=2048, n_layers=4, n_heads=32, n_kv_heads=4,
                                      hidden_dim=6144, max_seq_len=4096, n_experts=128, top_k=8, expert_dim=768,
                                      shared_expert=False, routing="fixed"),
})
#: every preset :func:`build_model` takes (the dense ones also by their short names, e.g. ``1b``, ``8b``)
PRESET_NAMES = (*BENCH_PRESETS, *MOE_PRESETS)


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, Predicate]:
    """``preset``'s model on ``device`` in ``dtype`` (no parallelism yet) and the predicate of its Muon
    matrices: the projections of a dense model; of an MoE model also the experts (3-D), not the router.
    Every build of a preset on one device has the same weights (seed 0, initialised on ``device``)."""
    preset = canonical_preset(preset)
    if preset in BENCH_PRESETS:
        return build_dense(preset, device, dtype), projection_predicate
    if preset not in MOE_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid names: {', '.join(PRESET_NAMES)}")
    with torch.device(device):
        model = TinyMoE(MOE_PRESETS[preset])
    torch.manual_seed(0)
    with torch.no_grad():  # on the device: the CPU generator of TinyLlama.init_weights is slow at 2B weights
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "embeddings" in name else p.shape[-1] ** -0.5)
    return model.to(dtype), expert_predicate


# --------------------------------------------------------------------------------------------------- #
# Collectives                                                                                           #
# --------------------------------------------------------------------------------------------------- #
#: torch.distributed function -> (kind, the argument whose bytes count). The bytes of a call are the size
#: of the whole buffer the collective covers, as nccl-tests report it: an all-gather's output, a
#: reduce-scatter's input, an all-to-all's input, the tensor of a broadcast, reduce or all-reduce.
_COUNTED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "send": ("send_recv", "tensor"),
    "recv": ("send_recv", "tensor"),
    "isend": ("send_recv", "tensor"),
    "irecv": ("send_recv", "tensor"),
}
_NAMESPACES = (dist, dist.distributed_c10d)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveCounter:
    """While entered, every ``torch.distributed`` collective this process calls (through ``torch.distributed``
    or ``torch.distributed.distributed_c10d``; FSDP2, dmuon, torchtitan's DistMuon and dion call them so) is
    counted: ``as_dict()`` is ``{kind: {"calls": n, "bytes": b}}``. A collective that calls another one
    counts once. Not counted: functional collectives (DTensor redistributions); object collectives count
    as the tensor collectives they run.

    Example::

        with CollectiveCounter() as counter:
            train_one_step()
        print(counter.as_dict())   # {'all_gather': {'calls': 34, 'bytes': 2415919104}, ...}
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Callable]] = []
        self._depth = threading.local()

    def _wrap(self, real: Callable, kind: str, arg: str) -> Callable:
        signature = inspect.signature(real)

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                try:
                    value = signature.bind(*args, **kwargs).arguments.get(arg)
                except TypeError:  # a call torch itself will refuse: let it say why
                    value = None
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(value)
            self._depth.n = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__wrapped__ = real  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> CollectiveCounter:
        for ns in _NAMESPACES:
            for name, (kind, arg) in _COUNTED.items():
                real = getattr(ns, name, None)
                if real is not None:
                    self._saved.append((ns, name, real))
                    setattr(ns, name, self._wrap(real, kind, arg))
        return self

    def __exit__(self, *exc: object) -> None:
        for ns, name, real in reversed(self._saved):
            setattr(ns, name, real)
        self._saved.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


# --------------------------------------------------------------------------------------------------- #
# Agreement                                                                                             #
# --------------------------------------------------------------------------------------------------- #
# [Note: agreement bound]
# Two correct Muon implementations, started from the same weights W_0 and fed the same batches, differ after
# k steps only by rounding, most of it inside Newton-Schulz. For one matrix, with the reference's W = W_k,
# r = ||W - W_0||_F / ||W||_F (how far it moved) and a variant's W', the error ||W' - W||_F / ||W||_F is
# flagged when it is over MARGIN * max(floor, analytic):
#
# * floor, measured in the same run: the same error of dmuon run again with its other 16-bit Newton-Schulz
#   arithmetic (torch's bf16 form where dmuon's own forms are fp16, as on a GPU; fp16 on the CPU, where its
#   own is bf16), two runs of one implementation that differ in rounding alone. It carries the bulk of the
#   noise whenever a matrix's gradient has fewer independent rows than the matrix has: each NS step
#   multiplies a direction of tiny singular value by a = 3.4445, five steps by up to a^5 ~ 480, so the
#   bf16 rounding (2^-8 of the largest singular value) that lands in the gradient's null space leaves NS
#   with singular values up to ~1, different in every arithmetic. On the tiny preset 64 tokens a step put
#   13% of the first update there (an expert fed 128 tokens is such a case); 512 tokens, 1-3%.
# * analytic, a minimum where the floor happens to be small, from two sources:
#   - Newton-Schulz on full-rank input: a 16-bit form differs from the float64 iteration by at most
#     1.29e-2 (torch's bf16 form, the worst of every Llama shape on an H200) and 1.3e-3 (dmuon's fp16
#     forms) relative in Frobenius norm (docs/benchmarks.md, 2026-12-01); two bf16 forms may differ by the
#     sum: NS_NOISE = 3e-2 per step. Momentum keeps consecutive steps aligned, so the k steps add up to
#     about NS_NOISE * r.
#   - storage: each step rounds W - lr O_t to the param dtype. Where two variants' unrounded values differ
#     by d below one unit in the last place u <= eps |W_ij| (eps = finfo(dtype).eps, 2^-7 for bf16), the
#     rounded ones differ by u with probability d / u: sqrt(u d) in the mean square. With Cauchy-Schwarz,
#     over the k steps a relative sqrt(eps * NS_NOISE * r).
#   analytic = NS_NOISE * r + sqrt(eps * NS_NOISE * r).
# * MARGIN = 3: a bf16 variant against a bf16 dmuon (the CPU) differs by about sqrt(2) floors (two
#   independent roundings against one; measured 1.4x to 1.7x on the tiny preset), and one pair of runs is
#   one sample of noise that, at a few tokens a step, sits in a few directions (the worst matrix of a
#   variant came within 0.86x of what MARGIN = 2 would allow).
#
# With bf16 weights, lr 0.02 and 3 steps (r ~ 0.06-0.1) the analytic part is 5.5e-3 to 7.8e-3, the tolerance
# at least 1.7e-2 to 2.3e-2. On an H200 (llama3.2-1b, 3 steps, 4 x 512 tokens) the noise floor was 3.3% of the
# update, DistMuon and dion came within 0.31x and 0.37x of their tolerance, and the control, which takes twice
# the learning rate (off by about r), was 4.4x over it; on qwen3-moe-debug 0.33x, 0.44x and 3.8x.
NS_NOISE = 3e-2
MARGIN = 3.0


def analytic_bound(moved: float, dtype: torch.dtype, *, ns_noise: float = NS_NOISE) -> float:
    """``NS_NOISE r + sqrt(eps NS_NOISE r)`` of [Note: agreement bound], for a matrix of ``dtype`` whose
    reference moved ``moved = r = ||W - W_0||_F / ||W||_F``."""
    eps = torch.finfo(dtype).eps
    return ns_noise * moved + math.sqrt(eps * ns_noise * moved)


def tolerance(moved: float, dtype: torch.dtype, floor: float = 0.0, *, margin: float = MARGIN) -> float:
    """The largest error that rounding explains ([Note: agreement bound]): ``margin`` times the larger of the
    measured ``floor`` and :func:`analytic_bound`."""
    return margin * max(floor, analytic_bound(moved, dtype))


@dataclass(frozen=True)
class MatrixAgreement:
    """One Muon matrix of a variant against the reference's (norms in float64)."""

    name: str
    #: ``||W' - W||_F / ||W||_F``
    error: float
    #: :func:`tolerance` of this matrix
    tolerance: float
    #: ``||W - W_0||_F / ||W||_F``: how far the reference moved it
    moved: float
    #: the noise floor's error on this matrix (0: none measured)
    floor: float
    #: ``||W||_F``, ``||W' - W||_F`` and ``||W - W_0||_F``, for the sums over matrices
    norm: float
    diff: float
    distance: float

    @property
    def ratio(self) -> float:
        """``error / tolerance``: over 1 is a disagreement."""
        if self.error == 0:
            return 0.0
        return self.error / self.tolerance if self.tolerance > 0 else math.inf


def matrix_agreement(name: str, init: torch.Tensor, ref: torch.Tensor, other: torch.Tensor, floor: float = 0.0, *,
                     margin: float = MARGIN) -> MatrixAgreement:
    """``other`` (a variant's matrix after k steps) against ``ref`` (the reference's), both from ``init``;
    ``floor``: the noise floor's error on this matrix. The bound reads the dtype of ``ref``. Any device;
    the three must have one shape."""
    if not init.shape == ref.shape == other.shape:
        raise ValueError(f"matrix_agreement({name!r}): shapes differ: init {tuple(init.shape)}, "
                         f"ref {tuple(ref.shape)}, other {tuple(other.shape)}")
    w = ref.double()
    norm = float(w.norm())
    diff = float((other.double() - w).norm())
    distance = float((w - init.double()).norm())
    moved = distance / norm if norm else 0.0
    return MatrixAgreement(name, diff / norm if norm else diff, tolerance(moved, ref.dtype, floor, margin=margin),
                           moved, floor, norm, diff, distance)


def summarize_agreement(rows: Iterable[MatrixAgreement]) -> dict[str, Any]:
    """A variant's verdict: ``flagged`` when any matrix is over its tolerance; ``worst``, the matrix
    furthest over (or nearest to) it; ``error``, the relative Frobenius error over all matrices together
    (``sqrt(sum ||W' - W||^2 / sum ||W||^2)``) and ``of_update``, the same over the distance moved."""
    rows = list(rows)
    if not rows:
        raise ValueError("summarize_agreement: no matrices to compare")
    worst = max(rows, key=lambda r: r.ratio)
    diff2 = sum(r.diff ** 2 for r in rows)
    return {"flagged": worst.ratio > 1.0, "matrices": len(rows),
            "error": math.sqrt(diff2 / sum(r.norm ** 2 for r in rows)),
            "of_update": math.sqrt(diff2 / max(sum(r.distance ** 2 for r in rows), 1e-300)),
            "worst": {**asdict(worst), "ratio": worst.ratio},
            "rows": [{"name": r.name, "error": r.error, "tolerance": r.tolerance, "moved": r.moved, "floor": r.floor}
                     for r in rows]}
