"""The fused attention-input kernel of decode windows (q/k norms, rotary, K/V append) gives bitwise what the
separate kernels give, under the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or strata.kernels are imported

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

if not isinstance(tl.sum, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py",
                allow_module_level=True)

from strata.kernels.qk_prep import qk_prep_reference, qk_prep_triton  # noqa: E402
from strata.kernels.rope import rope_inv_freq  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(4, 2, 16, 16), (6, 2, 24, 8), (2, 1, 40, 20)],
                         ids=lambda v: str(v))
def test_qk_prep_equals_the_separate_kernels(heads, kv_heads, head_dim, rotary_dim, qk_norm, dtype):
    g = torch.Generator().manual_seed(head_dim + heads)
    rows, seqs, cells = 3, 5, 9
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim + 3, generator=g).to(dtype)  # views with row strides
    q = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim].reshape(rows, kv_heads, head_dim)
    norms = (torch.rand(head_dim, generator=g) + 0.5, torch.rand(head_dim, generator=g) + 0.5) if qk_norm else (None, None)
    positions = torch.tensor([0, 7, 3], dtype=torch.int32)
    seq_ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    inv_freq = rope_inv_freq(rotary_dim, 10000.0, torch.device("cpu"))
    pools = [torch.randn(seqs, cells, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    ref = qk_prep_reference(q, k, v, *norms, 1e-6, positions, inv_freq, rotary_dim, *ref_pools, seq_ids)
    got = qk_prep_triton(q, k, v, *norms, 1e-6, positions, inv_freq, rotary_dim, *pools, seq_ids)
    assert torch.equal(got, ref)
    assert torch.equal(pools[0], ref_pools[0]) and torch.equal(pools[1], ref_pools[1])
    assert not torch.equal(pools[0][4, 0], torch.zeros_like(pools[0][4, 0]))  # the cells were written
