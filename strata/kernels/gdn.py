"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the short causal conv and the gated delta rule.

Plain float32 torch references for one sequence at a time (rows in order). They are the oracle a Triton
kernel beside each function is tested against; semantics follow transformers' Qwen3NextGatedDeltaNet.

The recurrence, per value head h and token t (S is [Dk, Dv], k and q L2-normalised, q scaled by Dk**-0.5):
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

`gdn_decode_triton` is the decode step for a window of rows, one token per row, each row on its own
sequence of the engine's pools: the conv and the recurrence update `conv_pool` and `rec_pool` in place.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


def causal_conv1d(x: Tensor, weight: Tensor, history: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv then silu over x [T, C], continuing from `history` [K-1, C] (the previous
    K-1 inputs, zeros for a fresh sequence); `weight` is [C, K] (checkpoint's conv1d.weight squeezed).

    Returns the output [T, C] in x's dtype and the new history [K-1, C]: the last K-1 rows of history+x.
    """
    num_tokens, num_taps = x.shape[0], weight.shape[1]
    xs = torch.cat([history.to(x.dtype), x])  # [K-1+T, C]
    xs32, w32 = xs.float(), weight.float()
    out = sum(xs32[j : j + num_tokens] * w32[:, j] for j in range(num_taps))  # [T, C]
    return F.silu(out).to(x.dtype), xs[xs.shape[0] - (num_taps - 1) :].clone()


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """float32, head-major copies: q and k normalised (q also scaled) and repeated to the value heads."""
    group = v.shape[1] // k.shape[1]
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    q, k = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))  # [Hv, T, Dk]
    v = v.float().transpose(0, 1)  # [Hv, T, Dv]
    return q, k, v, g.float().t(), beta.float().t()  # g, beta: [Hv, T]


def _check(q, k, v, g, beta, state) -> None:
    num_tokens, num_k_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[1:]
    assert q.shape == k.shape and v.shape[0] == num_tokens, (q.shape, k.shape, v.shape)
    assert num_v_heads % num_k_heads == 0, (num_k_heads, num_v_heads)
    assert g.shape == beta.shape == (num_tokens, num_v_heads), (g.shape, beta.shape)
    assert state.shape == (num_v_heads, head_k_dim, head_v_dim), state.shape


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Gated delta rule over a whole prompt, chunk by chunk (UT transform inside each chunk).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, <= 0), beta: [T, Hv]; state: [Hv, Dk, Dv] float32.
    Each q/k head serves Hv // Hk consecutive value heads. Returns output [T, Hv, Dv] in q's dtype and the
    new state [Hv, Dk, Dv] float32.
    """
    _check(q, k, v, g, beta, state)
    num_tokens, out_dtype = q.shape[0], q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, head_v_dim = v.shape[0], v.shape[-1]

    # Zero padding to whole chunks: beta = 0 and k = 0 write nothing, g = 0 decays nothing.
    pad = -num_tokens % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (num_tokens + pad) // chunk_size
    q, k, v = (x.reshape(num_heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, v))  # [Hv, N, C, D]
    g, beta = (x.reshape(num_heads, num_chunks, chunk_size) for x in (g, beta))  # [Hv, N, C]

    g_cum = g.cumsum(-1)  # [Hv, N, C]
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(future, float("-inf")).exp()  # [Hv, N, C, C]

    # UT transform: (I + strictly_lower(beta k k^T * decay)) [u | w] = [beta v | beta k exp(g_cum)]
    k_beta = k * beta[..., None]
    ut = ((k_beta @ k.mT) * decay).tril(-1) + torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(ut, v * beta[..., None], upper=False, unitriangular=True)  # [Hv, N, C, Dv]
    w = torch.linalg.solve_triangular(ut, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True)

    attn = (q @ k.mT) * decay  # [Hv, N, C, C]
    q_decayed = q * g_cum.exp()[..., None]  # [Hv, N, C, Dk]
    k_decayed = k * (g_cum[..., -1:] - g_cum).exp()[..., None]  # [Hv, N, C, Dk]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]

    s = state.to(torch.float32, copy=True)  # [Hv, Dk, Dv]
    out = torch.empty(num_heads, num_chunks, chunk_size, head_v_dim, device=q.device)
    for i in range(num_chunks):
        v_new = u[:, i] - w[:, i] @ s  # [Hv, C, Dv]
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_decayed[:, i].mT @ v_new

    out = out.reshape(num_heads, -1, head_v_dim)[:, :num_tokens]  # [Hv, T, Dv]
    return out.transpose(0, 1).to(out_dtype).contiguous(), s


def gated_delta_rule_step(q, k, v, g, beta, state) -> tuple[Tensor, Tensor]:
    """Gated delta rule token by token (the recurrent form, for decode where T is usually 1).

    Same shapes and results as `gated_delta_rule_chunked`.
    """
    _check(q, k, v, g, beta, state)
    num_tokens, out_dtype = q.shape[0], q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)

    s = state.to(torch.float32, copy=True)  # [Hv, Dk, Dv]
    out = torch.empty_like(v)  # [Hv, T, Dv]
    for t in range(num_tokens):
        s = s * g[:, t].exp()[:, None, None]
        k_t = k[:, t, :, None]  # [Hv, Dk, 1]
        delta = (v[:, t] - (s * k_t).sum(-2)) * beta[:, t, None]  # [Hv, Dv]
        s = s + k_t * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(-2)
    return out.transpose(0, 1).to(out_dtype).contiguous(), s


# Decode step in Triton: one token per row, each row on its own sequence (seq_ids distinct).
# Block sizes depend on the model's sizes only, never on the number of rows: a row computes alike in any window.
CONV_BLOCK_C = 256
REC_MAX_BLOCK_DV = 64


@triton.jit
def _conv_decode_kernel(
    p_mixed, p_w, p_pool, p_seq, p_out,
    C, stride_mixed, stride_w, stride_ps, stride_pk, stride_out,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per (row, channel block): conv + silu of this token over the history, history shifted."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    i_s = tl.load(p_seq + i_r).to(tl.int64)
    p_hist = p_pool + i_s * stride_ps + o_c
    b_x = tl.load(p_mixed + i_r.to(tl.int64) * stride_mixed + o_c, mask=m_c, other=0.0)  # [BLOCK_C]
    # Same order as the reference: taps 0..K-2 on the history (oldest first), tap K-1 on this token.
    b_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        b_h = tl.load(p_hist + j * stride_pk, mask=m_c, other=0.0).to(p_mixed.dtype.element_ty)
        b_acc += b_h.to(tl.float32) * tl.load(p_w + o_c * stride_w + j, mask=m_c, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(p_hist + (j - 1) * stride_pk, b_h.to(p_pool.dtype.element_ty), mask=m_c)
    b_acc += b_x.to(tl.float32) * tl.load(p_w + o_c * stride_w + (K - 1), mask=m_c, other=0.0).to(tl.float32)
    tl.store(p_hist + (K - 2) * stride_pk, b_x.to(p_pool.dtype.element_ty), mask=m_c)
    b_out = b_acc * tl.sigmoid(b_acc)
    tl.store(p_out + i_r.to(tl.int64) * stride_out + o_c, b_out.to(p_out.dtype.element_ty), mask=m_c)


@triton.jit
def _rec_decode_kernel(
    p_qkv, p_state, p_seq, p_decay, p_beta, p_o,
    stride_qkv, stride_ss, stride_sh, stride_sk, stride_decay, stride_beta, stride_or, stride_oh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    KEY_DIM: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One program per (row, value head, Dv block): one delta-rule step on a [Dk, BLOCK_DV] state tile."""
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r64 = i_r.to(tl.int64)
    i_kh = i_h // GROUP
    o_k = tl.arange(0, BLOCK_DK)
    o_v = i_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_k, m_v = o_k < DK, o_v < DV
    i_s = tl.load(p_seq + i_r).to(tl.int64)

    p_row = p_qkv + i_r64 * stride_qkv
    b_q = tl.load(p_row + i_kh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_DK]
    b_k = tl.load(p_row + KEY_DIM + i_kh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_DK]
    b_v = tl.load(p_row + 2 * KEY_DIM + i_h * DV + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BLOCK_DV]
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6) * (DK ** -0.5)
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    b_g = tl.load(p_decay + i_r64 * stride_decay + i_h).to(tl.float32)
    b_beta = tl.load(p_beta + i_r64 * stride_beta + i_h).to(tl.float32)

    p_s = p_state + i_s * stride_ss + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0) * tl.exp(b_g)  # [BLOCK_DK, BLOCK_DV] float32
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta  # [BLOCK_DV]
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BLOCK_DV]
    tl.store(p_s, b_s, mask=m_s)
    tl.store(p_o + i_r64 * stride_or + i_h * stride_oh + o_v, b_o.to(p_o.dtype.element_ty), mask=m_v)


def gdn_decode_triton(
    mixed: Tensor, conv_w: Tensor, conv_pool: Tensor, rec_pool: Tensor, seq_ids: Tensor,
    decay: Tensor, beta: Tensor, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
) -> Tensor:
    """One decode token per row: short conv + silu, then one gated delta-rule step, on sequence seq_ids[r].

    mixed: [R, C] pre-conv q|k|v (C = 2*Hk*Dk + Hv*Dv; rows may be strided, channels contiguous);
    conv_w: [C, K]; conv_pool: [S, K-1, C] and rec_pool: [S, Hv, Dk, Dv] float32, both updated IN PLACE
    (innermost dim contiguous); seq_ids: [R] int32, distinct; decay (log decay), beta: [R, Hv].
    Returns [R, Hv, Dv] in mixed's dtype, as `causal_conv1d` + `gated_delta_rule_step` would row by row.
    """
    num_rows, num_channels = mixed.shape
    num_taps = conv_w.shape[1]
    key_dim = num_k_heads * k_head_dim
    assert num_channels == 2 * key_dim + num_v_heads * v_head_dim, (mixed.shape, num_k_heads, num_v_heads)
    assert num_v_heads % num_k_heads == 0, (num_k_heads, num_v_heads)
    assert num_taps >= 2 and conv_w.shape[0] == num_channels, conv_w.shape
    assert conv_pool.shape[1:] == (num_taps - 1, num_channels), conv_pool.shape
    assert rec_pool.shape[1:] == (num_v_heads, k_head_dim, v_head_dim), rec_pool.shape
    assert rec_pool.dtype == torch.float32, rec_pool.dtype
    assert decay.shape == beta.shape == (num_rows, num_v_heads), (decay.shape, beta.shape)
    assert mixed.stride(1) == 1 and conv_pool.stride(2) == 1 and rec_pool.stride(3) == 1
    assert conv_w.stride(1) == 1 and decay.stride(1) == 1 and beta.stride(1) == 1 and seq_ids.is_contiguous()
    out = torch.empty(num_rows, num_v_heads, v_head_dim, device=mixed.device, dtype=mixed.dtype)  # [R, Hv, Dv]
    if num_rows == 0:
        return out

    conv_out = torch.empty(num_rows, num_channels, device=mixed.device, dtype=mixed.dtype)  # [R, C]
    _conv_decode_kernel[(num_rows, triton.cdiv(num_channels, CONV_BLOCK_C))](
        mixed, conv_w, conv_pool, seq_ids, conv_out,
        num_channels, mixed.stride(0), conv_w.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_out.stride(0),
        K=num_taps, BLOCK_C=CONV_BLOCK_C,
    )  # fmt: skip

    block_dv = min(triton.next_power_of_2(v_head_dim), REC_MAX_BLOCK_DV)
    _rec_decode_kernel[(num_rows, num_v_heads, triton.cdiv(v_head_dim, block_dv))](
        conv_out, rec_pool, seq_ids, decay, beta, out,
        conv_out.stride(0), rec_pool.stride(0), rec_pool.stride(1), rec_pool.stride(2),
        decay.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        GROUP=num_v_heads // num_k_heads, DK=k_head_dim, DV=v_head_dim,
        KEY_DIM=key_dim, BLOCK_DK=triton.next_power_of_2(k_head_dim), BLOCK_DV=block_dv,
    )  # fmt: skip
    return out
