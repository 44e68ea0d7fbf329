"""Packed weights read inside the kernels: a tile of a `PackedWeight` dequantized in registers, or multiplied as
integer codes with its scales applied after the dot.

`packed_tile` gives the float32 values of rows o_n, columns k0 .. k0 + BLOCK_K of a packed weight, exactly what
`strata.quant.packed.dequantize` gives there; a kernel rounds them to its activations' dtype and multiplies as it
does a plain weight's tile, so a packed weight's products are bitwise those of the weight dequantized at load
(the same tiles, the same order). Only the packed bytes cross the memory bus: a decode window, bound by reading
its weights, reads 2x (8-bit), 3.5x (4-bit K-quants) fewer bytes than bfloat16.

`packed_mm` is the K-quants' decode product (`scaled_after`): the codes go to the tensor cores as they are, two
columns a shift, a mask and an or, and each scale group's sum is scaled in float32, nearer the float reference
than a tile rounded to bfloat16 and with a third of the instructions a column (`packed_mm2`: the experts' gate and
up rows in one loop over x). On an H100 q4_k decode runs at 0.53-0.67x bf16's speed (docs/PERFORMANCE.md: where
the time goes and what would close it).

`dequantize_triton` writes a whole packed weight out in its activations' dtype, for prompt windows' products on
torch's GEMMs (a prompt window's arithmetic, not its weight reads, bounds it; the write is a small part of it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from strata.kernels import cpu_packed, onednn
from strata.quant.packed import PackedWeight, iq3s_grid


@triton.jit
def _load3(p_r, m_n, start, stride, limit, G: tl.constexpr, C: tl.constexpr):
    """[BN, G, C] from each row's record p_r ([BN, 1] pointers): element start + g * stride + c (< limit, else 0)."""
    o = start + tl.arange(0, G)[:, None] * stride + tl.arange(0, C)[None, :]  # [G, C]
    return tl.load(p_r[:, :, None] + o[None, :, :], mask=m_n[:, None, None] & (o < limit)[None, :, :], other=0)


@triton.jit
def _word(p_r, b, m):
    """int32 [BN, G]: the 32-bit word of each row's record (p_r: [BN, 1], 16-byte aligned) holding byte b ([G]).
    Scales are read as words, not as the bytes or halves they are: the compiler prefetches a loop's loads a few
    iterations ahead only when each thread's load is 4 bytes or more (a narrower one would wait every step)."""
    return tl.load(p_r.to(tl.pointer_type(tl.int32)) + (b // 4)[None, :], mask=m, other=0)


@triton.jit
def _field(p_r, b, m, SIZE: tl.constexpr):
    """int32 [BN, G]: the unsigned SIZE-byte fields (1 or 2, inside one word) at byte offsets b of each record."""
    return (_word(p_r, b, m) >> ((b % 4) * 8)[None, :]) & ((1 << (8 * SIZE)) - 1)


@triton.jit
def _exact_float(c, OFFSET: tl.constexpr):
    """float32 of the int32 c + OFFSET (0 <= c + OFFSET < 2**23) minus OFFSET, exactly: c + OFFSET placed in the
    mantissa of 2**23 and 2**23 + OFFSET taken off. An integer-to-float conversion runs at an eighth of the rate
    of an add on a Hopper multiprocessor (16 a clock against 128); this is an or and a subtraction."""
    return ((c + OFFSET) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _half(f):
    """float16 bits (int32) -> float32."""
    return f.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def packed_tile(p_w, o_n, m_n, k0, K, s_row, p_grid, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BN, BLOCK_K]: w[o_n, k0 + j] of a packed weight whose row records (`strata.quant.packed`) start at
    p_w (uint8), s_row bytes apart (o_n: int64 row indices [BN], masked by m_n; columns past K read as 0). K: the
    weight's columns (the record's parts are placed by it); k0: a multiple of BLOCK_K, a power of two. FMT:
    `strata.quant.packed.KERNEL_FORMAT`. p_grid: IQ3_S's grid as 512 int32 words of 4 bytes (`grid_words`), read by
    iq3_s tiles only.

    The tile is built as [BN, G, TG]: G runs of TG columns, each inside one scale group, so a run's scale is one
    value broadcast over its columns (the K-quants' codes from their 32-bit code words, `_codes`); one reshape
    gives [BN, BLOCK_K]. The products are those of
    `strata.quant.packed.dequantize` (exact in float32, so the same bits)."""
    p_r = p_w + o_n[:, None] * s_row  # [BN, 1] each row's record
    if FMT == 6:  # iq3_s: codes [K/4] | signs [K/8] | high [K/32] | scales [K/64] | d f16 [K/256]
        tl.static_assert(BLOCK_K >= 32, "iq3_s tiles are runs of 32 columns")
        G: tl.constexpr = BLOCK_K // 32
        o_run = k0 + tl.arange(0, G) * 32
        m = m_n[:, None] & (o_run < K)[None, :]
        o_i = tl.arange(0, 8)[None, None, :]  # a grid index's place in its run
        o_j = tl.arange(0, 32)[None, None, :]  # a column's place in its run
        b_hi = _field(p_r, K // 4 + K // 8 + o_run // 32, m, 1)  # a run's 8 ninth bits: one byte
        index = _load3(p_r, m_n, k0 // 4, 8, K // 4, G, 8).to(tl.int32) | (((b_hi[:, :, None] >> o_i) & 1) << 8)
        b_g = tl.load(p_grid + index)  # [BN, G, 8]: each index's 4 grid values, one byte each
        values = tl.interleave(tl.interleave(b_g & 255, (b_g >> 16) & 255),
                               tl.interleave((b_g >> 8) & 255, (b_g >> 24) & 255))  # [BN, G, 32]
        b_sign = (_word(p_r, K // 4 + o_run // 8, m)[:, :, None] >> o_j) & 1  # a run's 32 signs: one word
        nib = (_field(p_r, K // 4 + K // 8 + K // 32 + o_run // 64, m, 1) >> ((o_run // 32) % 2 * 4)[None, :]) & 15
        d = _half(_field(p_r, K // 4 + K // 8 + K // 32 + K // 64 + (o_run // 256) * 2, m, 2))
        db = d * _exact_float(1 + 2 * nib, 0)
        w = db[:, :, None] * (_exact_float(values, 0) * _exact_float(1 - 2 * b_sign, 1))
    elif FMT == 1 or FMT == 2:  # q8_0: codes i8 [K] | scales f16 [K/32]; fp8: codes e4m3 [K] | scales f32 [K/128]
        GS: tl.constexpr = 32 if FMT == 1 else 128
        TG: tl.constexpr = GS if GS < BLOCK_K else BLOCK_K
        G: tl.constexpr = BLOCK_K // TG
        o_run = k0 + tl.arange(0, G) * TG  # each run's first column
        m = m_n[:, None] & (o_run < K)[None, :]  # [BN, G]
        b_q = _load3(p_r, m_n, k0, TG, K, G, TG)
        if FMT == 1:
            s = _half(_field(p_r, K + (o_run // GS) * 2, m, 2))
            w = s[:, :, None] * _exact_float(b_q.to(tl.int8, bitcast=True).to(tl.int32), 128)
        else:
            s = _word(p_r, K + (o_run // GS) * 4, m).to(tl.float32, bitcast=True)
            w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]
    else:
        GS: tl.constexpr = 16 if FMT == 5 else 32
        TG: tl.constexpr = GS if GS < BLOCK_K else BLOCK_K
        G: tl.constexpr = BLOCK_K // TG
        o_run = k0 + tl.arange(0, G) * TG
        m = m_n[:, None] & (o_run < K)[None, :]
        b_c = _codes(p_w + o_n * s_row, m_n[:, None, None], k0, K, FMT, G, TG, tl.float32)  # [BN, G, TG] codes
        o_sup = o_run // 256  # each run's super-block
        if FMT == 5:  # q6_k: codes [K/2] | top bits [K/4] | d f16 [K/256] | scales i8 [K/16]
            d = _half(_field(p_r, K // 2 + K // 4 + o_sup * 2, m, 2))
            sc = _field(p_r, _q6k_scale_byte(o_run, K), m, 1).to(tl.int8).to(tl.float32)
            w = (d * sc)[:, :, None] * (b_c - 32.0)
        else:  # q4_k, q5_k: codes [K/2] | (d, dmin) f16 [K/256, 2] | (scale, min) u8 [K/32, 2] | fifth bits [K/8]
            d = _half(_field(p_r, K // 2 + o_sup * 4, m, 2))
            dmin = _half(_field(p_r, K // 2 + o_sup * 4 + 2, m, 2))
            o_g = K // 2 + K // 64 + (o_run // 32) * 2
            sc = _field(p_r, o_g, m, 1).to(tl.float32)
            mn = _field(p_r, o_g + 1, m, 1).to(tl.float32)
            w = (d * sc)[:, :, None] * b_c - (dmin * mn)[:, :, None]
    return tl.reshape(w, [w.shape[0], BLOCK_K])  # masked columns and rows: 0 (their codes and scales load as 0)


# `scaled_after`'s switch (A/B runs); a kernel names it so that Triton's cache keeps the two variants apart
SCALED_AFTER = tl.constexpr(os.environ.get("STRATA_PACKED_EXACT", "") != "1")
SCALED_AFTER_FORMATS = ("q4_k", "q5_k", "q6_k") if SCALED_AFTER.value else ()  # the formats `scaled_after` takes


@triton.constexpr_function
def scaled_after(fmt, block_m, switch=SCALED_AFTER):
    """Whether a decode tile of block_m rows over a weight of kernel format fmt takes its products by `packed_mm`
    (q4_k, q5_k, q6_k, at the decode windows' 16 rows or fewer; with STRATA_PACKED_EXACT=1, never: every format's
    tiles dequantized by `packed_tile`, bitwise the weight dequantized to the activations' dtype). A compile-time
    constant: the branch not taken is not compiled."""
    return bool(switch) and 3 <= fmt <= 5 and block_m <= 16


@triton.jit
def _code_pair(W, F, j: tl.constexpr, FMT: tl.constexpr):
    """int32 [..]: the codes of columns j and j + 4 of each code word (in its low and high 16 bits). W: 32-bit words
    of the low four bits (word w: columns 8w .. 8w + 7, column c in bits 4c .. 4c + 3); F: the high bits of the same
    columns as `_spread_high` gives them (unused for q4_k). A shift and a mask give two columns' codes at once."""
    c = (W >> (4 * j)) & 0x000F000F
    if FMT == 4:
        c = c | (((F >> j) & 0x00010001) << 4)
    if FMT == 5:
        c = c | (((F >> (2 * j)) & 0x00030003) << 4)
    return c


@triton.jit
def _spread_high(F, FMT: tl.constexpr):
    """A code word's high bits (q5_k: a byte, bit c for column c; q6_k: 16 bits, bits 2c, 2c + 1) with columns 4..7
    moved to the upper 16 bits, where `_code_pair` wants them."""
    if FMT == 4:
        F = (F & 0xF) | ((F & 0xF0) << 12)
    if FMT == 5:
        F = (F & 0xFF) | ((F & 0xFF00) << 8)
    return F


@triton.jit
def _halves(c, DT: tl.constexpr):
    """Two columns' codes (int32, low and high 16 bits) as DT values OFFSET + code (`_code_offset`): for the 16-bit
    types the code is placed in the mantissa of OFFSET by an or, two columns at once; float32 exactly."""
    if DT == tl.bfloat16:
        c = c | 0x43004300  # 128 + code
        return c.to(tl.int16).to(DT, bitcast=True), (c >> 16).to(tl.int16).to(DT, bitcast=True)
    elif DT == tl.float16:
        c = c | 0x64006400  # 1024 + code
        return c.to(tl.int16).to(DT, bitcast=True), (c >> 16).to(tl.int16).to(DT, bitcast=True)
    else:
        return _exact_float(c & 0xFFFF, 0), _exact_float(c >> 16, 0)


@triton.constexpr_function
def _code_offset(dt):
    """What `_halves` adds to a code in dtype dt (a compile-time constant)."""
    return {tl.bfloat16: 128.0, tl.float16: 1024.0}.get(dt, 0.0)


@triton.jit
def _codes(p_wr, m_w, k0, K, FMT: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, DT: tl.constexpr):
    """[BN, G, TG] DT: OFFSET (`_code_offset`) + the codes of columns k0 + g * TG + t of the rows whose records
    start at p_wr ([BN] uint8 pointers; m_w: the rows' mask, [BN] or [BN, 1, 1]) of a q4_k, q5_k or q6_k weight
    of K columns, read as 32-bit code words (`strata.quant.packed`'s word order) and put in column order by register joins:
    [.., h, b, a] of the joined tensor is half h of `_code_pair` a + 2b, column 4a + 2b + h of the word."""
    WG: tl.constexpr = TG // 8  # code words a group
    WP: tl.constexpr = 2 if WG >= 4 else 1  # words a thread loads at once (below)
    # [.., TG // 8 // WP, WP] words: a thread's load is at most 8 bytes. With 16-byte loads (a whole 32-column group
    # in one thread) Triton lays the tile out in shared memory along the other dimension, for the tensor cores, and
    # stores it 2 bytes at a time (seen in sm_90 code of four groups a step: 221 instructions a tile against 187)
    o_v = tl.arange(0, WG // WP)[:, None] * WP + tl.arange(0, WP)[None, :]  # [WG / WP, WP]
    o_g = k0 // 8 + tl.arange(0, G) * WG
    o_w = o_g[None, :, None, None] + o_v[None, None, :, :]  # [1, G, WG / WP, WP]
    p_r = p_wr[:, None, None, None]
    m_w = m_w.reshape(m_w.shape[0], 1, 1, 1)
    b_w = tl.load(p_r.to(tl.pointer_type(tl.int32)) + o_w, mask=m_w, other=0)  # [BN, G, WG / WP, WP]
    if FMT == 4:  # fifth bits: a byte per code word
        b_f = tl.load(p_r + K // 2 + K // 64 + K // 16 + o_w, mask=m_w, other=0).to(tl.int32)
    elif FMT == 5:  # top two bits: 16 bits per code word
        b_f = tl.load(p_r.to(tl.pointer_type(tl.int16)) + K // 4 + o_w, mask=m_w, other=0).to(tl.int32) & 0xFFFF
    else:
        b_f = b_w
    b_f = _spread_high(b_f, FMT)
    l0, h0 = _halves(_code_pair(b_w, b_f, 0, FMT), DT)
    l1, h1 = _halves(_code_pair(b_w, b_f, 1, FMT), DT)
    l2, h2 = _halves(_code_pair(b_w, b_f, 2, FMT), DT)
    l3, h3 = _halves(_code_pair(b_w, b_f, 3, FMT), DT)
    b_q = tl.join(tl.join(tl.join(l0, l1), tl.join(l2, l3)), tl.join(tl.join(h0, h1), tl.join(h2, h3)))
    return tl.reshape(b_q, [b_w.shape[0], b_w.shape[1], TG])  # [.., word / WP, word % WP, h, b, a] -> columns


@triton.jit
def _q6k_scale_byte(o_run, K):
    """The byte offset in a q6_k record of the scale of the 16-column group at column o_run."""
    return K // 2 + K // 4 + K // 128 + o_run // 16


@triton.jit
def _group_scales(p_wr, m_s, o_run, K, FMT: tl.constexpr):
    """int32 [G, BN]: the aligned 32-bit words holding the scale fields of the groups starting at columns o_run
    ([G]) of each row (q4_k, q5_k: the super-block's (d, dmin) word and the word holding the group's (scale, min)
    bytes; q6_k: the word holding d's float16 bits and the one holding the scale byte). Only whole words: a field
    narrower than a word, loaded alone, is repacked into its register once loaded, and a loop that carries it to
    the next step waits for the load there (`_scale_terms` takes the fields out where they are used)."""
    p_32 = p_wr.to(tl.pointer_type(tl.int32))[None, :]
    if FMT == 5:
        b_1 = tl.load(p_32 + ((K // 2 + K // 4) // 4 + o_run // 512)[:, None], mask=m_s, other=0)
        b_2 = tl.load(p_32 + (_q6k_scale_byte(o_run, K) // 4)[:, None], mask=m_s, other=0)
    else:
        b_1 = tl.load(p_32 + (K // 8 + o_run // 256)[:, None], mask=m_s, other=0)
        b_2 = tl.load(p_32 + (K // 8 + K // 256 + o_run // 64)[:, None], mask=m_s, other=0)
    return b_1, b_2


@triton.jit
def _scale_terms(b_1, b_2, o_run, K, FMT: tl.constexpr, OFFSET: tl.constexpr):
    """float32 (s, c) [G, BN] from `_group_scales`' words for the groups at columns o_run ([G, 1]): a group's
    weights are s * code - c, and c takes in the OFFSET the codes carry (`_halves`)."""
    if FMT == 5:
        d = _half(b_1 >> (16 * ((o_run // 256) % 2)))
        sc = (b_2 << (24 - 8 * (_q6k_scale_byte(o_run, K) % 4))) >> 24  # the scale byte, signed
        s = d * sc.to(tl.float32)
        c = s * (OFFSET + 32.0)
    else:
        f = b_2 >> (16 * ((o_run // 32) % 2))
        s = _half(b_1 & 0xFFFF) * (f & 0xFF).to(tl.float32)
        c = _half((b_1 >> 16) & 0xFFFF) * ((f >> 8) & 0xFF).to(tl.float32) + OFFSET * s
    return s, c


# scale groups `packed_mm` takes a step (32 columns of q4_k / q5_k, 16 of q6_k each). An H100, 8 layers of the 30B
# shape in q4_k, tok/s at 1 / 8 / 64 rows: 1 group 745 / 2,990 / 9,448; 2: 740 / 2,902 / 9,124; 4: 769 / 2,784 /
# 8,903 (more registers a program: 128 and more against 107)
GROUPS_A_STEP = tl.constexpr(1)


@triton.jit
def _step_scales(p_wr, m_s, k0, k_hi, K, FMT: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr):
    """The scale fields (`_group_scales`) of the NG groups from column k0 on, a tuple of NG ([1, BN], [1, BN])
    pairs; groups at or past k_hi load as 0 (scale 0: they add nothing)."""
    o_1 = tl.arange(0, 1)
    t = ()
    for j in tl.static_range(NG):
        o_g = k0 + j * GS + o_1
        t = t + (_group_scales(p_wr, m_s & (o_g < k_hi)[:, None], o_g, K, FMT),)
    return t


@triton.jit
def _group_mm(b_x, p_wr, m_n, k, K, scales, acc, FMT: tl.constexpr, BLOCK_N: tl.constexpr, GS: tl.constexpr,
              OFFSET: tl.constexpr):
    """acc plus one scale group's product: x [BM, GS] times the codes of columns k .. k + GS of the rows at p_wr,
    scaled by the group's fields `scales` (`_group_scales`' words)."""
    DT: tl.constexpr = b_x.dtype
    b_q = tl.trans(tl.reshape(_codes(p_wr, m_n, k, K, FMT, 1, GS, DT), [BLOCK_N, GS]))  # [GS, BN]
    # the rows' sums by the tensor cores too, against ones made from the codes' tile so that both products take
    # x in one layout (a constant tile gets another, and Triton's pipeline then loads x without asynchronous copies)
    ones = b_q * 0.0 + 1.0
    if DT == tl.float32:
        part = tl.dot(b_x, b_q, input_precision="ieee")
        b_sum = tl.dot(b_x, ones, input_precision="ieee")
    else:
        part = tl.dot(b_x, b_q)
        b_sum = tl.dot(b_x, ones)
    s, c = _scale_terms(scales[0], scales[1], k + tl.arange(0, 1)[:, None], K, FMT, OFFSET)
    acc += part * s
    acc -= b_sum * c
    return acc


@triton.jit
def _packed_mm2(p_xr, m_m, p_wr, p_wr2, m_n, k_lo, k_hi, K, FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, X_CG: tl.constexpr, TWO: tl.constexpr):
    """`packed_mm` over one weight (rows at p_wr) or, TWO, over two (p_wr and p_wr2) that share x and each step's
    x loads; returns (acc, acc2), acc2 zeros unless TWO."""
    DT: tl.constexpr = p_xr.dtype.element_ty
    GS: tl.constexpr = 16 if FMT == 5 else 32
    NG: tl.constexpr = GROUPS_A_STEP
    OFFSET: tl.constexpr = _code_offset(DT)
    o_c = tl.arange(0, GS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    m_x = m_m[:, None]
    m_s = m_n[None, :]
    # a step's scale fields are loaded one step ahead, after the step that uses the ones before them: Triton's
    # pipeline prefetches only the loads that feed the tensor cores (the codes, x), not these (they feed the
    # float32 sums); a step of NG groups leaves one trip to memory for them a step, not one a group
    n_s = _step_scales(p_wr, m_s, k_lo, k_hi, K, FMT, GS, NG)
    n_s2 = n_s
    if TWO:
        n_s2 = _step_scales(p_wr2, m_s, k_lo, k_hi, K, FMT, GS, NG)
    for k0 in range(k_lo, k_hi, NG * GS):
        b_s, b_s2 = n_s, n_s2
        for j in tl.static_range(NG):
            k = k0 + j * GS
            m_k = k < k_hi  # a step past k_hi (a chunk of K not a whole number of steps): x 0, codes not read
            o_x = p_xr[:, None] + k + o_c[None, :]  # [BM, GS]
            if X_CG:
                b_x = tl.load(o_x, mask=m_x & m_k, other=0.0, cache_modifier=".cg")
            else:
                b_x = tl.load(o_x, mask=m_x & m_k, other=0.0)
            acc = _group_mm(b_x, p_wr, m_n & m_k, k, K, b_s[j], acc, FMT, BLOCK_N, GS, OFFSET)
            if TWO:
                acc2 = _group_mm(b_x, p_wr2, m_n & m_k, k, K, b_s2[j], acc2, FMT, BLOCK_N, GS, OFFSET)
        n_s = _step_scales(p_wr, m_s, k0 + NG * GS, k_hi, K, FMT, GS, NG)
        if TWO:
            n_s2 = _step_scales(p_wr2, m_s, k0 + NG * GS, k_hi, K, FMT, GS, NG)
    return acc, acc2


@triton.jit
def packed_mm(p_xr, m_m, p_wr, m_n, k_lo, k_hi, K, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              X_CG: tl.constexpr = False):
    """float32 [BLOCK_M, BLOCK_N]: sum over columns [k_lo, k_hi) of x[m, k] * w[n, k], for the x rows at p_xr ([BM]
    pointers to each row's first element, masked by m_m) and the packed weight rows whose records start at p_wr
    ([BN] uint8 pointers, masked by m_n) of a q4_k, q5_k or q6_k weight of K columns. k_lo, k_hi: multiples of
    the scale group. X_CG: x read from L2 (`_down_tile`'s h). `packed_mm2`: two weights over the same x.

    Each scale group's products are taken with the integer codes themselves (offset into the activations' dtype by
    an or: `_halves`), and the group's scale is applied to the group's sum after the dot, in float32: w = s * code
    - c, so x . w = s * (x . (OFFSET + code)) - (c + OFFSET * s) * sum(x). A tile costs a shift, a mask and an or
    per two columns, where dequantizing it (`packed_tile`) costs a dozen operations a column; the sum of x is one
    more tensor-core product (against ones). The sums are not those of the weight dequantized to x's dtype (its
    rounding is not there: they are nearer the float reference), but a row's are the same whatever the other rows
    are: the groups are added in one order.

    A step takes GROUPS_A_STEP groups (2-D products, one a group) and loads the next step's scale fields as whole
    32-bit words (`_group_scales`): loaded as the bytes and halves they are, they were repacked into the loop's
    registers at the end of each step, which then waited a trip to memory for them (the sm_90 code showed it),
    and a q4_k expert layer at one row took ~100 us (now ~80; docs/perf-log.md, twenty-ninth session)."""
    return _packed_mm2(p_xr, m_m, p_wr, p_wr, m_n, k_lo, k_hi, K, FMT, BLOCK_M, BLOCK_N, X_CG, False)[0]


@triton.jit
def packed_mm2(p_xr, m_m, p_wr, p_wr2, m_n, k_lo, k_hi, K, FMT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """`packed_mm` over two weights of one format and shape (the experts' gate and up rows) that share x: one loop,
    each step's x loaded once; returns the two [BLOCK_M, BLOCK_N] sums."""
    return _packed_mm2(p_xr, m_m, p_wr, p_wr2, m_n, k_lo, k_hi, K, FMT, BLOCK_M, BLOCK_N, False, True)


@triton.jit
def _dequantize_kernel(p_w, p_out, p_grid, N, K, s_row, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_n = o_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = packed_tile(p_w, o_n, m_n, k0, K, s_row, p_grid, FMT, BLOCK_K)
    o_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(p_out + o_n[:, None] * K + o_k[None, :], w.to(p_out.dtype.element_ty), mask=m_n[:, None] & (o_k < K)[None, :])


def grid_words(w: PackedWeight | torch.Tensor) -> torch.Tensor:
    """What the kernels take as p_grid for `w`: IQ3_S's grid as int32 words (byte c of word i: value c of point i)
    on w's device for an iq3_s weight; any tensor of w's otherwise (not read). A view of the table
    `PackedWeight.to` put on the device: nothing is copied here, so it may run while a CUDA graph is captured."""
    data = w.data if isinstance(w, PackedWeight) else w
    if not isinstance(w, PackedWeight) or w.fmt != "iq3_s":
        return data
    return iq3s_grid(data.device).view(torch.int32).reshape(-1)


def project(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a weight that may be packed (written out in x's dtype first: the prompt windows' products; a CPU
    stage's, `host_kernel`, on the CPU's own kernel, `strata.kernels.cpu_packed`) or in oneDNN's blocked layout (a
    CPU stage's plain matrices, `strata.kernels.onednn`)."""
    if isinstance(weight, PackedWeight):
        if weight.host_kernel:  # a CPU stage's packed weight: the CPU's own kernel (`strata.kernels.cpu_packed`)
            return cpu_packed.project(x, weight, bias)
        weight = dequantize_triton(weight, x.dtype)
    elif onednn.is_blocked(weight):
        return onednn.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def plain_weight(w: torch.Tensor | PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A weight as a tensor: a packed one written out in `dtype` (default: its activations' dtype)."""
    if not isinstance(w, PackedWeight):
        return w
    if w.host_kernel:
        return cpu_packed.dequantize(w).to(dtype or w.dtype)
    return dequantize_triton(w, dtype)


def dequantize_triton(w: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The packed weight [..., N, K] written out in `dtype` (default: its activations' dtype), on its device."""
    data = w.data.contiguous()
    k = w.shape[-1]
    rows = 1
    for d in w.shape[:-1]:
        rows *= d
    out = torch.empty(*w.shape, dtype=dtype or w.dtype, device=w.device)
    if rows and k:
        block_n, block_k = 16, 256
        _dequantize_kernel[(triton.cdiv(rows, block_n), triton.cdiv(k, block_k))](
            data, out, grid_words(w), rows, k, data.shape[-1], FMT=w.kernel_format, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4)
    return out
