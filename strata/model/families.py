"""Model families: thin maps from a checkpoint's config and tensor names to the neutral `ModelSpec`.

All supported families use the Hugging Face tensor naming under a prefix; what differs is where
the language model lives, how norm weights are stored, and the layout of the Gated DeltaNet input
projection. Nothing outside this file looks at a family name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from strata.errors import CheckpointError
from strata.model.rope_scaling import rope_config
from strata.model.spec import AttentionSpec, GDNSpec, LayerSpec, ModelSpec, MoESpec


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    prefix: str  # where the language model's tensors live ("model." or "model.language_model.")
    norm_offset: float  # 1.0 where RMSNorm weights are stored zero-centred (the norm multiplies by 1 + w)
    gdn_projection: Literal["none", "fused_qkvz", "split"]
    spec_from_config: Callable[[dict, str], ModelSpec]


def _attention(cfg: dict, *, qk_norm: bool, output_gate: bool) -> AttentionSpec:
    theta, partial, rope_type, rope_params = rope_config(cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=theta,
        qk_norm=qk_norm,
        output_gate=output_gate,
        rope_type=rope_type,
        rope_params=rope_params,
    )


def _common(cfg: dict, family: str) -> dict:
    return dict(
        family=family,
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=int(cfg.get("max_position_embeddings", 4096)),
    )


def _moe_layer(cfg: dict, i: int) -> bool:
    step = cfg.get("decoder_sparse_step", 1) or 1
    return cfg.get("num_experts", 0) > 0 and i not in cfg.get("mlp_only_layers", []) and (i + 1) % step == 0


def _llama(cfg: dict, family: str) -> ModelSpec:
    layers = tuple(LayerSpec("attention", "dense") for _ in range(cfg["num_hidden_layers"]))
    return ModelSpec(
        **_common(cfg, family),
        layers=layers,
        attention=_attention(cfg, qk_norm=family == "qwen3", output_gate=False),
        dense_dim=cfg["intermediate_size"],
    )


def _qwen3_moe(cfg: dict, family: str) -> ModelSpec:
    cfg = {"num_experts": cfg.get("num_local_experts", 0), **cfg}
    layers = tuple(
        LayerSpec("attention", "moe" if _moe_layer(cfg, i) else "dense") for i in range(cfg["num_hidden_layers"])
    )
    return ModelSpec(
        **_common(cfg, family),
        layers=layers,
        attention=_attention(cfg, qk_norm=True, output_gate=False),
        dense_dim=cfg.get("intermediate_size", 0),
        moe=MoESpec(
            num_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            expert_dim=cfg["moe_intermediate_size"],
            norm_topk=bool(cfg.get("norm_topk_prob", False)),
        ),
    )


def _hybrid(cfg: dict, family: str) -> ModelSpec:
    """Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet layers between gated full-attention layers."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(n)
    ]
    unknown = sorted(set(kinds) - {"full_attention", "linear_attention"})
    if unknown:
        raise CheckpointError(f"layer_types holds unknown layer kinds {unknown}")
    always_moe = family == "qwen3_5_moe"
    layers = tuple(
        LayerSpec(
            "attention" if kinds[i] == "full_attention" else "gdn",
            "moe" if always_moe or _moe_layer(cfg, i) else "dense",
        )
        for i in range(n)
    )
    return ModelSpec(
        **_common(cfg, family),
        layers=layers,
        attention=_attention(cfg, qk_norm=True, output_gate=True),
        dense_dim=cfg.get("intermediate_size", 0) or 0,
        gdn=GDNSpec(
            num_k_heads=cfg["linear_num_key_heads"],
            num_v_heads=cfg["linear_num_value_heads"],
            k_head_dim=cfg["linear_key_head_dim"],
            v_head_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"],
        ),
        moe=MoESpec(
            num_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            expert_dim=cfg["moe_intermediate_size"],
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
            shared_dim=cfg.get("shared_expert_intermediate_size", 0) or 0,
            shared_gate=True,
        ),
        num_mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
    )


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), "model.", 0.0, "none", _llama),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "model.", 0.0, "none", _llama),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "model.", 0.0, "none", _qwen3_moe),
    Family("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",), "model.", 1.0, "fused_qkvz", _hybrid),
    Family(
        "qwen3_5_moe",
        ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        "model.language_model.",
        1.0,
        "split",
        _hybrid,
    ),
)


def text_config(config: dict) -> dict:
    """The language model's part of a config: a multimodal checkpoint nests it under `text_config`."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def find_family(config: dict, source: str) -> Family:
    archs = config.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.architectures for a in archs):
            return family
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise CheckpointError(
        f"{source}: unknown architecture {archs or model_type!r}; Strata supports {known}"
    )


def build_spec(config: dict, source: str) -> tuple[Family, ModelSpec]:
    family = find_family(config, source)
    cfg = text_config(config)
    if family.name == "qwen3_5_moe" and "text_config" not in config:
        family = Family(**{**family.__dict__, "prefix": "model."})  # a text-only Qwen3.5 checkpoint
    try:
        return family, family.spec_from_config(cfg, family.name)
    except KeyError as e:
        raise CheckpointError(f"{source}: the config has no {e.args[0]!r}, which a {family.name} model needs") from None
