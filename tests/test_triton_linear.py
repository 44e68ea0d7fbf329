"""The Triton row-invariant linear layer against F.linear, under the Triton interpreter, on odd sizes that
cross the M, N and K tiles; and a row's bits alone versus inside larger windows."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.kernels.linear import CONFIGS, linear_reference, linear_triton, split_k  # noqa: E402

TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SHAPES = [(m, n, k) for m in (1, 3, 17) for n in (40, 72) for k in (24, 136)]  # (M, N, K)


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)  # [M, K]
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    bias = torch.randn(n, generator=g).to(dtype)  # [N]
    return x, weight, bias


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=[f"M={m}-N={n}-K={k}" for m, n, k in SHAPES])
def test_matches_reference(shape, dtype, bias):
    x, weight, b = _inputs(*shape, dtype)
    b = b if bias else None
    out = linear_triton(x, weight, b)
    assert out.shape == (shape[0], shape[1]) and out.dtype == dtype
    want = linear_reference(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(out, want, **TOLS[dtype])


def test_strided_inputs():
    """A weight stored transposed and x taken from a wider buffer give the same result."""
    x, weight, b = _inputs(3, 40, 136, torch.float32)
    x_wide = torch.zeros(3, 200)  # [M, 200]
    x_wide[:, :136] = x
    weight_t = weight.t().contiguous().t()  # [N, K], strides (1, N)
    out = linear_triton(x_wide[:, :136], weight_t, b)
    torch.testing.assert_close(out, linear_reference(x, weight, b), **TOLS[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", [17, 33], ids=lambda r: f"M={r}")
def test_row_invariance(rows, dtype):
    """Row i computed alone equals row i inside a window of `rows` random rows, bit for bit."""
    n, k = 72, 136
    x, weight, b = _inputs(rows, n, k, dtype, seed=1)
    full = linear_triton(x, weight, b)  # [rows, N]
    for i in (0, 5, rows - 1):
        alone = linear_triton(x[i : i + 1].clone(), weight, b)  # [1, N]
        assert torch.equal(alone[0], full[i]), f"row {i} differs alone vs in {rows} rows"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_split_k_matches_reference_and_keeps_rows_invariant(dtype, bias):
    """A narrow weight with a long K is summed in chunks (split-K): still F.linear's result, and a row's bits
    alone equal its bits among 19 rows (the split depends on the weight's shape only)."""
    n, k = 40, 1024
    block_n, block_k, _ = CONFIGS[dtype]
    assert split_k(n, k, block_n, block_k) == 4
    x, weight, b = _inputs(19, n, k, dtype, seed=2)
    b = b if bias else None
    full = linear_triton(x, weight, b)
    want = linear_reference(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(full, want, **TOLS[dtype])
    for i in (0, 18):
        assert torch.equal(linear_triton(x[i : i + 1].clone(), weight, b)[0], full[i])


def test_split_k_depends_on_the_weight_shape_only():
    assert split_k(151936, 2048, 32, 128) == 1  # a wide weight fills the GPU by itself
    assert split_k(2048, 4096, 32, 128) == 4  # 64 tiles -> 256 programs of 1,024 columns (8 steps)
    assert split_k(5120, 2048, 32, 128) == 2  # 160 tiles -> 320 programs of 8 steps
    assert split_k(12352, 2048, 32, 128) == 1  # 386 tiles: two chunks would pass 512 programs
    assert split_k(128, 2048, 32, 128) == 8  # a router: 4 tiles -> 32 programs of 256 columns
    assert split_k(40, 136, 64, 64) == 1  # too short to split
