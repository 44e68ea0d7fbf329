"""Packed weights read inside the Triton kernels (under the interpreter): each format's tiles dequantize to the
float reference bit for bit; a projection or an MoE block over a packed weight gives bitwise what it gives over the
same weight dequantized to the activations' dtype (the same tiles, the same order), except the K-quants' decode
products (`packed_mm`: each scale group's integer codes multiplied, its scale applied to the sum), which give the
float reference at least as closely, and a row's bits alone as in a batch."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.kernels.linear import linear_split, linear_triton, split_k, CONFIGS  # noqa: E402
from strata.kernels.moe import decode_tiles, moe_triton, prompt_tiles  # noqa: E402
from strata.kernels.packed import SCALED_AFTER_FORMATS, dequantize_triton  # noqa: E402
from strata.kernels.deferred import SplitSum, finish  # noqa: E402
from strata.quant.packed import KERNEL_FORMAT, PackedWeight, dequantize, packed_nbytes  # noqa: E402

FORMATS = list(KERNEL_FORMAT)  # what the Triton kernels read (q4_1: the CPU's own kernel only, test_cpu_packed.py)
from tests.packed_weights import random_packed  # noqa: E402


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_dequantize_to_the_reference(fmt):
    for shape in [(48, 512), (3, 40, 256)]:
        w = random_packed(fmt, shape)
        want = dequantize(w)
        assert want.abs().max() > 0 and torch.isfinite(want).all()
        assert torch.equal(dequantize_triton(w, torch.float32), want)
        assert torch.equal(dequantize_triton(w.to(dtype=torch.float16)), want.half())
        assert w.nbytes() == packed_nbytes(fmt, shape[-2], shape[-1]) * (shape[0] if len(shape) == 3 else 1)


def test_a_row_record_is_as_long_as_gguf_blocks():
    """Bytes a row takes: GGUF's block sizes (q4_k, q5_k: their 6-bit scales unpacked, 4 bytes more per 256
    columns), padded to 16 bytes (the 30B shape's rows: 2048 columns, none; its experts' down rows, 768, 4 bytes)."""
    assert {f: packed_nbytes(f, 1, 2048) for f in FORMATS} == {"q8_0": 2176, "fp8": 2112, "q4_k": 1184,
                                                              "q5_k": 1440, "q6_k": 1680, "iq3_s": 880}
    assert {f: packed_nbytes(f, 1, 768) for f in FORMATS} == {"q8_0": 816, "fp8": 800, "q4_k": 448, "q5_k": 544,
                                                             "q6_k": 640, "iq3_s": 336}
    assert packed_nbytes("q4_1", 1, 2048) == 2048 // 32 * 20  # GGUF's Q4_1 blocks exactly (the CPU's kernel reads it)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_projection_is_bitwise_the_dequantized_one(fmt, dtype):
    # (40, 1024) splits K into chunks (its partial sums are what a reader adds); (24, 768): rows padded to 16 bytes,
    # parts at offsets that are not multiples of 16
    for n, k in [(48, 512), (40, 1024), (24, 768)]:
        w = random_packed(fmt, (n, k), seed=n, dtype=dtype)
        plain = dequantize(w).to(dtype)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        block_n, block_k, _ = CONFIGS[dtype]
        split = split_k(n, k, block_n, block_k)
        out, want = linear_split(x, w), linear_split(x, plain)
        assert isinstance(out, SplitSum) == (split > 1) == isinstance(want, SplitSum)
        reference = x.double() @ dequantize(w).double().T
        if fmt in SCALED_AFTER_FORMATS:  # the codes' products, scaled after: no rounding of the weight
            got, plain_err = finish(out).double(), rel_err(finish(want).double(), reference)
            assert rel_err(got, reference) <= max(1.05 * plain_err, 1e-6), (rel_err(got, reference), plain_err)
        else:
            assert torch.equal(finish(out), finish(want))
        torch.testing.assert_close(linear_triton(x, w).float(), x.float() @ dequantize(w).T, rtol=2e-2, atol=2e-3)
        # a row's bits are the same alone
        assert torch.equal(linear_triton(x[2:3], w), linear_triton(x, w)[2:3])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_experts_are_bitwise_the_dequantized_ones(fmt):
    """Decode tiles (gate_up and down in one launch) and prompt tiles (two launches, pointer loads where the plain
    weights take tensor descriptors), with a shared expert run as one more pair. The K-quants' decode tiles
    (`packed_mm`) instead match the float32 reference as closely, and a row alone gives its bits in the batch (checked
    on q4_k: the K-quants differ only in how a tile unpacks its codes)."""
    dt = torch.float16
    E, H, I, k = 3, 256, 256, 2  # few expert tiles: the K-quants decode slowly under the interpreter
    gu, dn = random_packed(fmt, (E, 2 * I, H), 1, dt), random_packed(fmt, (E, H, I), 2, dt)
    shared = (random_packed(fmt, (2 * I, H), 3, dt), random_packed(fmt, (H, I), 4, dt))
    plain = [dequantize(w).to(dt) for w in (gu, dn, *shared)]
    g = torch.Generator().manual_seed(0)
    router = torch.randn(E, H, generator=g).to(dt)
    for rows, tiles in [(2, decode_tiles(2)), (40, prompt_tiles(dt))]:  # few decode rows: slow under the interpreter
        x = torch.randn(rows, H, generator=g).to(dt)
        out = moe_triton(x, router, gu, dn, k, True, shared, None, tiles=tiles, shared_pair=True)
        want = moe_triton(x, router, plain[0], plain[1], k, True, tuple(plain[2:]), None, tiles=tiles,
                          shared_pair=True)
        assert out.abs().max() > 0
        if fmt in SCALED_AFTER_FORMATS and tiles.block_m <= 16:
            exact = [dequantize(w) for w in (gu, dn, *shared)]
            reference = moe_triton(x.float(), router.float(), exact[0], exact[1], k, True, tuple(exact[2:]), None,
                                   tiles=tiles, shared_pair=True)
            assert rel_err(out.float(), reference) <= 1.05 * rel_err(want.float(), reference)
            if fmt == "q4_k":  # the K-quants share the kernel's sums and differ in unpacking: one row-invariance check
                alone = moe_triton(x[1:2], router, gu, dn, k, True, shared, None, tiles=decode_tiles(1),
                                   shared_pair=True)
                assert torch.equal(alone, out[1:2])
        else:
            assert torch.equal(out, want)


def test_row_operations_act_on_whole_records():
    w = random_packed("q4_k", (12, 512))
    rows = torch.tensor([3, 0, 7])
    assert torch.equal(dequantize(w.rows(rows)), dequantize(w)[rows])
    e = random_packed("q6_k", (4, 8, 256))
    assert torch.equal(dequantize(e.index(torch.tensor([2, 1]))), dequantize(e)[[2, 1]])
    with pytest.raises(ValueError, match="multiple of 256"):
        PackedWeight("q4_k", (4, 100), data=torch.zeros(4, 10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8 rows of 160 bytes"):
        PackedWeight("q4_k", (4, 256), data=torch.zeros(4, 144, dtype=torch.uint8))
