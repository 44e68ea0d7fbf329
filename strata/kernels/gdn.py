"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the short causal conv and the gated delta rule.

Plain float32 torch references for one sequence at a time (rows in order). They are the oracle a Triton
kernel beside each function is tested against; semantics follow transformers' Qwen3NextGatedDeltaNet.

The recurrence, per value head h and token t (S is [Dk, Dv], k and q L2-normalised, q scaled by Dk**-0.5):
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

`gdn_decode_triton` is the decode step for a window of rows, one token per row, on the sequences of the engine's
pools: the conv and the recurrence update `conv_pool` and `rec_pool` in place. Consecutive rows of one sequence (a
drafting slot's last token and its drafts, a short prompt chunk) form a run that the programs of its first row step
through in order, so a row computes alike alone, in a run, or beside any other rows; a run's rows may also leave
their states in keep slots (a rejected draft's rollback).

`causal_conv1d_triton` and `gated_delta_rule_chunked_triton` are the prefill of one sequence's prompt rows, with
the contracts of `causal_conv1d` and `gated_delta_rule_chunked` (prompt windows with kernels="triton").
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.elementwise import gdn_gate_values
from strata.kernels.pdl import pdl, wait_for_prior
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
def _run_length(p_seq, i_r, R):
    """Rows in the run that row i_r begins (consecutive rows of its sequence), 0 when row i_r does not begin one."""
    i_s = tl.load(p_seq + i_r)
    prev = tl.load(p_seq + i_r - 1, mask=i_r > 0, other=-1)
    n = (prev != i_s).to(tl.int32)
    nxt = tl.load(p_seq + i_r + n, mask=(n > 0) & (i_r + n < R), other=-1)
    while nxt == i_s:
        n += 1
        nxt = tl.load(p_seq + i_r + n, mask=i_r + n < R, other=-1)
    return n


@triton.jit
def _conv_decode_kernel(
    p_mixed, p_w, p_pool, p_seq, p_out, p_keep_idx, p_keep,
    R, C, stride_mixed, stride_w, stride_ps, stride_pk, stride_out, stride_ks, stride_kk,
    K: tl.constexpr, BLOCK_C: tl.constexpr, KEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, channel block); a run's first row steps its rows in order (the others do nothing):
    conv + silu of each token over the history, history shifted (and, KEEP, copied to the row's keep slot)."""
    wait_for_prior(PDL)
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    n = _run_length(p_seq, i_r, R)
    i_s = tl.load(p_seq + i_r).to(tl.int64)
    p_hist = p_pool + i_s * stride_ps + o_c
    for t in range(n):
        i_row = (i_r + t).to(tl.int64)
        b_x = tl.load(p_mixed + i_row * stride_mixed + o_c, mask=m_c, other=0.0)  # [BLOCK_C]
        if KEEP:
            i_keep = tl.load(p_keep_idx + i_row)
            m_keep = m_c & (i_keep >= 0)
            p_kept = p_keep + tl.maximum(i_keep, 0).to(tl.int64) * stride_ks + o_c
        # Same order as the reference: taps 0..K-2 on the history (oldest first), tap K-1 on this token.
        b_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K - 1):
            b_h = tl.load(p_hist + j * stride_pk, mask=m_c, other=0.0).to(p_mixed.dtype.element_ty)
            b_acc += b_h.to(tl.float32) * tl.load(p_w + o_c * stride_w + j, mask=m_c, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(p_hist + (j - 1) * stride_pk, b_h.to(p_pool.dtype.element_ty), mask=m_c)
                if KEEP:
                    tl.store(p_kept + (j - 1) * stride_kk, b_h.to(p_keep.dtype.element_ty), mask=m_keep)
        b_acc += b_x.to(tl.float32) * tl.load(p_w + o_c * stride_w + (K - 1), mask=m_c, other=0.0).to(tl.float32)
        tl.store(p_hist + (K - 2) * stride_pk, b_x.to(p_pool.dtype.element_ty), mask=m_c)
        if KEEP:
            tl.store(p_kept + (K - 2) * stride_kk, b_x.to(p_keep.dtype.element_ty), mask=m_keep)
        b_out = b_acc * tl.sigmoid(b_acc)
        tl.store(p_out + i_row * stride_out + o_c, b_out.to(p_out.dtype.element_ty), mask=m_c)
        tl.debug_barrier()  # the next row of the run reads the history this one wrote


@triton.jit
def _rec_decode_kernel(
    p_qkv, p_state, p_seq, p_decay, p_beta, p_o, p_neg_a, p_dt_bias, p_keep_idx, p_keep,
    R, keep_on, stride_qkv, stride_ss, stride_sh, stride_sk, stride_decay, stride_beta, stride_or, stride_oh, stride_ks,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    KEY_DIM: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, GATES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, value head, Dv block); a run's first row steps its rows in order on a [Dk, BLOCK_DV]
    state tile held in registers (the others do nothing), one delta-rule step a row (keep_on: the tile after each
    row with a keep slot is copied there). keep_on is a runtime flag, not a constexpr: a variant compiled with the
    copies rounded the state differently (3e-8 on an H100), so with and without drafts configured the same kernel
    runs and a state is the same bits. GATES: p_decay, p_beta hold the projections a and b, and the program
    makes its head's log decay and beta itself (`elementwise.gdn_gate_values`, with p_neg_a and p_dt_bias), bit
    for bit as `gdn_gates_triton`."""
    wait_for_prior(PDL)
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // GROUP
    o_k = tl.arange(0, BLOCK_DK)
    o_v = i_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_k, m_v = o_k < DK, o_v < DV
    n = _run_length(p_seq, i_r, R)
    i_s = tl.load(p_seq + i_r).to(tl.int64)
    tile = i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    p_s = p_state + i_s * stride_ss + tile
    m_s = m_k[:, None] & m_v[None, :] & (n > 0)
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BLOCK_DK, BLOCK_DV] float32
    for t in range(n):
        i_row = (i_r + t).to(tl.int64)
        p_row = p_qkv + i_row * stride_qkv
        b_q = tl.load(p_row + i_kh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_DK]
        b_k = tl.load(p_row + KEY_DIM + i_kh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BLOCK_DK]
        b_v = tl.load(p_row + 2 * KEY_DIM + i_h * DV + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BLOCK_DV]
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6) * (DK ** -0.5)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        if GATES:
            b_g, b_beta = gdn_gate_values(tl.load(p_decay + i_row * stride_decay + i_h),
                                          tl.load(p_beta + i_row * stride_beta + i_h), tl.load(p_neg_a + i_h),
                                          tl.load(p_dt_bias + i_h))
            b_beta = b_beta.to(tl.float32)
        else:
            b_g = tl.load(p_decay + i_row * stride_decay + i_h).to(tl.float32)
            b_beta = tl.load(p_beta + i_row * stride_beta + i_h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta  # [BLOCK_DV]
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BLOCK_DV]
        tl.store(p_o + i_row * stride_or + i_h * stride_oh + o_v, b_o.to(p_o.dtype.element_ty), mask=m_v)
        i_keep = tl.load(p_keep_idx + i_row, mask=keep_on != 0, other=-1)
        tl.store(p_keep + tl.maximum(i_keep, 0).to(tl.int64) * stride_ks + tile, b_s, mask=m_s & (i_keep >= 0))
    tl.store(p_s, b_s, mask=m_s)


def gdn_decode_triton(
    mixed: Tensor, conv_w: Tensor, conv_pool: Tensor, rec_pool: Tensor, seq_ids: Tensor,
    decay: Tensor | None, beta: Tensor | None, num_k_heads: int, num_v_heads: int, k_head_dim: int,
    v_head_dim: int, gates: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    keep: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """One decode token per row: short conv + silu, then one gated delta-rule step, on sequence seq_ids[r].
    Consecutive rows of one sequence step in order (a run: its first row's programs step them all); a sequence's
    rows must be consecutive. `gates` (a, b [R, Hv], neg_a, dt_bias [Hv] float32), with decay and beta None: the
    step makes the log decay and beta from the projections itself, as `gdn_gates_triton` would (one launch fewer,
    the same bits). `keep` (keep_idx [R] int32, conv_keep [N, K-1, C], rec_keep [N, Hv, Dk, Dv] float32): a row
    with keep_idx >= 0 also leaves its sequence's conv history and recurrent state, as they are after it, in that
    keep slot.

    mixed: [R, C] pre-conv q|k|v (C = 2*Hk*Dk + Hv*Dv; rows may be strided, channels contiguous);
    conv_w: [C, K]; conv_pool: [S, K-1, C] and rec_pool: [S, Hv, Dk, Dv] float32, both updated IN PLACE
    (innermost dim contiguous); seq_ids: [R] int32; decay (log decay), beta: [R, Hv].
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
    if gates is not None:
        assert decay is None and beta is None, "give the gates' projections or decay and beta, not both"
        decay, beta, neg_a, dt_bias = gates  # a and b stand where decay and beta would
        assert neg_a.shape == dt_bias.shape == (num_v_heads,) and neg_a.dtype == dt_bias.dtype == torch.float32
    else:
        neg_a = dt_bias = decay
    assert decay.shape == beta.shape == (num_rows, num_v_heads), (decay.shape, beta.shape)
    assert mixed.stride(1) == 1 and conv_pool.stride(2) == 1 and rec_pool.stride(3) == 1
    assert conv_w.stride(1) == 1 and decay.stride(1) == 1 and beta.stride(1) == 1 and seq_ids.is_contiguous()
    if keep is not None:
        keep_idx, conv_keep, rec_keep = keep
        assert keep_idx.shape == (num_rows,) and keep_idx.dtype == torch.int32 and keep_idx.is_contiguous()
        assert conv_keep.shape[1:] == conv_pool.shape[1:] and conv_keep.dtype == conv_pool.dtype, conv_keep.shape
        assert rec_keep.shape[1:] == rec_pool.shape[1:] and rec_keep.dtype == torch.float32, rec_keep.shape
        assert conv_keep.stride()[1:] == conv_pool.stride()[1:] and rec_keep.stride()[1:] == rec_pool.stride()[1:]
    else:
        keep_idx, conv_keep, rec_keep = seq_ids, conv_pool, rec_pool  # not read (KEEP False)
    out = torch.empty(num_rows, num_v_heads, v_head_dim, device=mixed.device, dtype=mixed.dtype)  # [R, Hv, Dv]
    if num_rows == 0:
        return out

    conv_out = torch.empty(num_rows, num_channels, device=mixed.device, dtype=mixed.dtype)  # [R, C]
    _conv_decode_kernel[(num_rows, triton.cdiv(num_channels, CONV_BLOCK_C))](
        mixed, conv_w, conv_pool, seq_ids, conv_out, keep_idx, conv_keep,
        num_rows, num_channels, mixed.stride(0), conv_w.stride(0), conv_pool.stride(0), conv_pool.stride(1),
        conv_out.stride(0), conv_keep.stride(0), conv_keep.stride(1),
        K=num_taps, BLOCK_C=CONV_BLOCK_C, KEEP=keep is not None, **pdl(mixed),
    )  # fmt: skip

    block_dv = min(triton.next_power_of_2(v_head_dim), REC_MAX_BLOCK_DV)
    _rec_decode_kernel[(num_rows, num_v_heads, triton.cdiv(v_head_dim, block_dv))](
        conv_out, rec_pool, seq_ids, decay, beta, out, neg_a.contiguous(), dt_bias.contiguous(), keep_idx, rec_keep,
        num_rows, int(keep is not None), conv_out.stride(0), rec_pool.stride(0), rec_pool.stride(1), rec_pool.stride(2),
        decay.stride(0), beta.stride(0), out.stride(0), out.stride(1), rec_keep.stride(0),
        GROUP=num_v_heads // num_k_heads, DK=k_head_dim, DV=v_head_dim,
        KEY_DIM=key_dim, BLOCK_DK=triton.next_power_of_2(k_head_dim), BLOCK_DV=block_dv, GATES=gates is not None,
        **pdl(mixed),
    )  # fmt: skip
    return out


# Prefill in Triton: one sequence's prompt rows at a time, the same contracts as `causal_conv1d` and
# `gated_delta_rule_chunked`.
CONV_PREFILL_BLOCK_T = 32
CONV_PREFILL_BLOCK_C = 128
PREP_MAX_BLOCK_DV = 64  # Dv block of the per-chunk pass (u = T @ beta v, Dv walked inside the program)
SOLVE_BLOCK = 16  # rows of the diagonal blocks the per-chunk pass inverts by substitution (the chunk size: all)
PREP_WARPS = 2  # warps of the per-chunk pass (its substitution steps each reduce across the warps)
STATE_MAX_BLOCK_DV = 32  # Dv block of the sequential pass: Hv * Dv/32 programs (128 for 32 heads of 128)
STATE_WARPS = 4  # warps of the sequential pass
# Compiled offline for sm_90 (tests/sm90_compile.py; Triton 3.8, Dk = Dv = 128, chunk 64, bfloat16): the per-chunk
# pass spills 3,476 bytes at 2 warps, 352 at 4, none at 8, and 2 warps were the fastest on an H200 all the same
# (sixth session; re-timed in the eighth at Qwen3-Next's 4,096-row prompt: 344 us a layer for the rule at 2 warps,
# 412 at 4, 498 at 8; Dv blocks of 32 in the per-chunk pass 349, of 64 / 16 in the sequential one 366 / 448, the
# sequential pass on 8 warps 396); the sequential pass has no spills at 4 warps, 128 KiB of shared memory at 2
# stages (16-bit inputs), 64 KiB at one (float32 inputs: IEEE dots, one stage, so that its shared memory fits).


@triton.jit
def _conv_prefill_kernel(
    p_x, p_w, p_hist, p_out, p_new_hist,
    T, C, stride_x, stride_w, stride_h, stride_out, stride_nh,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per (row block, channel block): conv + silu over its rows; the programs of the first row
    block also write the new history (the last K-1 rows of history + x) for their channels."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t, m_c = o_t < T, o_c < C
    # Row s of history + x is x[s - (K-1)] when s >= K-1, else history[s]; tap j of output row t reads row t + j.
    b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        o_s = o_t + j  # [BLOCK_T] rows of history + x
        m_x = (o_s >= K - 1) & m_t
        m_h = (o_s < K - 1) & m_t
        p_xs = p_x + (o_s - (K - 1)).to(tl.int64)[:, None] * stride_x + o_c[None, :]
        b_x = tl.load(p_xs, mask=m_x[:, None] & m_c[None, :], other=0.0)
        b_h = tl.load(p_hist + o_s[:, None] * stride_h + o_c[None, :], mask=m_h[:, None] & m_c[None, :], other=0.0)
        b_xs = b_x + b_h.to(p_x.dtype.element_ty)  # one of the two is 0: exact, in x's dtype as the reference
        b_wj = tl.load(p_w + o_c * stride_w + j, mask=m_c, other=0.0).to(tl.float32)  # [BLOCK_C]
        b_acc += b_xs.to(tl.float32) * b_wj[None, :]
    b_out = b_acc * tl.sigmoid(b_acc)
    p_o = p_out + o_t.to(tl.int64)[:, None] * stride_out + o_c[None, :]
    tl.store(p_o, b_out.to(p_out.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])

    if i_t == 0:  # (names not used above: a compiled `if` may not change a variable's shape)
        o_r = tl.arange(0, BLOCK_H)  # new history row r is row T + r of history + x
        o_rs = T + o_r
        m_r = o_r < K - 1
        m_rx = (o_rs >= K - 1) & m_r
        m_rh = (o_rs < K - 1) & m_r
        p_rx = p_x + (o_rs - (K - 1)).to(tl.int64)[:, None] * stride_x + o_c[None, :]
        b_rx = tl.load(p_rx, mask=m_rx[:, None] & m_c[None, :], other=0.0)
        b_rh = tl.load(p_hist + o_rs[:, None] * stride_h + o_c[None, :], mask=m_rh[:, None] & m_c[None, :], other=0.0)
        b_rs = b_rx + b_rh.to(p_x.dtype.element_ty)
        p_nh = p_new_hist + o_r[:, None] * stride_nh + o_c[None, :]
        tl.store(p_nh, b_rs.to(p_new_hist.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


def causal_conv1d_triton(x: Tensor, weight: Tensor, history: Tensor) -> tuple[Tensor, Tensor]:
    """`causal_conv1d` in one Triton kernel: x [T, C] (rows may be strided, channels contiguous), weight [C, K],
    history [K-1, C]; returns the output [T, C] and the new history [K-1, C], both in x's dtype (new tensors:
    `history` is only read). Tiles of 32 rows x 128 channels, float32 accumulation in the reference's tap order.
    """
    num_tokens, num_channels = x.shape
    num_taps = weight.shape[1]
    assert num_taps >= 2 and weight.shape[0] == num_channels, (x.shape, weight.shape)
    assert history.shape == (num_taps - 1, num_channels), (history.shape, weight.shape)
    x, weight, history = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight, history))
    out = torch.empty(num_tokens, num_channels, device=x.device, dtype=x.dtype)  # [T, C]
    new_history = torch.empty(num_taps - 1, num_channels, device=x.device, dtype=x.dtype)  # [K-1, C]
    grid = (max(1, triton.cdiv(num_tokens, CONV_PREFILL_BLOCK_T)), triton.cdiv(num_channels, CONV_PREFILL_BLOCK_C))
    _conv_prefill_kernel[grid](
        x, weight, history, out, new_history,
        num_tokens, num_channels, x.stride(0), weight.stride(0), history.stride(0), out.stride(0),
        new_history.stride(0),
        K=num_taps, BLOCK_T=CONV_PREFILL_BLOCK_T, BLOCK_C=CONV_PREFILL_BLOCK_C,
        BLOCK_H=triton.next_power_of_2(num_taps - 1),
    )  # fmt: skip
    return out, new_history


@triton.jit
def _gdn_chunk_prep_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_w, p_u, p_qd, p_kd, p_aqk, p_gl,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, SUB: tl.constexpr,
):
    """One program per (chunk, value head), all independent: everything of a chunk that does not need the state.

    With gc the within-chunk cumsum of g, gl = gc[-1], and A = strict_lower(beta_i k_i.k_j exp(gc_i - gc_j)),
    it inverts (I + A) (float32; blocks of SUB rows by forward substitution, then products) and writes, for the
    sequential pass:
    w = (I+A)^-1 (beta k exp(gc)), u = (I+A)^-1 (beta v), qd = q exp(gc), kd = k exp(gl - gc),
    aqk = lower(q_i.k_j exp(gc_i - gc_j)) and gl. q, k are L2-normalised here (q also scaled by DK**-0.5).
    """
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    num_chunks = tl.num_programs(0)
    i_kh = i_h // GROUP
    o_r = tl.arange(0, BT)  # row within the chunk
    o_t = i_n * BT + o_r  # row of the prompt
    m_t = o_t < T
    o_t64 = o_t.to(tl.int64)
    o_k = tl.arange(0, BLOCK_DK)
    m_k = o_k < DK
    m_tk = m_t[:, None] & m_k[None, :]
    # Rows past T load as zeros: k = 0 and beta = 0 write nothing, g = 0 decays nothing (as the reference's padding).
    b_g = tl.load(p_g + o_t64 * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    b_beta = tl.load(p_beta + o_t64 * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    b_gc = tl.cumsum(b_g, axis=0)
    b_gl = tl.sum(tl.where(o_r == BT - 1, b_gc, 0.0), axis=0)

    p_qs = p_q + o_t64[:, None] * stride_qt + i_kh * stride_qh + o_k[None, :]
    b_q = tl.load(p_qs, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BLOCK_DK]
    b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6) * (DK**-0.5))[:, None]
    p_ks = p_k + o_t64[:, None] * stride_kt + i_kh * stride_kh + o_k[None, :]
    b_k = tl.load(p_ks, mask=m_tk, other=0.0).to(tl.float32)  # [BT, BLOCK_DK]
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]

    m_lower = o_r[:, None] >= o_r[None, :]  # [BT, BT], diagonal included
    b_decay = tl.where(m_lower, tl.exp(tl.where(m_lower, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    b_kc = b_k.to(p_w.dtype.element_ty)
    b_kt = tl.trans(b_kc)  # [BLOCK_DK, BT]
    b_kk = tl.dot(b_kc, b_kt, input_precision=PRECISION)  # [BT, BT]
    b_a = tl.where(o_r[:, None] > o_r[None, :], b_kk * b_decay * b_beta[:, None], 0.0)
    b_qk = tl.dot(b_q.to(p_w.dtype.element_ty), b_kt, input_precision=PRECISION) * b_decay  # [BT, BT]

    row = (i_h * num_chunks * BT + o_t).to(tl.int64)  # row of the [Hv, N*BT, .] scratch buffers
    tl.store(p_aqk + row[:, None] * BT + o_r[None, :], b_qk.to(p_aqk.dtype.element_ty))
    tl.store(p_qd + row[:, None] * DK + o_k[None, :], (b_q * tl.exp(b_gc)[:, None]).to(p_qd.dtype.element_ty),
             mask=m_k[None, :])
    tl.store(p_kd + row[:, None] * DK + o_k[None, :], (b_k * tl.exp(b_gl - b_gc)[:, None]).to(p_kd.dtype.element_ty),
             mask=m_k[None, :])
    tl.store(p_gl + i_h * num_chunks + i_n, b_gl)

    # (I + A)^-1 in blocks of SUB rows. First the diagonal blocks' inverses D, by forward substitution on all blocks
    # at once (row i of each block = e_i - sum_{j<i} A[i, j] row j; the blocks' columns are disjoint, so one
    # reduction serves them all): SUB - 1 sequential steps instead of BT - 1. Then, with N the strictly
    # block-lower part of A and M = D N (nilpotent: M^(BT/SUB) = 0), (I + A)^-1 = (I + M)^-1 D
    # = (I - M (I - M (... (I - M)))) D: BT/SUB - 1 products of [BT, BT] tiles on the tensor cores.
    o_blk = o_r // SUB
    m_block = o_blk[:, None] == o_blk[None, :]  # [BT, BT]: the same diagonal block
    b_eye = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)  # [BT, BT] float32
    b_ad = tl.where(m_block, b_a, 0.0)
    b_inv = b_eye
    for i in range(1, SUB):
        m_i = (o_r % SUB)[:, None] == i  # row i of every block
        b_ai = tl.sum(tl.where(m_i, b_ad, 0.0), axis=0)  # [BT]: each block's row i, in its own block's columns
        b_inv = tl.where(m_i & m_block, b_inv - tl.sum(b_ai[:, None] * b_inv, axis=0)[None, :], b_inv)
    if SUB < BT:
        b_m = tl.dot(b_inv, tl.where(o_blk[:, None] > o_blk[None, :], b_a, 0.0), input_precision=PRECISION)
        b_x = b_eye - b_m
        for _ in tl.static_range(BT // SUB - 2):
            b_x = b_eye - tl.dot(b_m, b_x, input_precision=PRECISION)
        b_inv = tl.dot(b_x, b_inv, input_precision=PRECISION)
    b_invc = b_inv.to(p_w.dtype.element_ty)

    b_kb = b_k * (b_beta * tl.exp(b_gc))[:, None]
    b_w = tl.dot(b_invc, b_kb.to(p_w.dtype.element_ty), input_precision=PRECISION)  # [BT, BLOCK_DK]
    tl.store(p_w + row[:, None] * DK + o_k[None, :], b_w.to(p_w.dtype.element_ty), mask=m_k[None, :])
    for v0 in range(0, DV, BLOCK_DV):
        o_v = v0 + tl.arange(0, BLOCK_DV)
        m_v = o_v < DV
        p_vs = p_v + o_t64[:, None] * stride_vt + i_h * stride_vh + o_v[None, :]
        b_v = tl.load(p_vs, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BT, BLOCK_DV]
        b_vb = (b_v * b_beta[:, None]).to(p_u.dtype.element_ty)
        b_u = tl.dot(b_invc, b_vb, input_precision=PRECISION)
        tl.store(p_u + row[:, None] * DV + o_v[None, :], b_u.to(p_u.dtype.element_ty), mask=m_v[None, :])


@triton.jit
def _gdn_chunk_state_kernel(
    p_w, p_u, p_qd, p_kd, p_aqk, p_gl, p_s0, p_o, p_s,
    T, num_chunks, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (value head, Dv block), walking the chunks in order with its [Dk, BLOCK_DV] float32 state:
    v_new = u - w S; o = qd S + aqk v_new; S = exp(gl) S + kd^T v_new (four tensor-core dots per chunk)."""
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BLOCK_DK)
    o_v = i_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_k, m_v = o_k < DK, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    o_s = i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]  # [Hv, Dk, Dv] contiguous
    b_s = tl.load(p_s0 + o_s, mask=m_s, other=0.0)  # [BLOCK_DK, BLOCK_DV] float32
    dot_ty = p_w.dtype.element_ty
    for i_n in range(num_chunks):
        o_t = i_n * BT + o_r
        row = (i_h * num_chunks * BT + o_t).to(tl.int64)
        b_w = tl.load(p_w + row[:, None] * DK + o_k[None, :], mask=m_k[None, :], other=0.0)  # [BT, BLOCK_DK]
        b_qd = tl.load(p_qd + row[:, None] * DK + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_kd = tl.load(p_kd + row[:, None] * DK + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_u = tl.load(p_u + row[:, None] * DV + o_v[None, :], mask=m_v[None, :], other=0.0).to(tl.float32)
        b_aqk = tl.load(p_aqk + row[:, None] * BT + o_r[None, :])  # [BT, BT]
        b_gl = tl.load(p_gl + i_h * num_chunks + i_n)

        b_sc = b_s.to(dot_ty)
        b_vn = b_u - tl.dot(b_w, b_sc, input_precision=PRECISION)  # [BT, BLOCK_DV] float32
        b_vnc = b_vn.to(dot_ty)
        b_o = tl.dot(b_qd, b_sc, input_precision=PRECISION)
        b_o = tl.dot(b_aqk, b_vnc, b_o, input_precision=PRECISION)
        p_os = p_o + o_t.to(tl.int64)[:, None] * stride_ot + i_h * stride_oh + o_v[None, :]
        tl.store(p_os, b_o.to(p_o.dtype.element_ty), mask=(o_t < T)[:, None] & m_v[None, :])
        b_s = b_s * tl.exp(b_gl) + tl.dot(tl.trans(b_kd), b_vnc, input_precision=PRECISION)
    tl.store(p_s + o_s, b_s, mask=m_s)


def gated_delta_rule_chunked_triton(q, k, v, g, beta, state, chunk_size: int = 64, solve_block: int = SOLVE_BLOCK,
                                    prep_warps: int = PREP_WARPS) -> tuple[Tensor, Tensor]:
    """`gated_delta_rule_chunked` on Triton: same shapes, dtypes and results (within float tolerance).

    Two kernels. `_gdn_chunk_prep_kernel`, one program per (chunk, value head), all in parallel: the L2 norm
    and scaling of q/k, the within-chunk cumsum of g, the UT transform (I + A)^-1 in float32 (diagonal blocks of
    `solve_block` rows by forward substitution, the rest by products of [chunk, chunk] tiles: tf32 tensor cores
    for 16-bit inputs, whose w and u round the inverse to 16 bits anyway), and the chunk's w, u, decayed q/k and
    masked q k^T into scratch buffers. `_gdn_chunk_state_kernel`,
    one program per (value head, 32 Dv columns), walks the chunks in order on a float32 state tile: four tl.dot
    per chunk on [chunk, D] tiles. Dots take operands in the input dtype (float16/bfloat16: tensor cores, float32
    accumulation; float32 inputs: IEEE float32 dots); the state stays float32 between chunks.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv]; state: [Hv, Dk, Dv] float32 (only read).
    chunk_size: a power of two >= 16. Returns output [T, Hv, Dv] in q's dtype and the new state float32.
    """
    _check(q, k, v, g, beta, state)
    assert chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0, chunk_size
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    num_tokens, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1:]
    device = q.device
    out = torch.empty(num_tokens, num_v_heads, head_v_dim, device=device, dtype=q.dtype)  # [T, Hv, Dv]
    new_state = torch.empty(num_v_heads, head_k_dim, head_v_dim, device=device, dtype=torch.float32)
    if num_tokens == 0:
        return out, new_state.copy_(state)
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    state = state.to(torch.float32).contiguous()

    num_chunks = triton.cdiv(num_tokens, chunk_size)
    rows = num_chunks * chunk_size
    dot_dtype = q.dtype  # float32 inputs: IEEE float32 dots (tf32 would cost ~1e-3 relative)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # (ignored for 16-bit operands)
    w = torch.empty(num_v_heads, rows, head_k_dim, device=device, dtype=dot_dtype)  # [Hv, N*C, Dk]
    q_decayed, k_decayed = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty(num_v_heads, rows, head_v_dim, device=device, dtype=dot_dtype)  # [Hv, N*C, Dv]
    attn = torch.empty(num_v_heads, rows, chunk_size, device=device, dtype=dot_dtype)  # [Hv, N*C, C]
    chunk_decay = torch.empty(num_v_heads, num_chunks, device=device, dtype=torch.float32)  # [Hv, N] log
    block_dk = max(16, triton.next_power_of_2(head_k_dim))
    dv_pow2 = max(16, triton.next_power_of_2(head_v_dim))

    _gdn_chunk_prep_kernel[(num_chunks, num_v_heads)](
        q, k, v, g, beta, w, u, q_decayed, k_decayed, attn, chunk_decay,
        num_tokens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0),
        GROUP=num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, BT=chunk_size,
        BLOCK_DK=block_dk, BLOCK_DV=min(dv_pow2, PREP_MAX_BLOCK_DV), PRECISION=precision,
        SUB=min(solve_block, chunk_size), num_warps=prep_warps,
    )  # fmt: skip
    block_dv = min(dv_pow2, STATE_MAX_BLOCK_DV)
    _gdn_chunk_state_kernel[(num_v_heads, triton.cdiv(head_v_dim, block_dv))](
        w, u, q_decayed, k_decayed, attn, chunk_decay, state, out, new_state,
        num_tokens, num_chunks, out.stride(0), out.stride(1),
        DK=head_k_dim, DV=head_v_dim, BT=chunk_size, BLOCK_DK=block_dk, BLOCK_DV=block_dv, PRECISION=precision,
        num_warps=STATE_WARPS, num_stages=1 if q.dtype == torch.float32 else 2,
    )  # fmt: skip
    return out, new_state
