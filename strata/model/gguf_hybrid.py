"""GGUF files of the hybrid family (Gated DeltaNet + gated attention, MoE): llama.cpp's `qwen3next` and `qwen35moe`.

llama.cpp's converter (its `Qwen3NextModel`, and `_LinearAttentionVReorderBase` for Qwen3.5) changes these
checkpoints' tensors on the way in; each change is undone here so that `GGUFCheckpoint` hands out exactly the
transformers tensors (names, shapes, values):

- RMSNorm weights (all but the Gated DeltaNet output norm `linear_attn.norm`) are stored as `1 + w`: 1 is taken off.
- `A_log` is stored as `ssm_a = -exp(A_log)`: `A_log = log(-ssm_a)` (equal to float32 rounding, not bit for bit).
- `dt_bias` is stored as `ssm_dt.bias`; `conv1d.weight` [C, 1, K] squeezed to [C, K]: the middle axis is put back.
- Qwen3-Next's `in_proj_qkvz`, whose rows are grouped per key head ([q | k | v | z] for each), is stored split
  and regrouped: `attn_qkv` (all q rows, then all k, then all v) and `attn_gate` (all z): the two are read together
  and put back into per-key-head groups. `in_proj_ba` is stored as it is (`ssm_ba`).
- Qwen3.5 (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` stored as `attn_qkv`, `attn_gate`, `ssm_beta`,
  `ssm_alpha`): every per-value-head axis (the v rows of `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
  `A_log`, `dt_bias`, the v channels of `conv1d`, the columns of `out_proj`) is reordered from grouped by key head
  ([k0: v0 v1 | k1: v0 v1]) to tiled ([v0: k0 k1 | v1: k0 k1]) for ggml's broadcast: the order is put back.
- Stacked experts `ffn_{gate,up,down}_exps` [E, out, in] keep their layout (read as `mlp.experts.gate_proj`, ...);
  a fused `ffn_gate_up_exps` [E, 2I, H] (gate rows first) is read as transformers' `mlp.experts.gate_up_proj`.
- A multi-token-prediction layer (`nextn_predict_layers` > 0) is stored as blocks after the model's own:
  `nextn.eh_proj` -> `mtp.fc`, `nextn.enorm`/`hnorm`/`shared_head_norm` -> `mtp.pre_fc_norm_embedding`/
  `pre_fc_norm_hidden`/`norm`, and the block's other tensors -> `mtp.layers.N.*`, undone as above.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata.errors import CheckpointError

# GGUF architecture -> (transformers model_type, architectures entry)
ARCHS = {
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
# block tensor (part, suffix) -> its transformers name inside the layer (the suffix included)
PARTS = {
    ("ssm_a", ""): "linear_attn.A_log",
    ("ssm_dt", "bias"): "linear_attn.dt_bias",
    ("ssm_conv1d", "weight"): "linear_attn.conv1d.weight",
    ("ssm_ba", "weight"): "linear_attn.in_proj_ba.weight",  # Qwen3-Next
    ("ssm_beta", "weight"): "linear_attn.in_proj_b.weight",  # Qwen3.5
    ("ssm_alpha", "weight"): "linear_attn.in_proj_a.weight",
    ("ssm_norm", "weight"): "linear_attn.norm.weight",
    ("ssm_out", "weight"): "linear_attn.out_proj.weight",
    ("attn_qkv", "weight"): "linear_attn.in_proj_qkv.weight",  # Qwen3-Next: fused with the gate below
    ("attn_gate", "weight"): "linear_attn.in_proj_z.weight",
}
# the multi-token-prediction head's own tensors, in its first block
NEXTN_PARTS = {
    "nextn.eh_proj": "mtp.fc.weight",
    "nextn.enorm": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm": "mtp.norm.weight",
}
FUSED_QKVZ = "linear_attn.in_proj_qkvz.weight"

Undo = Callable[[np.ndarray], np.ndarray]


def config(key: Callable, num_layers: int, shapes: dict[str, tuple[int, ...]], source: str) -> dict:
    """The config keys of the `qwen3_next` / `qwen3_5_moe` families, from `{arch}.*` metadata (`key(name, default)`)."""
    num_k, num_v, inner = key("ssm.group_count"), key("ssm.time_step_rank"), key("ssm.inner_size")
    if num_k <= 0 or num_v % num_k or inner % num_v:
        raise CheckpointError(f"{source}: ssm.group_count {num_k}, ssm.time_step_rank {num_v} and ssm.inner_size "
                              f"{inner} do not make whole value heads per key head")
    interval = key("full_attention_interval", 4)  # llama.cpp's default too
    shared = key("expert_shared_feed_forward_length", None)
    if shared is None:  # the shared expert's size from its tensor, where a file lacks the key
        shared = shapes.get("blk.0.ffn_up_shexp.weight", (0,))[0]
    return {
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)],
        "full_attention_interval": interval,
        "linear_num_key_heads": num_k,
        "linear_num_value_heads": num_v,
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_value_head_dim": inner // num_v,
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": True,  # llama.cpp's qwen3next / qwen35moe graphs renormalize the chosen experts' weights
    }


def _ungroup_v(w: np.ndarray, axis: int, cfg: dict, head_dim: int) -> np.ndarray:
    """Qwen3.5: value heads along `axis` from llama.cpp's tiled order back to transformers' grouped-by-key-head one."""
    num_k = cfg["linear_num_key_heads"]
    per = cfg["linear_num_value_heads"] // num_k
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(per, num_k, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _rows_after(w: np.ndarray, start: int, undo: Undo) -> np.ndarray:
    return np.concatenate([w[:start], undo(w[start:])])


def _stored_plus_one(hf_name: str) -> bool:
    """The converter's rule: every `*norm.weight` but the gated output norm gets 1 added, the MTP head's too (named
    `enorm`, `hnorm`, `shared_head.norm` when the rule is applied)."""
    if hf_name.startswith(("mtp.pre_fc_norm_embedding.", "mtp.pre_fc_norm_hidden.")):
        return True
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def undo(hf_name: str, shape: tuple[int, ...], arch: str, cfg: dict) -> tuple[tuple[int, ...], Undo | None]:
    """The transformers shape of a tensor stored with `shape`, and the function that turns the stored values into
    transformers' (None: as stored)."""
    steps: list[Undo] = []
    if _stored_plus_one(hf_name):
        steps.append(lambda w: w.astype(np.float32) - np.float32(1))
    if hf_name.endswith("linear_attn.A_log"):
        steps.append(lambda w: np.log(-w.astype(np.float64)).astype(np.float32))
    if hf_name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:  # stored as a vector by some writers
        shape = (1, *shape)
        steps.append(lambda w: w.reshape(1, -1))
    if arch == "qwen35moe" and ".linear_attn." in hf_name:
        steps += _qwen35_steps(hf_name.rsplit(".linear_attn.", 1)[1], cfg)
    if hf_name.endswith("linear_attn.conv1d.weight") and len(shape) == 2:
        shape = (shape[0], 1, shape[1])
        steps.append(lambda w: w.reshape(w.shape[0], 1, w.shape[1]))
    if not steps:
        return shape, None

    def apply(w: np.ndarray) -> np.ndarray:
        for step in steps:
            w = step(w)
        return w

    return shape, apply


def _qwen35_steps(leaf: str, cfg: dict) -> list[Undo]:
    dv, qk_rows = cfg["linear_value_head_dim"], 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    if leaf == "in_proj_qkv.weight" or leaf == "conv1d.weight":  # q and k rows (channels) first, then v
        return [lambda w: _rows_after(w, qk_rows, lambda v: _ungroup_v(v, 0, cfg, dv))]
    if leaf == "in_proj_z.weight":
        return [lambda w: _ungroup_v(w, 0, cfg, dv)]
    if leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return [lambda w: _ungroup_v(w, 0, cfg, 1)]
    if leaf == "out_proj.weight":
        return [lambda w: _ungroup_v(w, 1, cfg, dv)]
    return []


def fuse_qkvz(qkv: np.ndarray, z: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3-Next: `attn_qkv` and `attn_gate` back into `in_proj_qkvz`, whose rows are grouped per key head."""
    num_k, dk, hidden = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], qkv.shape[-1]
    q, k, v = np.split(qkv, [num_k * dk, 2 * num_k * dk])
    return np.concatenate([t.reshape(num_k, -1, hidden) for t in (q, k, v, z)], axis=1).reshape(-1, hidden)
