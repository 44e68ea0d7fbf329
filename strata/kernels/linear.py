"""A row-invariant linear layer for decode windows: out = x @ weight.T (+ bias).

Row m of the result is bitwise the same whatever the other rows are and however many there are: the
tiles are fixed constants (never derived from M), each program owns one [BLOCK_M, BLOCK_N] output tile
and runs the whole K loop in one fixed order (no split-K), and no arithmetic crosses rows. BLOCK_M is
the tensor-core minimum, 16: a decode window of up to 16 rows reads the weight exactly once, which is
what the step costs (it is bound by reading W). `linear_reference` is the torch op it mirrors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16
# dtype -> (BLOCK_N, BLOCK_K, num_stages); one configuration per dtype, whatever M is.
CONFIGS = {
    torch.float32: (64, 64, 3),
    torch.float16: (64, 128, 4),
    torch.bfloat16: (64, 128, 4),
}
NUM_WARPS = 4


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K]; bias: [N] or None -> [M, N]."""
    return F.linear(x, weight, bias)


@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    p_x, p_w, p_b, p_out,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_m = o_m < M
    m_n = o_n < N
    p_xk = p_x + o_m.to(tl.int64)[:, None] * stride_xm + o_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    p_wk = p_w + o_n.to(tl.int64)[None, :] * stride_wn + o_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    # tl.full and // rather than tl.zeros / tl.cdiv (jit helpers that break the interpreter when triton
    # was imported before TRITON_INTERPRET was set)
    b_acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for i_k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        m_k = o_k < K - i_k * BLOCK_K
        b_x = tl.load(p_xk, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_wk, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=INPUT_PRECISION)
        p_xk += BLOCK_K * stride_xk
        p_wk += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_acc += tl.load(p_b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    p_o = p_out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :]
    tl.store(p_o, b_acc.to(p_out.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (x's dtype, any strides); bias: [N] or None -> [M, N] in x's dtype.

    float32 inputs multiply in full float32 (as F.linear does by default), the 16-bit ones on tensor
    cores; all accumulate in float32."""
    m, k = x.shape
    n, k_w = weight.shape
    assert k == k_w, f"x has K={k}, weight has K={k_w}"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    block_n, block_k, num_stages = CONFIGS[x.dtype]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, BLOCK_M))
    linear_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=NUM_WARPS, num_stages=num_stages,
    )
    return out
