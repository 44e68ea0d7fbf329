"""RoPE scaling: a checkpoint's `rope_parameters` (or the older `rope_scaling`) turned into the rotary embedding's
inverse frequencies and the factor its cos/sin are multiplied by, as `transformers` computes them for the families
Strata serves.

Kinds: `default`; `linear` (positions divided by `factor`); `llama3` (Llama 3.1+: low frequencies divided by
`factor`, high ones kept, a smooth blend between); `yarn` (frequencies blended between interpolated and kept by a
ramp over the dimensions, cos/sin multiplied by an attention factor); `dynamic` (NTK-aware scaling that changes the
base only for sequences longer than `max_position_embeddings`: Strata never runs positions past that — its cells
are capped there — so within it this is exactly the default embedding). Any other kind is refused by name.
"""

from __future__ import annotations

import math

import torch

from strata.errors import CheckpointError

KINDS = ("default", "linear", "llama3", "yarn", "dynamic")
# the keys each kind reads; anything else in the dictionary is ignored, as transformers ignores it
NEEDS = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
         "yarn": ()}
KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor",
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def rope_config(cfg: dict) -> tuple[float, float, str, tuple[tuple[str, float], ...]]:
    """(theta, partial rotary factor, kind, the kind's parameters as sorted (key, value) pairs) from a config.json
    dictionary; a kind Strata does not implement, or one missing what it needs, is a `CheckpointError`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in KINDS:
        raise CheckpointError(f"rope_type {kind!r} is not supported: Strata implements {', '.join(KINDS)}")
    if kind == "default":
        return theta, partial, kind, ()
    missing = [k for k in NEEDS[kind] if rope.get(k) is None]
    if missing:
        raise CheckpointError(f"rope_type {kind!r} needs {', '.join(missing)} in rope_parameters; the config has "
                              f"{sorted(rope)}")
    params = {k: rope[k] for k in KEYS if rope.get(k) is not None}
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
        if params["original_max_position_embeddings"] is None:
            raise CheckpointError(f"rope_type {kind!r} needs original_max_position_embeddings (or "
                                  "max_position_embeddings) in the config")
    if kind == "yarn" and params.get("factor") is None:  # DeepSeek-style configs: the ratio of the two lengths
        params["factor"] = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
        raise CheckpointError(f"rope_parameters factor {factor!r}: expected a positive number")
    return theta, partial, kind, tuple(sorted((k, float(v)) for k, v in params.items()))


def _default(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
                            / rotary_dim))


def rope_frequencies(rotary_dim: int, theta: float, kind: str = "default", params: tuple = (),
                     device=None) -> tuple[torch.Tensor, float]:
    """[rotary_dim / 2] float32 inverse frequencies and the factor cos and sin are multiplied by (1.0 but for yarn)."""
    p = dict(params)
    inv_freq = _default(rotary_dim, theta, device)
    if kind in ("default", "dynamic"):  # dynamic: the default within max_position_embeddings (the module's note)
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, p, device)
    raise CheckpointError(f"rope_type {kind!r} is not supported: Strata implements {', '.join(KINDS)}")


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: interpolated
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, p: dict, device) -> tuple[torch.Tensor, float]:
    factor, old = p["factor"], p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` in `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", 1.0):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as trained)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept
    return inv_freq, float(attention)
