"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the short causal conv and the gated delta rule.

Plain float32 torch references for one sequence at a time (rows in order). They are the oracle a Triton
kernel beside each function is tested against; semantics follow transformers' Qwen3NextGatedDeltaNet.

The recurrence, per value head h and token t (S is [Dk, Dv], k and q L2-normalised, q scaled by Dk**-0.5):
    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S
"""

import torch
import torch.nn.functional as F
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
