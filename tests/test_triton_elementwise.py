"""The small fused decode steps (strata/kernels/elementwise.py) against the torch ops they replace, under the
Triton interpreter: odd shapes, strided rows (views of a wider projection), float32 and float16, row invariance."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / strata.kernels are imported (conftest sets it too)

import pytest
import torch

from strata.kernels.elementwise import (gdn_gates, gdn_gates_triton, sigmoid_gate_add, sigmoid_gate_add_triton,
                                        silu_mul, silu_mul_triton)

DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)


def _rand(*shape, dtype, seed, scale=2.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inner"), [(1, 3), (5, 37), (3, 1100)])  # 1100: more than one column block
def test_silu_mul(dtype, rows, inner):
    wide = _rand(rows, 2 * inner + 9, dtype=dtype, seed=rows)
    gate_up = wide[:, 5 : 5 + 2 * inner]  # a view with a row stride wider than its columns
    got = silu_mul_triton(gate_up)
    torch.testing.assert_close(got, silu_mul(gate_up), **_tol(dtype))
    assert torch.equal(silu_mul_triton(gate_up[1:2]), got[1:2])  # a row alone = the same row among others


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 7), (4, 130), (2, 2050)])
def test_sigmoid_gate_add(dtype, rows, hidden):
    out, s = _rand(rows, hidden, dtype=dtype, seed=1), _rand(rows, hidden, dtype=dtype, seed=2)
    logit = _rand(rows, 3, dtype=dtype, seed=3)[:, 1:2]  # [R, 1] view with row stride 3
    got = sigmoid_gate_add_triton(out, s, logit)
    torch.testing.assert_close(got, sigmoid_gate_add(out, s, logit), **_tol(dtype))
    assert torch.equal(sigmoid_gate_add_triton(out[-1:], s[-1:], logit[-1:]), got[-1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "heads"), [(1, 4), (6, 32), (3, 7)])
def test_gdn_gates(dtype, rows, heads):
    proj = _rand(rows, 3 * heads + 5, dtype=dtype, seed=heads, scale=12.0)  # large values reach softplus's linear part
    a, b = proj[:, 2 : 2 + heads], proj[:, 2 + heads : 2 + 2 * heads]
    neg_a = -_rand(heads, dtype=torch.float32, seed=4).abs()
    dt_bias = _rand(heads, dtype=torch.float32, seed=5)
    decay, beta = gdn_gates_triton(a, b, neg_a, dt_bias)
    want_decay, want_beta = gdn_gates(a, b, neg_a, dt_bias)
    assert decay.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(decay, want_decay, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, want_beta, **_tol(dtype))
    one = gdn_gates_triton(a[:1], b[:1], neg_a, dt_bias)
    assert torch.equal(one[0], decay[:1]) and torch.equal(one[1], beta[:1])
