"""Tiny random checkpoints of every supported family, written with `transformers` itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 160

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, max_position_embeddings=512, initializer_range=0.05)
HYBRID = dict(
    COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)

# name -> (config class, model class, config kwargs); several shapes per family
CASES = {
    "llama-gqa-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(COMMON, hidden_size=96, intermediate_size=128, num_attention_heads=6, num_key_value_heads=2,
                            tie_word_embeddings=True, rope_theta=100000.0)),
    "llama-mha-untied": ("LlamaConfig", "LlamaForCausalLM",
                         dict(COMMON, intermediate_size=80, num_attention_heads=4, num_key_value_heads=4,
                              tie_word_embeddings=False)),
    "qwen3_moe-gqa4": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)),
    "qwen3_moe-mixed-dense": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(COMMON, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=4,
                                   num_key_value_heads=4, head_dim=12, num_experts=6, num_experts_per_tok=3,
                                   norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(HYBRID, intermediate_size=96)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", None),
}
# families tested against transformers in tests/test_families.py (and RoPE scaling) but not in every batch test:
# Qwen3 dense is Llama's layer with q/k norms, which the MoE cases run
MORE_CASES = {
    "qwen3-dense": ("Qwen3Config", "Qwen3ForCausalLM",
                    dict(COMMON, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=True, rope_theta=1000000.0)),
}
ALL_CASES = {**CASES, **MORE_CASES}


def _qwen3_5_config(**text_overrides):
    import transformers

    text = {**HYBRID, "num_key_value_heads": 1, **text_overrides}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)


def build(name: str, folder: Path, seed: int = 0, **overrides):
    """Write checkpoint `name` into `folder` and return the transformers model (the reference). `overrides`: config
    values that differ from the case's."""
    import transformers

    config_cls, model_cls, kwargs = ALL_CASES[name]
    multimodal = kwargs is None  # its overrides go to the text model's config
    torch.manual_seed(seed)
    if multimodal:
        config = _qwen3_5_config(**overrides)
    else:
        config = getattr(transformers, config_cls)(**dict(kwargs, **overrides))
    model = getattr(transformers, model_cls)(config).eval()
    # sharded when it is the multimodal one, so the index file path is exercised
    model.save_pretrained(folder, max_shard_size="200KB" if multimodal else "50MB")
    return model


def add_mtp_weights(folder: Path, hidden: int, num_layers: int = 1) -> list[str]:
    """Append a separate shard of mtp.* tensors (as released Qwen3-Next checkpoints carry) and list their names."""
    torch.manual_seed(1)
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
               "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden), "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden)}
    for i in range(num_layers):
        tensors[f"mtp.layers.{i}.input_layernorm.weight"] = torch.randn(hidden)
    save_file(tensors, str(folder / "mtp.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data))
    return sorted(tensors)


def add_mtp_layer(folder: Path, model, draft_vocab: list[int] | None = None, seed: int = 2) -> dict[str, torch.Tensor]:
    """Append a whole multi-token-prediction layer (the Qwen3-Next layout over a Llama model's layer kind: norms,
    fc, one decoder layer with a dense MLP) as a separate shard, random but for the decoder layer, copied from the
    model's last; `draft_vocab`: the ids its head scores (`mtp.draft_vocab`). Returns the tensors written."""
    torch.manual_seed(seed)
    cfg = model.config
    hidden = cfg.hidden_size
    last = {k.split(f"layers.{cfg.num_hidden_layers - 1}.", 1)[1]: v.detach().clone()
            for k, v in model.state_dict().items() if f"layers.{cfg.num_hidden_layers - 1}." in k}
    tensors = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * hidden**-0.5,
               "mtp.norm.weight": 1 + 0.1 * torch.randn(hidden),
               "mtp.pre_fc_norm_embedding.weight": 1 + 0.1 * torch.randn(hidden),
               "mtp.pre_fc_norm_hidden.weight": 1 + 0.1 * torch.randn(hidden)}
    tensors |= {f"mtp.layers.0.{k}": v + 0.02 * torch.randn_like(v) for k, v in last.items()}
    for k in tensors:  # an attention whose output matters next to the residual: its cells must be right
        if k.endswith(("self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_proj.weight")):
            tensors[k] = tensors[k] * 6
    if draft_vocab is not None:
        tensors["mtp.draft_vocab"] = torch.tensor(sorted(draft_vocab), dtype=torch.int64)
    save_file(tensors, str(folder / "mtp.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data))
    return tensors
