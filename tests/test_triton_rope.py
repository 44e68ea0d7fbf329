"""The Triton rotary embedding against `apply_rope(x, *rope_cos_sin(...))` under the Triton interpreter: odd
shapes, partial rotary, non-contiguous positions and q, in place, and row invariance."""

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    # triton's own jitted helpers (tl.sum...) were made for a GPU: the interpreter cannot run them in this process
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton / strata.kernels are imported

import torch

import strata.kernels.rope as rope

DTYPES = [torch.float32, torch.float16]
CASES = [  # (R, H, D, rotary_dim)
    (1, 1, 24, 24),
    (3, 3, 40, 40),
    (7, 3, 64, 64),
    (3, 3, 40, 16),
    (7, 1, 24, 8),
    (3, 2, 64, 16),  # Qwen3-Next's quarter rotary, scaled down
    (1, 20, 24, 24),  # more heads than one head block
]


def _case_id(case):
    return "R={}-H={}-D={}-rot={}".format(*case)


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


def make_inputs(r, h, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, h, d, generator=gen).to(dtype)  # [R, H, D]
    positions = torch.randint(0, 5000, (r,), generator=gen)
    return x, positions


def reference(x, positions, inv_freq):
    return rope.apply_rope(x, *rope.rope_cos_sin(positions.long(), inv_freq, x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_apply_rope(case, dtype):
    r, h, d, rot = case
    x, positions = make_inputs(r, h, d, dtype)
    inv_freq = rope.rope_inv_freq(rot, 10000.0)
    x_before = x.clone()
    out = rope.apply_rope_triton(x, positions, inv_freq, rot)
    assert torch.equal(x, x_before) and out.dtype == dtype
    torch.testing.assert_close(out, reference(x, positions, inv_freq), **_tol(dtype))
    assert torch.equal(out[..., rot:], x[..., rot:])  # the pass-through dims are copied as they are


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
def test_strided_positions_and_heads(pos_dtype):
    """positions as a column of a [R, 2] tensor; q as a head slice of a fused [R, H, D] projection."""
    x, _ = make_inputs(7, 5, 40, torch.float32)
    q = x[:, 1:4]  # [R, 3, D], rows and heads strided
    positions = torch.tensor([[0, 3], [1, 17], [2, 4096], [3, 5], [4, 99], [5, 0], [6, 1234]], dtype=pos_dtype)[:, 1]
    inv_freq = rope.rope_inv_freq(16, 1e6)
    out = rope.apply_rope_triton(q, positions, inv_freq, 16)
    torch.testing.assert_close(out, reference(q, positions, inv_freq), rtol=1e-5, atol=1e-5)


def test_in_place():
    x, positions = make_inputs(3, 3, 40, torch.float16)
    inv_freq = rope.rope_inv_freq(16, 10000.0)
    expected = rope.apply_rope_triton(x, positions, inv_freq, 16)
    assert rope.apply_rope_triton(x, positions, inv_freq, 16, out=x) is x
    assert torch.equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_invariance(dtype):
    """Row i alone equals row i among 7 rows, bit for bit."""
    x, positions = make_inputs(7, 3, 40, dtype, seed=1)
    inv_freq = rope.rope_inv_freq(16, 10000.0)
    full = rope.apply_rope_triton(x, positions, inv_freq, 16)
    for i in (0, 3, 6):
        assert torch.equal(rope.apply_rope_triton(x[i : i + 1], positions[i : i + 1], inv_freq, 16), full[i : i + 1])
