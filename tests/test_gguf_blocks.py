"""GGUF blocks <-> packed planes (`strata.quant.gguf_blocks`): `from_gguf` dequantizes to `gguf`'s bits, and
`quantize` writes bytes `gguf` reads back close to the weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from strata.quant import gguf_blocks
from strata.quant.gguf_blocks import SUPPORTED, dequantize_gguf, from_gguf, quantize
from strata.quant.packed import cat, dequantize

TYPES = list(SUPPORTED)
# byte offsets of d (and dmin)
FP16_FIELDS = {T.Q8_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ3_S: (0,)}
# relative RMS error of gguf's dequantization of `quantize` on normal [64, 512] weights: about 1.5x the measured
# 0.0053 (Q8_0), 0.078 (Q4_1, Q4_K), 0.038 (Q5_K), 0.0193 (Q6_K), 0.136 (IQ3_S: nearest grid point, no search)
MAX_ERROR = {T.Q8_0: 0.008, T.Q4_1: 0.12, T.Q4_K: 0.12, T.Q5_K: 0.06, T.Q6_K: 0.03, T.IQ3_S: 0.2}


def random_blocks(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes for `shape`: random bytes with finite float16 d / dmin."""
    rng = np.random.default_rng(seed)
    cols, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // cols, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        d = (rng.standard_normal(blocks.shape[:-1]) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = d[..., None].view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def gguf_reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(8, 256), (4, 1024), (3, 8, 512)], ids=["one-super", "4-supers", "experts"])
def test_from_gguf_random_blocks_bitwise(qtype, shape):
    raw = random_blocks(qtype, shape)
    pw = from_gguf(torch.from_numpy(raw), qtype, shape)
    assert pw.fmt == SUPPORTED[qtype] and pw.shape == shape
    assert torch.equal(dequantize(pw), gguf_reference(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_accuracy_and_roundtrip(qtype):
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    raw = quantize(w, qtype)
    cols, size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == torch.uint8 and raw.shape == (64, 512 // cols * size)
    ref = gguf_reference(raw.numpy(), qtype)
    error = ((ref - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert error < MAX_ERROR[qtype]
    assert torch.equal(dequantize_gguf(raw, qtype, (64, 512)), ref)


def test_q8_0_matches_gguf_bytes():
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(2))
    w[0, :32] = 0  # an all-zero block
    w[1, :32] = torch.arange(32) - 15.5  # with d = 1 (the 127 below), exact halves: ties go away from zero
    w[1, 0] = 127
    w[1, 1] = float(np.nextafter(np.float32(0.5), np.float32(0)))  # rounds to 0, where floor(x + 0.5) gives 1
    assert np.array_equal(quantize(w, T.Q8_0).numpy(), gguf_quantize(w.numpy(), T.Q8_0))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_experts_chunked(qtype, monkeypatch):
    """A 3-D weight spanning several super-blocks: each expert's bytes are its own 2-D quantization, whatever the
    chunking, and `from_gguf` of them is gguf's dequantization."""
    w = torch.randn(3, 8, 1024, generator=torch.Generator().manual_seed(3)).bfloat16()
    w[1, 2] = 0  # zero rows and sub-blocks must not make NaNs
    w[2, 3, :40] = 0
    raw = quantize(w, qtype)
    assert raw.shape[:2] == (3, 8)
    monkeypatch.setattr(gguf_blocks, "_CHUNK", 1000)  # one row a pass
    assert torch.equal(quantize(w, qtype), raw)
    assert torch.equal(torch.stack([quantize(e, qtype) for e in w]), raw)
    ref = gguf_reference(raw.numpy(), qtype)
    assert torch.isfinite(ref).all() and (ref[1, 2] == 0).all()
    assert torch.equal(dequantize(from_gguf(raw, qtype, tuple(w.shape))), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_and_cat(qtype):
    shape = (12, 512)
    raw = torch.from_numpy(random_blocks(qtype, shape, seed=4))
    pw = from_gguf(raw, qtype, shape)
    full = dequantize(pw)
    a, b = torch.tensor([7, 0, 3]), torch.tensor([11, 5, 6, 1])
    joined = cat([pw.rows(a), pw.rows(b)])
    assert joined.shape == (7, 512)
    assert torch.equal(dequantize(joined), full[torch.cat([a, b])])


def test_unsupported_type():
    with pytest.raises(ValueError):
        from_gguf(torch.zeros(1, 18, dtype=torch.uint8), T.Q4_0, (1, 32))
    with pytest.raises(ValueError):
        quantize(torch.zeros(1, 32), T.Q4_0)
