"""Owner assignment (dmuon.partition) and Llama shape presets (dmuon.tools.presets).

Pure Python, no torch.distributed: these run in well under a second.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import pytest

from dmuon.partition import OwnerPlan, ParamSpec, RankLoad, assign_owners, ns_cost
from dmuon.tools.presets import PRESETS, LlamaShape, projection_specs

U = 4096**3  # NS-cost unit for Llama-3.1-8B: q/o cost 6U, gate/up/down 16U, k/v 18/64 U


def _layer_of(fqn: str) -> str:
    return ".".join(fqn.split(".")[:3])


def _proj_of(fqn: str) -> str:
    return fqn.split(".")[-2]


# --------------------------------------------------------------------------- ns_cost


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((1, 1), 6),
        ((2, 3), 4 * 2 * 2 * 3 + 2 * 2**3),  # 64
        ((4096, 4096), 6 * U),
        ((14336, 4096), 4 * 4096**2 * 14336 + 2 * 4096**3),  # == 16U
        ((1024, 4096), 18 * 1024**3),
    ],
)
def test_ns_cost_formula(shape: tuple[int, int], expected: int) -> None:
    assert ns_cost(shape) == float(expected)
    assert isinstance(ns_cost(shape), float)


def test_ns_cost_is_orientation_independent() -> None:
    # Muon orthogonalises the wide orientation, so (out, in) and (in, out) cost the same.
    assert ns_cost((1024, 4096)) == ns_cost((4096, 1024))
    assert ns_cost((4096, 14336)) == ns_cost((14336, 4096)) == 16 * U
    # ...but it is not symmetric in the "m²n" sense of ignoring which side is small.
    assert ns_cost((1024, 4096)) < ns_cost((4096, 4096))


@pytest.mark.parametrize("shape", [(0, 3), (3, -1), (3,), (2, 3, 4), (2.0, 3), (True, 3), "ab", 5])
def test_ns_cost_rejects_bad_shapes(shape: object) -> None:
    with pytest.raises(ValueError, match="shape"):
        ns_cost(shape)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- Llama-3.1-8B balance


def _plan_8b(ws: int) -> OwnerPlan:
    return assign_owners(projection_specs("llama3-8b"), ws)


@pytest.mark.parametrize("ws", [8, 16])
def test_llama8b_perfect_split_is_found(ws: int) -> None:
    plan = _plan_8b(ws)
    print(f"llama3-8b ws={ws}: imbalance {plan.imbalance:.6f} | {plan.summary_line()}")
    assert plan.imbalance <= 1.01
    # 1938U splits exactly (12 MLP + 8 q/o + 4 packed k/v per rank at 8), so we expect exactly 1.
    assert plan.imbalance == pytest.approx(1.0, abs=1e-12)
    costs = {r.cost for r in plan.ranks}
    assert costs == {1938 * U / ws}


def test_llama8b_64_ranks_hits_the_forced_bound() -> None:
    plan = _plan_8b(64)
    print(f"llama3-8b ws=64: imbalance {plan.imbalance:.6f} | {plan.summary_line()}")
    # 96 matrices of 16U over 64 ranks: some rank owns two, so max >= 32U for ANY whole-matrix
    # ownership, while the mean is 1938U/64. Matching this bound exactly means we lose nothing.
    forced = 32 * U / (1938 * U / 64)
    assert forced == pytest.approx(1.0568, abs=1e-4)
    assert 1.05 <= plan.imbalance <= 1.06
    assert plan.imbalance == pytest.approx(forced, rel=1e-12)
    assert max(r.cost for r in plan.ranks) == 32 * U


def test_llama8b_every_param_owned_exactly_once() -> None:
    specs = projection_specs("llama3-8b")
    for ws in (1, 7, 8, 64, 300):
        plan = assign_owners(specs, ws)
        listed = [f for r in plan.ranks for f in r.fqns]
        assert len(listed) == len(set(listed)) == len(specs) == 224
        assert set(listed) == {s.fqn for s in specs} == set(plan.owners)
        for r in plan.ranks:
            assert all(plan.owners[f] == r.rank for f in r.fqns)
        by_fqn = {s.fqn: s for s in specs}
        for r in plan.ranks:
            assert r.numel == sum(by_fqn[f].numel for f in r.fqns)
            assert r.cost == sum(ns_cost(by_fqn[f].shape) for f in r.fqns)


@pytest.mark.parametrize("ws", [8, 16])
def test_llama8b_mlp_matrices_of_a_layer_on_distinct_ranks(ws: int) -> None:
    plan = _plan_8b(ws)
    mlp = defaultdict(list)
    for fqn, rank in plan.owners.items():
        if _proj_of(fqn) in ("gate_proj", "up_proj", "down_proj"):
            mlp[_layer_of(fqn)].append(rank)
    assert len(mlp) == 32
    for layer, ranks in mlp.items():
        assert len(set(ranks)) == 3, (layer, ranks)


def test_llama8b_small_kv_packed_per_layer_by_default() -> None:
    # k/v cost 18/64 U, far below 1/64 of a rank's fair share at 8 ranks (3.8U): one owner per layer.
    plan = _plan_8b(8)
    for i in range(32):
        k = plan.owners[f"model.layers.{i}.self_attn.k_proj.weight"]
        v = plan.owners[f"model.layers.{i}.self_attn.v_proj.weight"]
        assert k == v
    # Packed params are adjacent in the owner's list so they can be bucketed together.
    r0 = plan.ranks[plan.owners["model.layers.0.self_attn.k_proj.weight"]].fqns
    i = r0.index("model.layers.0.self_attn.k_proj.weight")
    assert r0[i + 1] == "model.layers.0.self_attn.v_proj.weight"


def test_llama8b_without_packing_at_64_ranks_spreads_every_layer() -> None:
    plan = assign_owners(projection_specs("llama3-8b"), 64, pack_fraction=0)
    per_layer = defaultdict(set)
    for fqn, rank in plan.owners.items():
        per_layer[_layer_of(fqn)].add(rank)
    assert all(len(r) == 7 for r in per_layer.values())
    assert plan.imbalance == pytest.approx(32 * 64 / 1938, rel=1e-12)


# --------------------------------------------------------------------------- spreading rule


def test_equal_loads_prefer_rank_without_same_layer() -> None:
    # Plain LPT with lowest-rank tie-break would put a.w2 next to a.w1 on rank 0.
    specs = [
        ParamSpec("a.w1", (64, 64), "a"),
        ParamSpec("b.w1", (64, 64), "b"),
        ParamSpec("a.w2", (8, 8), "a"),
    ]
    plan = assign_owners(specs, 2, pack_fraction=0)
    assert plan.owners["a.w1"] == 0 and plan.owners["b.w1"] == 1
    assert plan.owners["a.w2"] == 1


def test_near_equal_loads_within_slack_prefer_other_layer() -> None:
    # b.w1 (65x64) is 1% costlier than a.w1, so plain LPT sends a.w2 to a.w1's rank. The
    # load gap (16384) is within 5% of a.w2's cost (384000), so spreading wins.
    specs = [
        ParamSpec("a.w1", (64, 64), "a"),
        ParamSpec("b.w1", (65, 64), "b"),
        ParamSpec("a.w2", (40, 40), "a"),
    ]
    plan = assign_owners(specs, 2, pack_fraction=0)
    assert plan.owners["b.w1"] == 0 and plan.owners["a.w1"] == 1
    assert plan.owners["a.w2"] == 0


def test_balance_beats_spreading_outside_slack() -> None:
    # Same as above but a.w2 is tiny: a 16384-FLOP gap is far beyond 5% of its 3072 FLOPs,
    # so it goes to the least-loaded rank even though that rank already holds layer a.
    specs = [
        ParamSpec("a.w1", (64, 64), "a"),
        ParamSpec("b.w1", (65, 64), "b"),
        ParamSpec("a.w2", (8, 8), "a"),
    ]
    plan = assign_owners(specs, 2, pack_fraction=0)
    assert plan.owners["a.w2"] == plan.owners["a.w1"] == 1


# --------------------------------------------------------------------------- packing


def _packing_specs() -> list[ParamSpec]:
    specs = []
    for layer in range(4):
        specs.append(ParamSpec(f"l{layer}.big", (512, 512), f"l{layer}"))
        specs += [ParamSpec(f"l{layer}.tiny{j}", (4, 4), f"l{layer}") for j in range(3)]
    return specs


def test_small_params_of_a_layer_share_one_owner() -> None:
    plan = assign_owners(_packing_specs(), 4)
    for layer in range(4):
        owners = {plan.owners[f"l{layer}.tiny{j}"] for j in range(3)}
        assert len(owners) == 1, (layer, owners)
        fqns = plan.ranks[owners.pop()].fqns
        i = fqns.index(f"l{layer}.tiny0")
        assert fqns[i : i + 3] == tuple(f"l{layer}.tiny{j}" for j in range(3))


def test_packing_disabled_spreads_small_params() -> None:
    # Contrast: as independent items the tiny params of one layer go to different ranks.
    plan = assign_owners(_packing_specs(), 4, pack_fraction=0)
    for layer in range(4):
        owners = {plan.owners[f"l{layer}.tiny{j}"] for j in range(3)}
        assert len(owners) == 3, (layer, owners)


def test_packing_threshold_is_relative_to_fair_share() -> None:
    # Same tiny params are not "small" if the model is made only of them.
    specs = [ParamSpec(f"l.tiny{j}", (4, 4), "l") for j in range(5)]
    plan = assign_owners(specs, 4)
    assert sorted(plan.owners.values()) == [0, 0, 1, 2, 3]
    # ...and pack_fraction=1 packs anything below a whole fair share (5/4 of one tiny here).
    plan = assign_owners(specs, 4, pack_fraction=1)
    assert set(plan.owners.values()) == {0}
    # With 4 params on 4 ranks each costs exactly the fair share: not "below", so not packed.
    plan = assign_owners(specs[:4], 4, pack_fraction=1)
    assert sorted(plan.owners.values()) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- determinism / digest


def test_shuffled_input_gives_identical_plan_and_digest() -> None:
    specs = projection_specs("llama3-8b") + _packing_specs()
    for ws in (3, 8, 64):
        ref = assign_owners(specs, ws)
        for seed in range(5):
            shuffled = list(specs)
            random.Random(seed).shuffle(shuffled)
            plan = assign_owners(shuffled, ws)
            assert plan == ref
            assert plan.ranks == ref.ranks  # per-rank order too, not just the owner map
            assert plan.digest() == ref.digest()
            assert hash(plan) == hash(ref)


def test_digest_changes_with_assignment_and_world_size() -> None:
    specs = projection_specs("125m")
    d8, d16 = assign_owners(specs, 8).digest(), assign_owners(specs, 16).digest()
    assert len(d8) == 64 and int(d8, 16) >= 0
    assert d8 != d16

    a = RankLoad(0, ("x",), 1, 6.0)
    b = RankLoad(1, ("y",), 1, 6.0)
    p1 = OwnerPlan(2, {"x": 0, "y": 1}, (a, b))
    p2 = OwnerPlan(2, {"x": 1, "y": 0}, (RankLoad(0, ("y",), 1, 6.0), RankLoad(1, ("x",), 1, 6.0)))
    assert p1.digest() != p2.digest()
    # Insertion order of the mapping must not matter.
    assert OwnerPlan(2, {"y": 1, "x": 0}, (a, b)).digest() == p1.digest()


def test_plan_is_frozen_and_hashable() -> None:
    plan = assign_owners(_packing_specs(), 2)
    with pytest.raises(TypeError):
        plan.owners["l0.big"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        plan.world_size = 3  # type: ignore[misc]
    assert {plan: 1}[plan] == 1


def test_inconsistent_hand_built_plan_rejected() -> None:
    a = RankLoad(0, ("x",), 1, 6.0)
    b = RankLoad(1, ("y",), 1, 6.0)
    with pytest.raises(ValueError, match="disagrees"):
        OwnerPlan(2, {"x": 1, "y": 1}, (a, b))
    with pytest.raises(ValueError, match="one RankLoad per rank"):
        OwnerPlan(3, {"x": 0, "y": 1}, (a, b))


# --------------------------------------------------------------------------- edge cases


def test_world_size_one_puts_everything_on_rank_zero() -> None:
    specs = projection_specs("llama3.2-1b")
    plan = assign_owners(specs, 1)
    assert set(plan.owners.values()) == {0}
    assert len(plan.ranks) == 1 and len(plan.ranks[0].fqns) == len(specs)
    assert plan.imbalance == 1.0


def test_more_ranks_than_params() -> None:
    specs = [ParamSpec(f"w{i}", (16, 16), "l") for i in range(3)]
    plan = assign_owners(specs, 8)
    assert sorted(plan.owners.values()) == [0, 1, 2]
    assert [len(r.fqns) for r in plan.ranks] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert plan.ranks[5] == RankLoad(5, (), 0, 0.0)
    # Reported honestly: the busiest rank does 8/3 of the mean.
    assert plan.imbalance == pytest.approx(8 / 3)
    assert "per-rank params 0..1" in plan.summary_line()


def test_summary_line_and_as_dict() -> None:
    plan = _plan_8b(8)
    line = plan.summary_line()
    assert "\n" not in line
    assert line.startswith("dmuon: 224 dedicated params over 8 ranks, NS-cost imbalance 1.000 (max/mean)")
    assert "per-rank params 28..28" in line
    d = json.loads(json.dumps(plan.as_dict()))
    assert d["world_size"] == 8 and d["imbalance"] == pytest.approx(1.0)
    assert d["digest"] == plan.digest()
    assert [r["rank"] for r in d["per_rank"]] == list(range(8))
    assert sum(r["params"] for r in d["per_rank"]) == 224
    assert sum(r["numel"] for r in d["per_rank"]) == sum(s.numel for s in projection_specs("llama3-8b"))
    assert set(d["per_rank"][0]) == {"rank", "params", "numel", "cost"}


# --------------------------------------------------------------------------- validation


def test_duplicate_fqn_rejected() -> None:
    specs = [ParamSpec("w", (4, 4), "l"), ParamSpec("v", (4, 4), "l"), ParamSpec("w", (8, 8), "m")]
    with pytest.raises(ValueError, match=r"duplicate fqns.*\['w'\]"):
        assign_owners(specs, 2)


@pytest.mark.parametrize("ws", [0, -1, 2.0, True, "8", None])
def test_bad_world_size_rejected(ws: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([ParamSpec("w", (4, 4), "l")], ws)  # type: ignore[arg-type]


def test_empty_specs_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        assign_owners([], 4)


@pytest.mark.parametrize("pf", [-0.1, 1.5, float("nan"), float("inf"), "0.1", None])
def test_bad_pack_fraction_rejected(pf: object) -> None:
    with pytest.raises(ValueError, match="pack_fraction"):
        assign_owners([ParamSpec("w", (4, 4), "l")], 2, pack_fraction=pf)  # type: ignore[arg-type]


def test_non_spec_entry_rejected() -> None:
    with pytest.raises(ValueError, match="ParamSpec"):
        assign_owners([("w", (4, 4), "l")], 2)  # type: ignore[list-item]


@pytest.mark.parametrize("shape", [(4,), (0, 4), (4, -2), (4.0, 4), (0, 4, 4), (4, 0, 4)])
def test_bad_param_shape_rejected(shape: object) -> None:
    with pytest.raises(ValueError, match="'w'.*shape"):
        ParamSpec("w", shape, "l")  # type: ignore[arg-type]


def test_batched_and_blocked_specs_cost_their_matrices() -> None:
    """Experts ``[E, m, n]`` weigh ``E`` matrices, never one ``E m x n`` matrix; row blocks weigh each block."""
    assert ParamSpec("e", (8, 64, 32), "l").cost == 8 * ns_cost((64, 32))
    assert ParamSpec("e", (8, 64, 32), "l").cost != ns_cost((8 * 64, 32))
    assert ParamSpec("e", (8, 64, 32), "l").numel == 8 * 64 * 32
    assert ParamSpec("qkv", (96, 64), "l", rows=(64, 16, 16)).cost == ns_cost((64, 64)) + 2 * ns_cost((16, 64))
    assert ParamSpec("gu", (4, 64, 32), "l", rows=2).rows == (32, 32)
    assert ParamSpec("gu", (4, 64, 32), "l", rows=2).cost == 8 * ns_cost((32, 32))
    with pytest.raises(ValueError, match="do not tile"):
        ParamSpec("qkv", (96, 64), "l", rows=(64, 16))
    with pytest.raises(ValueError, match="'w'.*2-D"):
        ParamSpec("w", (2, 8, 4), "l", tp_split=(0, 2))  # tensor parallelism splits matrices, not batches


def test_param_spec_normalises_shape_and_checks_names() -> None:
    s = ParamSpec("w", [3, 5], "l")  # type: ignore[arg-type]
    assert s.shape == (3, 5) and type(s.shape) is tuple
    assert s == ParamSpec("w", (3, 5), "l") and hash(s) == hash(ParamSpec("w", (3, 5), "l"))
    assert s.numel == 15 and s.cost == ns_cost((3, 5))
    with pytest.raises(ValueError, match="fqn"):
        ParamSpec("", (3, 5), "l")
    with pytest.raises(ValueError, match="layer"):
        ParamSpec("w", (3, 5), None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- presets


def test_presets_have_expected_names() -> None:
    assert set(PRESETS) == {"tiny", "125m", "llama3.2-1b", "llama3.2-3b", "llama3-8b"}
    with pytest.raises(TypeError):
        PRESETS["x"] = PRESETS["125m"]  # type: ignore[index]


def test_llama8b_projection_shapes() -> None:
    specs = projection_specs("llama3-8b")
    assert len(specs) == 32 * 7
    by = {s.fqn: s for s in specs}
    assert len(by) == len(specs)
    L = "model.layers.31"
    assert by[f"{L}.self_attn.q_proj.weight"].shape == (4096, 4096)
    assert by[f"{L}.self_attn.k_proj.weight"].shape == (1024, 4096)
    assert by[f"{L}.self_attn.v_proj.weight"].shape == (1024, 4096)
    assert by[f"{L}.self_attn.o_proj.weight"].shape == (4096, 4096)
    assert by[f"{L}.mlp.gate_proj.weight"].shape == (14336, 4096)
    assert by[f"{L}.mlp.up_proj.weight"].shape == (14336, 4096)
    assert by[f"{L}.mlp.down_proj.weight"].shape == (4096, 14336)
    assert all(s.layer == _layer_of(s.fqn) for s in specs)
    # Llama-3.1-8B has ~6.98B parameters in its projections.
    assert sum(s.numel for s in specs) == 32 * (2 * 4096**2 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    assert Counter(_proj_of(s.fqn) for s in specs) == {
        p: 32 for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    }


@pytest.mark.parametrize(
    ("name", "layers", "q", "kv", "gate"),
    [
        ("125m", 12, (768, 768), (768, 768), (3072, 768)),
        ("llama3.2-1b", 16, (2048, 2048), (512, 2048), (8192, 2048)),
        ("llama3.2-3b", 28, (3072, 3072), (1024, 3072), (8192, 3072)),
    ],
)
def test_small_preset_shapes(name: str, layers: int, q: tuple, kv: tuple, gate: tuple) -> None:
    specs = projection_specs(name)
    assert len(specs) == 7 * layers
    by = {_proj_of(s.fqn): s.shape for s in specs if s.layer == "model.layers.0"}
    assert by["q_proj"] == q and by["k_proj"] == kv and by["v_proj"] == kv
    assert by["o_proj"] == (q[1], q[0])
    assert by["gate_proj"] == by["up_proj"] == gate
    assert by["down_proj"] == (gate[1], gate[0])


def test_custom_shape_and_unknown_preset() -> None:
    tiny = LlamaShape("tiny", hidden=16, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=100)
    specs = projection_specs(tiny)
    assert [s.fqn for s in specs[:2]] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ]
    assert specs[1].shape == (8, 16)
    with pytest.raises(ValueError, match=r"llama3-8b.*|125m"):
        projection_specs("llama-8b")
    with pytest.raises(ValueError, match="valid names: 125m, llama3-8b, llama3.2-1b, llama3.2-3b"):
        projection_specs("nope")
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaShape("bad", hidden=16, intermediate=48, layers=2, heads=3, kv_heads=2, head_dim=4, vocab=100)
    with pytest.raises(ValueError, match="hidden"):
        LlamaShape("bad", hidden=0, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=4, vocab=100)


def test_a_tensor_parallel_shard_weighs_its_share_of_the_whole_matrix():
    """Under TP an owner slot runs Newton-Schulz on whole matrices, dealt over its t tp ranks ([Note: TP
    update]): a shard weighs 1/t of its matrix's cost, not the cost of a shard-shaped matrix (for a 4096^2
    matrix split 8 ways by rows, 11x more than a 512 x 4096 matrix would)."""
    from dmuon.partition import ParamSpec, assign_owners, ns_cost

    rows = ParamSpec("q", (512, 4096), "layers.0", tp_split=(0, 8))
    cols = ParamSpec("o", (4096, 512), "layers.0", tp_split=(1, 8))
    assert rows.cost == cols.cost == ns_cost((4096, 4096)) / 8
    assert rows.cost > 10 * ParamSpec("q", (512, 4096), "layers.0").cost  # a shard-shaped matrix: 11x less
    # a slot with one whole 4096^2 matrix balances eight shards' worth of them on the other slot
    plan = assign_owners([ParamSpec("w", (4096, 4096), "a")]
                         + [ParamSpec(f"s{i}", (512, 4096), f"b{i}", tp_split=(0, 8)) for i in range(8)], 2)
    assert plan.imbalance == 1.0, plan.summary_line()
