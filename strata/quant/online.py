"""Float weights quantized as they load: any checkpoint served as if it were stored packed.

`QuantizingCheckpoint` wraps a checkpoint of float weights and answers the loader's `load_packed` with each
matrix quantized in one format (q8_0, q4_k, q5_k, q6_k through `strata.quant.gguf_blocks.quantize`, fp8 in
128 x 128 blocks as FP8 checkpoints are published). The quantizers are plain roundings (absmax, min/max), not
llama.cpp's searches: enough to run real shapes with real bytes per weight (benchmarks), not to make the best
quantized model of a checkpoint. Matrices whose reduction dimension does not fit the format stay float.
"""

from __future__ import annotations

from pathlib import Path

import torch

from strata.quant.gguf_blocks import SUPPORTED, from_gguf, quantize
from strata.quant.packed import FORMATS, PackedWeight

GGUF_TYPE = {fmt: qtype for qtype, fmt in SUPPORTED.items()}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_BLOCK = 128


def quantize_fp8(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> PackedWeight:
    """A float weight [N, K] (K a multiple of 128) in 128 x 128 blocks, each scaled so its largest value is e4m3's
    largest: codes e4m3 [N, K] and each block's scale, as an FP8 checkpoint stores them (`weight_scale_inv`)."""
    n, k = w.shape
    if k % FP8_BLOCK:
        raise ValueError(f"fp8 blocks need K a multiple of {FP8_BLOCK}, got {k}")
    rows = -(-n // FP8_BLOCK) * FP8_BLOCK
    x = torch.zeros(rows, k, dtype=torch.float32, device=w.device)
    x[:n] = w.float()
    blocks = x.reshape(rows // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows, k)[:n]
    row_scales = scale.expand(-1, FP8_BLOCK, -1, -1).reshape(rows, k // FP8_BLOCK)[:n]
    return PackedWeight("fp8", (n, k), codes.contiguous(), row_scales.contiguous(), dtype=dtype)


def quantize_weight(w: torch.Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16) -> PackedWeight:
    """A float weight [..., N, K] packed in `fmt` (fp8: 2-D or each matrix of a stack on its own)."""
    if fmt == "fp8":
        if w.dim() == 2:
            return quantize_fp8(w, dtype)
        parts = [quantize_fp8(m, dtype) for m in w.reshape(-1, *w.shape[-2:])]
        data = torch.stack([p.data for p in parts]).reshape(*w.shape[:-1], -1)
        return PackedWeight("fp8", tuple(w.shape), dtype=dtype, data=data)
    return from_gguf(quantize(w, GGUF_TYPE[fmt]), GGUF_TYPE[fmt], tuple(w.shape), dtype)


FLOAT_KINDS = {"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"}


def stored_quantized(ckpt) -> list[str]:
    """The quantized storage types among a checkpoint's tensors (GGUF block types, float8), by `qtype_name`;
    empty for a checkpoint of float (and integer) tensors."""
    kinds = {ckpt.qtype_name(name) for name in ckpt.names()}
    if getattr(ckpt, "quantization", None) is not None:
        kinds.add("quantization_config")
    return sorted(k for k in kinds if k not in FLOAT_KINDS and not k.lower().startswith(("i", "uint", "bool", "?")))


class QuantizingCheckpoint:
    """`inner`'s tensors, its matrices quantized in `fmt` as the loader reads them: packed where the loader keeps
    them packed, and written out again (the same quantized values) where it does not, so that a model served
    with `--quantization` has the same weights on every device and kernel path.

    `device`: where the quantizing runs (a GPU quantizes a layer's experts in milliseconds; the tensors are read
    to the host first either way)."""

    quantizes = True  # the loader reads every matrix through `load_packed` (`strata.model.weights._Reader`)

    @staticmethod
    def check_format(fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"quantization {fmt!r} is unknown (known: {', '.join(FORMATS)})")

    def __init__(self, inner, fmt: str, device: torch.device | str | None = None):
        self.check_format(fmt)
        self.inner, self.fmt = inner, fmt
        self.device = torch.device(device) if device is not None else None
        self.path: Path = inner.path
        self.config: dict = inner.config

    def names(self) -> list[str]:
        return self.inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.load(name, dtype)

    def tokenizer(self):
        return self.inner.tokenizer()

    def fits(self, shape: tuple[int, ...]) -> bool:
        group, superblock, _ = FORMATS[self.fmt]
        return len(shape) in (2, 3) and shape[-1] % max(group, superblock) == 0

    def load_packed(self, name: str, dtype: torch.dtype = torch.bfloat16) -> PackedWeight | None:
        shape = tuple(self.inner.shape(name))
        if not self.fits(shape):
            return None
        w = self.inner.load(name, dtype)
        if self.device is not None:
            w = w.to(self.device)
        return quantize_weight(w, self.fmt, dtype)  # (each block scaled in float32)

    def packed_format(self, name: str) -> str | None:
        return self.fmt if self.fits(tuple(self.inner.shape(name))) else None

    def qtype_name(self, name: str) -> str:
        return self.fmt if self.fits(tuple(self.inner.shape(name))) else "float"
