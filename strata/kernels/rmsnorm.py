"""RMSNorm, plain, residual-fused and gated: torch references and their Triton kernels (float32 inside, the
input's dtype out).

A norm weight arrives already in multiply form: families that store zero-centred weights (1 + w)
are folded at load, so one op serves every family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.deferred import PairSum, SplitSum, add_shared, load_rows, pair_args, source, sum_pairs
from strata.kernels.invariant import plain
from strata.kernels.pdl import pdl, wait_for_prior


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; weight: [D] float32 -> x / rms(x) * weight, in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_normalize(x, weight, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rows=plain) -> torch.Tensor:
    """Norm each head vector of x, scale by weight, multiply by silu(gate). x, gate: [R, ..., D]; weight: [D].

    `rows` runs the per-row reduction (pass `in_row_blocks` for row-invariant decode windows)."""
    return (rows(rms_normalize, x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused ahead of a norm: -> (rms_norm(residual + x), residual + x)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


# ---- Triton: one program per row vector (a row of [R, D], a head of [R, H, D]), the whole vector in one
# block, float32 inside. Nothing depends on R, so a row rounds the same whatever its neighbours.

MAX_D = 16384


@triton.jit
def _normalize(b_x, p_w, o_d, m_d, D, eps):
    """x / rms(x) * weight in float32, over one row vector held whole in the block."""
    b_x = b_x.to(tl.float32)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    return b_x * b_rstd * b_w


@triton.jit
def _rms_norm_kernel(
    p_x, p_gate, p_w, p_out,
    stride_xr, stride_xh, stride_gr, stride_gh,
    H, D, eps,
    BLOCK: tl.constexpr, GATED: tl.constexpr, HEADS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row program_id(0)'s head vectors HEADS * program_id(1) and the HEADS - 1 after it, one after the other, each
    as a program of its own would."""
    wait_for_prior(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK)
    for j in tl.static_range(HEADS):
        i_h = tl.program_id(1) * HEADS + j
        m_d = (o_d < D) & (i_h < H)
        b_x = tl.load(p_x + i_r * stride_xr + i_h * stride_xh + o_d, mask=m_d, other=0.0)
        b_y = _normalize(b_x, p_w, o_d, o_d < D, D, eps)
        if GATED:
            b_g = tl.load(p_gate + i_r * stride_gr + i_h * stride_gh + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
        tl.store(p_out + (i_r * H + i_h) * D + o_d, b_y.to(p_out.dtype.element_ty), mask=m_d)


@triton.jit
def _add_rms_norm_kernel(
    p_h, p_ids, p_s, p_g, p_res, p_w, p_out, p_res_out,
    s_h, s_chunk_h, s_s, s_chunk_s, s_g, s_chunk_g, s_res, E, D, eps,
    PAIRS: tl.constexpr, SPLIT: tl.constexpr, K_TOP: tl.constexpr, BLOCK_TOP: tl.constexpr, SHARED: tl.constexpr,
    SPLIT_S: tl.constexpr, SPLIT_G: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One row: h (a tensor, a SplitSum's chunks, or a PairSum's pairs and shared expert: finished here as their own
    kernels would), residual + h rounded as torch's add, stored, then normalised."""
    wait_for_prior(PDL)
    TY = p_out.dtype.element_ty  # the residual's dtype: h rounds to it as its own kernel would store it
    i_r = tl.program_id(0)
    r = i_r.to(tl.int64)
    o_d = tl.arange(0, BLOCK)
    m_d = o_d < D
    if PAIRS:
        b_h = sum_pairs(p_h, p_ids, i_r, o_d, m_d, E, D, K_TOP, BLOCK_TOP).to(TY)
        b_h = add_shared(b_h, p_s + r * s_s + o_d, s_chunk_s, p_g + r * s_g, s_chunk_g, m_d, SHARED, SPLIT_S, SPLIT_G,
                         TY)
    else:
        b_h = load_rows(p_h + r * s_h + o_d, m_d, s_chunk_h, SPLIT, TY)
    b_res = tl.load(p_res + r * s_res + o_d, mask=m_d, other=0.0)
    b_x = (b_res.to(tl.float32) + b_h.to(tl.float32)).to(TY)  # rounds as torch's residual + x
    tl.store(p_res_out + r * D + o_d, b_x, mask=m_d)
    tl.store(p_out + r * D + o_d, _normalize(b_x, p_w, o_d, m_d, D, eps).to(TY), mask=m_d)


def _row_vectors(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """t: [R, D] or [R, H, D] -> (t with a unit last stride, row stride, head stride)."""
    assert t.dim() in (2, 3), f"expected [R, D] or [R, H, D], got {tuple(t.shape)}"
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, t.stride(0), t.stride(1) if t.dim() == 3 else 0


def norm_warps(block: int) -> int:
    """Warps of a norm over a block-wide row vector. A row's sum order depends on it: every kernel that must match
    the norm kernel's bits (`qk_prep`'s q/k norms) takes its warps from here."""
    return min(16, max(1, block // 512))


def add_norm_warps(block: int, decode: bool = False) -> int:
    """Warps of the residual norm: it may add a row's split-K chunks or expert pairs (tens of kilobytes) before it
    normalises, so it takes more warps than the plain norm to keep those loads in flight. `decode`: a decode
    window's, whose few programs (one per row) sit on the step's critical path: 16 (eighth session, H200, A/B in
    one process against 8 at a 2,048-wide row: 30B shape +1.0 % tok/s at 1 row and +0.6 % at 8, Qwen3-Next +1.6 %
    and +1.0 %; 4 warps: -3.5 % at 1 row). A row's sum order depends on it: a decode window always passes it."""
    return 16 if decode else min(16, max(4, block // 256))


def heads_per_program(rows: int, heads: int, block: int) -> int:
    """Head vectors one norm program takes in turn: one for decode windows (few rows, every head its own
    program), up to 4,096 elements' worth for prompt windows (a [4,096, 32, 128] GDN output is 131,072 programs
    otherwise, each too short to cover its start). A head's arithmetic is the same either way."""
    return 1 if rows < 64 else min(heads, max(1, 4096 // block))


def _launch_rms_norm(x, weight, eps, gate=None):
    d = x.shape[-1]
    assert d <= MAX_D and weight.shape == (d,) and weight.dtype == torch.float32, "weight: [D] float32"
    heads = x.shape[1] if x.dim() == 3 else 1
    x, sxr, sxh = _row_vectors(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [R, (H,) D]
    sgr, sgh = 0, 0
    if gate is not None:
        assert gate.shape == x.shape
        gate, sgr, sgh = _row_vectors(gate)
    block = triton.next_power_of_2(d)
    if x.shape[0]:
        per = heads_per_program(x.shape[0], heads, block)
        _rms_norm_kernel[(x.shape[0], triton.cdiv(heads, per))](
            x, gate, weight.contiguous(), out, sxr, sxh, sgr, sgh, heads, d, eps,
            BLOCK=block, GATED=gate is not None, HEADS=per, num_warps=norm_warps(block), **pdl(x)
        )
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one Triton program per row vector. x: [R, D] or [R, H, D]; weight: [D] float32."""
    return _launch_rms_norm(x, weight, eps)


def add_rms_norm_triton(
    x: torch.Tensor | SplitSum | PairSum, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    decode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in one pass: x, residual: [R, D] or [R, H, D], same dtype -> (normed, new residual).
    x may be left unfinished by the kernel before (`deferred.SplitSum` or `PairSum`, [R, D]): it is finished here,
    bitwise as its own kernel would have, at no launch of its own. `decode`: a decode window's (`add_norm_warps`;
    other sum order than a prompt window's, the same at every row count)."""
    shape, d = residual.shape, residual.shape[-1]
    assert d <= MAX_D and weight.shape == (d,) and weight.dtype == torch.float32, "weight: [D] float32"
    assert tuple(x.shape) == tuple(shape) and x.dtype == residual.dtype, "x and residual: same shape and dtype"
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1, d)
    residual = residual.reshape(-1, d)
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows = residual.shape[0]
    out = torch.empty(rows, d, dtype=residual.dtype, device=residual.device)  # [rows, D]
    res_out = torch.empty_like(out)  # [rows, D]
    block = triton.next_power_of_2(d)
    if rows:
        if isinstance(x, PairSum):
            a = pair_args(x)
            h, ids, s, g = a.tensors
            src = dict(PAIRS=True, SPLIT=0, **a.meta)
            strides, s_h, s_chunk_h, e = a.strides, 0, 0, x.num_experts
        else:
            if isinstance(x, torch.Tensor) and x.stride(-1) != 1:
                x = x.contiguous()
            h, s_chunk_h, split = source(x)
            ids = s = g = h
            s_h, strides, e = x.stride(0), (0, 0, 0, 0), 0
            src = dict(PAIRS=False, SPLIT=split, K_TOP=1, BLOCK_TOP=1, SHARED=0, SPLIT_S=0, SPLIT_G=0)
        _add_rms_norm_kernel[(rows,)](
            h, ids, s, g, residual, weight.contiguous(), out, res_out,
            s_h, s_chunk_h, *strides, residual.stride(0), e, d, eps,
            **src, BLOCK=block, num_warps=add_norm_warps(block, decode), **pdl(residual),
        )
    return out.reshape(shape), res_out.reshape(shape)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, rows=plain
) -> torch.Tensor:
    """`gated_rms_norm` in Triton. x, gate: [R, Hv, Dv] (or [R, D]); weight: [Dv] float32. `rows` is accepted
    for a drop-in swap and ignored: the kernel is row-invariant by construction."""
    return _launch_rms_norm(x, weight, eps, gate=gate)
