"""`exact_sum` (strata/kernels/invariant.py) under the Triton interpreter: the float32 sum of a vector, the same
bits in any order of its values, within float32 rounding of the float64 sum."""

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton / strata.kernels are imported

import torch
import triton
import triton.language as tl

from strata.kernels.invariant import exact_sum


@triton.jit
def _sum_kernel(p_x, p_out, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_out, exact_sum(tl.load(p_x + o, mask=o < N, other=0.0)))


def _exact_sum(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(1, dtype=torch.float32)
    _sum_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return out[0]


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e4, 1e30])
@pytest.mark.parametrize("n", [1, 7, 2048, 16384])
def test_exact_sum_is_order_free_and_close(n, scale):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * scale
    x[0] *= 1000  # one large value: the others are carried relative to it
    s = _exact_sum(x)
    for _ in range(3):
        assert torch.equal(_exact_sum(x[torch.randperm(n, generator=g)]), s)
    want = x.double().sum()
    assert abs(s.double() - want) <= 2 ** -23 * abs(want) + n * 2 ** -47 * x.abs().max().double()


def test_exact_sum_of_zeros_and_cancellation():
    assert _exact_sum(torch.zeros(16)).item() == 0.0
    x = torch.tensor([3.0, -3.0, 1e-7, 2.5e-8])
    assert torch.equal(_exact_sum(x), torch.tensor(1e-7 + 2.5e-8, dtype=torch.float64).float())
