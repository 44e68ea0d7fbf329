"""The Triton GDN decode step (conv + delta rule, pools updated in place) against the torch references
composed row by row, on odd sizes, under the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from strata.kernels.elementwise import gdn_gates_triton  # noqa: E402
from strata.kernels.gdn import causal_conv1d, gated_delta_rule_step, gdn_decode_triton  # noqa: E402

K, S = 4, 6
SEQS = {1: [4], 3: [5, 0, 2], 5: [3, 1, 5, 0, 4]}  # R -> seq_ids, a subset of the S sequences in some order
# (R, Hk, Hv, Dk, Dv); Dv=72 spans two Dv blocks of the recurrence kernel
SHAPES = [(1, 2, 4, 12, 20), (3, 3, 3, 16, 24), (5, 2, 4, 16, 20), (3, 2, 4, 12, 24), (1, 1, 2, 16, 72)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
STATE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _id(shape):
    r, hk, hv, dk, dv = shape
    return f"R={r}-Hk={hk}-Hv={hv}-Dk={dk}-Dv={dv}"


def make_layer(hk, hv, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    conv_w = (0.5 * torch.randn(c, K, generator=gen)).to(dtype)  # [C, K]
    conv_pool = torch.randn(S, K - 1, c, generator=gen).to(dtype)  # [S, K-1, C]
    rec_pool = 0.5 * torch.randn(S, hv, dk, dv, generator=gen)  # [S, Hv, Dk, Dv] float32
    return conv_w, conv_pool, rec_pool


def make_token(r, hk, hv, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    c = 2 * hk * dk + hv * dv
    proj = torch.randn(r, c + 3, generator=gen).to(dtype)  # [R, C+3]: mixed is a strided view, as in forward
    decay = -F.softplus(torch.randn(r, hv, generator=gen))  # [R, Hv] float32, <= 0
    beta = torch.sigmoid(torch.randn(r, hv, generator=gen)).to(dtype)  # [R, Hv]
    return proj[:, :c], decay, beta


def reference(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv):
    """causal_conv1d + gated_delta_rule_step row by row; returns out and updated copies of the pools."""
    conv_pool, rec_pool = conv_pool.clone(), rec_pool.clone()
    outs = []
    for r, s in enumerate(seq_ids.tolist()):
        conv_out, conv_pool[s] = causal_conv1d(mixed[r : r + 1], conv_w, conv_pool[s])
        q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.reshape(1, hk, dk), k.reshape(1, hk, dk), v.reshape(1, hv, dv)
        out, rec_pool[s] = gated_delta_rule_step(q, k, v, decay[r : r + 1], beta[r : r + 1], rec_pool[s])
        outs.append(out)
    return torch.cat(outs), conv_pool, rec_pool


def run_both(shape, dtype, steps):
    r, hk, hv, dk, dv = shape
    seq_ids = torch.tensor(SEQS[r], dtype=torch.int32)
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, dtype)
    ref_conv, ref_rec = conv_pool.clone(), rec_pool.clone()
    for step in range(steps):
        mixed, decay, beta = make_token(r, hk, hv, dk, dv, dtype, seed=step)
        expected, ref_conv, ref_rec = reference(mixed, conv_w, ref_conv, ref_rec, seq_ids, decay, beta, hk, hv, dk, dv)
        out = gdn_decode_triton(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv)
        assert out.dtype == dtype and out.shape == (r, hv, dv)
        torch.testing.assert_close(out, expected, **TOL[dtype])
        torch.testing.assert_close(conv_pool, ref_conv, rtol=0, atol=0)  # the history is copied, not computed
        torch.testing.assert_close(rec_pool, ref_rec, **STATE_TOL[dtype])
        if dtype == torch.float16:  # keep the two on the same history so fp16 errors do not compound
            rec_pool.copy_(ref_rec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_one_step_matches_reference(shape, dtype):
    run_both(shape, dtype, steps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(3, 2, 4, 12, 20), (1, 3, 3, 16, 24)], ids=_id)
def test_five_steps_in_a_row(shape, dtype):
    run_both(shape, dtype, steps=5)


def test_other_sequences_untouched():
    hk, hv, dk, dv = 2, 4, 12, 20
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, torch.float32)
    conv_before, rec_before = conv_pool.clone(), rec_pool.clone()
    seq_ids = torch.tensor([5, 2], dtype=torch.int32)
    mixed, decay, beta = make_token(2, hk, hv, dk, dv, torch.float32, seed=0)
    gdn_decode_triton(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv)
    for s in (0, 1, 3, 4):
        assert torch.equal(conv_pool[s], conv_before[s]) and torch.equal(rec_pool[s], rec_before[s])
    for s in (5, 2):
        assert not torch.equal(conv_pool[s], conv_before[s]) and not torch.equal(rec_pool[s], rec_before[s])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_row_alone_equals_row_in_batch(dtype):
    hk, hv, dk, dv = 2, 4, 16, 24
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, dtype)
    mixed, decay, beta = make_token(5, hk, hv, dk, dv, dtype, seed=7)
    seq_ids = torch.tensor([3, 1, 5, 0, 4], dtype=torch.int32)
    row, seq = 2, 5

    alone_conv, alone_rec = conv_pool.clone(), rec_pool.clone()
    one = slice(row, row + 1)
    alone = gdn_decode_triton(
        mixed[one], conv_w, alone_conv, alone_rec, seq_ids[one], decay[one], beta[one], hk, hv, dk, dv
    )
    batched = gdn_decode_triton(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv)
    assert torch.equal(alone[0], batched[row])
    assert torch.equal(alone_conv[seq], conv_pool[seq]) and torch.equal(alone_rec[seq], rec_pool[seq])


def test_no_rows():
    hk, hv, dk, dv = 2, 4, 12, 20
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, torch.float32)
    mixed, decay, beta = make_token(0, hk, hv, dk, dv, torch.float32, seed=0)
    seq_ids = torch.zeros(0, dtype=torch.int32)
    out = gdn_decode_triton(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv)
    assert out.shape == (0, hv, dv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=[_id(s) for s in SHAPES[:3]])
def test_decode_step_makes_its_gates_as_the_gates_kernel(shape, dtype):
    """gdn_decode_triton(gates=(a, b, neg_a, dt_bias)): the step makes each head's log decay and beta from the
    projections itself; the output and both pools are bitwise those of gdn_gates_triton followed by the step."""
    r, hk, hv, dk, dv = shape
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, dtype)
    mixed, _, _ = make_token(r, hk, hv, dk, dv, dtype, seed=3)
    gen = torch.Generator().manual_seed(7)
    ab = torch.randn(r, 2 * hv + 1, generator=gen).to(dtype)  # a and b as strided views of one projection
    a, b = ab[:, :hv], ab[:, hv : 2 * hv]
    neg_a, dt_bias = -torch.rand(hv, generator=gen) - 0.1, torch.randn(hv, generator=gen)
    a[0, 0] = 30.0  # past softplus's threshold
    seq_ids = torch.tensor(SEQS[r], dtype=torch.int32)
    pools = [(conv_pool.clone(), rec_pool.clone()) for _ in range(2)]
    decay, beta = gdn_gates_triton(a, b, neg_a, dt_bias)
    want = gdn_decode_triton(mixed, conv_w, *pools[0], seq_ids, decay, beta, hk, hv, dk, dv)
    got = gdn_decode_triton(mixed, conv_w, *pools[1], seq_ids, None, None, hk, hv, dk, dv,
                            gates=(a, b, neg_a, dt_bias))
    assert torch.equal(got, want)
    assert torch.equal(pools[1][0], pools[0][0]) and torch.equal(pools[1][1], pools[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_runs_of_one_sequences_rows_step_in_order_and_keep_their_states(dtype):
    """Consecutive rows of one sequence (a drafting slot's rows, a short prompt chunk) in one launch: each run
    steps in order, bitwise as the same rows launched one at a time, beside single rows of other sequences; rows
    given a keep slot leave there the conv history and recurrent state as they are after them (a rollback's
    target), and no other keep slot is written."""
    hk, hv, dk, dv = 2, 4, 16, 72  # Dv spans two blocks of the recurrence kernel
    conv_w, conv_pool, rec_pool = make_layer(hk, hv, dk, dv, dtype)
    seq_list = [3, 3, 3, 0, 5, 5, 1, 1, 1, 1]
    keep_list = [0, 2, -1, -1, 1, -1, 4, -1, 3, -1]
    r = len(seq_list)
    mixed, decay, beta = make_token(r, hk, hv, dk, dv, dtype, seed=11)
    seq_ids = torch.tensor(seq_list, dtype=torch.int32)
    c = mixed.shape[1]
    conv_keep = torch.full((6, K - 1, c), 7.0, dtype=dtype)
    rec_keep = torch.full((6, hv, dk, dv), 7.0)
    one_conv, one_rec = conv_pool.clone(), rec_pool.clone()
    singles, after = [], {}
    for j in range(r):  # the rows one launch each: what a window of one row a sequence gives
        one = slice(j, j + 1)
        singles.append(gdn_decode_triton(mixed[one], conv_w, one_conv, one_rec, seq_ids[one], decay[one], beta[one],
                                         hk, hv, dk, dv)[0])
        after[j] = (one_conv[seq_list[j]].clone(), one_rec[seq_list[j]].clone())
    expected, ref_conv, ref_rec = reference(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv)
    keep = (torch.tensor(keep_list, dtype=torch.int32), conv_keep, rec_keep)
    out = gdn_decode_triton(mixed, conv_w, conv_pool, rec_pool, seq_ids, decay, beta, hk, hv, dk, dv, keep=keep)
    assert torch.equal(out, torch.stack(singles))
    assert torch.equal(conv_pool, one_conv) and torch.equal(rec_pool, one_rec)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(rec_pool, ref_rec, **STATE_TOL[dtype])
    for j, slot in enumerate(keep_list):
        if slot >= 0:
            assert torch.equal(conv_keep[slot], after[j][0]) and torch.equal(rec_keep[slot], after[j][1]), j
    assert (conv_keep[5] == 7).all() and (rec_keep[5] == 7).all()  # no row keeps into slot 5
