"""Random packed weights of every format, for the kernels' tests (valid parts: finite scales, codes in range)."""

from __future__ import annotations

import torch

from strata.quant.packed import FORMATS, PackedWeight


def random_packed(fmt: str, shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  scale: float = 0.02) -> PackedWeight:
    """A packed weight whose values are about `scale` in size."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    group, superblock, bits = FORMATS[fmt]

    def u8(*s):
        return torch.randint(0, 256, tuple(s), generator=g, dtype=torch.int32).to(torch.uint8)

    if fmt == "q8_0":
        codes = torch.randint(-127, 128, tuple(shape), generator=g, dtype=torch.int32).to(torch.int8)
        scales = (torch.rand(*lead, k // group, generator=g) * scale / 64).half()
        return PackedWeight(fmt, tuple(shape), codes, scales, dtype=dtype)
    if fmt == "fp8":
        codes = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(*lead, k // group, generator=g) * scale / 100
        return PackedWeight(fmt, tuple(shape), codes, scales, dtype=dtype)
    if fmt == "iq3_s":  # any index, sign and scale is valid
        supers = (torch.rand(*lead, k // superblock, generator=g) * scale / 200).half()
        return PackedWeight(fmt, tuple(shape), u8(*lead, k // 4), u8(*lead, k // 64), supers, u8(*lead, k // 32),
                            dtype=dtype, signs=u8(*lead, k // 8))
    codes = u8(*lead, k // 2)
    if fmt == "q6_k":
        scales = torch.randint(-64, 64, (*lead, k // group), generator=g, dtype=torch.int32).to(torch.int8)
        supers = (torch.rand(*lead, k // superblock, generator=g) * scale / 1000).half()
        return PackedWeight(fmt, tuple(shape), codes, scales, supers, u8(*lead, k // 4), dtype=dtype)
    scales = torch.randint(0, 64, (*lead, k // group, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    supers = (torch.rand(*lead, k // superblock, 2, generator=g) * scale / 500).half()
    high = u8(*lead, k // 8) if fmt == "q5_k" else None
    return PackedWeight(fmt, tuple(shape), codes, scales, supers, high, dtype=dtype)
