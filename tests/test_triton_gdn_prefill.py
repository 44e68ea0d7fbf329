"""The Triton GDN prefill kernels (causal conv + silu over a prompt's rows, the chunked gated delta rule) against
the torch references under the Triton interpreter, and a qwen3_next engine with kernels="triton" reading a prompt
longer than one chunk against kernels="torch"."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from strata.kernels.gdn import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_triton,
    gated_delta_rule_chunked,
    gated_delta_rule_chunked_triton,
    gated_delta_rule_step,
)

DTYPES = [torch.float32, torch.float16]  # the interpreter mishandles bfloat16
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}
CONV_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _dtype_id(dtype):
    return {torch.float32: "fp32", torch.float16: "fp16"}[dtype]


# ---- causal conv ----

CONV_CASES = [(t, c, k) for t in (1, 2, 63, 65, 130) for c, k in ((100, 4), (200, 4))] + [(5, 40, 2), (33, 24, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"T={c[0]}-C={c[1]}-K={c[2]}")
def test_conv_matches_reference(case, dtype):
    t, c, k = case
    gen = torch.Generator().manual_seed(t * 7 + c)
    proj = torch.randn(t, c + 9, generator=gen).to(dtype)  # x is a strided view, as in forward
    x = proj[:, 3 : 3 + c]
    weight = (0.5 * torch.randn(c, k, generator=gen)).to(dtype)
    history = torch.randn(k - 1, c, generator=gen).to(dtype)
    history_before = history.clone()
    expected, expected_history = causal_conv1d(x, weight, history)
    out, new_history = causal_conv1d_triton(x, weight, history)
    assert out.dtype == dtype and out.shape == (t, c) and new_history.shape == (k - 1, c)
    torch.testing.assert_close(out, expected, **CONV_TOL[dtype])
    assert torch.equal(new_history, expected_history)  # copied rows, not computed
    assert torch.equal(history, history_before)


def test_conv_continues_across_calls():
    """A prompt read in three pieces gives the rows and history of reading it at once."""
    gen = torch.Generator().manual_seed(3)
    c, k = 72, 4
    x = torch.randn(70, c, generator=gen)
    weight = torch.randn(c, k, generator=gen)
    history = torch.randn(k - 1, c, generator=gen)
    whole, whole_history = causal_conv1d(x, weight, history)
    outs = []
    for piece in (slice(0, 2), slice(2, 67), slice(67, 70)):
        out, history = causal_conv1d_triton(x[piece], weight, history)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(history, whole_history)


# ---- chunked gated delta rule ----

# (T, Hk, Hv, Dk, Dv): T around the chunk of 64; GQA (Hv = 2 Hk) and Hv = Hk; Dk/Dv not powers of two;
# Dv = 40 spans two Dv blocks of the sequential kernel, Dv = 72 two of the per-chunk kernel.
RULE_CASES = [
    (1, 2, 4, 16, 16),
    (63, 2, 4, 16, 16),
    (64, 1, 2, 32, 32),
    (65, 2, 4, 12, 20),
    (130, 2, 4, 16, 16),
    (130, 3, 3, 16, 40),
    (70, 1, 2, 20, 72),
]


def _rule_id(case):
    t, hk, hv, dk, dv = case
    return f"T={t}-Hk={hk}-Hv={hv}-Dk={dk}-Dv={dv}"


def make_inputs(t, hk, hv, dk, dv, dtype, seed=0, state_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(t, 2 * hk * dk + hv * dv + 5, generator=gen).to(dtype)  # q|k|v are views, as in forward
    q = conv[:, : hk * dk].reshape(t, hk, dk)
    k = conv[:, hk * dk : 2 * hk * dk].reshape(t, hk, dk)
    v = conv[:, 2 * hk * dk : 2 * hk * dk + hv * dv].reshape(t, hv, dv)
    g = -F.softplus(torch.randn(t, hv, generator=gen))  # [T, Hv] float32 log decay
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen)).to(dtype)
    state = state_scale * torch.randn(hv, dk, dv, generator=gen)  # [Hv, Dk, Dv] float32
    return q, k, v, g, beta, state


def check_rule(inputs, dtype, chunk_size=64):
    q, k, v, g, beta, state = inputs
    state_before = state.clone()
    expected, expected_state = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    out, new_state = gated_delta_rule_chunked_triton(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert out.dtype == dtype and out.shape == v.shape and new_state.dtype == torch.float32
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(new_state, expected_state, **TOL[dtype])
    assert torch.equal(state, state_before)
    return out, new_state


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", RULE_CASES, ids=_rule_id)
def test_rule_matches_reference(case, dtype):
    check_rule(make_inputs(*case, dtype, seed=case[0]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_rule_from_zero_state_and_small_chunks(dtype):
    inputs = make_inputs(50, 2, 4, 16, 16, dtype, seed=5, state_scale=0.0)
    check_rule(inputs, dtype, chunk_size=16)


@pytest.mark.parametrize("solve_block", [64, 16, 8])
def test_rule_matches_token_by_token_recurrence(solve_block):
    """Strong decay and near-duplicate keys with beta ~ 1 (the UT transform's hard case) against the recurrence,
    the chunk's (I + A)^-1 by substitution over the whole chunk (64) or in diagonal blocks and products."""
    q, k, v, g, beta, state = make_inputs(100, 1, 2, 16, 24, torch.float32, seed=9)
    k = k[:1] + 0.01 * k
    for g_scale, b in ((20.0, beta), (1.0, torch.full_like(beta, 0.999))):
        expected, expected_state = gated_delta_rule_step(q, k, v, g * g_scale, b, state)
        out, new_state = gated_delta_rule_chunked_triton(q, k, v, g * g_scale, b, state, solve_block=solve_block)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(new_state, expected_state, rtol=1e-4, atol=1e-4)


def test_rule_continues_across_calls():
    """A prompt read in pieces (state carried) gives what reading it at once gives."""
    q, k, v, g, beta, state = make_inputs(90, 2, 4, 16, 16, torch.float32, seed=11)
    whole, whole_state = gated_delta_rule_chunked(q, k, v, g, beta, state)
    outs = []
    for piece in (slice(0, 1), slice(1, 70), slice(70, 90)):
        out, state = gated_delta_rule_chunked_triton(q[piece], k[piece], v[piece], g[piece], beta[piece], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, whole_state, rtol=1e-4, atol=1e-4)


# ---- engine: prompt windows on the Triton GDN prefill ----


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine
    from tests.tiny_models import build

    folder = tmp_path_factory.mktemp("qwen3_next")
    build("qwen3_next", folder)
    files = ModelFiles.open(folder)
    return Engine(files, max_cells=256, kernels="torch"), Engine(files, max_cells=256, kernels="triton")


def _count_calls(engine):
    calls = {"conv": 0, "rule": 0}
    for stage in engine.stages:
        conv, rule = stage.forward.prompt_gdn

        def counted_conv(*a, _f=conv, **kw):
            calls["conv"] += 1
            return _f(*a, **kw)

        def counted_rule(*a, _f=rule, **kw):
            calls["rule"] += 1
            return _f(*a, **kw)

        stage.forward.prompt_gdn = (counted_conv, counted_rule)
    return calls


def test_engine_prompt_longer_than_a_chunk_matches_torch(engines):
    from tests.tiny_models import VOCAB

    reference, fast = engines
    assert all(stage.forward.prompt_gdn is None for stage in reference.stages)
    calls = _count_calls(fast)
    ids = [(j * 37 + 11) % VOCAB for j in range(90)]  # 90 rows: chunks of 64 and 26
    states = reference.new_state(), fast.new_state()
    a, b = (engine.run(state, ids, all_logits=True) for engine, state in zip(engines, states))
    assert calls["conv"] > 0 and calls["rule"] > 0
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    # the states the prompt left behind carry on alike: one more prompt window of 40 rows
    more = [(j * 13 + 5) % VOCAB for j in range(40)]
    a, b = (engine.run(state, more) for engine, state in zip(engines, states))
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
