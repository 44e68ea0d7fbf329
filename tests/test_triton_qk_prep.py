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

from strata.kernels.attention import QKPrep, decode_attention_triton  # noqa: E402
from strata.kernels.deferred import SplitSum  # noqa: E402
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


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("split", [False, True], ids=["tensor", "split-k"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rotary_dim", [(4, 2, 16, 16), (6, 2, 24, 8), (2, 1, 40, 20)],
                         ids=lambda v: str(v))
def test_attention_prepares_its_own_q_and_k(heads, kv_heads, head_dim, rotary_dim, qk_norm, split, dtype):
    """decode_attention_triton(prep=...) takes the projection's raw heads (a tensor, or a SplitSum's chunks): the
    cells it writes and the attention it returns are what qk_prep_triton followed by the attention give (within
    one rounding: its norms sum in another order), and a row alone gets the bits it gets among the others."""
    g = torch.Generator().manual_seed(head_dim + heads + split)
    rows, seqs, cells = 3, 5, 9
    width = (heads + 2 * kv_heads) * head_dim
    parts = torch.randn(2, rows, width, generator=g)  # two K chunks of a projection, float32
    qkv = SplitSum(parts, dtype) if split else (parts[0] + parts[1]).to(dtype)
    q, k, v = (t.reshape(rows, n, head_dim) for t, n in
               zip(qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1),
                   (heads, kv_heads, kv_heads)))
    norms = (torch.rand(head_dim, generator=g) + 0.5, torch.rand(head_dim, generator=g) + 0.5) if qk_norm else (None, None)
    positions = torch.tensor([0, 7, 3], dtype=torch.int32)
    seq_ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    inv_freq = rope_inv_freq(rotary_dim, 10000.0, torch.device("cpu"))
    pools = [torch.randn(seqs, cells, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    q_done = qk_prep_triton(q, k, v, *norms, 1e-6, positions, inv_freq, rotary_dim, *ref_pools, seq_ids)
    want = decode_attention_triton(q_done, *ref_pools, seq_ids, positions, head_dim**-0.5)
    prep = QKPrep(k, v, *norms, 1e-6, inv_freq, rotary_dim)
    got = decode_attention_triton(q, *pools, seq_ids, positions, head_dim**-0.5, prep=prep)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(pools[0], ref_pools[0], **tol)
    assert torch.equal(pools[1], ref_pools[1])  # v is copied as is
    row = 1
    one = lambda t: t[row : row + 1] if isinstance(t, torch.Tensor) else SplitSum(t.parts[:, row : row + 1], dtype)  # noqa: E731
    alone_pools = [p.clone() for p in pools]
    alone = decode_attention_triton(one(q), *alone_pools, seq_ids[row : row + 1], positions[row : row + 1],
                                    head_dim**-0.5, prep=QKPrep(one(k), one(v), *norms, 1e-6, inv_freq, rotary_dim))
    assert torch.equal(alone[0], got[row]) and torch.equal(alone_pools[0], pools[0])
