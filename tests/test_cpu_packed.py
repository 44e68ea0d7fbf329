"""The CPU's own products over packed weights (strata/kernels/cpu_packed.c): y = x @ W.T against float64 over the
dequantized weight, row invariance (a row's bits alone, beside any rows, at any place, with 1 or 2 threads), the
dequantizer bit for bit, and what the kernel takes. Each test runs at every width this CPU has (8 lanes, and 16
where it has AVX-512): each sums in its own order, a process keeps one."""

import logging

import gguf
import pytest
import torch

from strata.kernels import cpu_packed, native_build
from strata.quant import gguf_blocks
from strata.quant.packed import PackedWeight, dequantize

pytestmark = pytest.mark.skipif(not cpu_packed.available(), reason=f"the packed CPU kernel cannot run here: "
                                f"{cpu_packed.why()} (it needs AVX2, FMA and F16C, and gcc or a built library)")
T = gguf.GGMLQuantizationType
QTYPES = {"q8_0": T.Q8_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K, "q6_k": T.Q6_K}
# [N, K]: N not a multiple of the kernel's 16-row chunks or 8-row tiles; K from one block (32 columns) up
SHAPES = {"q8_0": [(37, 32), (576, 576), (1536, 160)], "q4_1": [(37, 32), (576, 576), (1536, 160)],
          "q4_k": [(37, 256), (576, 512), (1536, 2048)], "q6_k": [(37, 256), (576, 512), (1536, 2048)]}


def widths() -> list[int]:
    got = {cpu_packed.use_wide(False), cpu_packed.use_wide(True)}  # leaves the widest in use
    return sorted(got)


@pytest.fixture(params=widths(), ids=lambda lanes: f"{lanes}lanes")
def lanes(request):
    assert cpu_packed.use_wide(request.param == 16) == request.param
    yield request.param
    cpu_packed.use_wide(True)


def packed(fmt: str, n: int, k: int, seed: int = 0) -> PackedWeight:
    torch.manual_seed(seed)
    w = gguf_blocks.from_gguf(gguf_blocks.quantize(torch.randn(n, k) * 0.1, QTYPES[fmt]), QTYPES[fmt], (n, k))
    assert w.fmt == fmt and cpu_packed.serves(w)
    return w


def assert_near(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """y within float32 summation error of x @ w.T (+ bias) summed in float64: 1e-6 of the sum of |terms|."""
    ref = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    bound = x.double().abs() @ w.double().abs().T + (bias.double().abs() if bias is not None else 0)
    err = (y.double() - ref).abs()
    assert (err <= 1e-6 * bound + 1e-30).all(), f"worst error {(err / bound).max():.2e} of the sum of |terms|"


@pytest.mark.parametrize("fmt", QTYPES)
def test_linear_is_the_product_over_the_dequantized_weight(fmt, lanes):
    for n, k in SHAPES[fmt]:
        w = packed(fmt, n, k)
        dense = dequantize(w)
        x = torch.randn(5, k)
        y = cpu_packed.linear(x, w)
        assert y.shape == (5, n) and y.dtype == torch.float32
        assert_near(y, x, dense)
        bias = torch.randn(n)
        assert_near(cpu_packed.linear(x, w, bias), x, dense, bias)
        lead = torch.randn(2, 3, k)  # leading dimensions, and rows that are a view of a wider tensor
        assert cpu_packed.linear(lead, w).shape == (2, 3, n)
        assert_near(cpu_packed.linear(lead, w).reshape(6, n), lead.reshape(6, k), dense)
        view = torch.randn(4, 2 * k)[:, k:]
        assert_near(cpu_packed.linear(view, w), view, dense)
        half = x.bfloat16()  # `project`: F.linear's contract for any float x, computed in float32
        assert torch.equal(cpu_packed.project(half, w, bias), cpu_packed.linear(half.float(), w, bias).bfloat16())
    assert cpu_packed.linear(torch.randn(0, k), w).shape == (0, n)


@pytest.mark.parametrize("fmt", QTYPES)
def test_a_row_is_the_same_alone_beside_any_rows_and_with_any_threads(fmt, lanes):
    """The decode windows' property: row r's bits depend on row r alone (not R, the others, its place, threads)."""
    n, k = SHAPES[fmt][1]
    w = packed(fmt, n, k, seed=1)
    torch.manual_seed(2)
    row = torch.randn(1, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_packed.linear(row, w)
        torch.set_num_threads(2)
        assert torch.equal(cpu_packed.linear(row, w), alone)
        for rows in (2, 3, 5, 8, 17, 64):
            window = torch.randn(rows, k) * 3
            for place in {0, rows // 2, rows - 1}:
                window[place] = row[0]
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert torch.equal(cpu_packed.linear(window, w)[place], alone[0]), (rows, place, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", QTYPES)
def test_dequantize_is_the_reference_bit_for_bit(fmt):
    for n, k in SHAPES[fmt]:
        w = packed(fmt, n, k, seed=3)
        got, ref = cpu_packed.dequantize(w), dequantize(w)
        assert got.shape == (n, k) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_serves_only_2d_packed_weights_in_its_formats():
    w = packed("q4_1", 64, 64)
    assert cpu_packed.serves(w)
    assert not cpu_packed.serves(dequantize(w))  # a plain tensor
    assert not cpu_packed.serves(PackedWeight("q4_1", (2, 32, 64), data=w.data.reshape(2, 32, -1)))  # experts'
    for qtype in (T.IQ3_S, T.Q5_K):  # formats only the GPU kernels read
        other = gguf_blocks.from_gguf(gguf_blocks.quantize(torch.randn(8, 256), qtype), qtype, (8, 256))
        assert not cpu_packed.serves(other)
    fp8 = PackedWeight("fp8", (8, 128), torch.randn(8, 128).to(torch.float8_e4m3fn), torch.ones(8, 1))
    assert not cpu_packed.serves(fp8)


def test_a_kernel_that_cannot_be_built_is_said_once_and_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native_build, "GCC", "no-such-compiler")
    monkeypatch.setattr(cpu_packed, "SHIPPED", tmp_path / "none.so")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build either
    cpu_packed._loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.engine"):
            assert not cpu_packed.available()
            assert "no gcc" in cpu_packed.why()
            assert not cpu_packed.serves(PackedWeight("q4_1", (8, 32), data=torch.zeros(8, 32, dtype=torch.uint8)))
        said = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(said) == 1 and "no gcc" in said[0]
    finally:
        cpu_packed._loaded.cache_clear()
        monkeypatch.undo()
    assert cpu_packed.available()

