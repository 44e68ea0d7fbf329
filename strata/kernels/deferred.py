"""Results a decode kernel leaves for the kernel that reads them to finish, so the last step costs no launch.

At a few rows a decode window is a chain of small kernels, and each link costs its launch and a trip to memory
whatever it computes. Two of those links only add things up: the float32 chunks of a split-K projection
(`linear.py`) and the routed experts' weighted outputs of each row (`moe.py`). Left unfinished, they are added by
their reader as it loads them — the next RMSNorm, the q/k preparation, the router's top-k, silu × up — in exactly
the order and with the roundings their own kernel would use, so a row's bits do not change.

- `SplitSum`: a projection's K chunks [S, ...] (float32), summed in chunk order and rounded to `dtype`.
- `PairSum`: each row's k expert outputs [R * k, H] (float32, route weight applied), summed in ascending expert
  id and rounded, then the shared expert added (plain, or scaled by sigmoid of its gate logit).

`finish(value)` turns either into a tensor with the stand-alone kernel, for readers that do not take them.
Readers take a `Rows` value through `source(value)`: a pointer tensor, its chunk stride and the chunk count
(0: a plain tensor), and call the `load_rows` device helper.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SplitSum:
    """A projection's float32 partial sums over S chunks of K: parts [S, *shape]. Viewed like the tensor it
    stands for (`split`, `reshape`, `chunk` act on the dimensions after S), so a reader can take a slice."""

    parts: torch.Tensor  # [S, *shape] float32
    dtype: torch.dtype  # what the finished sum is rounded to

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def splits(self) -> int:
        return self.parts.shape[0]

    def stride(self, dim: int) -> int:
        return self.parts.stride(_after_chunks(dim))

    def dim(self) -> int:
        return self.parts.dim() - 1

    def split(self, sizes, dim: int = -1):
        return tuple(replace(self, parts=p) for p in self.parts.split(sizes, dim=_after_chunks(dim)))

    def chunk(self, n: int, dim: int = -1):
        return tuple(replace(self, parts=p) for p in self.parts.chunk(n, dim=_after_chunks(dim)))

    def reshape(self, *shape):
        return replace(self, parts=self.parts.reshape(self.splits, *shape))


def _after_chunks(dim: int) -> int:
    return dim + 1 if dim >= 0 else dim


@dataclass(frozen=True)
class PairSum:
    """The routed experts' outputs of R rows, k pairs each: y [R * k, H] (route weight applied; float32, or
    rounded to `dtype` in prompt windows: `ExpertTiles.round_pairs`; added in float32 either way), ids
    [R, k] (ids >= num_experts add nothing: not held here), plus the shared expert's output `shared` [R, H] and
    its gate logit `shared_gate` [R, 1] (either may be None), tensors or `SplitSum`s in `dtype`."""

    y: torch.Tensor
    ids: torch.Tensor
    num_experts: int
    dtype: torch.dtype
    shared: torch.Tensor | SplitSum | None = None
    shared_gate: torch.Tensor | SplitSum | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ids.shape[0], self.y.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.y.device


Deferred = torch.Tensor | SplitSum | PairSum


def source(t: torch.Tensor | SplitSum) -> tuple[torch.Tensor, int, int]:
    """(the tensor a kernel points at, the stride between chunks, the chunk count: 0 for a plain tensor)."""
    if isinstance(t, SplitSum):
        return t.parts, t.parts.stride(0), t.splits
    return t, 0, 0


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype):
    """Triton's name for a float dtype (a kernel's rounding target, passed as a constexpr)."""
    return _TL[dtype]


def finish(value: Deferred | None) -> torch.Tensor | None:
    """The tensor a deferred result stands for, by the stand-alone kernels (a plain tensor is returned as is)."""
    if isinstance(value, SplitSum):
        from strata.kernels.linear import sum_chunks_triton

        return sum_chunks_triton(value)
    if isinstance(value, PairSum):
        from strata.kernels.moe import combine_triton

        return combine_triton(value)
    return value


@triton.jit
def sum_chunks(p, mask, s_chunk, SPLIT: tl.constexpr):
    """The float32 sum of SPLIT chunks at p, p + s_chunk, ..., added in chunk order starting from 0."""
    b_acc = 0.0 + tl.load(p, mask=mask, other=0.0)
    for i_s in tl.static_range(1, SPLIT):
        b_acc += tl.load(p + tl.full([], i_s, tl.int64) * s_chunk, mask=mask, other=0.0)
    return b_acc


@triton.jit
def load_rows(p, mask, s_chunk, SPLIT: tl.constexpr, TY: tl.constexpr):
    """Values at p of a plain tensor (SPLIT 0: loaded as stored) or of a SplitSum (its chunks summed, rounded to
    TY, as the stand-alone sum stores them)."""
    if SPLIT == 0:
        return tl.load(p, mask=mask, other=0.0)
    else:
        return sum_chunks(p, mask, s_chunk, SPLIT).to(TY)


@triton.jit
def sum_pairs(p_y, p_ids, i_r, o_n, m_n, E, H, K_TOP: tl.constexpr, BLOCK_TOP: tl.constexpr):
    """Row i_r's k pair outputs at columns o_n, added in ascending expert id (float32); ids >= E are skipped."""
    o_j = tl.arange(0, BLOCK_TOP)
    b_ids = tl.load(p_ids + i_r * K_TOP + o_j, mask=o_j < K_TOP, other=E)  # [BT], E in padding lanes
    b_ids = tl.minimum(b_ids, E)  # ids >= E: experts not held here, skipped like padding
    b_out = tl.zeros(o_n.shape, dtype=tl.float32)
    for _ in tl.static_range(K_TOP):
        b_min = tl.min(b_ids, axis=0)
        i_j = tl.min(tl.where(b_ids == b_min, o_j, BLOCK_TOP), axis=0)
        b_ids = tl.where(o_j == i_j, E, b_ids)
        b_out += tl.load(p_y + (i_r * K_TOP + i_j).to(tl.int64) * H + o_n, mask=m_n & (b_min < E), other=0.0)
    return b_out


@triton.jit
def add_shared(b_out, p_s, s_chunk_s, p_g, s_chunk_g, m_n, SHARED: tl.constexpr, SPLIT_S: tl.constexpr,
               SPLIT_G: tl.constexpr, TY: tl.constexpr):
    """b_out (the combined pairs, rounded to TY) plus the shared expert: SHARED 0 none, 1 `out + s`, 2
    `out + sigmoid(gate) * s`, with torch's roundings to TY in between. p_s, p_g: the row's own values."""
    if SHARED == 0:
        return b_out
    else:
        b_s = load_rows(p_s, m_n, s_chunk_s, SPLIT_S, TY).to(tl.float32)
        if SHARED == 2:
            b_g = tl.sigmoid(load_rows(p_g, True, s_chunk_g, SPLIT_G, TY).to(tl.float32)).to(TY).to(tl.float32)
            b_s = (b_g * b_s).to(TY).to(tl.float32)
        return (b_out.to(tl.float32) + b_s).to(TY)


def shared_mode(value: PairSum) -> int:
    return 0 if value.shared is None else 1 if value.shared_gate is None else 2


class PairArgs(NamedTuple):
    """What a kernel that finishes a PairSum (`sum_pairs` + `add_shared`) is launched with."""

    tensors: tuple  # (y, ids, shared, shared gate): pointers (y stands in for an absent shared / gate)
    strides: tuple  # (shared's row stride, its chunk stride, the gate's row stride, its chunk stride)
    meta: dict  # the constexprs: K_TOP, BLOCK_TOP, SHARED, SPLIT_S, SPLIT_G


def pair_args(value: PairSum) -> PairArgs:
    """The launch arguments of `sum_pairs` + `add_shared` for a PairSum."""
    s, s_chunk_s, split_s = source(value.shared) if value.shared is not None else (value.y, 0, 0)
    g, s_chunk_g, split_g = source(value.shared_gate) if value.shared_gate is not None else (value.y, 0, 0)
    k = value.ids.shape[1]
    return PairArgs(
        tensors=(value.y, value.ids.contiguous(), s, g),
        strides=(s.stride(-2) if value.shared is not None else 0, s_chunk_s,
                 g.stride(-2) if value.shared_gate is not None else 0, s_chunk_g),
        meta=dict(K_TOP=k, BLOCK_TOP=triton.next_power_of_2(k), SHARED=shared_mode(value), SPLIT_S=split_s,
                  SPLIT_G=split_g))
