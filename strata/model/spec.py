"""An architecture-neutral description of a decoder-only language model.

Families (`families.py`) build a `ModelSpec` from a checkpoint's own config; the runtime reads only
the spec, never a family name. Sizes are `num_*`, dimensions `*_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mixer = Literal["attention", "gdn"]
MLPKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of each head that rotary embedding turns (partial rotary when < head_dim)
    rope_theta: float
    qk_norm: bool  # RMSNorm over each head of q and k before rotary (Qwen3 families)
    output_gate: bool  # q_proj also yields a per-channel gate: out * sigmoid(gate) (Qwen3-Next, Qwen3.5)
    rope_type: str = "default"  # RoPE scaling kind and its parameters (`strata.model.rope_scaling`)
    rope_params: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GDNSpec:
    """Gated DeltaNet (linear attention) layer sizes."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the short conv: q, k and v side by side
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_dim: int  # intermediate size of one routed expert
    norm_topk: bool  # renormalise the top-k routing weights to sum to 1
    shared_dim: int = 0  # intermediate size of the shared expert, 0 when there is none
    shared_gate: bool = False  # the shared expert's output is scaled by sigmoid(x @ w_gate)


@dataclass(frozen=True)
class LayerSpec:
    mixer: Mixer
    mlp: MLPKind


@dataclass(frozen=True)
class ModelSpec:
    family: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    attention: AttentionSpec
    rms_eps: float
    tie_embeddings: bool
    max_positions: int
    dense_dim: int = 0  # intermediate size of dense MLP layers
    gdn: GDNSpec | None = None
    moe: MoESpec | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers found in the checkpoint (loaded, used for drafts later)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attention_layers(self, layers: range | None = None) -> list[int]:
        return [i for i in (layers or range(self.num_layers)) if self.layers[i].mixer == "attention"]

    def gdn_layers(self, layers: range | None = None) -> list[int]:
        return [i for i in (layers or range(self.num_layers)) if self.layers[i].mixer == "gdn"]
