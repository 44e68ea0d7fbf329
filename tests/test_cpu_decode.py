"""The decode rows' work between a CPU stage's products (strata/kernels/cpu_decode.c): the residual add and norm near
float64, the attention block against torch's reference ops (the K/V cells written, the output), each row bitwise
itself alone or beside others, drafts of one sequence in one window, and the engine's answer without the library."""

import pytest
import torch

from strata.kernels import cpu_decode
from strata.kernels.attention import attention as reference_attention
from strata.kernels.rmsnorm import rms_norm as reference_norm
from strata.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason=f"the CPU decode kernels cannot run here: "
                                f"{cpu_decode.why()} (they need AVX2 and FMA, and gcc or a built library)")


@pytest.mark.parametrize("d", [576, 100])
def test_the_decode_rows_norm_is_the_float64_norm_and_each_row_its_own(d):
    """`rms_norm`: the residual add written out exactly, the norm near float64's, a row alone bitwise itself among
    any rows; without a delta, x itself."""
    torch.manual_seed(3)
    x, delta, w = torch.randn(9, d), torch.randn(9, d), torch.rand(d) + 0.5
    out, summed = cpu_decode.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(summed, x + delta)
    s = (x + delta).double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-6
    for r in (0, 4, 8):
        alone, _ = cpu_decode.rms_norm(x[r:r + 1], w, 1e-6, delta[r:r + 1])
        assert torch.equal(alone[0], out[r])
    plain, same = cpu_decode.rms_norm(x, w, 1e-6)
    assert torch.equal(same, x) and torch.equal(plain[2], cpu_decode.rms_norm(x[2:3], w, 1e-6)[0][0])


# (heads, K/V heads, head dim, rotary dims, output gate, q/k norms): SmolLM2's GQA; Qwen3-Next's gated heads with a
# quarter of their dims turned and q/k norms; one head a K/V head, D below the 32 dims the output takes at a time
SHAPES = [(9, 3, 64, 64, False, False), (8, 2, 128, 32, True, True), (4, 4, 16, 16, False, True)]


def reference(qkv, h, hkv, d, gated, cos, sin, q_norm, k_norm, k_pool, v_pool, seq, pos):
    """torch's ops as the stage runs them without the library: the cells written, then each row over its own."""
    r = qkv.shape[0]
    q_out = h * d * (2 if gated else 1)
    q, k, v = qkv.split([q_out, hkv * d, hkv * d], dim=-1)
    q = q.reshape(r, h, -1)[..., :d]
    k, v = k.reshape(r, hkv, d), v.reshape(r, hkv, d)
    if q_norm is not None:
        q, k = reference_norm(q, q_norm, 1e-6), reference_norm(k, k_norm, 1e-6)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for j in range(r):
        k_pool[seq[j], pos[j]], v_pool[seq[j], pos[j]] = k[j], v[j]
    return torch.cat([reference_attention(q[j:j + 1], k_pool[seq[j], :pos[j] + 1], v_pool[seq[j], :pos[j] + 1],
                                          pos[j:j + 1], d**-0.5) for j in range(r)])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}h{s[1]}kv{s[2]}d")
def test_attention_is_torchs_and_each_row_its_own(shape):
    h, hkv, d, rot, gated, norms = shape
    torch.manual_seed(1)
    sequences, cells = 5, 300
    k_pool, v_pool = torch.randn(sequences, cells, hkv, d), torch.randn(sequences, cells, hkv, d)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    # rows of four sequences; the first at its first cell, one at the last cell, two of one sequence one position
    # apart (a drafted row: it reads the cell the row before it writes in the same call)
    seq, pos = torch.tensor([3, 0, 4, 1, 1]), torch.tensor([0, 17, cells - 1, 100, 101])
    qkv = torch.randn(5, h * d * (2 if gated else 1) + 2 * hkv * d)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(rot, 10000.0), torch.float32)
    q_norm, k_norm = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if norms else (None, None)
    out = cpu_decode.attention(qkv, h, hkv, d, gated, cos, sin, q_norm, k_norm, 1e-6, k_pool, v_pool, seq, pos,
                               d**-0.5)
    want = reference(qkv, h, hkv, d, gated, cos, sin, q_norm, k_norm, k_ref, v_ref, seq, pos)
    assert out.shape == (5, h, d)
    assert torch.equal(v_pool, v_ref)  # values copied as they are
    assert torch.allclose(k_pool, k_ref, atol=2e-6, rtol=0)  # keys turned (and normed) as torch turns them
    if not norms:
        assert torch.equal(k_pool, k_ref)  # the rotary alone rounds as torch's does
    assert torch.allclose(out, want, atol=2e-6, rtol=0)
    for j in (0, 2, 3):  # a row alone: bitwise its place among the others (its cells as they are now)
        alone = cpu_decode.attention(qkv[j:j + 1], h, hkv, d, gated, cos[j:j + 1], sin[j:j + 1], q_norm, k_norm,
                                     1e-6, k_pool, v_pool, seq[j:j + 1], pos[j:j + 1], d**-0.5)
        assert torch.equal(alone[0], out[j])


def test_what_the_attention_takes():
    cells = torch.zeros(2, 8, 3, 64)
    assert cpu_decode.takes(cells, cells.clone(), 64)
    assert not cpu_decode.takes(cells.to(torch.bfloat16), cells.to(torch.bfloat16), 64)  # float32 cells only
    assert not cpu_decode.takes(torch.zeros(2, 8, 3, 12), torch.zeros(2, 8, 3, 12), 12)  # D a multiple of 8
    odd = torch.zeros(2, 3, 8, 64).transpose(1, 2)  # heads not packed within a cell
    assert not cpu_decode.takes(odd, odd, 64)


def test_the_default_engine_decodes_on_it_and_answers_the_same_without_it(default_engine):
    """The default's CPU stage runs its decode rows' norms and attention here; with torch's ops instead the greedy
    tokens are the same and the logits within float32 rounding."""
    forward = default_engine.stages[0].forward
    assert forward.host_decode
    ids = default_engine.tokenizer.encode("The capital of France is")

    def decode(steps=12):
        state = default_engine.new_state()
        logits = default_engine.run(state, ids)
        out, last = [], []
        for _ in range(steps):
            token = int(logits[-1].argmax())
            out.append(token)
            logits = default_engine.run(state, [token])
            last.append(logits[-1].clone())
        return out, torch.stack(last)

    tokens, logits = decode()
    forward.host_decode = False
    try:
        plain_tokens, plain_logits = decode()
    finally:
        forward.host_decode = True
    assert tokens == plain_tokens
    assert torch.allclose(logits, plain_logits, atol=1e-3, rtol=0), float((logits - plain_logits).abs().max())


def test_a_library_that_cannot_be_had_is_said_once_and_the_stage_runs_torchs_ops(tmp_path, monkeypatch, caplog):
    import logging

    from strata.kernels import native_build

    monkeypatch.setattr(native_build, "GCC", "no-such-compiler")
    monkeypatch.setattr(cpu_decode, "SHIPPED", tmp_path / "none.so")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build either
    cpu_decode._loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.engine"):
            assert not cpu_decode.available() and "no gcc" in cpu_decode.why()
            assert not cpu_decode.takes(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), 8)
        said = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(said) == 1 and "no gcc" in said[0] and "torch's ops" in said[0]
        monkeypatch.setenv("STRATA_CPU_DECODE", "0")
        cpu_decode._loaded.cache_clear()
        assert not cpu_decode.available() and cpu_decode.why() == "STRATA_CPU_DECODE=0"
    finally:
        cpu_decode._loaded.cache_clear()
        monkeypatch.undo()
    assert cpu_decode.available()
