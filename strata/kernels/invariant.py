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
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


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
