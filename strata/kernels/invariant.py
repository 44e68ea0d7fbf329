"""Row-invariant ops: a row's result does not depend on the other rows of the window.

A BLAS picks its blocking (and so its summation order) from the matrix shape, and a GPU reduction picks
its thread layout from the number of rows, so the same row can round differently in a window of 1 row and
of 8. Decode windows (one row per sequence) therefore run their per-row products and reductions in fixed
blocks of rows, zero-padded: every row sees the same shape, and a conversation's arithmetic is the same
alone or batched. (Seen on an H200: an RMSNorm row differed by one bfloat16 ulp between 1 and 8 rows.)

The block is the largest that costs about what one row costs, and that depends on the CPU and its BLAS, so on
the CPU it is measured once per process and dtype (`row_block`): a product over a weight larger than the caches
is timed at 1, 2, 3, 4 and 8 rows (oneDNN's product over a blocked weight where the CPU stage runs those:
`strata.kernels.onednn`), and the block is the largest whose time is within 1.3x of one row's. Measured with MKL
on SmolLM2-135M's projections, float32: an Intel Xeon with AMX (MKL) takes 20, 23, 25, 38 and 49 ms (block 3);
an AMD EPYC (MKL's AVX-512 path) 57, 83, 112, 71 and 89 ms (block 1: a product of 3 rows there costs twice one
row); bfloat16 on either costs about the same from 1 to 8 rows (block 8). `STRATA_ROW_BLOCK=n` sets it instead
(results are then identical across machines that agree on n and the BLAS). On a GPU the torch path keeps fixed
blocks (3 rows in float32, 8 otherwise). Prompt windows use the plain ops.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from strata.kernels.cpu_packed import KERNEL_ROWS
from strata.quant.packed import PackedWeight

CANDIDATES = (1, 2, 3, 4, 8)
WITHIN = 1.3  # a block may cost this much more than one row
_blocks: dict[torch.dtype, int] = {}
log = logging.getLogger("strata.engine")


def measure_row_block(dtype: torch.dtype, nbytes: int = 48 << 20, repeats: int = 7) -> tuple[int, dict[int, float]]:
    """(the block, {rows: seconds}): the CPU stage's product (oneDNN's over blocked weights where `onednn.available`,
    else F.linear) over a [N, 1024] weight of about `nbytes`, each row count timed
    `repeats` times over a fresh pass, the counts in turn (best kept), the weights walked in four parts so no part
    stays cached."""
    from strata.kernels import onednn

    k = 1024
    n = max(256, nbytes // (k * torch.finfo(dtype).bits // 8) // 4)
    parts = [torch.randn(n, k, dtype=dtype) * 0.01 for _ in range(4)]
    product = F.linear
    if onednn.available(dtype):  # the products a CPU stage runs (`strata.kernels.onednn`)
        parts, product = [onednn.block(w) for w in parts], onednn.linear
    inputs = {rows: torch.randn(rows, k, dtype=dtype) for rows in CANDIDATES}
    for x in inputs.values():
        for w in parts:  # warm the code paths
            product(x, w)
    times = dict.fromkeys(CANDIDATES, float("inf"))
    for _ in range(repeats):  # the row counts take turns, so a change of clock or load weighs on all of them alike
        for rows, x in inputs.items():
            t = time.perf_counter()
            for w in parts:
                product(x, w)
            times[rows] = min(times[rows], time.perf_counter() - t)
    block = max(r for r in CANDIDATES if times[r] <= WITHIN * times[1])
    return block, times


def row_block(dtype: torch.dtype) -> int:
    """The decode block of rows for `dtype` on this machine's CPU (measured once per process; see the module)."""
    if dtype not in _blocks:
        forced = os.environ.get("STRATA_ROW_BLOCK")
        if forced:
            if not forced.isdigit() or int(forced) < 1:
                raise ValueError(f"STRATA_ROW_BLOCK={forced!r}: expected a whole number of rows, at least 1")
            _blocks[dtype] = int(forced)
        else:
            block, times = measure_row_block(dtype)
            _blocks[dtype] = block
            log.info("decode windows run %s products in blocks of %d row(s) on this CPU (measured: %s)",
                     str(dtype).removeprefix("torch."), block,
                     ", ".join(f"{r} rows {t * 1e3:.1f} ms" for r, t in times.items()))
    return _blocks[dtype]


def in_row_blocks(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """fn(x, ...) computed on zero-padded blocks of rows of x [R, ...]; fn must work row by row and
    return a tensor or a tuple of tensors with one row per input row. Over weights packed for the CPU's own kernel,
    which sums each row alone whatever the rows beside it, in parts of at most its KERNEL_ROWS rows, unpadded."""
    rows = x.shape[0]
    summed = _summed_alone(args)
    if summed and rows <= KERNEL_ROWS:  # (a decode window's rows on the CPU's kernel: one call)
        return fn(x, *args, **kwargs)
    if summed:  # the CPU's own packed kernel sums every row alone at any count: no padding, and
        # parts of rows it takes whole (more rows would be written out and multiplied otherwise)
        block = KERNEL_ROWS
    else:
        block = row_block(x.dtype) if x.device.type == "cpu" else (3 if x.dtype == torch.float32 else 8)
        if rows % block:
            x = torch.cat([x, x.new_zeros(block - rows % block, *x.shape[1:])])
    outs = [fn(b, *args, **kwargs) for b in x.split(block)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:rows] for parts in zip(*outs))
    return torch.cat(outs)[:rows] if len(outs) > 1 else outs[0][:rows]


def _summed_alone(args) -> bool:
    """Whether fn's weights (its arguments after x) are all packed for the CPU's own kernel
    (`strata.kernels.cpu_packed`), whose products sum each row on its own whatever the rows beside it."""
    summed = False
    for a in args:
        if isinstance(a, PackedWeight):
            if not a.host_kernel:
                return False
            summed = True
        elif isinstance(a, torch.Tensor) and a.dim() >= 2:
            return False
    return summed


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [R, K]; weight: [N, K] -> [R, N], each row computed at its place in a zero-padded block of rows."""
    return in_row_blocks(F.linear, x, weight, bias)


def in_blocks_of(block: int) -> Callable[..., torch.Tensor]:
    """`in_row_blocks` with a fixed block of `block` rows on every device: the CPU expert pool's prompt rows beside
    a GPU stage's row-invariant prompt kernels (a library's product of M rows may sum a row differently by M)."""

    def rows(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        n = x.shape[0]
        if n % block:
            x = torch.cat([x, x.new_zeros(block - n % block, *x.shape[1:])])
        outs = [fn(b, *args, **kwargs) for b in x.split(block)]
        return torch.cat(outs)[:n] if len(outs) > 1 else outs[0][:n]

    return rows


def plain(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The prompt-window counterpart of `in_row_blocks`: fn over all rows at once."""
    return fn(x, *args, **kwargs)
