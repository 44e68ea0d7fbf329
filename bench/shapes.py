"""Real model shapes for benchmarks on random weights (sizes from the models' published configs)."""

from __future__ import annotations

from dataclasses import replace

from strata.model.spec import AttentionSpec, GDNSpec, LayerSpec, ModelSpec, MoESpec


def qwen3_30b_a3b() -> ModelSpec:
    return ModelSpec(
        family="qwen3_moe", hidden_size=2048, vocab_size=151936, rms_eps=1e-6, tie_embeddings=False,
        max_positions=40960, layers=tuple(LayerSpec("attention", "moe") for _ in range(48)),
        attention=AttentionSpec(32, 4, 128, 128, 1e6, qk_norm=True, output_gate=False),
        moe=MoESpec(num_experts=128, top_k=8, expert_dim=768, norm_topk=True),
    )


def qwen3_next_80b_a3b() -> ModelSpec:
    return ModelSpec(
        family="qwen3_next", hidden_size=2048, vocab_size=151936, rms_eps=1e-6, tie_embeddings=False,
        max_positions=262144,
        layers=tuple(LayerSpec("attention" if (i + 1) % 4 == 0 else "gdn", "moe") for i in range(48)),
        attention=AttentionSpec(16, 2, 256, 64, 1e7, qk_norm=True, output_gate=True),
        gdn=GDNSpec(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128, conv_kernel=4),
        moe=MoESpec(num_experts=512, top_k=10, expert_dim=512, norm_topk=True, shared_dim=512, shared_gate=True),
    )


SHAPES = {"qwen3-30b-a3b": qwen3_30b_a3b, "qwen3-next-80b-a3b": qwen3_next_80b_a3b}


def shape(name: str, num_layers: int | None = None) -> ModelSpec:
    spec = SHAPES[name]()
    return replace(spec, layers=spec.layers[:num_layers]) if num_layers else spec
