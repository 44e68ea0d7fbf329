"""Random weights at a model's real shapes, in the neutral layout of `weights.py`, for benchmarks.

Speed depends on shapes, not values, so a benchmark can run a 30B-parameter MoE shape without downloading
it. Values are scaled like a trained model's (unit-norm-ish activations), so routing spreads over experts.
"""

from __future__ import annotations

import torch

from strata.model.spec import ModelSpec
from strata.model.weights import StageWeights, Tensors


def _w(gen: torch.Generator, *shape: int, device, dtype, fan_in: int | None = None) -> torch.Tensor:
    std = (fan_in or shape[-1]) ** -0.5
    return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def random_stage_weights(spec: ModelSpec, layers: range, device: torch.device, dtype: torch.dtype,
                         seed: int = 0, trim: bool = True) -> StageWeights:
    gen = torch.Generator(device=device).manual_seed(seed)
    h = spec.hidden_size
    ones = lambda n: torch.ones(n, device=device, dtype=torch.float32)  # noqa: E731
    w = lambda *shape, fan_in=None: _w(gen, *shape, device=device, dtype=dtype, fan_in=fan_in)  # noqa: E731
    out: dict[int, Tensors] = {}
    held: dict[int, Tensors] = {}
    for i in range(spec.num_layers) if not trim else layers:
        if i not in layers:  # an untrimmed stage holds the other layers' dense tensors
            layer_w = random_stage_weights(spec, range(i, i + 1), device, dtype, seed).layers[i]
            held[i] = {k: v for k, v in layer_w.items() if not k.startswith("experts_")}
            continue
        gen.manual_seed(seed + 1 + i)  # a layer's tensors do not depend on which stage draws them
        layer = spec.layers[i]
        t: Tensors = {"attn_norm": ones(h), "mlp_norm": ones(h)}
        if layer.mixer == "attention":
            a = spec.attention
            q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
            t["qkv"] = w(q_out + 2 * a.num_kv_heads * a.head_dim, h)
            t["o"] = w(h, a.num_heads * a.head_dim)
            if a.qk_norm:
                t["q_norm"], t["k_norm"] = ones(a.head_dim), ones(a.head_dim)
        else:
            g = spec.gdn
            t["in_proj"] = w(g.conv_dim + g.value_dim + 2 * g.num_v_heads, h)
            t["conv"] = w(g.conv_dim, g.conv_kernel)
            t["neg_a"] = -torch.rand(g.num_v_heads, generator=gen, device=device) * 0.5 - 0.1
            t["dt_bias"] = torch.zeros(g.num_v_heads, device=device)
            t["norm"] = ones(g.v_head_dim)
            t["out"] = w(h, g.value_dim)
        if layer.mlp == "dense":
            t["gate_up"], t["down"] = w(2 * spec.dense_dim, h), w(h, spec.dense_dim)
        else:
            m = spec.moe
            t["router"] = w(m.num_experts, h)
            t["experts_gate_up"] = w(m.num_experts, 2 * m.expert_dim, h)
            t["experts_down"] = w(m.num_experts, h, m.expert_dim)
            if m.shared_dim:
                t["shared_gate_up"], t["shared_down"] = w(2 * m.shared_dim, h), w(h, m.shared_dim)
                if m.shared_gate:
                    t["shared_gate"] = w(1, h)
        out[i] = t
    weights = StageWeights(layers=out, held=held)
    if layers.start == 0:
        gen.manual_seed(seed)
        weights.embed = w(spec.vocab_size, h, fan_in=1)
    if layers.stop == spec.num_layers:
        gen.manual_seed(seed + 1 + spec.num_layers)
        weights.final_norm = ones(h)
        weights.lm_head = weights.embed if spec.tie_embeddings and weights.embed is not None else w(spec.vocab_size, h)
    return weights
