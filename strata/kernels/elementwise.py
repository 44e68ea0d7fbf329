"""Small elementwise steps of a decode window, one Triton launch each instead of two to five torch ones (prompt
windows use the GDN gates' kernel too: four torch passes over a prompt's [R, Hv] gates become one).

At a few rows these steps read and write almost nothing; what they cost is their launches. Each kernel keeps the
torch ops' roundings (a bfloat16 result is rounded where torch would round it), one program per row and block
of columns, so a row's values do not depend on the other rows. Each torch reference beside its kernel is the
sequence of torch ops it replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels.deferred import SplitSum, add_shared, load_rows, source
from strata.kernels.pdl import pdl, wait_for_prior

BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [R, 2I] (gate columns, then up) -> silu(gate) * up [R, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_add(out: torch.Tensor, s: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(gate_logit) * s; out, s [R, H], gate_logit [R, 1]."""
    return out + torch.sigmoid(gate_logit) * s


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """A Gated DeltaNet step's gates from its projections a, b [R, Hv]: (decay float32, beta in b's dtype)."""
    return neg_a * F.softplus(a.float() + dt_bias), torch.sigmoid(b)


@triton.jit
def _silu_mul_kernel(p_in, p_out, I, s_in, s_out, s_chunk, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_prior(PDL)
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < I
    p_row = p_in + i_r.to(tl.int64) * s_in
    ty = p_out.dtype.element_ty
    b_gate = load_rows(p_row + o_n, m_n, s_chunk, SPLIT, ty)
    b_up = load_rows(p_row + I + o_n, m_n, s_chunk, SPLIT, ty)
    b_act = (b_gate.to(tl.float32) * tl.sigmoid(b_gate.to(tl.float32))).to(ty)  # F.silu, rounded
    tl.store(p_out + i_r.to(tl.int64) * s_out + o_n, (b_act.to(tl.float32) * b_up.to(tl.float32)).to(ty), mask=m_n)


@triton.jit
def _sigmoid_gate_add_kernel(p_out, p_s, p_g, p_res, H, s_out, s_s, s_g, s_res, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
    wait_for_prior(PDL)
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < H
    r = i_r.to(tl.int64)
    ty = p_res.dtype.element_ty
    b_out = tl.load(p_out + r * s_out + o_n, mask=m_n, other=0.0)
    # the arithmetic the MoE's combine and residual norm finish a gated shared expert with (deferred.add_shared)
    b_res = add_shared(b_out, p_s + r * s_s + o_n, 0, p_g + r * s_g, 0, m_n, 2, 0, 0, ty)
    tl.store(p_res + r * s_res + o_n, b_res, mask=m_n)


@triton.jit
def _gdn_gates_kernel(p_a, p_b, p_neg_a, p_dt_bias, p_decay, p_beta, HV, s_a, s_b, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    wait_for_prior(PDL)
    i_r = tl.program_id(0)
    o_h = tl.arange(0, BLOCK)
    m_h = o_h < HV
    r = i_r.to(tl.int64)
    b_a = tl.load(p_a + r * s_a + o_h, mask=m_h, other=0.0)
    b_b = tl.load(p_b + r * s_b + o_h, mask=m_h, other=0.0)
    b_decay, b_beta = gdn_gate_values(b_a, b_b, tl.load(p_neg_a + o_h, mask=m_h, other=0.0),
                                      tl.load(p_dt_bias + o_h, mask=m_h, other=0.0))
    tl.store(p_decay + r * HV + o_h, b_decay, mask=m_h)
    tl.store(p_beta + r * HV + o_h, b_beta, mask=m_h)


@triton.jit
def gdn_gate_values(b_a, b_b, b_neg_a, b_dt_bias):
    """`gdn_gates` on loaded values: (log decay float32, beta in b's dtype). The GDN decode step calls it too
    (`gdn.gdn_decode_triton(gates=...)`), so both give the same bits."""
    b_x = b_a.to(tl.float32) + b_dt_bias
    b_soft = tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))  # F.softplus (threshold 20)
    return b_neg_a * b_soft, tl.sigmoid(b_b.to(tl.float32)).to(b_b.dtype)


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def silu_mul_triton(gate_up: torch.Tensor | SplitSum) -> torch.Tensor:
    """`silu_mul` in one launch. gate_up: [R, 2I], unit column stride (or a `SplitSum` of it, added up here)."""
    assert gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    r, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(r, i, dtype=gate_up.dtype, device=gate_up.device)  # [R, I]
    p, s_chunk, split = source(gate_up)
    if r and i:
        _silu_mul_kernel[(r, triton.cdiv(i, BLOCK))](p, out, i, gate_up.stride(0), out.stride(0), s_chunk,
                                                      SPLIT=split, BLOCK=BLOCK, **pdl(p))
    return out


def sigmoid_gate_add_triton(out: torch.Tensor, s: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """`sigmoid_gate_add` in one launch. out, s: [R, H] (same dtype); gate_logit: [R, 1]."""
    assert _rows(out) and _rows(s) and out.shape == s.shape and out.dtype == s.dtype
    assert gate_logit.shape == (out.shape[0], 1)
    r, h = out.shape
    res = torch.empty_like(out)  # [R, H]
    if r and h:
        _sigmoid_gate_add_kernel[(r, triton.cdiv(h, BLOCK))](
            out, s, gate_logit, res, h, out.stride(0), s.stride(0), gate_logit.stride(0), res.stride(0), BLOCK=BLOCK,
            **pdl(out))
    return res


def gdn_gates_triton(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """`gdn_gates` in one launch. a, b: [R, Hv] (unit column stride); neg_a, dt_bias: [Hv] float32."""
    assert _rows(a) and _rows(b) and a.shape == b.shape
    r, hv = a.shape
    decay = torch.empty(r, hv, dtype=torch.float32, device=a.device)  # [R, Hv]
    beta = torch.empty(r, hv, dtype=b.dtype, device=b.device)  # [R, Hv]
    if r and hv:
        _gdn_gates_kernel[(r,)](a, b, neg_a.contiguous(), dt_bias.contiguous(), decay, beta, hv, a.stride(0),
                                b.stride(0), BLOCK=triton.next_power_of_2(hv), **pdl(a))
    return decay, beta
