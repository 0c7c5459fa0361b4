"""Llama-shaped parameter lists without instantiating a model.

Planner tests and benchmarks need the exact matrix shapes of real models
(the owner split depends on them), but building an 8B model just to read its
shapes is slow and memory-hungry. These presets produce the same
:class:`~dmuon.partition.ParamSpec` list that walking the HF model would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from ..partition import ParamSpec

__all__ = ["LlamaShape", "MoEShape", "PRESETS", "MOE_PRESETS", "PRESET_ALIASES", "canonical_preset", "projection_specs",
           "attention_specs", "shape_groups"]


@dataclass(frozen=True)
class LlamaShape:
    """The handful of config numbers that fix every projection shape."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if f.name == "shared_intermediate" and v == 0:  # MoEShape: no shared expert
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaShape {self.name!r}: {f.name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaShape {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}) for GQA"
            )


PRESETS: Mapping[str, LlamaShape] = MappingProxyType(
    {
        p.name: p
        for p in (
            # the bench's CPU smoke shape (dmuon.tools.models.TinyLlama: dim 128, 2 layers)
            LlamaShape("tiny", hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256),
            LlamaShape("125m", hidden=768, intermediate=3072, layers=12, heads=12, kv_heads=12, head_dim=64, vocab=32000),
            LlamaShape("llama3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256),
            LlamaShape("llama3.2-3b", hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, head_dim=128, vocab=128256),
            # Llama-3.1-8B (same shapes as Llama-3-8B).
            LlamaShape("llama3-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256),
        )
    }
)


@dataclass(frozen=True)
class MoEShape(LlamaShape):
    """A decoder whose every layer's MLP is routed experts (HF ``Qwen3MoeForCausalLM``'s layout):
    ``experts`` matrices of each of gate ``[E, F, D]``, up ``[E, F, D]`` and down ``[E, D, F]`` per layer,
    ``top_k`` of them per token, plus an optional shared expert of ``shared_intermediate`` rows (0: none).
    ``intermediate`` is unused (no dense MLP layer)."""

    experts: int = 1
    expert_intermediate: int = 1
    top_k: int = 1
    shared_intermediate: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k > self.experts:
            raise ValueError(f"MoEShape {self.name!r}: top_k ({self.top_k}) must be at most experts ({self.experts})")


#: MoE shapes, for ``python -m dmuon.plan --simulate`` only (the benchmark builds dense models).
MOE_PRESETS: Mapping[str, MoEShape] = MappingProxyType(
    {
        p.name: p
        for p in (
            # Qwen3-30B-A3B (HF config.json: 48 layers, 128 experts of 768, top-8, GQA 32/4, head_dim 128)
            MoEShape("qwen3-30b-a3b", hidden=2048, intermediate=6144, layers=48, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936, experts=128, expert_intermediate=768, top_k=8),
        )
    }
)


#: Short spellings ``python -m dmuon.bench`` used to have; both CLIs accept them silently, as the same preset.
PRESET_ALIASES: Mapping[str, str] = MappingProxyType({"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3-8b"})


def canonical_preset(name: str) -> str:
    """The preset's one name (``"8b"`` -> ``"llama3-8b"``); any other string comes back unchanged, so an
    argparse ``type=`` of this still reports an unknown name as an invalid choice."""
    return PRESET_ALIASES.get(name, name)


def projection_specs(preset: str | LlamaShape) -> list[ParamSpec]:
    """The 7 projection weights of every decoder layer, HF names, nn.Linear (out, in) layout.

    Embeddings, lm_head and norms are not included: Muon does not own them.
    """
    if isinstance(preset, str):
        preset = canonical_preset(preset)
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; valid names: {', '.join(sorted(PRESETS))}")
        cfg = PRESETS[preset]
    elif isinstance(preset, LlamaShape):
        cfg = preset
    else:
        raise ValueError(
            f"preset must be a preset name ({', '.join(sorted(PRESETS))}) or a LlamaShape, got {preset!r}"
        )
    q_out = cfg.heads * cfg.head_dim
    kv_out = cfg.kv_heads * cfg.head_dim
    specs: list[ParamSpec] = []
    for i in range(cfg.layers):
        layer = f"model.layers.{i}"
        for name, shape in (
            ("self_attn.q_proj", (q_out, cfg.hidden)),
            ("self_attn.k_proj", (kv_out, cfg.hidden)),
            ("self_attn.v_proj", (kv_out, cfg.hidden)),
            ("self_attn.o_proj", (cfg.hidden, q_out)),
            ("mlp.gate_proj", (cfg.intermediate, cfg.hidden)),
            ("mlp.up_proj", (cfg.intermediate, cfg.hidden)),
            ("mlp.down_proj", (cfg.hidden, cfg.intermediate)),
        ):
            specs.append(ParamSpec(f"{layer}.{name}.weight", shape, layer))
    return specs


def attention_specs(shape: LlamaShape) -> list[ParamSpec]:
    """The 4 attention projections of every layer (HF names, ``(out, in)``): an MoE model's dense Muon matrices
    (its experts stay on the engine's shards, ``Route.MUON_SHARDED``)."""
    return [s for s in projection_specs(shape) if ".self_attn." in s.fqn]


def shape_groups(preset: str) -> dict[tuple[int, int], int]:
    """Matrix shape -> how many projections of ``preset`` have it: what one owner holding all of them
    batches into one Newton–Schulz call."""
    return dict(Counter(tuple(s.shape) for s in projection_specs(preset)))  # type: ignore[misc]
