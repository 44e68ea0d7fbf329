"""Gated DeltaNet references against transformers' Qwen3-Next torch paths, and against themselves
(chunked vs step, one call vs a prompt split in two, chunk sizes), on odd sizes."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from strata.kernels.gdn import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_step


def _torch_path(fn):
    # The decorated functions may dispatch to fla / causal-conv1d when installed: keep the torch path.
    return getattr(fn, "__wrapped__", fn)


hf_chunk = _torch_path(hf.torch_chunk_gated_delta_rule)
hf_recurrent = _torch_path(hf.torch_recurrent_gated_delta_rule)
hf_conv_fn = _torch_path(hf.causal_conv1d_fn)
hf_conv_update = _torch_path(hf.causal_conv1d_update)

TOL = dict(rtol=1e-5, atol=1e-5)
DK, DV = 12, 20
HEADS = [(2, 4), (3, 3)]  # (Hk, Hv)
LENGTHS = [1, 5, 63, 64, 65, 130]
SHAPES = [(t, hk, hv) for t in LENGTHS for hk, hv in HEADS]


def _id(shape):
    t, hk, hv = shape
    return f"T={t}-Hk={hk}-Hv={hv}-Dk={DK}-Dv={DV}"


def make_inputs(t, hk, hv, seed=0, fresh=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(t, hk, DK), randn(t, hk, DK), randn(t, hv, DV)
    g = -F.softplus(randn(t, hv))  # log decay <= 0
    beta = torch.sigmoid(randn(t, hv))
    state = torch.zeros(hv, DK, DV) if fresh else 0.5 * randn(hv, DK, DV)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta)) + (state,)


def run_hf(fn, q, k, v, g, beta, state, **kwargs):
    out, new_state = fn(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
    )
    return out[0], new_state[0]


def assert_same(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    torch.testing.assert_close(actual[1], expected[1], **TOL)


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "carried"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_chunked_matches_transformers(shape, fresh):
    inputs = make_inputs(*shape, fresh=fresh)
    assert_same(gated_delta_rule_chunked(*inputs), run_hf(hf_chunk, *inputs))


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_step_matches_transformers(shape):
    inputs = make_inputs(*shape)
    assert_same(gated_delta_rule_step(*inputs), run_hf(hf_recurrent, *inputs))


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_chunked_equals_step(shape):
    inputs = make_inputs(*shape)
    assert_same(gated_delta_rule_chunked(*inputs), gated_delta_rule_step(*inputs))


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
@pytest.mark.parametrize("shape", [(130, 2, 4), (63, 3, 3)], ids=_id)
def test_chunk_sizes_agree(shape, chunk_size):
    inputs = make_inputs(*shape)
    assert_same(gated_delta_rule_chunked(*inputs, chunk_size=chunk_size), gated_delta_rule_chunked(*inputs))


def _split(inputs, at):
    *seq, state = inputs
    return [x[:at] for x in seq], [x[at:] for x in seq], state


@pytest.mark.parametrize("at", [1, 17, 63, 64, 65, 129])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hk={h[0]}-Hv={h[1]}")
def test_prompt_split_in_two_equals_one_call(heads, at):
    inputs = make_inputs(130, *heads, fresh=True)
    whole_out, whole_state = gated_delta_rule_chunked(*inputs)
    first, second, state = _split(inputs, at)
    out1, state = gated_delta_rule_chunked(*first, state)
    out2, state = gated_delta_rule_chunked(*second, state)
    assert_same((torch.cat([out1, out2]), state), (whole_out, whole_state))


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"Hk={h[0]}-Hv={h[1]}")
def test_prefill_then_decode_equals_one_call(heads):
    inputs = make_inputs(70, *heads, fresh=True)
    whole_out, whole_state = gated_delta_rule_chunked(*inputs)
    prompt, rest, state = _split(inputs, 65)
    out, state = gated_delta_rule_chunked(*prompt, state)
    outs = [out]
    for t in range(rest[0].shape[0]):
        out, state = gated_delta_rule_step(*(x[t : t + 1] for x in rest), state)
        outs.append(out)
    assert_same((torch.cat(outs), state), (whole_out, whole_state))


@pytest.mark.parametrize("fn", [gated_delta_rule_chunked, gated_delta_rule_step], ids=["chunked", "step"])
def test_inputs_untouched_and_dtypes(fn):
    inputs = make_inputs(9, 2, 4, dtype=torch.bfloat16)
    copies = [x.clone() for x in inputs]
    out, state = fn(*inputs)
    for x, copy in zip(inputs, copies):
        assert torch.equal(x, copy)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 4, DV)
    assert state.dtype == torch.float32 and state.shape == (4, DK, DV)
    assert state.data_ptr() != inputs[-1].data_ptr()


@pytest.mark.parametrize("fn", [gated_delta_rule_chunked, gated_delta_rule_step], ids=["chunked", "step"])
def test_no_tokens_keeps_state(fn):
    inputs = make_inputs(0, 2, 4)
    out, state = fn(*inputs)
    assert out.shape == (0, 4, DV)
    torch.testing.assert_close(state, inputs[-1], rtol=0, atol=0)


# Causal conv: C = 2 * Hk * Dk + Hv * Dv for Hk=2, Hv=3 plus one odd channel, K = 4 as in Qwen3-Next.
CONV_C, CONV_K = 2 * 2 * DK + 3 * DV + 1, 4


def make_conv(t, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, CONV_C, generator=gen)
    weight = torch.randn(CONV_C, CONV_K, generator=gen)
    history = torch.randn(CONV_K - 1, CONV_C, generator=gen)
    return x, weight, history


@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T={t}-C={CONV_C}-K={CONV_K}")
def test_conv_fresh_matches_transformers(t):
    x, weight, _ = make_conv(t)
    out, history = causal_conv1d(x, weight, torch.zeros(CONV_K - 1, CONV_C))
    expected = hf_conv_fn(x.T[None], weight, None, activation="silu")[0].T
    torch.testing.assert_close(out, expected, **TOL)
    padded = torch.cat([torch.zeros(CONV_K - 1, CONV_C), x])
    torch.testing.assert_close(history, padded[-(CONV_K - 1) :], rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, 2, 5], ids=lambda t: f"T={t}-C={CONV_C}-K={CONV_K}")
def test_conv_update_matches_transformers(t):
    x, weight, history = make_conv(t)
    hf_state = history.T[None].clone()  # [1, C, K-1], updated in place by transformers
    expected = hf_conv_update(x.T[None], hf_state, weight, None, activation="silu")[0].T
    out, new_history = causal_conv1d(x, weight, history)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(new_history, hf_state[0].T, rtol=0, atol=0)


@pytest.mark.parametrize("at", [0, 1, 2, 3, 40, 64])
def test_conv_history_equals_concatenation(at):
    x, weight, history = make_conv(65)
    whole_out, whole_history = causal_conv1d(x, weight, history)
    copies = [t.clone() for t in (x, weight, history)]
    out1, mid = causal_conv1d(x[:at], weight, history)
    out2, end = causal_conv1d(x[at:], weight, mid)
    torch.testing.assert_close(torch.cat([out1, out2]), whole_out, **TOL)
    torch.testing.assert_close(end, whole_history, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip((x, weight, history), copies))
