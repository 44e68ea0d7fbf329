"""A grammar's token bitmask applied to logits on the GPU in one launch (structured output, `strata.grammar`).

`bitmask` [R, W] int32: bit t % 32 of word t // 32 of a row is set where token t is allowed. For the listed rows
only, every logit whose bit is clear becomes -inf, in place; other rows and allowed tokens are not touched, so an
unconstrained row beside constrained ones keeps its logits bit for bit. One program per (listed row, block of
tokens): it reads the block's words once and writes only where a token is forbidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _apply_kernel(p_logits, p_bitmask, p_rows, V, s_logits, s_bitmask, BLOCK: tl.constexpr):
    row = tl.load(p_rows + tl.program_id(0)).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < V
    words = tl.load(p_bitmask + row * s_bitmask + t // 32, mask=inside, other=-1)
    forbidden = ((words >> (t % 32)) & 1) == 0
    minus_inf = tl.full((BLOCK,), float("-inf"), tl.float32).to(p_logits.dtype.element_ty)
    tl.store(p_logits + row * s_logits + t, minus_inf, mask=inside & forbidden)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [R, V] (float32 or bfloat16, rows contiguous), bitmask [R, >= ceil(V / 32)] int32 and rows [n] int
    (the constrained rows), all on the logits' GPU."""
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.dtype == torch.int32
    if rows.numel() == 0:
        return
    grid = (rows.numel(), triton.cdiv(logits.shape[1], BLOCK))
    _apply_kernel[grid](logits, bitmask, rows, logits.shape[1], logits.stride(0), bitmask.stride(0), BLOCK=BLOCK)
