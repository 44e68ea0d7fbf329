"""RMSNorm (plain, zero-centred, gated) and rotary embedding references against transformers' Llama and
Qwen3-Next modules, on odd sizes and non-contiguous positions."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3NextConfig
from transformers.models.llama import modeling_llama as llama
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from strata.kernels.rmsnorm import gated_rms_norm, rms_norm
from strata.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
EPS = 1e-6
POSITIONS = torch.tensor([0, 5, 9, 100, 4097])

# ---- rope


ROPES = [  # (heads, head_dim, rotary_dim, theta)
    (3, 20, 20, 10000.0),
    (5, 64, 64, 1e6),
    (3, 20, 8, 10000.0),
    (5, 64, 16, 1e7),
]


def _rope_id(case):
    h, d, rot, theta = case
    return f"R={len(POSITIONS)}-H={h}-D={d}-rot={rot}-theta={theta:g}"


def hf_rotary(d, rot, theta):
    """transformers' rotary embedding module for this shape: Llama when it is full, Qwen3-Next when partial."""
    params = {"rope_type": "default", "rope_theta": theta}
    if rot == d:
        return llama.LlamaRotaryEmbedding(LlamaConfig(head_dim=d, rope_parameters=params))
    config = Qwen3NextConfig(head_dim=d, rope_parameters={**params, "partial_rotary_factor": rot / d})
    return qwen3_next.Qwen3NextRotaryEmbedding(config)


def hf_apply(d, rot):
    return llama.apply_rotary_pos_emb if rot == d else qwen3_next.apply_rotary_pos_emb


@pytest.mark.parametrize("case", ROPES, ids=_rope_id)
def test_cos_sin_match_transformers(case):
    _, d, rot, theta = case
    emb = hf_rotary(d, rot, theta)
    inv_freq = rope_inv_freq(rot, theta)
    torch.testing.assert_close(inv_freq, emb.inv_freq, rtol=0, atol=0)
    hf_cos, hf_sin = emb(torch.zeros(1, dtype=torch.float32), POSITIONS[None])
    cos, sin = rope_cos_sin(POSITIONS, inv_freq, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], **TOL)
    torch.testing.assert_close(sin, hf_sin[0], **TOL)


@pytest.mark.parametrize("case", ROPES, ids=_rope_id)
def test_apply_rope_matches_transformers(case):
    h, d, rot, theta = case
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), h, d, generator=gen)  # [R, H, D]
    k = torch.randn(len(POSITIONS), 1, d, generator=gen)
    hf_cos, hf_sin = hf_rotary(d, rot, theta)(q, POSITIONS[None])  # [1, R, rot]
    hf_q, hf_k = hf_apply(d, rot)(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)  # [1, H, R, D]
    cos, sin = rope_cos_sin(POSITIONS, rope_inv_freq(rot, theta), torch.float32)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), **TOL)
    if rot < d:
        torch.testing.assert_close(apply_rope(q, cos, sin)[..., rot:], q[..., rot:], rtol=0, atol=0)


# ---- rms norm

NORMS = [(7, 20), (1, 45), (33, 64)]  # (rows, D)
DTYPES = [torch.float32, torch.bfloat16]


def _norm_id(case):
    r, d = case
    return f"R={r}-D={d}"


def _tol(dtype):
    return TOL if dtype == torch.float32 else BF16_TOL


def make_norm_inputs(r, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(r, d, generator=gen)
    gate = torch.randn(r, d, generator=gen)
    w = 0.5 * torch.randn(d, generator=gen)
    return x.to(dtype), gate.to(dtype), w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORMS, ids=_norm_id)
@torch.no_grad()
def test_rms_norm_matches_llama(case, dtype):
    x, _, w = make_norm_inputs(*case, dtype)
    norm = llama.LlamaRMSNorm(case[1], eps=EPS)
    norm.weight.copy_(1 + w)
    norm.to(dtype)  # a checkpoint's norm weight comes in the model's dtype
    out = rms_norm(x, norm.weight.float(), EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", NORMS, ids=_norm_id)
@torch.no_grad()
def test_rms_norm_matches_zero_centred_qwen3_next(case, dtype):
    x, _, w = make_norm_inputs(*case, dtype)
    norm = qwen3_next.Qwen3NextRMSNorm(case[1], eps=EPS)
    norm.weight.copy_(w)
    norm.to(dtype)
    out = rms_norm(x, 1 + norm.weight.float(), EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [(7, 3, 20), (1, 5, 45), (33, 2, 64)], ids=lambda c: "R={}-H={}-D={}".format(*c))
@torch.no_grad()
def test_gated_rms_norm_matches_qwen3_next(case, dtype):
    r, h, d = case
    x, gate, w = make_norm_inputs(r * h, d, dtype)
    x, gate = x.reshape(r, h, d), gate.reshape(r, h, d)  # one norm per head vector
    norm = qwen3_next.Qwen3NextRMSNormGated(d, eps=EPS)
    norm.weight.copy_(1 + w)
    norm.to(dtype)
    out = gated_rms_norm(x, gate, norm.weight.float(), EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm(x, gate), **_tol(dtype))
