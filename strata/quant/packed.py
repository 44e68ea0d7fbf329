"""Quantized weights kept packed: the layout the Triton kernels read, and its float reference.

A `PackedWeight` stands for a float weight [..., N, K] (rows N, reduction K; a leading dimension for stacked
experts) stored as small integer or float8 codes with per-group scales, in the formats users download. Each row is
one record of bytes, `data` [..., N, row_bytes] uint8, holding the row's parts one after another:

  q8_0  codes int8 [K] | scales float16 [K/32]:                          w = f32(scale) * code
  q4_1  codes uint8 [K/2] (four bits a column, in column order) | scales float16 [K/32, 2] (each 32 columns' d, m):
                                                                         w = f32(d) * code + f32(m)
        (llama.cpp's legacy type, the embedded default's; read by the CPU's own kernel only: its `FORMATS`)
  fp8   codes float8_e4m3fn [K] | scales float32 [K/128] (a checkpoint's 128 x 128 blocks, repeated per row):
                                                                         w = f32(code) * scale
  q4_k  codes uint8 [K/2] (four bits a column, in word order: below) | supers float16 [K/256, 2] (each 256
        columns' d, dmin) | scales uint8 [K/32, 2] (each 32 columns' 6-bit scale, min):
                                                                         w = (f32(d) * scale) * code - f32(dmin) * min
  q5_k  q4_k's parts | high uint8 [K/8] (a byte per 8 columns: each one's fifth bit, in word order):
                                                                         code = nibble | bit << 4
  q6_k  codes uint8 [K/2] (the low four bits, as q4_k) | high uint8 [K/4] (two bytes per 8 columns: each one's top
        two bits, in word order) | supers float16 [K/256] (d) | scales int8 [K/16]:
                                                                         w = (f32(d) * scale) * (code - 32)
  iq3_s codes uint8 [K/4] (the low 8 bits of each 4 columns' grid index) | signs uint8 [K/8] (bit i of byte j:
        column 8j + i negative) | high uint8 [K/32] (bit i of byte j: index 8j + i's ninth bit) | scales uint8
        [K/64] (two 4-bit scales a byte, low first, one per 32 columns) | supers float16 [K/256] (d):
                                                          w = f32(d) * (1 + 2 * scale) * grid[index][c] * sign
        (grid: IQ3_S's 512 points of 4 odd values, `iq3s_grid`; exactly GGUF's 110 bytes per 256 columns)

Word order (q4_k, q5_k, q6_k): each 8 columns' codes are one 32-bit word, field i (nibble i; bit i of the fifth
bits' byte, bits 2i, 2i + 1 of the top bits' 16) holding column WORD_ORDER[i] = 0, 4, 2, 6, 1, 5, 3, 7 of the 8, so
that one shift and one mask of the word give two adjacent columns' codes in its two 16-bit halves, as the decode
kernels' tensor-core products take them (`strata.kernels.packed.packed_mm`). The parts given to `PackedWeight` and
read back from `codes` / `high` are in column order (byte j: column 2j in its low nibble, 2j + 1 in its high one;
the high bits likewise, lowest column first); only the record holds them in word order.

A row record is as long as GGUF's blocks for the row (q4_k and q5_k: 4 bytes more per 256 columns, their 6-bit
scales unpacked to bytes), padded to 16 bytes, so a kernel addresses any column with shifts and a load per part,
every row starts aligned, and rows join, split and index like any tensor's (`cat`, `rows`, `index`): the loader
fuses packed weights as it fuses float ones.

Every product above is exact in float32 (the factors' mantissas are short), so `dequantize` gives, bit for bit,
what `gguf`'s dequantizer (and transformers' FP8 dequantization) gives; rounded to bfloat16 it is the weight a
checkpoint dequantized at load would hold. A kernel that dequantizes a tile in float32, rounds it to the
activations' dtype and multiplies with the plain weight's tiles gives that kernel's bits.
"""

from __future__ import annotations

import torch

# format -> (columns a scale covers, columns a super-block covers or 0, bits of a column's code)
FORMATS = {
    "q8_0": (32, 0, 8),
    "q4_1": (32, 0, 4),
    "fp8": (128, 0, 8),
    "q4_k": (32, 256, 4),
    "q5_k": (32, 256, 5),
    "q6_k": (16, 256, 6),
    "iq3_s": (32, 256, 3),
}
# the formats' numbers in the Triton kernels (a constexpr); 0 is a plain weight. A format not here (q4_1) is kept
# packed only where the CPU's own kernel reads it (`strata.kernels.cpu_packed`), dequantized at load elsewhere
KERNEL_FORMAT = {"q8_0": 1, "fp8": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5, "iq3_s": 6}
_CODE_DTYPE = {"q8_0": torch.int8, "fp8": torch.float8_e4m3fn}
_SCALE_DTYPE = {"q8_0": torch.float16, "q4_1": torch.float16, "fp8": torch.float32, "q4_k": torch.uint8,
                "q5_k": torch.uint8, "q6_k": torch.int8, "iq3_s": torch.uint8}


def part_sizes(fmt: str, k: int) -> dict[str, int]:
    """Each part's bytes in a row of k columns, in the record's order."""
    group, superblock, bits = FORMATS[fmt]
    if fmt == "iq3_s":  # GGUF's own parts, regrouped by kind
        return {"codes": k // 4, "signs": k // 8, "high": k // 32, "scales": k // 64, "supers": k // 128}
    sizes = {"codes": k if bits == 8 else k // 2}
    if fmt == "q6_k":  # its top bits next to the codes, so that they start at a 4-byte boundary for every k
        sizes["high"] = k // 4
    if superblock:
        sizes["supers"] = k // superblock * (4 if fmt in ("q4_k", "q5_k") else 2)
    sizes["scales"] = k // group * {"q8_0": 2, "q4_1": 4, "fp8": 4, "q4_k": 2, "q5_k": 2, "q6_k": 1}[fmt]
    if fmt == "q5_k":
        sizes["high"] = k // 8
    return sizes


ROW_ALIGN = 16  # a row record's bytes are padded to a multiple of this


def row_bytes(fmt: str, k: int) -> int:
    """A row record's bytes: its parts, padded to ROW_ALIGN so that every row starts 16-byte aligned (the kernels
    load codes 16 bytes at a time and scales as 32-bit words)."""
    return -(-sum(part_sizes(fmt, k).values()) // ROW_ALIGN) * ROW_ALIGN


def packed_nbytes(fmt: str, n: int, k: int) -> int:
    """Bytes of an [n, k] weight packed in `fmt` (autoconfig's count)."""
    return n * row_bytes(fmt, k)


WORD_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)  # field i of a code word holds column WORD_ORDER[i] (its own inverse)
_WORD_ORDERED = ("q4_k", "q5_k", "q6_k")


def _word_order(part: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., K * width / 8] fields of `width` bits (4: codes, 1: fifth bits, 2: top bits), lowest first, with
    each 8 fields permuted by WORD_ORDER: column order -> word order, and back (the permutation is an involution)."""
    lead = part.shape[:-1]
    shifts = torch.arange(0, 8, width, device=part.device, dtype=torch.uint8)
    fields = (part[..., None] >> shifts) & ((1 << width) - 1)  # [..., bytes, 8 / width]
    order = torch.tensor(WORD_ORDER, device=part.device)
    fields = fields.reshape(*lead, -1, 8)[..., order].reshape(*lead, -1, 8 // width)
    return (fields << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is their OR


def _as_bytes(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(*lead, -1)


class PackedWeight:
    """A weight of `shape` [..., N, K] packed in `fmt`, as row records `data` [..., N, row_bytes] (see the module).

    Made from its parts (`PackedWeight(fmt, shape, codes, scales, supers, high)`, each with the weight's leading
    dimensions: codes [..., N, K or K/2], scales [..., N, K/group] (q4_1, q4_k, q5_k: [..., N, K/32, 2]), supers
    [..., N, K/256] (q4_k, q5_k: [..., N, K/256, 2]), high [..., N, K/8 or K/4]) or from `data`. `dtype`: the
    activations' dtype, what a dequantized tile is rounded to. `host_kernel`: read by the CPU's own kernel
    (`strata.kernels.cpu_packed`) rather than the Triton kernels (a CPU stage on the torch path keeps its weights
    packed for it); weights made from this one (rows, joins, copies) keep it."""

    host_kernel = False

    def __init__(self, fmt: str, shape: tuple[int, ...], codes: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, supers: torch.Tensor | None = None,
                 high: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                 data: torch.Tensor | None = None, signs: torch.Tensor | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"packed format {fmt!r} is unknown (known: {', '.join(FORMATS)})")
        group, superblock, _ = FORMATS[fmt]
        k = shape[-1]
        if k % max(group, superblock):
            raise ValueError(f"a {fmt} weight needs K a multiple of {max(group, superblock)}, got {k}")
        self.fmt, self.shape, self.dtype = fmt, tuple(shape), dtype
        lead = tuple(shape[:-1])
        if data is None:
            given = {"codes": codes, "supers": supers, "scales": scales, "high": high, "signs": signs}
            given = {name: _as_bytes(t, lead) if t is not None else None for name, t in given.items()}
            if fmt in _WORD_ORDERED:
                given["codes"] = _word_order(given["codes"], 4)
                given["high"] = _word_order(given["high"], 1 if fmt == "q5_k" else 2) if fmt != "q4_k" else None
            parts = [given[name] for name in part_sizes(fmt, k)]
            pad = row_bytes(fmt, k) - sum(part.shape[-1] for part in parts)
            if pad:
                parts.append(parts[0].new_zeros(*lead, pad))
            data = torch.cat(parts, dim=-1)
        if tuple(data.shape) != (*lead, row_bytes(fmt, k)) or data.dtype != torch.uint8:
            raise ValueError(f"a {fmt} weight of shape {list(shape)} needs uint8 rows of {row_bytes(fmt, k)} bytes, "
                             f"got {data.dtype} {list(data.shape)}")
        self.data = data

    def __repr__(self) -> str:
        return f"PackedWeight({self.fmt}, {list(self.shape)}, {self.dtype}, {self.device})"

    def _part(self, name: str) -> torch.Tensor | None:
        sizes = part_sizes(self.fmt, self.shape[-1])
        if name not in sizes:
            return None
        start = 0
        for part, size in sizes.items():
            if part == name:
                break
            start += size
        return self.data[..., start:start + sizes[name]]

    @property
    def codes(self) -> torch.Tensor:
        """The codes in column order (q4_k, q5_k, q6_k: byte j holds column 2j in its low nibble, 2j + 1 in its
        high one)."""
        codes = self._part("codes")
        if self.fmt in _WORD_ORDERED:
            return _word_order(codes, 4)
        return codes.view(_CODE_DTYPE[self.fmt]) if self.fmt in _CODE_DTYPE else codes

    @property
    def scales(self) -> torch.Tensor:
        scales = self._part("scales").view(_SCALE_DTYPE[self.fmt])
        return scales.unflatten(-1, (-1, 2)) if self.fmt in ("q4_1", "q4_k", "q5_k") else scales

    @property
    def supers(self) -> torch.Tensor | None:
        supers = self._part("supers")
        if supers is None:
            return None
        supers = supers.view(torch.float16)
        return supers.unflatten(-1, (-1, 2)) if self.fmt in ("q4_k", "q5_k") else supers

    @property
    def high(self) -> torch.Tensor | None:
        """The high bits (q5_k, q6_k: in column order) or IQ3_S's ninth index bits."""
        high = self._part("high")
        if high is not None and self.fmt in _WORD_ORDERED:
            return _word_order(high, 1 if self.fmt == "q5_k" else 2)
        return high

    @property
    def signs(self) -> torch.Tensor | None:
        return self._part("signs")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def kernel_format(self) -> int:
        return KERNEL_FORMAT[self.fmt]

    def nbytes(self) -> int:
        return self.data.numel()

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def _with(self, data: torch.Tensor, shape: tuple[int, ...] | None = None,
              dtype: torch.dtype | None = None) -> "PackedWeight":
        out = PackedWeight(self.fmt, shape or (*data.shape[:-1], self.shape[-1]), dtype=dtype or self.dtype, data=data)
        out.host_kernel = self.host_kernel
        return out

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "PackedWeight":
        """On `device`; `dtype` changes only the dtype tiles are rounded to (the bytes stay as they are)."""
        out = self._with(self.data.to(device)) if device is not None else self
        if self.fmt == "iq3_s":
            iq3s_grid(out.device)  # its table on the device now, not at a kernel's first launch (maybe in a capture)
        if dtype is not None:
            out = out._with(out.data, self.shape, dtype)
        return out

    def contiguous(self) -> "PackedWeight":
        return self._with(self.data.contiguous())

    def rows(self, index: torch.Tensor) -> "PackedWeight":
        """The rows `index` (along N) of a 2-D weight."""
        assert self.ndim == 2
        return self._with(self.data.index_select(0, index.to(self.device)))

    def index(self, index: torch.Tensor) -> "PackedWeight":
        """Entries `index` along the leading (expert) dimension of a 3-D weight."""
        assert self.ndim == 3
        return self._with(self.data.index_select(0, index.to(self.device)))

    def __getitem__(self, e: int) -> "PackedWeight":
        """Entry e of the leading (expert) dimension: [E, N, K] -> [N, K] (a view of the records)."""
        assert self.ndim >= 3 and isinstance(e, int)
        return self._with(self.data[e])

    def reshape_rows(self, *lead: int) -> "PackedWeight":
        """The row dimensions regrouped: [N, K] -> [*lead, K] (prod(lead) = N), or back."""
        return self._with(self.data.reshape(*lead, self.data.shape[-1]))


def cat(parts: list[PackedWeight], dim: int = 0) -> PackedWeight:
    """Packed weights of one format joined along a row dimension (0 for [N, K]; 1 for experts' [E, N, K])."""
    first = parts[0]
    assert all(p.fmt == first.fmt and p.shape[-1] == first.shape[-1] for p in parts), "one format and K"
    assert dim < first.ndim - 1, "packed weights join along rows, not K"
    return first._with(torch.cat([p.data for p in parts], dim))


def stack(parts: list[PackedWeight]) -> PackedWeight:
    """[N, K] packed weights of one format as [E, N, K]."""
    return parts[0]._with(torch.stack([p.data for p in parts]))


_GRIDS: dict = {}


def iq3s_grid(device: torch.device | str = "cpu") -> torch.Tensor:
    """IQ3_S's 512 grid points, uint8 [512, 4] (odd values 1 to 15), as `gguf` holds them."""
    device = torch.device(device)
    if device not in _GRIDS:
        from gguf.quants import IQ3_S

        IQ3_S.init_grid()
        _GRIDS[device] = torch.from_numpy(IQ3_S.grid.reshape(512, 4).astype("uint8")).to(device)
    return _GRIDS[device]


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> [..., K] int32: each byte's low nibble, then its high one."""
    c = codes.to(torch.int32)
    return torch.stack([c & 15, c >> 4], dim=-1).flatten(-2)


def _bits(high: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., K * width / 8] -> [..., K] int32: each byte's fields of `width` bits, lowest first."""
    c = high.to(torch.int32)
    shifts = torch.arange(0, 8, width, device=high.device, dtype=torch.int32)
    return ((c[..., None] >> shifts) & ((1 << width) - 1)).flatten(-2)


def _per_column(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=-1)


def dequantize(w: PackedWeight | torch.Tensor) -> torch.Tensor:
    """The float32 weight [..., N, K] a packed one stands for (a plain tensor is returned as float32)."""
    if isinstance(w, torch.Tensor):
        return w.float()
    group, _, _ = FORMATS[w.fmt]
    if w.fmt == "q8_0":
        return _per_column(w.scales.float(), group) * w.codes.float()
    if w.fmt == "q4_1":
        d, m = w.scales.float().unbind(-1)  # [..., N, K/32]
        return _per_column(d, group) * _nibbles(w.codes).float() + _per_column(m, group)
    if w.fmt == "fp8":
        return w.codes.float() * _per_column(w.scales.float(), group)
    if w.fmt in ("q4_k", "q5_k"):
        code = _nibbles(w.codes)
        if w.fmt == "q5_k":
            code = code | (_bits(w.high, 1) << 4)
        d, dmin = w.supers.float().unbind(-1)  # [..., N, K/256]
        sc, mn = w.scales.float().unbind(-1)  # [..., N, K/32]
        scale = _per_column(d, 256 // group) * sc
        low = _per_column(dmin, 256 // group) * mn
        return _per_column(scale, group) * code.float() - _per_column(low, group)
    if w.fmt == "iq3_s":  # 9-bit indices of 4 grid values; db = d * (1 + 2 * scale) per 32; a sign per column
        index = w.codes.to(torch.int64) | (_bits(w.high, 1).to(torch.int64) << 8)  # [..., K/4]
        values = iq3s_grid(w.device)[index].flatten(-2).float()  # [..., K]
        sign = 1.0 - 2.0 * _bits(w.signs, 1).float()
        db = _per_column(w.supers.float(), 256 // group) * (1 + 2 * _bits(w.scales, 4)).float()  # [..., K/32]
        return _per_column(db, group) * values * sign
    code = _nibbles(w.codes) | (_bits(w.high, 2) << 4)  # q6_k
    scale = _per_column(w.supers.float(), 256 // group) * w.scales.float()
    return _per_column(scale, group) * (code - 32).float()
