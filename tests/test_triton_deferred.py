"""Deferred sums (strata/kernels/deferred.py): every kernel that adds up a split-K projection's chunks or a row's
expert outputs as it loads them gives bitwise what it gives on the finished tensor, under the Triton interpreter
on odd sizes."""

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton / strata.kernels are imported

import torch

from strata.kernels.deferred import PairSum, SplitSum, finish
from strata.kernels.elementwise import sigmoid_gate_add_triton, silu_mul_triton
from strata.kernels.linear import linear_split, linear_triton
from strata.kernels.moe import combine_triton, fused_experts_triton, moe, moe_triton, route_triton
from strata.kernels.qk_prep import qk_prep_triton
from strata.kernels.rmsnorm import add_rms_norm_triton
from strata.runtime.forward import split_qkv
from strata.model.spec import AttentionSpec

DTYPES = [torch.float32, torch.float16]
EPS = 1e-6


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _split(m, n, k, dtype, seed=0):
    """A projection of [m, k] rows by an [n, k] weight wide enough in K to be split."""
    g = _gen(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_split_finishes_to_linear_triton(dtype):
    x, w = _split(3, 40, 1024, dtype)
    value = linear_split(x, w)
    assert isinstance(value, SplitSum) and value.splits > 1 and value.shape == (3, 40)
    assert torch.equal(finish(value), linear_triton(x, w))
    torch.testing.assert_close(finish(value).float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)
    # a bias is added by the sum kernel: the result comes back finished
    b = torch.randn(40, generator=_gen(3)).to(dtype)
    assert torch.equal(linear_split(x, w, b), linear_triton(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_adds_split_chunks_as_the_sum_kernel(dtype):
    x, w = _split(5, 72, 1024, dtype)
    value = linear_split(x, w)
    assert isinstance(value, SplitSum)
    residual = torch.randn(5, 72, generator=_gen(1)).to(dtype)
    weight = 1 + 0.3 * torch.randn(72, generator=_gen(2))
    got = add_rms_norm_triton(value, residual, weight, EPS)
    want = add_rms_norm_triton(finish(value), residual, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _pairs(dtype, shared: str, rows=4, hidden=48, experts=7, top_k=3, inter=24):
    g = _gen(5)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    weights, ids = route_triton(torch.randn(rows, experts, generator=g), top_k, True)
    ids[1, 0] = experts + 2  # an expert not held here: adds nothing
    pairs = fused_experts_triton(x, weights, ids, gate_up, down, defer=True)
    assert isinstance(pairs, PairSum)
    if shared != "none":
        s_gu = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        s_down = (torch.randn(hidden, 8 * 128, generator=g) / 32).to(dtype)
        h = torch.randn(rows, 8 * 128, generator=g).to(dtype)  # wide enough in K for the down product to split
        s = linear_split(h, s_down)
        assert isinstance(s, SplitSum)
        g_w = (torch.randn(1, 1024, generator=g) / 32).to(dtype)
        gl = linear_split(torch.randn(rows, 1024, generator=g).to(dtype), g_w) if shared == "gated" else None
        pairs = PairSum(pairs.y, pairs.ids, pairs.num_experts, dtype, shared=s, shared_gate=gl)
        del s_gu
    return x, pairs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared", ["none", "plain", "gated"])
def test_norm_adds_expert_pairs_as_the_combine(dtype, shared):
    x, pairs = _pairs(dtype, shared)
    combined = combine_triton(pairs)
    if shared == "gated":  # the stand-alone kernels: combine, then out + sigmoid(gate) * shared
        plain = PairSum(pairs.y, pairs.ids, pairs.num_experts, dtype)
        assert torch.equal(combined, sigmoid_gate_add_triton(combine_triton(plain), finish(pairs.shared),
                                                             finish(pairs.shared_gate)))
    elif shared == "plain":
        plain = PairSum(pairs.y, pairs.ids, pairs.num_experts, dtype)
        assert torch.equal(combined, combine_triton(plain) + finish(pairs.shared))
    residual = torch.randn(x.shape, generator=_gen(7)).to(dtype)
    weight = 1 + 0.3 * torch.randn(x.shape[1], generator=_gen(8))
    got = add_rms_norm_triton(pairs, residual, weight, EPS)
    want = add_rms_norm_triton(combined, residual, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _moe_args(dtype, rows, gated: bool, seed=13, hidden=64, experts=6, inter=32):
    g = _gen(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    router = (torch.randn(experts, hidden, generator=g) / 8).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / 6).to(dtype)
    shared = ((torch.randn(2 * inter, hidden, generator=g) / 8).to(dtype),
              (torch.randn(hidden, inter, generator=g) / 6).to(dtype))
    shared_gate = (torch.randn(1, hidden, generator=g) / 8).to(dtype) if gated else None
    return x, router, gate_up, down, 2, True, shared, shared_gate


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_deferred_matches_finished_and_reference(dtype):
    args = _moe_args(dtype, 3, gated=True, seed=11, hidden=256)
    deferred = moe_triton(*args, linear=linear_split, defer=True)
    assert isinstance(deferred, PairSum)
    finished = moe_triton(*args, linear=linear_triton)
    assert torch.equal(finish(deferred), finished)
    torch.testing.assert_close(finished.float(), moe(*args).float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_route_adds_split_router_logits(dtype):
    x, w = _split(4, 20, 1024, dtype, seed=4)
    logits = linear_split(x, w)
    assert isinstance(logits, SplitSum)
    got, want = route_triton(logits, 3, True), route_triton(finish(logits), 3, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_adds_split_gate_up(dtype):
    x, w = _split(3, 2 * 40, 1024, dtype, seed=6)
    gate_up = linear_split(x, w)
    assert isinstance(gate_up, SplitSum)
    assert torch.equal(silu_mul_triton(gate_up), silu_mul_triton(finish(gate_up)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_prep_adds_split_qkv(dtype):
    a = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, rope_theta=1e4, qk_norm=True,
                      output_gate=False)
    rows, hidden = 3, 1024
    x, w = _split(rows, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, hidden, dtype, seed=9)
    qkv = linear_split(x, w)
    assert isinstance(qkv, SplitSum)
    g = _gen(10)
    qn, kn = 1 + 0.2 * torch.randn(16, generator=g), 1 + 0.2 * torch.randn(16, generator=g)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
    positions, seq_ids = torch.tensor([0, 5, 9]), torch.tensor([2, 0, 1])
    outs = []
    for value in (qkv, finish(qkv)):
        k_pool = torch.zeros(3, 12, a.num_kv_heads, a.head_dim, dtype=dtype)
        v_pool = torch.zeros_like(k_pool)
        q, k, v, gate = split_qkv(a, value)
        assert gate is None
        outs.append((qk_prep_triton(q, k, v, qn, kn, EPS, positions, inv_freq, 8, k_pool, v_pool, seq_ids),
                     k_pool, v_pool))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_shared_expert_as_one_more_pair(dtype, gated):
    """The shared expert run as expert E inside the experts' kernels: the MoE block within tolerance of the torch
    reference, its rows bitwise the same alone or among others, the deferred pairs finished by the norm bitwise."""
    args = _moe_args(dtype, 5, gated)
    pairs = moe_triton(*args, linear=linear_split, defer=True, shared_pair=True)
    assert isinstance(pairs, PairSum) and pairs.ids.shape == (5, 3) and pairs.shared is None
    assert torch.equal(pairs.ids[:, 2], torch.full((5,), 6, dtype=pairs.ids.dtype))  # pair k: expert E, the shared
    out = finish(pairs)
    torch.testing.assert_close(out.float(), moe(*args).float(), rtol=3e-2, atol=3e-2)
    x = args[0]
    for i in (0, 3):
        alone = finish(moe_triton(x[i : i + 1], *args[1:], linear=linear_split, defer=True, shared_pair=True))
        assert torch.equal(alone, out[i : i + 1])
    residual = torch.randn(x.shape, generator=_gen(14)).to(dtype)
    weight = 1 + 0.3 * torch.randn(x.shape[1], generator=_gen(15))
    got, want = add_rms_norm_triton(pairs, residual, weight, EPS), add_rms_norm_triton(out, residual, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_shared_pair_needs_the_routed_experts_shape():
    """A shared expert of another size keeps its own products (and the same result as without shared_pair)."""
    x, router, gate_up, down, k, norm, shared, gate = _moe_args(torch.float32, 3, True)
    wide = (torch.randn(96, 64, generator=_gen(16)) / 8, torch.randn(64, 48, generator=_gen(17)) / 6)
    a = moe_triton(x, router, gate_up, down, k, norm, wide, gate, linear=linear_triton, shared_pair=True)
    b = moe_triton(x, router, gate_up, down, k, norm, wide, gate, linear=linear_triton)
    assert torch.equal(a, b)


def test_split_sum_views_finish_like_the_finished_tensor():
    """A SplitSum sliced and reshaped as split_qkv slices the projection (column ranges, heads) finishes to the
    same slice of the finished tensor."""
    x, w = _split(3, 96, 1024, torch.float32, seed=21)
    value, whole = linear_split(x, w), linear_triton(x, w)
    q, k, v = value.split([48, 32, 16], dim=-1)
    assert q.shape == (3, 48) and q.stride(0) == 96 and q.dim() == 2
    assert torch.equal(finish(k), whole[:, 48:80])
    heads = q.reshape(3, 4, 12)
    assert heads.shape == (3, 4, 12) and torch.equal(finish(heads), whole[:, :48].reshape(3, 4, 12))
    first, second = v.chunk(2, dim=-1)
    assert torch.equal(finish(second), whole[:, 88:])
