"""Row-invariant ops: a row's result does not depend on the other rows of the window.

A BLAS picks its blocking (and so its summation order) from the matrix shape, and a GPU reduction picks
its thread layout from the number of rows, so the same row can round differently in a window of 1 row and
of 8. Decode windows (one row per sequence) therefore run their per-row products and reductions in fixed
blocks of rows, zero-padded: every row sees the same shape, and a conversation's arithmetic is the same
alone or batched. (Seen on an H200: an RMSNorm row differed by one bfloat16 ulp between 1 and 8 rows.)

The block is the largest that costs about what one row costs. Measured on the 2-core CPU (AVX-512, AMX)
over SmolLM2-135M's projections: float32 products of 1, 2, 3, 4 and 8 rows take 20, 23, 25, 38 and 49 ms,
so float32 uses blocks of 3; bfloat16 products of 1 and 8 rows take 20.5 and 21.8 ms (AMX), so the
16-bit types use blocks of 8. Prompt windows use the plain ops.

On the GPU a kernel's reduction order follows its thread layout, so two kernels with different warps sum the same
vector in different orders. `exact_sum` sums in fixed point, where addition is exact: its bits are the same in any
kernel, at any warps. The norms and the routing use it, so their warps are chosen for speed alone, and a reduction
can move into another kernel (of other warps) without changing a row's bits.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def row_block(dtype: torch.dtype) -> int:
    return 3 if dtype == torch.float32 else 8


def in_row_blocks(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """fn(x, ...) computed on zero-padded blocks of rows of x [R, ...]; fn must work row by row and
    return a tensor or a tuple of tensors with one row per input row."""
    rows, block = x.shape[0], row_block(x.dtype)
    if rows % block:
        x = torch.cat([x, x.new_zeros(block - rows % block, *x.shape[1:])])
    outs = [fn(b, *args, **kwargs) for b in x.split(block)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:rows] for parts in zip(*outs))
    return torch.cat(outs)[:rows] if len(outs) > 1 else outs[0][:rows]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [R, K]; weight: [N, K] -> [R, N], each row computed at its place in a zero-padded block of rows."""
    return in_row_blocks(F.linear, x, weight, bias)


def plain(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The prompt-window counterpart of `in_row_blocks`: fn over all rows at once."""
    return fn(x, *args, **kwargs)


# exact_sum: values scaled so the largest magnitude is below 2^49, then truncated to integers: up to 2^14 = 16,384
# of them add up in int64 without overflow, each carried to 2^-48 of the largest (float32 keeps 2^-24).


@triton.jit
def _pow2(k):
    """2.0 ** k as float64, for integer k within float64's normal exponents."""
    return ((k + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)


@triton.jit
def exact_sum(b_v):
    """The sum of a float32 vector [N] (N <= 16,384), the same bits whatever the kernel's layout and warps: every
    value in fixed point relative to the largest magnitude (float64 scaled by a power of two, truncated to int64),
    added exactly, rounded once to float32. Within 2^-48 of the largest value per term of the exact sum."""
    b_max = tl.max(tl.abs(b_v), axis=0)
    b_exp = ((b_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # largest magnitude < 2^(b_exp + 1)
    b_shift = 48 - b_exp
    b_q = (b_v.to(tl.float64) * _pow2(b_shift)).to(tl.int64)
    return (tl.sum(b_q, axis=0).to(tl.float64) * _pow2(-b_shift)).to(tl.float32)
