"""Owner assignment: which rank runs Newton–Schulz for which weight matrix.

Muon's orthogonalisation needs the *whole* matrix, but under FSDP2 every rank
only holds a shard. dmuon therefore gives each selected weight (a matrix, or a
batch of them such as experts ``[E, m, n]``) exactly one owner rank that gathers
the full gradient, runs Newton–Schulz (NS) on it and sends the result back. NS
time dominates the optimizer step, so the owners must be chosen to balance NS
FLOPs across ranks; that is what this module does. A parameter's cost is the sum
over its matrices ([Note: matrix blocks] in ``dmuon/runtime/blocks.py``).

Everything here is pure Python (no torch, no torch.distributed) so that every
rank can compute the plan independently from the same inputs and get
bit-identical results, which :meth:`OwnerPlan.digest` lets callers verify.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from types import MappingProxyType

from .runtime.blocks import Blocks, RowBlocks

__all__ = [
    "ParamSpec",
    "RankLoad",
    "OwnerPlan",
    "ns_cost",
    "blocks_ns_cost",
    "shard_ns_cost",
    "assign_owners",
    "assign_node_owners",
]

# A rank counts as "about as idle as the idlest rank" when its load is within
# this fraction of the item being placed. Inside that window we trade a little
# balance for spreading one layer's matrices over different ranks (so one
# layer's gathers/scatters do not serialise on one owner). Because the slack is
# relative to the item, the max load can grow by at most 5 % of one item over
# plain longest-processing-time, and exact ties (the common case for
# transformer stacks, where many matrices share a shape) cost nothing.
_SPREAD_SLACK = 0.05


def _check_shape(shape: object, what: str, *, batched: bool = False) -> tuple[int, ...]:
    """Normalise ``shape`` (tuple, list, torch.Size, ...) to ``(rows, cols)`` of positive ints; with
    ``batched``, to any shape of 2 or more dims (leading dims a batch of matrices, each > 0)."""
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{what}: shape must be a 2-D sequence of positive ints like (4096, 4096), got {shape!r}"
        ) from None
    if len(dims) != 2 and not (batched and len(dims) > 2):
        raise ValueError(
            f"{what}: shape must be 2-D (rows, cols){' or a batch of them (E, rows, cols)' if batched else ''}, "
            f"got {shape!r} with {len(dims)} dims; only weight matrices can be orthogonalised by Muon, route "
            "other params to AdamW"
        )
    out: list[int] = []
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise ValueError(f"{what}: shape entries must be ints, got {shape!r}")
        d = operator.index(d)
        if d <= 0:
            raise ValueError(
                f"{what}: shape entries must be positive, got {shape!r}; empty matrices have nothing to orthogonalise"
            )
        out.append(d)
    return tuple(out)


def _ns_flops(rows: int, cols: int) -> int:
    """Exact integer FLOPs of one NS iteration (ints keep ties and sums exact)."""
    m, n = min(rows, cols), max(rows, cols)
    return 4 * m * m * n + 2 * m * m * m


def ns_cost(shape: tuple[int, int]) -> float:
    """FLOPs of ONE Newton–Schulz iteration on a matrix of ``shape``.

    Mirrors torch.optim.Muon, which orthogonalises the wide orientation so the
    Gram matrix is m×m with m = min(rows, cols), n = max(rows, cols):
    ``A = X @ X.T`` costs 2·m²·n, the polynomial ``b·A + c·A@A`` 2·m³ and the
    update ``B @ X`` 2·m²·n, i.e. 4·m²·n + 2·m³ in total. The number of NS steps
    is the same for every matrix, so it is a constant factor that cannot change
    a balance decision and is deliberately left out.
    """
    rows, cols = _check_shape(shape, "ns_cost")
    return float(_ns_flops(rows, cols))


def _blocks_flops(blocks: Blocks) -> int:
    """Exact integer FLOPs of one NS iteration over every matrix of ``blocks``."""
    return sum(k * _ns_flops(m, n) for (m, n), k in blocks.matrices())


def blocks_ns_cost(blocks: Blocks) -> float:
    """:func:`ns_cost` summed over every matrix of ``blocks`` (experts, row blocks)."""
    return float(_blocks_flops(blocks))


def shard_ns_cost(shape: tuple[int, ...], tp_split: tuple[int, int] | None, rows: RowBlocks = None) -> float:
    """:func:`ns_cost` of what one rank carries for a parameter it holds ``shape`` of: the sum over its
    matrices (``shape`` may be a batch ``(E, m, n)``, ``rows`` its row blocks, see [Note: matrix blocks] in
    ``dmuon/runtime/blocks.py``), or under tensor parallelism (``tp_split = (tp_dim, tp_size)``, ``shape`` a
    shard of a 2-D matrix) ``1/tp_size`` of the whole matrix's, since its Newton–Schulz runs whole on one of
    the owner slot's tp ranks ([Note: TP update] in ``dmuon/optim/tp_update.py``)."""
    dims = _check_shape(shape, "shard_ns_cost", batched=tp_split is None)
    if tp_split is None:
        return float(_blocks_flops(Blocks.of(dims, rows, what="shard_ns_cost")))
    return _blocks_flops(Blocks.of(_full_shape(dims, tp_split), rows, what="shard_ns_cost")) / tp_split[1]


def _full_shape(shape: tuple[int, ...], tp_split: tuple[int, int] | None) -> tuple[int, ...]:
    """The whole matrix of which ``shape`` is a TP shard (``shape`` itself without ``tp_split``)."""
    if tp_split is None:
        return shape
    dim, t = tp_split
    return (shape[0] * t, shape[1]) if dim == 0 else (shape[0], shape[1] * t)


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one Muon-managed weight.

    ``layer`` is the hook-boundary key (e.g. ``"model.layers.3"``): small
    matrices of the same layer are packed onto one owner so they can travel as
    one bucket, and a layer's big matrices are spread over different owners.
    """

    fqn: str
    #: the matrix ``(rows, cols)``, or a batch of matrices ``(E, rows, cols)`` (experts)
    shape: tuple[int, ...]
    layer: str
    #: tensor parallelism: ``shape`` is a shard of a matrix split ``tp_size`` ways along ``tp_dim``, whose
    #: Newton–Schulz runs on the whole matrix on one of the owner slot's tp ranks ([Note: TP update] in
    #: ``dmuon/optim/tp_update.py``): it weighs ``1/tp_size`` of the whole matrix's cost. ``(tp_dim, tp_size)``
    tp_split: tuple[int, int] | None = None
    #: declared row blocks of each matrix (fused QKV), ``None``: one block ([Note: matrix blocks] in
    #: ``dmuon/runtime/blocks.py``); they split the whole matrix, also when ``shape`` is a TP shard of it
    rows: RowBlocks = None

    def __post_init__(self) -> None:
        if not isinstance(self.fqn, str) or not self.fqn:
            raise ValueError(
                f"ParamSpec.fqn must be a non-empty str (the parameter's fully qualified name), got {self.fqn!r}"
            )
        if not isinstance(self.layer, str):
            raise ValueError(
                f"ParamSpec.layer for {self.fqn!r} must be a str such as 'model.layers.3', got {self.layer!r}"
            )
        # Normalise torch.Size / lists to a plain tuple so specs hash and compare by value.
        what = f"ParamSpec {self.fqn!r}"
        object.__setattr__(self, "shape", _check_shape(self.shape, what, batched=self.tp_split is None))
        if self.rows is not None:
            object.__setattr__(self, "rows", Blocks.of(_full_shape(self.shape, self.tp_split), self.rows, what=what).spec)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cost(self) -> float:
        """NS FLOPs per iteration, see :func:`shard_ns_cost`."""
        return shard_ns_cost(self.shape, self.tp_split, self.rows)


@dataclass(frozen=True)
class RankLoad:
    """The matrices one rank owns and the work they cost it."""

    rank: int
    fqns: tuple[str, ...]  # in plan order (descending cost; packed params stay adjacent)
    numel: int
    #: NS FLOPs per iteration of everything this rank runs: what it owns plus :attr:`engine_cost`
    cost: float
    #: the part of :attr:`cost` from matrices the engine's shards put here (``Route.MUON_SHARDED`` experts),
    #: which the plan balances around
    engine_cost: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fqns", tuple(self.fqns))


@dataclass(frozen=True)
class OwnerPlan:
    """Owner rank of every Muon matrix, plus per-rank load for logging.

    ``owners`` is a read-only mapping; it is excluded from the hash because
    ``ranks`` already determines it (and mapping proxies are unhashable).
    """

    world_size: int
    owners: Mapping[str, int] = field(hash=False)
    ranks: tuple[RankLoad, ...]

    def __post_init__(self) -> None:
        # Cheap consistency checks so a hand-built plan cannot silently disagree with itself.
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"OwnerPlan.world_size must be an int >= 1, got {self.world_size!r}")
        ranks = tuple(self.ranks)
        if len(ranks) != self.world_size or any(r.rank != i for i, r in enumerate(ranks)):
            raise ValueError(
                f"OwnerPlan.ranks must hold one RankLoad per rank in rank order (0..{self.world_size - 1}), "
                f"got ranks {[r.rank for r in ranks]}"
            )
        owners = dict(sorted(dict(self.owners).items()))
        listed = {fqn: r.rank for r in ranks for fqn in r.fqns}
        if listed != owners:
            raise ValueError(
                "OwnerPlan.owners disagrees with OwnerPlan.ranks[*].fqns; build plans with assign_owners()"
            )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "owners", MappingProxyType(owners))

    @property
    def imbalance(self) -> float:
        """max / mean NS cost over ranks: the step's NS time relative to a perfect split."""
        total = sum(r.cost for r in self.ranks)
        if total <= 0:
            return 1.0
        return max(r.cost for r in self.ranks) / (total / self.world_size)

    def digest(self) -> str:
        """SHA-256 of the assignment, to all-gather and compare so ranks never disagree on owners."""
        canonical = json.dumps(
            [self.world_size, sorted(self.owners.items())],
            separators=(",", ":"),
            ensure_ascii=True,
        )
        return hashlib.sha256(canonical.encode("ascii")).hexdigest()

    def summary_line(self) -> str:
        """One log line; enough to spot a bad split without dumping the plan (element counts in K/M/G, so
        an 8B model's 218M-element shares read at a glance)."""
        counts = [len(r.fqns) for r in self.ranks]
        numels = [r.numel for r in self.ranks]
        idle = counts.count(0)
        return (
            f"dmuon: {len(self.owners)} dedicated params over {_plural(self.world_size, 'rank')}, "
            f"NS-cost imbalance {self.imbalance:.3f} (max/mean), "
            f"per-rank params {min(counts)}..{max(counts)}, "
            f"elements {_count(min(numels))}..{_count(max(numels))}"
            + (f", {_plural(idle, 'rank')} own{'s' if idle == 1 else ''} none" if idle else "")
        )

    def as_dict(self) -> dict:
        """JSON-able summary for benchmark/telemetry output."""
        return {
            "world_size": self.world_size,
            "imbalance": self.imbalance,
            "digest": self.digest(),
            "per_rank": [
                {"rank": r.rank, "params": len(r.fqns), "numel": r.numel, "cost": r.cost}
                for r in self.ranks
            ],
        }


def _plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _count(n: int) -> str:
    """An element count for people: ``950``, ``12.6K``, ``218M``, ``6.98G``, ``14.0G``: three significant
    digits, trailing zeros kept, so counts printed side by side carry the same precision."""
    if n < 1000:
        return str(n)
    for exp, unit in enumerate("KMGT", start=1):
        v = float(f"{n / 1000**exp:.3g}")  # rounded to 3 digits first: 999.96K is 1.00M, not 1e+03K
        if v < 1000 or unit == "T":
            return f"{v:.{max(0, 3 - len(str(int(v))))}f}{unit}"
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Item:
    """A unit of assignment: one matrix, or all small matrices of one layer."""

    cost: int
    fqns: tuple[str, ...]
    layer: str
    numel: int


def _build_items(specs: Sequence[ParamSpec], world_size: int, pack_fraction: float) -> list[_Item]:
    costs = {s.fqn: s.cost for s in specs}
    total = sum(costs.values())
    threshold = pack_fraction * total / world_size
    items: list[_Item] = []
    small: dict[str, list[ParamSpec]] = {}
    for s in specs:
        if costs[s.fqn] < threshold:
            small.setdefault(s.layer, []).append(s)
        else:
            items.append(_Item(costs[s.fqn], (s.fqn,), s.layer, s.numel))
    for layer, group in small.items():
        group = sorted(group, key=lambda s: s.fqn)
        items.append(
            _Item(
                sum(costs[s.fqn] for s in group),
                tuple(s.fqn for s in group),
                layer,
                sum(s.numel for s in group),
            )
        )
    # fqns are unique, so (−cost, first fqn) is a total order independent of input order.
    items.sort(key=lambda it: (-it.cost, it.fqns[0]))
    return items


def assign_owners(
    specs: Sequence[ParamSpec],
    world_size: int,
    *,
    pack_fraction: float = 1 / 64,
    preload: Sequence[float] | None = None,
) -> OwnerPlan:
    """Give every spec exactly one owner rank, balancing NS FLOPs.

    Longest-processing-time greedy over items sorted by (descending cost,
    fqn): each goes to the least-loaded rank, except that among ranks within
    a small slack of the minimum it prefers the rank owning the fewest items
    of the same layer. Specs costing less than ``pack_fraction`` of a rank's
    fair share are packed per layer into one item (one owner, one bucket),
    because per-matrix collectives for tiny matrices cost more in latency than
    their NS work. ``pack_fraction=0`` disables packing.

    ``preload``: NS work each rank already has that is not the plan's to place
    (experts on the engine's shards); the greedy starts from it. ``specs`` may
    be empty when everything Muon updates is preloaded.

    The result depends only on the *set* of specs, never on their order, so
    all ranks compute the same plan.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    if (
        isinstance(pack_fraction, bool)
        or not isinstance(pack_fraction, (int, float))
        or not math.isfinite(pack_fraction)
        or not 0 <= pack_fraction <= 1
    ):
        raise ValueError(
            f"pack_fraction must be a float in [0, 1] (0 disables packing), got {pack_fraction!r}"
        )
    specs = list(specs)
    base = [0] * world_size if preload is None else [int(round(x)) for x in preload]
    if len(base) != world_size or any(x < 0 for x in base):
        raise ValueError(f"preload must hold one non-negative cost per rank ({world_size}), got {preload!r}")
    if not specs and preload is None:
        raise ValueError("assign_owners needs at least one ParamSpec; got an empty list (nothing for Muon to own)")
    for s in specs:
        if not isinstance(s, ParamSpec):
            raise ValueError(f"assign_owners expects ParamSpec entries, got {s!r}; wrap it as ParamSpec(fqn, shape, layer)")
    dups = sorted(f for f, n in Counter(s.fqn for s in specs).items() if n > 1)
    if dups:
        raise ValueError(f"duplicate fqns in specs: {dups}; each parameter must be listed once")

    loads = list(base)  # exact ints, so ties are real ties
    owned: list[list[_Item]] = [[] for _ in range(world_size)]
    layer_count: dict[tuple[int, str], int] = {}
    for item in _build_items(specs, world_size, pack_fraction):
        limit = min(loads) + _SPREAD_SLACK * item.cost
        rank = min(
            (r for r in range(world_size) if loads[r] <= limit),
            key=lambda r: (layer_count.get((r, item.layer), 0), loads[r], r),
        )
        loads[rank] += item.cost
        owned[rank].append(item)
        layer_count[(rank, item.layer)] = layer_count.get((rank, item.layer), 0) + 1

    ranks = tuple(
        RankLoad(
            rank=r,
            fqns=tuple(f for it in owned[r] for f in it.fqns),
            numel=sum(it.numel for it in owned[r]),
            cost=float(loads[r]),
            engine_cost=float(base[r]),
        )
        for r in range(world_size)
    )
    owners = {f: r.rank for r in ranks for f in r.fqns}
    return OwnerPlan(world_size=world_size, owners=owners, ranks=ranks)


def assign_node_owners(
    specs: Sequence[ParamSpec],
    nodes: int,
    per_node: int,
    *,
    preload: Sequence[float] | None = None,
) -> OwnerPlan:
    """The node layout's plan ([Note: node layout] in ``dmuon/runtime/hierarchy.py``): every boundary (``layer``)
    owned inside one node, its matrices spread over that node's ``per_node`` ranks, slot ``node x per_node +
    local``.

    Boundaries are dealt to nodes by bytes (largest first, ties by name, each to the node holding the fewest
    elements so far, then the lowest index), so every node sends about the same share across the network; each
    node's specs then go through :func:`assign_owners` over its ``per_node`` slots (with its part of
    ``preload``). Like :func:`assign_owners`, the result depends only on the set of specs.

    Example::

        specs = [ParamSpec(f"layers.{i}.{n}", (64, 64), f"layers.{i}") for i in range(4) for n in "qkvo"]
        plan = assign_node_owners(specs, nodes=2, per_node=4)   # layers 0 and 2 on node 0, 1 and 3 on node 1
        assert {plan.owners["layers.1.q"] // 4, plan.owners["layers.2.q"] // 4} == {0, 1}
    """
    for name, v in (("nodes", nodes), ("per_node", per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"assign_node_owners: {name} must be an int >= 1, got {v!r}")
    world = nodes * per_node
    base = [0.0] * world if preload is None else [float(x) for x in preload]
    if len(base) != world or any(x < 0 for x in base):
        raise ValueError(f"preload must hold one non-negative cost per rank ({world}), got {preload!r}")
    dups = sorted(f for f, k in Counter(getattr(s, "fqn", None) for s in specs).items() if k > 1)
    if dups:
        raise ValueError(f"duplicate fqns in specs: {dups}; each parameter must be listed once")
    layers: dict[str, list[ParamSpec]] = {}
    for s in specs:
        if not isinstance(s, ParamSpec):
            raise ValueError(f"assign_node_owners expects ParamSpec entries, got {s!r}; wrap it as ParamSpec(fqn, shape, "
                             "layer)")
        layers.setdefault(s.layer, []).append(s)
    held = [0] * nodes
    mine: list[list[ParamSpec]] = [[] for _ in range(nodes)]
    for layer in sorted(layers, key=lambda x: (-sum(s.numel for s in layers[x]), x)):
        node = min(range(nodes), key=lambda k: (held[k], k))
        held[node] += sum(s.numel for s in layers[layer])
        mine[node] += layers[layer]
    loads: list[RankLoad] = []
    for node in range(nodes):
        share = base[node * per_node : (node + 1) * per_node]
        if not mine[node]:
            loads += [RankLoad(node * per_node + r, (), 0, share[r], share[r]) for r in range(per_node)]
            continue
        sub = assign_owners(mine[node], per_node, preload=share if preload is not None else None)
        loads += [dataclass_replace(r, rank=node * per_node + r.rank) for r in sub.ranks]
    owners = {f: r.rank for r in loads for f in r.fqns}
    return OwnerPlan(world_size=world, owners=owners, ranks=tuple(loads))
