"""GGUF's quantized blocks, to and from the packed layout.

GGUF stores each row of a Q8_0 / Q4_K / Q5_K / Q6_K weight as a run of blocks along K, every block holding its
own scales and interleaved code bits. `from_gguf` splits those bytes into a `PackedWeight`'s planes (see
`strata.quant.packed`) so that `dequantize` of the result is, bit for bit, `gguf.quants.dequantize` of the bytes.
`quantize` goes the other way from float weights: a plain min/max (Q4_K, Q5_K) or absmax (Q6_K, Q8_0) rounding
written in GGUF's exact block layout (Q8_0's bytes are those of `gguf.quants.quantize`), meant for making
quantized weights at real model shapes in tests and benchmarks, not for matching llama.cpp's search.

Everything is torch on the tensors' own device, one pass over all blocks at once; `quantize` works through the
rows in chunks so its float32 temporaries stay small next to the weight.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.quant.packed import PackedWeight, dequantize

T = GGMLQuantizationType
SUPPORTED = {T.Q8_0: "q8_0", T.Q4_1: "q4_1", T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k", T.IQ3_S: "iq3_s"}

_CHUNK = 1 << 24  # elements `quantize` handles per pass (its temporaries are a few float32 copies of this)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2m] -> float16 [..., m] (little-endian, as GGUF and every torch device store them)."""
    return b.contiguous().view(torch.float16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., m] -> [..., 8 / width, m]: field s is bits s * width .. (s + 1) * width - 1 of each byte."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)[:, None]
    return (b[..., None, :] >> shifts) & ((1 << width) - 1)


def _merge(f: torch.Tensor, width: int) -> torch.Tensor:
    """`_fields`' inverse: uint8 [..., 8 / width, m] (each field below 2**width) -> [..., m]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=f.device)[:, None]
    return (f << shifts).sum(-2, dtype=torch.uint8)  # the fields' bits are disjoint: the sum is their OR


def _pack(v: torch.Tensor, width: int) -> torch.Tensor:
    """Per-column fields uint8 [..., K] -> packed.py's planes [..., K * width / 8] (column per * j + i at bit
    i * width of byte j)."""
    per = 8 // width
    return _merge(v.reshape(*v.shape[:-1], -1, per).transpose(-1, -2), width)


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins, uint8 [..., 8] each."""
    a, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (md & 15) | ((a >> 2) & 48)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)
    return sc, mn


def _pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`_scale_min`'s inverse."""
    lo, hi = sc[..., :4], sc[..., 4:]
    mlo, mhi = mn[..., :4], mn[..., 4:]
    return torch.cat([lo | ((hi >> 4) << 6), mlo | ((mhi >> 4) << 6), (hi & 15) | ((mhi & 15) << 4)], -1)


def from_gguf(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...],
              dtype: torch.dtype = torch.bfloat16) -> PackedWeight:
    """GGUF bytes uint8 [..., N, K / block_cols * block_bytes] of a weight of `shape` [..., N, K] as a
    `PackedWeight` (tiles rounded to `dtype`)."""
    qtype = T(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype.name} has no packed format (supported: {[t.name for t in SUPPORTED]})")
    cols, size = GGML_QUANT_SIZES[qtype]
    *lead, k = shape
    if k % cols:
        raise ValueError(f"{qtype.name} needs K a multiple of {cols}, got {k}")
    nb = k // cols
    b = raw.reshape(*lead, nb, size)
    fmt = SUPPORTED[qtype]
    if qtype == T.Q8_0:
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(*lead, k)
        return PackedWeight(fmt, tuple(shape), codes, _f16(b[..., :2]).reshape(*lead, nb), dtype=dtype)
    if qtype == T.Q4_1:  # d | m | qs[16]: column i in the low nibble of byte i, column 16 + i in its high one
        low = _fields(b[..., 4:], 4).reshape(*lead, k)
        scales = _f16(b[..., :4]).reshape(*lead, nb, 2)
        return PackedWeight(fmt, tuple(shape), _pack(low, 4), scales, dtype=dtype)
    if qtype == T.IQ3_S:  # d | qs[64] | qh[8] | signs[32] | scales[4]: each part's bytes joined across blocks
        part = lambda a, z: b[..., a:z].reshape(*lead, -1)  # noqa: E731
        return PackedWeight(fmt, tuple(shape), part(2, 66), part(106, 110), _f16(b[..., :2]).reshape(*lead, nb),
                            part(66, 74), dtype=dtype, signs=part(74, 106))
    if qtype == T.Q6_K:
        ql, qh = b[..., :128].reshape(*lead, nb, 2, 64), b[..., 128:192].reshape(*lead, nb, 2, 32)
        low = _fields(ql, 4).reshape(*lead, k)  # half h: columns 128h + 64s + i in nibble s of byte 64h + i
        top = _fields(qh, 2).reshape(*lead, k)  # half h: columns 128h + 32s + i in bits 2s, 2s + 1 of byte 32h + i
        scales = b[..., 192:208].contiguous().view(torch.int8).reshape(*lead, nb * 16)
        return PackedWeight(fmt, tuple(shape), _pack(low, 4), scales, _f16(b[..., 208:210]).reshape(*lead, nb),
                            _pack(top, 2), dtype=dtype)
    sc, mn = _scale_min(b[..., 4:16])
    scales = torch.stack([sc, mn], -1).reshape(*lead, nb * 8, 2)
    qs = b[..., -128:].reshape(*lead, nb, 4, 32)
    low = _fields(qs, 4).reshape(*lead, k)  # columns 64j + 32s + i in nibble s of byte 32j + i
    high = None
    if qtype == T.Q5_K:  # column 32s + i's fifth bit is bit s of byte i
        high = _pack(_fields(b[..., 16:48], 1).reshape(*lead, k), 1)
    return PackedWeight(fmt, tuple(shape), _pack(low, 4), scales, _f16(b[..., :4]), high, dtype=dtype)


def dequantize_gguf(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 [..., N, K]: what `gguf.quants.dequantize` gives for these bytes."""
    return dequantize(from_gguf(raw, qtype, shape))


def _ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, 0 where b is 0 (an all-zero block, or a scale that underflowed float16)."""
    return torch.where(b > 0, a / b, 0.0)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly as `gguf.quants.np_roundf` (floor(|v| + 0.5) can round up at 0.5 - ulp)."""
    a = v.abs()
    r = a.floor()
    return (r + (2 * (a - r)).floor()).copysign(v)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _roundf(x * torch.where(d == 0, 0.0, 1 / d))  # gguf's float32 steps, for its bytes
    return torch.cat([_bytes(d.half()), _bytes(q.to(torch.int8))], -1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((x - lo) * torch.where(d == 0, 0.0, 1 / d) + 0.5).trunc_().clamp_(0, 15).to(torch.uint8)
    return torch.cat([_bytes(d.half()), _bytes(lo.half()), _merge(q.view(-1, 2, 16), 4)], -1)


def _q45_k(x: torch.Tensor, bits: int) -> torch.Tensor:
    top = (1 << bits) - 1
    xs = x.view(-1, 8, 32)
    lo = xs.amin(-1).clamp(max=0)  # the min is subtracted as dmin * m with m >= 0: it can only lower the range
    scale, off = (xs.amax(-1) - lo) / top, -lo
    d, dmin = (scale.amax(-1, keepdim=True) / 63).half(), (off.amax(-1, keepdim=True) / 63).half()
    # the 6-bit sub-block values are fitted to the float16 supers the dequantizer will use
    sc = _ratio(scale, d.float()).round_().clamp_(0, 63)
    mn = _ratio(off, dmin.float()).round_().clamp_(0, 63)
    q = _ratio(xs + (dmin.float() * mn)[..., None], (d.float() * sc)[..., None]).round_().clamp_(0, top)
    q = q.to(torch.uint8)
    qs = _merge((q & 15).view(-1, 4, 2, 32), 4).view(-1, 128)
    parts = [_bytes(d), _bytes(dmin), _pack_scale_min(sc.to(torch.uint8), mn.to(torch.uint8))]
    if bits == 5:
        parts.append(_merge((q >> 4).view(-1, 8, 32), 1))
    return torch.cat([*parts, qs], -1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    xs = x.view(-1, 16, 16)
    scale = xs.abs().amax(-1) / 31
    d = (scale.amax(-1, keepdim=True) / 127).half()
    sc = _ratio(scale, d.float()).round_().clamp_(0, 127)
    q = (_ratio(xs, (d.float() * sc)[..., None]).round_().clamp_(-32, 31) + 32).to(torch.uint8).view(-1, 256)
    ql = _merge((q & 15).view(-1, 2, 2, 64), 4).view(-1, 128)
    qh = _merge((q >> 4).view(-1, 2, 4, 32), 2).view(-1, 64)
    return torch.cat([ql, qh, _bytes(sc.to(torch.int8)), _bytes(d)], -1)


_GROUPS = 1 << 18  # groups of 4 values `_iq3_s` matches against the grid at a time


def _iq3_s(x: torch.Tensor) -> torch.Tensor:
    """Each 32 values' scale from its largest (to 15 grid units), each 4 values' magnitudes to the nearest of the
    512 grid points, the signs as they are."""
    from strata.quant.packed import iq3s_grid

    xs = x.view(-1, 8, 32)
    db = xs.abs().amax(-1) / 15  # [B, 8]
    d = (db.amax(-1, keepdim=True) / 31).half()
    sc = ((_ratio(db, d.float()) - 1) / 2).round_().clamp_(0, 15)
    t = _ratio(xs.abs(), (d.float() * (1 + 2 * sc))[..., None]).reshape(-1, 4)  # [B * 64, 4] in grid units
    grid = iq3s_grid(x.device).float()  # [512, 4]
    norms = (grid * grid).sum(-1)
    index = torch.empty(t.shape[0], dtype=torch.int64, device=x.device)
    for i in range(0, t.shape[0], _GROUPS):
        index[i : i + _GROUPS] = (norms - 2 * t[i : i + _GROUPS] @ grid.T).argmin(-1)  # nearest: |g|^2 - 2 t.g
    index = index.view(-1, 64)
    qs = (index & 255).to(torch.uint8)
    qh = _pack((index >> 8).to(torch.uint8), 1)
    signs = _pack((xs < 0).to(torch.uint8).view(-1, 256), 1)
    scales = _pack(sc.to(torch.uint8), 4)
    return torch.cat([_bytes(d), qs, qh, signs, scales], -1)


_QUANTIZERS = {T.IQ3_S: _iq3_s, T.Q8_0: _q8_0, T.Q4_1: _q4_1, T.Q4_K: lambda x: _q45_k(x, 4),
               T.Q5_K: lambda x: _q45_k(x, 5), T.Q6_K: _q6_k}


def quantize(w: torch.Tensor, qtype: GGMLQuantizationType | int) -> torch.Tensor:
    """Float weight [..., N, K] -> GGUF bytes uint8 [..., N, K / block_cols * block_bytes] of `qtype`."""
    qtype = T(qtype)
    if qtype not in _QUANTIZERS:
        raise ValueError(f"cannot quantize to GGUF type {qtype.name} (supported: {[t.name for t in SUPPORTED]})")
    cols, size = GGML_QUANT_SIZES[qtype]
    k = w.shape[-1]
    if k % cols:
        raise ValueError(f"{qtype.name} needs K a multiple of {cols}, got {k}")
    rows = w.reshape(-1, k)
    out = torch.empty(rows.shape[0], k // cols * size, dtype=torch.uint8, device=w.device)
    step = max(1, _CHUNK // k)
    for i in range(0, rows.shape[0], step):  # chunks of many rows, to bound the float32 temporaries
        chunk = rows[i : i + step].float().reshape(-1, cols)
        out[i : i + step] = _QUANTIZERS[qtype](chunk).view(-1, out.shape[1])
    return out.reshape(*w.shape[:-1], -1)
