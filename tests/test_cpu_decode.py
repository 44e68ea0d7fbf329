"""The decode rows' work between a CPU stage's products (strata/kernels/cpu_decode.c): the residual add and norm near
float64, the attention block against torch's reference ops (the K/V cells written, the output), each row bitwise
itself alone or beside others, drafts of one sequence in one window; a whole stage in one call (`Stage`: a tiny
Qwen3, q/k norms included, quantized as it loads) against `transformers` over the same quantized values, batched
rows bitwise their solo rows, and the per-layer path; the engine's answer without the library."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.kernels import cpu_decode, cpu_packed
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


def cells(k_pool, v_pool, seq):
    """The [2, R] table of each row's sequence's K and V cells (`cpu_decode.cell_table`'s rows for one layer)."""
    return torch.tensor([[k_pool[s].data_ptr() for s in seq], [v_pool[s].data_ptr() for s in seq]])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}h{s[1]}kv{s[2]}d")
def test_attention_is_torchs_and_each_row_its_own(shape):
    h, hkv, d, rot, gated, norms = shape
    torch.manual_seed(1)
    sequences, n_cells = 5, 300
    k_pool, v_pool = torch.randn(sequences, n_cells, hkv, d), torch.randn(sequences, n_cells, hkv, d)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    # rows of four sequences; the first at its first cell, one at the last cell, two of one sequence one position
    # apart (a drafted row: it reads the cell the row before it writes in the same call)
    seq, pos = torch.tensor([3, 0, 4, 1, 1]), torch.tensor([0, 17, n_cells - 1, 100, 101])
    qkv = torch.randn(5, h * d * (2 if gated else 1) + 2 * hkv * d)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(rot, 10000.0), torch.float32)
    q_norm, k_norm = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if norms else (None, None)
    out = cpu_decode.attention(qkv, h, hkv, d, gated, cos, sin, q_norm, k_norm, 1e-6, cells(k_pool, v_pool, seq), pos,
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
                                     1e-6, cells(k_pool, v_pool, seq[j:j + 1]), pos[j:j + 1], d**-0.5)
        assert torch.equal(alone[0], out[j])


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


def test_a_library_that_cannot_be_had_is_said_once_with_why(tmp_path, monkeypatch, caplog):
    import logging

    from strata.kernels import native_build

    monkeypatch.setattr(native_build, "GCC", "no-such-compiler")
    monkeypatch.setattr(cpu_decode, "SHIPPED", tmp_path / "none.so")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build either
    cpu_decode._loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="strata.engine"):
            assert not cpu_decode.available() and "no gcc" in cpu_decode.why()
        said = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(said) == 1 and "no gcc" in said[0] and "torch's ops" in said[0]
        monkeypatch.setenv("STRATA_CPU_DECODE", "0")
        cpu_decode._loaded.cache_clear()
        assert not cpu_decode.available() and cpu_decode.why() == "STRATA_CPU_DECODE=0"
    finally:
        cpu_decode._loaded.cache_clear()
        monkeypatch.undo()
    assert cpu_decode.available()


def quantized_twins(tmp_path_factory, case: str):
    """(a tiny model of `case` on the CPU with its matrices quantized to Q8_0 as they load, transformers' model over
    a twin checkpoint holding those quantized values)."""
    import transformers

    from strata.model.loader import ModelFiles
    from strata.quant.online import quantize_weight
    from strata.quant.packed import dequantize
    from strata.runtime.generate import Engine
    from tests.tiny_models import build

    base, twin = tmp_path_factory.mktemp(case), tmp_path_factory.mktemp(case + "-q8_0")
    build(case, base, tie_word_embeddings=False, num_hidden_layers=3)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (twin / f.name).write_bytes(f.read_bytes())
    matrix = lambda k: k.endswith("_proj.weight") or k == "lm_head.weight"  # noqa: E731 (what --quantization takes)
    save_file({k: dequantize(quantize_weight(v.float(), "q8_0", torch.float32)).to(v.dtype).contiguous()
               if matrix(k) else v for k, v in load_file(base / "model.safetensors").items()}, twin / "model.safetensors")
    engine = Engine(ModelFiles.open(base, "q8_0"), dtype=torch.float32, kernels="torch", max_cells=64)
    ref = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    return engine, ref


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return quantized_twins(tmp_path_factory, "qwen3-dense")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return quantized_twins(tmp_path_factory, "qwen3_moe-gqa4")


def transformers_check(engine, ref, steps: int = 6):
    """Greedy decode steps (decode rows) after a prompt: logits within 1e-4 of transformers', the same tokens."""
    from tests.tiny_models import VOCAB

    prompt = [(i * 37 + 11) % VOCAB for i in range(9)]
    state = engine.new_state()
    logits = engine.run(state, prompt)
    ids, got = list(prompt), []
    for _ in range(steps):
        ids.append(int(logits[-1].argmax()))
        logits = engine.run(state, ids[-1:])
        got.append(logits[-1])
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids])).logits[0, len(prompt):].float()
    got = torch.stack(got)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def batched_and_solo(engine):
    """One decode window's logits over five slots, and each slot's alone: bitwise equal."""
    from tests.slot_helpers import decode_logits
    from tests.tiny_models import VOCAB

    prompts = {i: [(i * 29 + j * 13 + 5) % VOCAB for j in range(4 + 3 * i)] for i in range(5)}
    together = decode_logits(engine.init_slots(5), prompts)
    for i, p in prompts.items():
        alone = decode_logits(engine.init_slots(1), {0: p})
        assert torch.equal(together[i], alone[0]), i
    return prompts, together


@pytest.mark.skipif(not cpu_packed.available(), reason=f"no CPU packed kernel here: {cpu_packed.why()}")
def test_a_whole_stage_in_one_call_is_transformers_and_each_row_its_own(qwen3):
    from tests.slot_helpers import decode_logits

    engine, ref = qwen3
    forward = engine.stages[0].forward
    assert forward.host_stage is not None  # every matrix packed for the CPU's kernel, q/k norms in the stage
    transformers_check(engine, ref)
    prompts, together = batched_and_solo(engine)
    stage, forward.host_stage = forward.host_stage, None  # the per-layer path: the same steps, torch's silu
    try:
        per_layer = decode_logits(engine.init_slots(5), prompts)
    finally:
        forward.host_stage = stage
    assert torch.allclose(together, per_layer, atol=1e-5, rtol=0)
    assert torch.equal(together.argmax(-1), per_layer.argmax(-1))


def test_the_cell_table_is_the_same_read_from_the_pool_or_from_each_sequence(qwen3):
    """`cell_table`: a window whose sequences share a pool reads the addresses from it; one whose sequences do not
    (or a window told so) from each sequence's own cells: the same addresses."""
    import dataclasses

    from strata.runtime.window import Window
    from strata.state.session import SessionState, StatePool

    engine = qwen3[0]
    spec = engine.spec
    pool = StatePool(spec, range(spec.num_layers), 3, 16, torch.device("cpu"), torch.float32)
    states = [SessionState(pool, i) for i in (2, 0)]
    window = Window.build([(s, [1], True) for s in states], torch.device("cpu"))
    layers = spec.attention_layers()
    head_cells = spec.attention.num_kv_heads * spec.attention.head_dim
    shared = cpu_decode.cell_table(window, layers, head_cells)
    assert window.pool is pool and shared.shape == (len(layers), 2, 2)
    each = cpu_decode.cell_table(dataclasses.replace(window, pool=None), layers, head_cells)
    assert torch.equal(shared, each)
    assert int(shared[1, 1, 0]) == pool.v[layers[1]][2].data_ptr()
    half = StatePool(spec, range(spec.num_layers), 1, 16, torch.device("cpu"), torch.bfloat16)
    mixed = Window.build([(states[0], [1], True), (SessionState(half, 0), [1], True)], torch.device("cpu"))
    assert cpu_decode.cell_table(mixed, layers, head_cells) is None  # bfloat16 cells: torch's ops


@pytest.mark.skipif(not cpu_packed.available(), reason=f"no CPU packed kernel here: {cpu_packed.why()}")
def test_a_moe_stage_in_one_call_is_transformers_and_each_row_its_own(qwen3_moe, monkeypatch):
    """A Qwen3-MoE stage's decode rows in one call (`Stage`: routing and each layer's routed experts in C too)
    against transformers over the same quantized values and batched == solo bitwise; then layer by layer, the routed
    experts one call a layer (`cpu_decode.experts`), and torch's loop over the experts: the same tokens, the logits
    to float32 rounding (each row's pairs are summed in its choices' order in C, by expert in torch's loop)."""
    from tests.slot_helpers import decode_logits

    engine, ref = qwen3_moe
    forward = engine.stages[0].forward
    assert forward.host_stage is not None
    transformers_check(engine, ref)
    prompts, together = batched_and_solo(engine)
    calls = []
    experts = cpu_decode.experts
    monkeypatch.setattr(cpu_decode, "experts", lambda *a: calls.append(a[0].shape[0]) or experts(*a))
    monkeypatch.setattr(forward, "host_stage", None)
    per_layer = decode_logits(engine.init_slots(5), prompts)
    assert calls and set(calls) == {5}  # each MoE layer of the decode window, its five rows in one call
    monkeypatch.setattr(cpu_decode, "takes_experts", lambda *a: False)
    looped = decode_logits(engine.init_slots(5), prompts)
    for other in (per_layer, looped):
        assert torch.allclose(together, other, atol=1e-5, rtol=0)
        assert torch.equal(together.argmax(-1), other.argmax(-1))


def test_experts_skip_ids_not_held_and_sum_each_rows_choices():
    """`experts` against the per-pair sum written out: an id past E adds nothing; a row alone is bitwise itself."""
    import gguf

    from strata.kernels.elementwise import silu_mul
    from strata.quant import gguf_blocks
    from strata.quant.packed import dequantize

    torch.manual_seed(5)
    e, h, i = 4, 64, 32

    def stack(n, k):
        q = gguf.GGMLQuantizationType.Q8_0
        w = gguf_blocks.from_gguf(gguf_blocks.quantize(torch.randn(e * n, k) * 0.1, q), q, (e * n, k))
        w.host_kernel = True
        return w.reshape_rows(e, n)

    gate_up, down = stack(2 * i, h), stack(h, i)
    x = torch.randn(3, h)
    ids = torch.tensor([[2, 0], [1, 9], [2, 2]])  # 9: not held here
    weights = torch.rand(3, 2)
    out = cpu_decode.experts(x, weights, ids, gate_up, down)
    gu, dn = dequantize(gate_up), dequantize(down)
    want = torch.zeros(3, h, dtype=torch.float64)
    for r in range(3):
        for j in range(2):
            if ids[r, j] < e:
                y = silu_mul((x[r:r + 1].double() @ gu[ids[r, j]].double().T)) @ dn[ids[r, j]].double().T
                want[r] += weights[r, j].double() * y[0]
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=0)
    for r in range(3):
        assert torch.equal(cpu_decode.experts(x[r:r + 1], weights[r:r + 1], ids[r:r + 1], gate_up, down)[0], out[r])
