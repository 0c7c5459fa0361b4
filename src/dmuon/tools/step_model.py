"""The step-time model of ``python -m dmuon.plan --simulate``: what one training step costs a rank, per design.

A step is forward + backward (the model's flops at a measured rate, with a host floor) plus the part of each
phase's collectives that compute does not hide, plus the optimizer step (Newton–Schulz of the busiest rank
from :mod:`dmuon.tools.ns_table`, the element-wise updates from bytes and a measured bandwidth, and the
collectives a design issues inside ``step()``). Which collectives each design issues is in
:mod:`dmuon.tools.schedules`; how long each takes, in :mod:`dmuon.links`.

Every constant below is a measurement of ``docs/benchmarks.md`` or an assumption, and says which.
[Note: exposed communication] A phase's collectives run on their own streams while the phase computes. The
first unit's gather (forward) and the last unit's reduce (backward) have nothing to hide under; of the rest,
a fraction :data:`OVERLAP` runs under compute, and whatever exceeds the phase's compute time is exposed too:
``exposed = unhideable + max((1 - OVERLAP) x rest, rest - compute)``, ``rest`` summed per link class
(NVLink, network: separate wires) and the larger class taken. Collectives inside ``step()`` are exposed
whole, except where a design pipelines them against its own Newton–Schulz (dion). Expert parallelism's token
all-to-alls sit between a layer's router and its experts, so they are counted exposed, for every design.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..links import Links
from .presets import LlamaShape, MoEShape, attention_specs, projection_specs

__all__ = ["Scenario", "ModelSizes", "OVERLAP", "COMPUTE_ANCHORS", "sizes_of", "compute_ms", "adamw_ms",
           "muon_update_ms", "exposed_ms", "host_floor_ms", "rate_tflops"]

# ------------------------------------------------------------------------------------------ calibration #

#: Fraction of a phase's hideable collective time that runs under compute: NCCL kernel time that overlapped
#: a compute kernel, 2 x H200, 1B dmuon Z3, 4 x 2048 per rank (third session: 91% / 93%; first run: 87% / 86%;
#: ``scripts/gpu_profile.py --parts overlap``). Assumed the same for FSDP2's own gathers.
OVERLAP = 0.90

#: fwd + bwd rate anchors: (preset, world, tokens per rank, measured ms, where). The achieved rate is the
#: model's flops over that time; other hidden sizes interpolate in log2(hidden) and hold at the ends.
COMPUTE_ANCHORS: tuple[tuple[str, int, tuple[int, int], float, str], ...] = (
    ("llama3.2-1b", 1, (4, 2048), 145.5,
     "2026-11-29 third session, 1 GPU, unwrapped model, median of 50 rounds (scripts/gpu_fwdbwd_paired.py)"),
    ("llama3-8b", 2, (4, 2048), 250.59 + 498.65,
     "2026-11-29 first two-GPU run, fsdp_adamw forward + backward (python -m dmuon.bench --preset 8b): a "
     "calibration point, so its own FSDP2 exposure is inside the rate"),
)

#: Routed experts' grouped GEMMs (a few hundred tokens per expert and rank) run at this fraction of the dense
#: rate: an assumption, nothing MoE was timed end to end.
EXPERT_GEMM_EFFICIENCY = 0.6

#: Host floor of forward + backward (the Python that issues kernels), fitted to the 1-GPU 1B runs at
#: 4 x 512 tokens where the GPU idles: unwrapped ~48 ms for 16 layers, FSDP2 per-layer wrap ~94 ms (17 units).
HOST_MS_PER_LAYER = 3.0
HOST_MS_PER_FSDP_UNIT = 2.7
#: share of the host floor in forward (torch_muon 4 x 512: 21 / 48 ms)
HOST_FORWARD_SHARE = 0.45

#: Element-wise optimizer work: ``fixed + bytes / bandwidth``, fitted to fsdp_adamw's fused AdamW step on
#: 2 x H200 (1B: 8.60 / 10.65 ms for 0.75G params a rank; 8B: 32.45 / 29.80 ms for 4.0G).
ELEMENTWISE_GBS = 2120.0
ADAMW_FIXED_MS = 4.6
#: bytes moved per element, in units of the param's bytes: fused AdamW reads p, g, m, v and writes p, m, v;
#: Muon's momentum (m, g -> m), Nesterov (g, m -> u) and apply (p, o -> p) are three such passes.
ADAMW_PASSES = 7
MUON_PASSES = 9


# ------------------------------------------------------------------------------------------- the model #


@dataclass(frozen=True)
class ModelSizes:
    """Element counts of a preset and its flops per token."""

    #: dense Muon matrices (dedicated under dmuon): (fqn, (rows, cols), layer)
    muon: tuple[tuple[str, tuple[int, int], str], ...]
    #: one layer's routed experts: (rows, cols) of each of its batched params, E matrices each
    expert_params: tuple[tuple[int, int], ...]
    experts: int
    layers: int
    embed: int
    head: int
    norms: int
    router: int
    #: forward flops per token: dense matmuls + attention, and routed experts
    dense_flops: float
    expert_flops: float
    hidden: int

    @property
    def muon_elements(self) -> int:
        return sum(r * c for _, (r, c), _ in self.muon)

    @property
    def expert_elements(self) -> int:
        return self.layers * self.experts * sum(r * c for r, c in self.expert_params)

    @property
    def rest(self) -> int:
        """Params outside Muon: embeddings, head, norms, router (AdamW)."""
        return self.embed + self.head + self.norms + self.router


def sizes_of(shape: LlamaShape, seq: int) -> ModelSizes:
    """A preset's counts: the bench's Llama layout (untied head, two norms a layer and a final one), or an MoE
    layout (attention on Muon owners, experts on the engine's shards, a router per layer)."""
    moe = isinstance(shape, MoEShape)
    specs = attention_specs(shape) if moe else projection_specs(shape)
    muon = tuple((s.fqn, (int(s.shape[0]), int(s.shape[1])), s.layer) for s in specs)
    q_dim = shape.heads * shape.head_dim
    attention = 4 * shape.layers * seq * q_dim  # QK^T and AV, forward, every key counted
    embed = head = shape.vocab * shape.hidden
    norms = (2 * shape.layers + 1) * shape.hidden + (2 * shape.layers * shape.head_dim if moe else 0)
    if not moe:
        dense = 2 * (sum(r * c for _, (r, c), _ in muon) + head) + attention
        return ModelSizes(muon, (), 0, shape.layers, embed, head, norms, 0, float(dense), 0.0, shape.hidden)
    F, D = shape.expert_intermediate, shape.hidden
    router = shape.layers * shape.experts * D
    shared = shape.layers * 3 * shape.shared_intermediate * D
    dense = 2 * (sum(r * c for _, (r, c), _ in muon) + head + router + shared) + attention
    routed = 2 * shape.layers * shape.top_k * 3 * F * D
    params = ((F, D), (F, D), (D, F))
    return ModelSizes(muon, params, shape.experts, shape.layers, embed, head, norms + shared, router,
                      float(dense), float(routed), shape.hidden)


# ---------------------------------------------------------------------------------------- the scenario #


@dataclass(frozen=True)
class Scenario:
    """One job: a model shape, a mesh, tokens per rank and the links. ``world = replicas x shard x tp``."""

    shape: LlamaShape
    world: int
    replicas: int = 1
    tp: int = 1
    ep: int = 1
    batch: int = 4
    seq: int = 2048
    dtype_bytes: int = 2
    #: dmuon: ``"z3"`` frees after forward and broadcasts again in backward, ``"z2"`` keeps
    reshard: str = "z3"
    #: dmuon's FSDP2 units for the params it leaves to FSDP2: ``"root"``, ``"layers"`` (the recipe), ``"none"``
    dmuon_wrap: str = "root"
    #: HSDP: dmuon's publish overlaps the next forward (``replicate_async``)
    publish_async: bool = True
    #: dmuon's Newton–Schulz, a backend of :mod:`dmuon.tools.ns_table`
    ns_backend: str = "auto"
    links: Links = field(default_factory=Links)

    def __post_init__(self) -> None:
        for name in ("world", "replicas", "tp", "ep", "batch", "seq", "dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"dmuon.plan: {name} must be a positive int, got {v!r}")
        if self.world % (self.replicas * self.tp):
            raise ValueError(f"dmuon.plan: replicas x tp ({self.replicas} x {self.tp}) must divide the world size "
                             f"({self.world})")
        moe = isinstance(self.shape, MoEShape)
        if self.ep > 1 and (not moe or self.shard % self.ep or self.shape.experts % self.ep):
            raise ValueError(f"dmuon.plan: ep={self.ep} needs an MoE preset whose experts and shard size "
                             f"({self.shard}) it divides")
        if self.reshard not in ("z2", "z3") or self.dmuon_wrap not in ("root", "layers", "none"):
            raise ValueError(f"dmuon.plan: reshard must be z2 or z3 and the wrap root, layers or none, got "
                             f"{self.reshard!r}, {self.dmuon_wrap!r}")

    @property
    def shard(self) -> int:
        """Ranks of one shard group (FSDP2's dim and dmuon's broadcast group)."""
        return self.world // (self.replicas * self.tp)

    @property
    def tokens(self) -> int:
        """Tokens per data-parallel rank and step (shared by its ``tp`` ranks)."""
        return self.batch * self.seq


# ------------------------------------------------------------------------------------------ the parts #


def host_floor_ms(layers: int, fsdp_units: int) -> float:
    """What the host needs to issue one forward + backward (:data:`HOST_MS_PER_LAYER`)."""
    return HOST_MS_PER_LAYER * layers + HOST_MS_PER_FSDP_UNIT * fsdp_units


def rate_tflops(hidden: int) -> float:
    """The achieved forward + backward rate (TFLOP/s of the model's flops) at ``hidden``, from
    :data:`COMPUTE_ANCHORS`: linear in ``log2(hidden)`` between anchors, held outside them."""
    from math import log2

    from .presets import PRESETS

    points = sorted((log2(PRESETS[p].hidden), 3 * sizes_of(PRESETS[p], seq).dense_flops * batch * seq / ms / 1e9)
                    for p, _, (batch, seq), ms, _ in COMPUTE_ANCHORS)
    x = log2(hidden)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def compute_ms(sc: Scenario, sizes: ModelSizes, fsdp_units: int) -> tuple[float, float]:
    """(forward, backward) ms of one rank: flops at the rate of its hidden size (backward twice forward), each at
    least its share of the host floor."""
    rate = rate_tflops(sizes.hidden) * 1e9  # flops per ms
    per_rank = sc.tokens / sc.tp
    fwd = per_rank * (sizes.dense_flops / rate + sizes.expert_flops / (rate * EXPERT_GEMM_EFFICIENCY))
    host = host_floor_ms(sizes.layers, fsdp_units)
    return max(fwd, HOST_FORWARD_SHARE * host), max(2 * fwd, (1 - HOST_FORWARD_SHARE) * host)


def adamw_ms(elements: float, dtype_bytes: int) -> float:
    """Fused AdamW over ``elements`` params of one rank (0 when it has none)."""
    if elements <= 0:
        return 0.0
    return ADAMW_FIXED_MS + elements * dtype_bytes * ADAMW_PASSES / (ELEMENTWISE_GBS * 1e6)


def muon_update_ms(elements: float, dtype_bytes: int) -> float:
    """Muon's element-wise work around Newton–Schulz (momentum, Nesterov, apply) on ``elements``."""
    return elements * dtype_bytes * MUON_PASSES / (ELEMENTWISE_GBS * 1e6)


def exposed_ms(collectives: list[dict[str, Any]], phase: str, compute: float) -> float:
    """What ``phase``'s collectives add to it ([Note: exposed communication])."""
    mine = [c for c in collectives if c["phase"] == phase]
    unhideable = sum(c["ms"] if c["units"] == 0 else c["ms"] / c["units"] for c in mine)
    rest: dict[str, float] = {}
    for c in mine:
        if c["units"]:
            rest[c["link"]] = rest.get(c["link"], 0.0) + c["ms"] * (1 - 1 / c["units"])
    hideable = max(rest.values(), default=0.0)
    return unhideable + max((1 - OVERLAP) * hideable, hideable - compute)
