"""Bad input fails loudly, with the offending name, before anything changes (no attribute set, no
storage freed, no hook left behind), and hook boundaries resolve as documented."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests._dist import run_distributed
from tests._training import build_model

import dmuon
from dmuon.runtime.hooks import STATE_ATTR


def _fingerprint(model: nn.Module) -> dict:
    return {
        "tagged": [n for n, p in model.named_parameters() if hasattr(p, "_dedicated_owner_rank")],
        "state": getattr(model, STATE_ATTR, None) is not None,
        "storage": {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()},
        # (0-byte placeholders must not be read: that is a segfault, not an exception)
        "values": {n: p.detach().clone() for n, p in model.named_parameters() if p.untyped_storage().nbytes()},
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
    }


def _unchanged(before: dict, model: nn.Module) -> bool:
    after = _fingerprint(model)
    return (
        before["tagged"] == after["tagged"]
        and before["state"] == after["state"]
        and before["storage"] == after["storage"]
        and before["hooks"] == after["hooks"]
        and all(torch.equal(before["values"][k], after["values"][k]) for k in before["values"])
    )


class Vision(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(2))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(2))


class Multimodal(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = Vision()
        self.decoder = Decoder()
        self.head = nn.Linear(8, 4)


def misuse_job(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    proj = lambda n, p: p.ndim == 2 and "proj" in n  # noqa: E731
    out: dict[str, tuple[str, str, bool]] = {}

    def attempt(case: str, model: nn.Module, fn) -> None:
        before = _fingerprint(model)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded and checked by the test
            out[case] = (type(e).__name__, str(e), _unchanged(before, model))
        else:
            out[case] = ("no error", "", _unchanged(before, model))

    m = build_model()
    fully_shard(m.layers[0], mesh=mesh)
    attempt("after_fully_shard", m, lambda: dmuon.dedicate_params(m, mesh, proj))

    m = build_model()
    attempt("non_2d", m, lambda: dmuon.dedicate_params(m, mesh, lambda n, p: "proj" in n or "norm" in n))
    m = build_model()
    m.layers[0].mlp.up_proj.weight.requires_grad_(False)
    attempt("frozen", m, lambda: dmuon.dedicate_params(m, mesh, proj))
    m = build_model()
    attempt("selects_nothing", m, lambda: dmuon.dedicate_params(m, mesh, lambda n, p: False))
    m = build_model()
    m.layers[1].attention.q_proj.weight = m.layers[0].attention.q_proj.weight
    attempt("tied", m, lambda: dmuon.dedicate_params(m, mesh, proj))
    m = build_model()
    compiled = torch.compile(m)
    attempt("after_torch_compile", compiled, lambda: dmuon.dedicate_params(compiled, mesh, proj))
    m = build_model()
    m.lm_head.weight = m.tok_embeddings.weight  # first registered as tok_embeddings.weight
    attempt("tied_second_name", m, lambda: dmuon.dedicate_params(m, mesh, lambda n, p: n == "lm_head.weight"))

    sub = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    m = build_model()
    attempt("mesh_smaller_than_world", m, lambda: dmuon.dedicate_params(m, sub["a"], proj))
    attempt("mesh_2d", m, lambda: dmuon.dedicate_params(m, sub, proj))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    attempt("hsdp_meshes_swapped", m, lambda: dmuon.dedicate_params(m, hsdp["replicate"], proj,
                                                                     replicate_mesh=hsdp["shard"]))
    attempt("strict_boundary", m, lambda: dmuon.dedicate_params(
        m, mesh, proj, hook_boundary_predicate=lambda mod: isinstance(mod, nn.Embedding)))
    attempt("muon_before_dedicate", m, lambda: dmuon.Muon(m))

    # a valid call, then misuse on the prepared model must leave it trainable
    dmuon.dedicate_params(m, mesh, proj)
    attempt("twice", m, lambda: dmuon.dedicate_params(m, mesh, proj))
    attempt("bad_adjust_lr_fn", m, lambda: dmuon.Muon(m, adjust_lr_fn="sqrt"))
    attempt("bad_momentum", m, lambda: dmuon.Muon(m, momentum=1.5))
    attempt("bad_ns_steps", m, lambda: dmuon.Muon(m, ns_steps=-1))
    attempt("muon_takes_model", m, lambda: dmuon.Muon(list(m.parameters())))
    # torch.optim.Muon's 4th positional argument is weight_decay; dmuon's used to be nesterov
    attempt("muon_positional_after_lr", m, lambda: dmuon.Muon(m, 0.02, 0.95, 0.1))
    opt = dmuon.Muon(m)
    attempt("add_param_group", m, lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]}))
    tok = torch.randint(0, 128, (2, 8))
    m(tok, tok).loss.backward()
    opt.step()
    out["still_trains"] = ("ok", "", all(torch.isfinite(p).all() for p in dmuon.get_owned_params(m).values()))
    _optimizer_order_cases(rank, m, opt, tok, mesh, proj, attempt, out)
    _boundary_cases(mesh, attempt, out)
    return out


def _optimizer_order_cases(rank, m, opt, tok, mesh, proj, attempt, out: dict) -> None:
    """Calls in the wrong order: zero_grad between backward and step, dmuon.Muon built before fully_shard,
    settings that differ per rank."""
    from torch.distributed.fsdp import fully_shard

    # zero_grad between backward and step discards the gradients, the reduces still in flight included
    # (torch: step() then has no gradient to apply and leaves every parameter as it is)
    before = {n: p.detach().clone() for n, p in m.named_parameters() if p.untyped_storage().nbytes()}
    m(tok, tok).loss.backward()
    opt.zero_grad()
    opt.step()
    after = {n: p.detach() for n, p in m.named_parameters() if p.untyped_storage().nbytes()}
    out["zero_grad_discards"] = ("ok", repr(sorted(before)), all(torch.equal(before[n], after[n]) for n in before))

    # dmuon.Muon built before fully_shard holds the params fully_shard replaced: refused at its first use
    m3 = build_model()
    dmuon.dedicate_params(m3, mesh, proj)
    early = dmuon.Muon(m3)
    fully_shard(m3, mesh=mesh)
    attempt("muon_before_fully_shard_zero_grad", m3, lambda: early.zero_grad())
    attempt("muon_before_fully_shard_step", m3, lambda: early.step())

    # ranks that disagree on a setting fail together at dedicate_params instead of hanging later
    m2 = build_model()
    attempt("settings_differ_per_rank", m2,
            lambda: dmuon.dedicate_params(m2, mesh, proj, reshard_after_forward=rank == 0))


def _boundary_cases(mesh, attempt, out: dict) -> None:
    """Where the default and a custom hook_boundary_predicate put the boundaries; strict mode names a weight
    left outside them."""
    mm = Multimodal()
    dmuon.dedicate_params(mm, mesh, lambda n, p: p.ndim == 2)
    default_bounds = sorted(g.fqn for g in getattr(mm, STATE_ATTR).groups)
    mm = Multimodal()
    dmuon.dedicate_params(mm, mesh, lambda n, p: p.ndim == 2,
                          hook_boundary_predicate=lambda mod: isinstance(mod, (Vision, Decoder)),
                          hook_boundary_strict=False)
    custom_bounds = sorted(g.fqn for g in getattr(mm, STATE_ATTR).groups)
    mm = Multimodal()
    attempt("strict_multimodal_head", mm, lambda: dmuon.dedicate_params(
        mm, mesh, lambda n, p: p.ndim == 2, hook_boundary_predicate=lambda mod: isinstance(mod, (Vision, Decoder))))
    out["bounds"] = (repr(default_bounds), repr(custom_bounds), True)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(misuse_job, 2)[0]


@pytest.mark.parametrize(
    "case, error, needle",
    [
        ("after_fully_shard", "ValueError", "before fully_shard"),
        ("non_2d", "ValueError", "attention_norm.weight"),
        ("frozen", "ValueError", "layers.0.mlp.up_proj.weight"),
        ("selects_nothing", "ValueError", "selected no parameters"),
        ("tied", "ValueError", "shared"),
        ("after_torch_compile", "ValueError", "torch.compile wrapper"),
        ("tied_second_name", "ValueError", "'lm_head.weight' is shared (also registered as ['tok_embeddings.weight'])"),
        ("mesh_smaller_than_world", "ValueError", "1 ranks but the default process group has 2"),
        ("mesh_2d", "ValueError", "must be 1-D"),
        ("hsdp_meshes_swapped", "ValueError", "look swapped"),
        ("strict_boundary", "ValueError", "layers.0.attention.q_proj.weight"),
        ("muon_before_dedicate", "ValueError", "dedicate_params"),
        ("twice", "ValueError", "already called"),
        ("bad_adjust_lr_fn", "ValueError", "'sqrt'"),
        ("bad_momentum", "ValueError", "1.5"),
        ("bad_ns_steps", "ValueError", "-1"),
        ("muon_takes_model", "TypeError", "list"),
        ("muon_positional_after_lr", "TypeError", "everything else by keyword"),
        ("settings_differ_per_rank", "RuntimeError", "different owner plans or settings"),
        ("muon_before_fully_shard_zero_grad", "ValueError", "built before fully_shard"),
        ("muon_before_fully_shard_step", "ValueError", "built before fully_shard"),
        ("add_param_group", "ValueError", "not a parameter of this model"),
        ("strict_multimodal_head", "ValueError", "'head.weight'"),
    ],
)
def test_misuse_raises_before_any_change(results, case, error, needle):
    got_type, message, unchanged = results[case]
    assert got_type == error, f"{case}: expected {error}, got {got_type}: {message}"
    assert needle in message, f"{case}: {message!r} does not mention {needle!r}"
    assert unchanged, f"{case}: the model changed although the call failed"


def test_strict_boundary_message_names_a_param(results):
    # no projection has an nn.Embedding ancestor-or-self
    assert "dedicated param" in results["strict_boundary"][1]


def test_model_still_trains_after_rejected_calls(results):
    assert results["still_trains"][2]


def test_zero_grad_before_step_discards_every_gradient(results):
    _, names, unchanged = results["zero_grad_discards"]
    assert "layers.0.attention.q_proj.weight" in names or "layers.0.attention.k_proj.weight" in names, names
    assert unchanged, "a gradient reduced after zero_grad() was applied by step()"


def test_hook_boundaries(results):
    default_bounds, custom_bounds, _ = results["bounds"]
    assert eval(default_bounds) == [  # noqa: S307 - our own repr
        "decoder.layers.0", "decoder.layers.1", "head", "vision.blocks.0", "vision.blocks.1",
    ]
    assert eval(custom_bounds) == ["decoder", "head", "vision"]  # noqa: S307


def test_dedicate_params_needs_torch_distributed():
    model = build_model()
    before = _fingerprint(model)
    with pytest.raises(RuntimeError, match="init_process_group"):
        dmuon.dedicate_params(model, None)  # type: ignore[arg-type]
    assert _unchanged(before, model)


def one_rank_refuses_job(rank: int, world: int) -> dict:
    """Only rank 1 passes a predicate that selects nothing (or that raises): before, rank 0 went on into the
    collective plan check and waited there for rank 1 until the process group's timeout."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    before = _fingerprint(model)
    out = {}
    for case, bad in (("selects_nothing", lambda n, p: False), ("raises", lambda n, p: {}[n])):
        predicate = bad if rank == 1 else (lambda n, p: p.ndim == 2 and "proj" in n)
        try:
            dmuon.dedicate_params(model, mesh, predicate)
            out[case] = ""
        except (ValueError, KeyError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    out["unchanged"] = _unchanged(before, model)
    return out


def test_a_rank_that_refuses_alone_makes_every_rank_raise():
    r0, r1 = run_distributed(one_rank_refuses_job, 2)
    assert "selected no parameters" in r1["selects_nothing"], r1
    assert "refused on rank 1" in r0["selects_nothing"] and "selected no parameters" in r0["selects_nothing"], r0
    # a predicate that raises on one rank: that rank keeps its own error, the other is told
    assert r1["raises"].startswith("KeyError"), r1
    assert r0["raises"].startswith("ValueError") and "refused on rank 1: KeyError" in r0["raises"], r0
    assert r0["unchanged"] and r1["unchanged"]
