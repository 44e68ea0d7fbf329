"""The Triton RMSNorms (plain, per head, residual-fused, gated) against their torch references, under the
Triton interpreter on odd sizes, and their row invariance."""

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    # triton's own jitted helpers (tl.sum...) were made for a GPU: the interpreter cannot run them in this process
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton / strata.kernels are imported

import torch

import strata.kernels.rmsnorm as rmsnorm

EPS = 1e-6
DTYPES = [torch.float32, torch.float16]
SHAPES = [(1, 24), (3, 40), (7, 64), (3, 3, 24), (7, 3, 40), (1, 1, 64)]  # [R, D] or [R, H, D]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


def _shape_id(shape):
    return "x".join(map(str, shape))


def make_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(shape, generator=gen)
    other = torch.randn(shape, generator=gen)  # the residual or the gate
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)  # [D] float32
    return x.to(dtype), other.to(dtype), w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_rms_norm(shape, dtype):
    x, _, w = make_inputs(shape, dtype)
    out = rmsnorm.rms_norm_triton(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rmsnorm.rms_norm(x, w, EPS), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_add_rms_norm(shape, dtype):
    x, residual, w = make_inputs(shape, dtype)
    normed, new_residual = rmsnorm.add_rms_norm_triton(x, residual, w, EPS)
    ref_normed, ref_residual = rmsnorm.add_rms_norm(x, residual, w, EPS)
    assert torch.equal(new_residual, ref_residual)  # the add rounds exactly as torch's
    assert normed.dtype == dtype
    torch.testing.assert_close(normed, ref_normed, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 24), (3, 3, 40), (7, 2, 64)], ids=_shape_id)
def test_gated_rms_norm(shape, dtype):
    x, gate, w = make_inputs(shape, dtype)
    out = rmsnorm.gated_rms_norm_triton(x, gate, w, EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rmsnorm.gated_rms_norm(x, gate, w, EPS), **_tol(dtype))


def test_strided_heads():
    """q and k as views of one fused projection [R, (Hq + Hk) * D]: rows and heads strided."""
    x, _, _ = make_inputs((3, 5 * 24), torch.float32)
    w = make_inputs((24,), torch.float32)[2]
    q = x.view(3, 5, 24)[:, :3]  # [R, 3, D], row stride 5 * D
    torch.testing.assert_close(rmsnorm.rms_norm_triton(q, w, EPS), rmsnorm.rms_norm(q, w, EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(40,), (3, 40)], ids=lambda s: "Rx" + _shape_id(s))
def test_row_invariance(shape, dtype):
    """Row i alone equals row i among 7 rows, bit for bit, for every launcher."""
    x, other, w = make_inputs((7, *shape), dtype, seed=1)
    full = dict(
        plain=rmsnorm.rms_norm_triton(x, w, EPS),
        add=rmsnorm.add_rms_norm_triton(x, other, w, EPS),
        gated=rmsnorm.gated_rms_norm_triton(x, other, w, EPS) if len(shape) == 2 else None,
    )
    for i in (0, 4, 6):
        assert torch.equal(rmsnorm.rms_norm_triton(x[i : i + 1], w, EPS), full["plain"][i : i + 1])
        normed, res = rmsnorm.add_rms_norm_triton(x[i : i + 1], other[i : i + 1], w, EPS)
        assert torch.equal(normed, full["add"][0][i : i + 1]) and torch.equal(res, full["add"][1][i : i + 1])
        if full["gated"] is not None:
            alone = rmsnorm.gated_rms_norm_triton(x[i : i + 1], other[i : i + 1], w, EPS)
            assert torch.equal(alone, full["gated"][i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prompt_rows_take_several_heads_per_program_with_the_same_bits(dtype):
    """70 rows of 5 heads: prompt-sized, so each program walks its row's heads in turn; every head equals its
    norm computed alone (one head per program), for the plain and gated norms."""
    x, gate, w = make_inputs((70, 5, 24), dtype, seed=2)
    assert rmsnorm.heads_per_program(70, 5, 32) > 1 and rmsnorm.heads_per_program(1, 5, 32) == 1
    plain, gated = rmsnorm.rms_norm_triton(x, w, EPS), rmsnorm.gated_rms_norm_triton(x, gate, w, EPS)
    torch.testing.assert_close(gated, rmsnorm.gated_rms_norm(x, gate, w, EPS), **_tol(dtype))
    for i in (0, 33, 69):
        assert torch.equal(rmsnorm.rms_norm_triton(x[i : i + 1], w, EPS), plain[i : i + 1])
        assert torch.equal(rmsnorm.gated_rms_norm_triton(x[i : i + 1], gate[i : i + 1], w, EPS), gated[i : i + 1])
