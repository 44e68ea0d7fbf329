"""Quantized weights kept packed by a whole engine (Triton kernels, under the interpreter): tiny Llama and Qwen3-MoE
GGUF files whose matrices are Q8_0 / Q4_K / Q5_K / Q6_K / IQ3_S (each format in several roles, q/k rows permuted as
llama.cpp's converter permutes Llama's), and a tiny FP8 block-scaled checkpoint.

A packed run gives the logits of `transformers` over gguf's own dequantization of the very bytes written (and so
does the torch path, which dequantizes at load), those of the same engine with `dequantize_weights` (float32: bit
for bit where a tile dequantizes in float32 and rounds to float32, which changes nothing; to float32 rounding where
the K-quants' decode products apply their scales after the sum), keeps the matrices packed
(`PackedWeight`) where the stored type allows and says so in its load's log line, and holds fewer bytes."""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from strata.model.loader import ModelFiles  # noqa: E402
from strata.quant.gguf_blocks import quantize  # noqa: E402
from strata.quant.packed import PackedWeight  # noqa: E402
from strata.runtime.generate import Engine  # noqa: E402
from tests.test_gguf import hybrid_pair  # noqa: E402, F401 (a fixture)
from tests.test_quantization import write_fp8  # noqa: E402
from tests.tiny_models import VOCAB, build  # noqa: E402

T = gguf.GGMLQuantizationType
F32, Q8_0, Q4_K, Q5_K, Q6_K, IQ3_S = T.F32, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ3_S
FMT = {Q8_0: "q8_0", Q4_K: "q4_k", Q5_K: "q5_k", Q6_K: "q6_k", IQ3_S: "iq3_s"}

PROMPT = [(i * 37 + 11) % VOCAB for i in range(10)]
STEPS = 2  # greedy decode steps after the prompt (each a decode window of packed kernels: slow under the interpreter)
MAX_CELLS = 64

# every matrix's K a multiple of 256 (K-quants): hidden, intermediate, heads * head_dim
SIZES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2)
CASES = {
    "llama": ("llama-mha-untied", SIZES),
    "qwen3moe": ("qwen3_moe-gqa4", dict(SIZES, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)),
}
ARCH = {"llama": "llama", "qwen3moe": "qwen3moe"}  # case -> GGUF arch
# GGUF tensor -> its type in layer 0 and layer 1 (every format in several roles); top-level tensors: one type
TYPES = {
    "llama": {
        "attn_q": (Q8_0, Q4_K), "attn_k": (Q8_0, Q4_K), "attn_v": (Q8_0, Q4_K), "attn_output": (Q5_K, IQ3_S),
        "ffn_gate": (Q4_K, Q5_K), "ffn_up": (Q4_K, Q5_K), "ffn_down": (Q6_K, Q8_0),
        "attn_norm": (F32, F32), "ffn_norm": (F32, F32),
        "token_embd": Q8_0, "output": Q6_K, "output_norm": F32,
    },
    "qwen3moe": {
        # layer 0's fused qkv mixes Q4_K and Q6_K: dequantized at load; layer 1's is one type: packed
        "attn_q": (Q4_K, Q5_K), "attn_k": (Q4_K, Q5_K), "attn_v": (Q6_K, Q5_K), "attn_output": (Q8_0, IQ3_S),
        # layer 0's experts in llama.cpp's Q4_K_M layout (gate and up Q4_K, down Q6_K: two formats in one experts
        # kernel); layer 1's gate and up Q5_K, down Q4_K
        "ffn_gate_exps": (Q4_K, Q5_K), "ffn_up_exps": (Q4_K, Q5_K), "ffn_down_exps": (Q6_K, Q4_K),
        "ffn_gate_inp": (F32, F32), "attn_q_norm": (F32, F32), "attn_k_norm": (F32, F32),
        "attn_norm": (F32, F32), "ffn_norm": (F32, F32),
        "token_embd": Q8_0, "output": Q4_K, "output_norm": F32,
    },
}
# GGUF block tensor -> transformers name (in layer i)
HF_NAMES = {
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight", "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight", "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj",
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
}
TOP_NAMES = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight", "output_norm": "model.norm.weight"}
# neutral StageWeights keys -> the GGUF tensors fused into them
NEUTRAL = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
           "down": ("ffn_down",), "experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"),
           "experts_down": ("ffn_down_exps",)}


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved in pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The permutation's inverse, found from where each row went (independent of Strata's `_unpermute_rows`)."""
    went = permute_like_llama_cpp(np.arange(w.shape[0]), n_head)  # stored row j is original row went[j]
    out = np.empty_like(w)
    out[went] = w
    return out


def gguf_tensors(model, case: str, types: dict | None = None) -> dict[str, tuple[np.ndarray, T]]:
    """GGUF name -> (float32 array as the converter writes it, the type to store it in: `types`, TYPES[case]'s
    layout, by default TYPES[case])."""
    cfg, state = model.config, model.state_dict()
    types, arch = types or TYPES[case], ARCH[case]
    out = {}
    for part, hf in TOP_NAMES.items():
        out[f"{part}.weight"] = (state[hf].float().numpy(), types[part])
    for i in range(cfg.num_hidden_layers):
        for part, per_layer in types.items():
            if part in TOP_NAMES:
                continue
            qtype, name = per_layer[i], f"blk.{i}.{part}.weight"
            if part in ("ffn_gate_exps", "ffn_up_exps"):  # transformers fuses them: [E, 2I, H] = [gate | up]
                gate, up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].float().chunk(2, dim=1)
                w = (gate if part == "ffn_gate_exps" else up).contiguous().numpy()
            else:
                w = state[f"model.layers.{i}.{HF_NAMES[part]}"].float().numpy()
            if arch == "llama" and part in ("attn_q", "attn_k"):
                w = permute_like_llama_cpp(w, cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads)
            out[name] = (np.ascontiguousarray(w), qtype)
    return out


def write_gguf(path, arch: str, cfg, tensors: dict[str, tuple[np.ndarray, T]]) -> dict[str, np.ndarray]:
    """Write the file (metadata as llama.cpp's converter writes it, a byte-level vocabulary); returns each tensor's
    values as gguf's own dequantizer reads its bytes back."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    tokens = [chr(0x21 + i) for i in range(94)] + [chr(0x100 + i) for i in range(cfg.vocab_size - 94)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    stored = {}
    for name, (array, qtype) in tensors.items():
        if qtype == F32:
            writer.add_tensor(name, array)
            stored[name] = array
        else:
            raw = quantize(torch.from_numpy(array), qtype).numpy()
            writer.add_tensor(name, raw, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(raw, qtype).reshape(array.shape)
            assert not np.array_equal(stored[name], array), name  # the rounding is real
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def reference_state(model, case: str, stored: dict[str, np.ndarray], types: dict | None = None) -> dict[str, torch.Tensor]:
    """The transformers state dict holding the file's dequantized values (q/k rows back in transformers' order)."""
    cfg, arch = model.config, ARCH[case]
    state = {hf: torch.from_numpy(stored[f"{part}.weight"]) for part, hf in TOP_NAMES.items()}
    for i in range(cfg.num_hidden_layers):
        for part in types or TYPES[case]:
            if part in TOP_NAMES or part in ("ffn_gate_exps", "ffn_up_exps"):
                continue
            w = stored[f"blk.{i}.{part}.weight"]
            if arch == "llama" and part in ("attn_q", "attn_k"):
                w = unpermute(w, cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads)
            state[f"model.layers.{i}.{HF_NAMES[part]}"] = torch.from_numpy(np.ascontiguousarray(w))
        if arch == "qwen3moe":
            state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
                [torch.from_numpy(stored[f"blk.{i}.ffn_{x}_exps.weight"]) for x in ("gate", "up")], dim=1)
    return state


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def make_engine(path, **kwargs) -> tuple[Engine, list[str]]:
    """An engine on `path` and the lines its load logged (`strata.engine`)."""
    logger, handler = logging.getLogger("strata.engine"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        engine = Engine(ModelFiles.open(path), dtype=torch.float32, max_cells=MAX_CELLS, **kwargs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return engine, handler.lines


def decode(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Logits [len(PROMPT) + STEPS, V]: every prompt position (one prompt window), then a decode window a token of
    `tokens`."""
    state = engine.new_state()
    rows = [engine.run(state, PROMPT, all_logits=True)]
    rows += [engine.run(state, [token]) for token in tokens]
    return torch.cat(rows)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# case -> what a fixture built for it: a test that picks its case (`indirect`) may run after pytest has torn the
# module's fixture for that case down, and must not build the model, engines and logits again
_BUILT: dict[tuple[str, str], object] = {}


def _once(what: str, case: str, make):
    if (what, case) not in _BUILT:
        _BUILT[(what, case)] = make()
    return _BUILT[(what, case)]


@pytest.fixture(scope="module", params=list(CASES))
def gguf_model(request, tmp_path_factory):
    """(case, the GGUF file, the transformers reference over its dequantized bytes, the tensors' float values)."""
    case = request.param

    def make():
        name, overrides = CASES[case]
        folder = tmp_path_factory.mktemp(case)
        model = build(name, folder / "hf", **overrides)
        torch.manual_seed(1)
        with torch.no_grad():  # norms that matter (the tiny models' are all ones)
            for name, param in model.state_dict().items():
                if name.endswith("norm.weight"):
                    param.add_(0.2 * torch.randn_like(param))
        tensors = gguf_tensors(model, case)
        path = folder / f"{case}.gguf"
        stored = write_gguf(path, ARCH[case], model.config, tensors)
        with torch.no_grad():
            missing, unexpected = model.load_state_dict(reference_state(model, case, stored), strict=True)
        assert not missing and not unexpected
        return case, path, model.eval(), tensors

    return _once("model", case, make)


@pytest.fixture(scope="module")
def reference(gguf_model):
    """transformers' greedy tokens (STEPS of them) and its logits at every position of the prompt and those."""
    def make():
        ref = gguf_model[2]
        ids = list(PROMPT)
        with torch.no_grad():
            for _ in range(STEPS):
                ids.append(int(ref(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            logits = ref(input_ids=torch.tensor([ids])).logits[0].float()
        return ids[len(PROMPT):], logits

    return _once("reference", gguf_model[0], make)


@pytest.fixture(scope="module")
def engines(gguf_model):
    """The packed engine and the one with dequantize_weights, each with the lines its load logged."""
    path = gguf_model[1]
    return _once("engines", gguf_model[0], lambda: (make_engine(path, kernels="triton"),
                                                    make_engine(path, kernels="triton", dequantize_weights=True)))


@pytest.fixture(scope="module")
def packed_logits(engines, reference, gguf_model):
    return _once("packed_logits", gguf_model[0], lambda: decode(engines[0][0], reference[0]))


def test_packed_engine_gives_the_float_reference(packed_logits, reference):
    """transformers over gguf's dequantization of the bytes: the logits at every prompt position and decode step,
    and so its greedy tokens."""
    tokens, want = reference
    got = packed_logits
    assert got.shape == want.shape == (len(PROMPT) + STEPS, VOCAB)
    assert rel_err(got, want) < 1e-4
    assert got[len(PROMPT) - 1:-1].argmax(-1).tolist() == tokens


def test_packed_is_bitwise_the_dequantized_engine(packed_logits, engines, reference):
    """The prompt window bit for bit (its weights written out by dequantize_triton); the decode windows, whose
    K-quant products take the integer codes and apply each group's scale after the sum (`packed_mm`), to float32
    rounding (the other formats' tiles are dequantized inside the kernels, bitwise as at load)."""
    plain = decode(engines[1][0], reference[0])
    got, n = packed_logits, len(PROMPT)
    assert torch.equal(got[:n], plain[:n])
    for step in range(STEPS):
        assert rel_err(got[n + step], plain[n + step]) < 1e-5, step
        assert got[n + step].argmax() == plain[n + step].argmax()


def test_torch_kernels_give_the_float_reference(gguf_model, reference):
    """The torch kernels on the CPU keep packed what the CPU's own kernel reads (`strata.kernels.cpu_packed`, where
    it can run; tests/test_cpu_packed_engine.py) and dequantize the rest at load: the same reference."""
    from strata.kernels import cpu_packed

    engine, log = make_engine(gguf_model[1], kernels="torch")
    for layer in engine.weights.layers.values():
        for w in layer.values():
            assert isinstance(w, torch.Tensor) or (w.host_kernel and w.fmt in cpu_packed.FORMATS), w
    tokens, want = reference
    assert rel_err(decode(engine, tokens), want) < 1e-4


def _expected(case: str, layer: int, key: str):
    """The packed format a neutral weight must have (None: a plain tensor, its parts' types differ)."""
    kinds = {TYPES[case][part][layer] for part in NEUTRAL[key]}
    return FMT[kinds.pop()] if len(kinds) == 1 else None


def test_quantized_matrices_stay_packed(gguf_model, engines):
    case, path, _, tensors = gguf_model
    (packed, _), (plain, _) = engines
    packed, plain = packed.weights, plain.weights
    checked = 0
    for i, layer in packed.layers.items():
        for key, w in layer.items():
            if key not in NEUTRAL:
                assert isinstance(w, torch.Tensor), (i, key)  # norms, router
                continue
            fmt = _expected(case, i, key)
            if fmt is None:
                assert isinstance(w, torch.Tensor) and w.dtype == torch.float32, (i, key)
            else:
                assert isinstance(w, PackedWeight) and w.fmt == fmt, (i, key, w)
                assert w.dtype == torch.float32  # tiles rounded to the engine's dtype
            assert tuple(w.shape) == tuple(plain.layers[i][key].shape), (i, key)
            checked += 1
    assert checked == 4 * len(packed.layers)  # qkv, o and the two MLP matrices
    if case == "llama":  # spelled out: Q/K rows reordered in the packed form, a Q5_K o, a Q8_0 down
        assert isinstance(packed.layers[0]["o"], PackedWeight) and packed.layers[0]["o"].fmt == "q5_k"
        assert packed.layers[0]["qkv"].fmt == "q8_0" and packed.layers[1]["down"].fmt == "q8_0"
    elif case == "qwen3moe":  # Q4_K q, k beside a Q6_K v: dequantized; experts [E, N, K] packed
        assert isinstance(packed.layers[0]["qkv"], torch.Tensor) and packed.layers[1]["qkv"].fmt == "q5_k"
        assert packed.layers[0]["experts_gate_up"].fmt == "q4_k" and packed.layers[0]["experts_down"].fmt == "q6_k"
        assert packed.layers[1]["experts_gate_up"].fmt == "q5_k" and packed.layers[1]["experts_down"].fmt == "q4_k"
        assert packed.layers[0]["experts_gate_up"].shape == (4, 512, 256)
    head_fmt = FMT[TYPES[case]["output"]]
    assert isinstance(packed.lm_head, PackedWeight) and packed.lm_head.fmt == head_fmt
    # the embedding is always read dequantized (a row lookup)
    assert isinstance(packed.embed, torch.Tensor) and packed.embed.dtype == torch.float32
    embed = tensors["token_embd.weight"][0]
    assert torch.equal(packed.embed, torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(embed, Q8_0), Q8_0)))
    # with dequantize_weights nothing is packed
    for i, layer in plain.layers.items():
        for key, w in layer.items():
            assert isinstance(w, torch.Tensor) and w.dtype == torch.float32, (i, key)
    assert isinstance(plain.lm_head, torch.Tensor)


def test_load_summary_line(gguf_model, engines):
    """The packed engine's load says how many matrices of each stored type stayed packed, and how many were
    dequantized (a fused weight whose parts differ in type); the dequantized engine's says nothing."""
    case, _, _, _ = gguf_model
    kept, mixed = {}, 0
    for layer in range(SIZES["num_hidden_layers"]):
        for key, parts in NEUTRAL.items():
            if not all(p in TYPES[case] for p in parts):
                continue
            kinds = [TYPES[case][p][layer] for p in parts]
            if _expected(case, layer, key) is None:
                mixed += len(kinds)
            else:
                for k in kinds:
                    kept[k.name] = kept.get(k.name, 0) + 1
    head = TYPES[case]["output"].name
    kept[head] = kept.get(head, 0) + 1
    say_kept = ", ".join(f"{n} {k}" for k, n in sorted(kept.items()))
    say_dequantized = f"{mixed} mixed types" if mixed else "none"
    want = f"weights kept quantized on the device: {say_kept}; dequantized at load: {say_dequantized}"
    (_, packed_log), (_, plain_log) = engines
    assert [line for line in packed_log if line.startswith("weights kept")] == [want]
    assert not [line for line in plain_log if line.startswith("weights kept")]


def test_packed_weights_take_fewer_bytes(gguf_model, engines):
    packed, plain = (engine.weights.nbytes() for engine, _ in engines)
    # float32 matrices are 4 bytes a value, the packed ones about 0.6 to 1.1
    assert packed < 0.5 * plain, (packed, plain)
    # autoconfig counts what each engine holds: packed (a GPU's Triton kernels) or dequantized, float32 here
    from autoconfig.facts import read_model

    for held, kept in [(packed, True), (plain, False)]:
        facts = read_model(gguf_model[1], bytes_per_param=4, packed=kept)
        counted = sum(facts.dense_bytes) + sum(facts.expert_bytes) + facts.embed_bytes + facts.head_bytes
        assert counted == held, (kept, counted, held)


# FP8 blocks of 128 x 128: every matrix's K a multiple of 128 (the packed fp8 form's scale group)
FP8_SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_hidden_layers=2)


@pytest.fixture(scope="module")
def fp8_engines(tmp_path_factory):
    """The packed and the dequantized engine on a tiny FP8 checkpoint, their load logs, and transformers over its
    dequantized weights."""
    folder = tmp_path_factory.mktemp("fp8")
    ref = build("llama-gqa-tied", folder, **FP8_SIZES)
    dequantized = write_fp8(folder, (128, 128))
    with torch.no_grad():
        missing, unexpected = ref.load_state_dict(dequantized, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: the head is the embedding
    packed, packed_log = make_engine(folder, kernels="triton")
    plain, plain_log = make_engine(folder, kernels="triton", dequantize_weights=True)
    return packed, plain, packed_log, plain_log, ref.eval(), folder


def test_fp8_packed_is_bitwise_the_dequantized_engine(fp8_engines):
    packed, plain, packed_log, plain_log, ref, folder = fp8_engines
    tokens = [int(t) for t in torch.randint(0, VOCAB, (STEPS,), generator=torch.Generator().manual_seed(0))]
    got, want = decode(packed, tokens), decode(plain, tokens)
    assert got.abs().max() > 0 and torch.equal(got, want)
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    assert rel_err(got, theirs) < 1e-4
    for i, layer in packed.weights.layers.items():
        for key in ("qkv", "o", "gate_up", "down"):
            w = layer[key]
            assert isinstance(w, PackedWeight) and w.fmt == "fp8", (i, key, w)
            assert isinstance(plain.weights.layers[i][key], torch.Tensor)
    # tied head: the embedding (FP8 checkpoints keep it in float)
    assert packed.weights.lm_head is packed.weights.embed and isinstance(packed.weights.embed, torch.Tensor)
    assert [line for line in packed_log if line.startswith("weights kept")] == [
        f"weights kept quantized on the device: {7 * FP8_SIZES['num_hidden_layers']} float8_e4m3fn; "
        "dequantized at load: none"]
    assert not [line for line in plain_log if line.startswith("weights kept")]
    assert packed.weights.nbytes() < plain.weights.nbytes()
    from autoconfig.facts import read_model

    for engine, kept in [(packed, True), (plain, False)]:  # autoconfig counts what each engine holds
        facts = read_model(folder, bytes_per_param=4, packed=kept)
        counted = sum(facts.dense_bytes) + sum(facts.expert_bytes) + facts.embed_bytes + facts.head_bytes
        assert counted == engine.weights.nbytes() + (facts.embed_bytes if facts.tie_embeddings else 0), kept


def test_a_hybrid_gguf_keeps_its_gated_deltanet_projections_packed(hybrid_pair):
    """Qwen3-Next / Qwen3.5 GGUF files whose layer-0 Gated DeltaNet projections are Q8_0, stored split and regrouped
    by llama.cpp's converter (`tests.test_gguf`): the engine keeps that layer's fused in_proj packed and gives the
    logits of the same engine with dequantize_weights, bit for bit (Q8_0 tiles dequantize exactly in float32)."""
    _, path, _, _, _ = hybrid_pair
    (packed, log), (plain, _) = make_engine(path, kernels="triton"), make_engine(path, kernels="triton",
                                                                                dequantize_weights=True)
    in_proj = packed.weights.layers[0]["in_proj"]
    assert isinstance(in_proj, PackedWeight) and in_proj.fmt == "q8_0"
    assert isinstance(plain.weights.layers[0]["in_proj"], torch.Tensor)
    kept = 3 if path.name == "qwen3_next.gguf" else 5  # qkvz, ba (qkv, z, b, a) and layer 1's experts' down
    assert any(line.startswith(f"weights kept quantized on the device: {kept} Q8_0;") for line in log), log
    tokens = [3, 4]
    got, want = decode(packed, tokens), decode(plain, tokens)
    assert got.abs().max() > 0 and torch.equal(got, want)


def test_a_qwen35_gguf_keeps_its_column_tiled_out_proj_packed(tmp_path):
    """Qwen3.5's converter tiles the value heads of `out_proj`'s columns, which a packed row cannot take back: the
    weight stays packed in the file's column order and the heads of its input are put in that order first
    (`out_heads`); the engine's logits are those of the same engine with dequantize_weights to float32 rounding
    (the product sums the columns in the file's order), on the prompt window and the decode windows, and its greedy
    tokens the same. (Value heads of 16 so that out_proj's 64 columns are whole Q8_0 blocks.)"""
    from tests.test_gguf import HYBRID_GGUF, convert_like_llama_cpp, write_hybrid_gguf

    model = build("qwen3_5_moe", tmp_path / "hf", linear_value_head_dim=16)
    cfg = model.config.get_text_config().to_dict()
    state = {k: v for k, v in model.state_dict().items() if "visual" not in k}
    tensors = convert_like_llama_cpp(state, cfg, HYBRID_GGUF["qwen3_5_moe"])
    path = tmp_path / "qwen35.gguf"
    write_hybrid_gguf(path, HYBRID_GGUF["qwen3_5_moe"], cfg, tensors, also_quantized=("blk.0.ssm_out.weight",))
    (packed, _), (plain, _) = make_engine(path, kernels="triton"), make_engine(path, kernels="triton",
                                                                              dequantize_weights=True)
    layer = packed.weights.layers[0]
    assert isinstance(layer["out"], PackedWeight) and layer["out"].fmt == "q8_0"
    assert sorted(layer["out_heads"].tolist()) == [0, 1, 2, 3] and layer["out_heads"].tolist() != [0, 1, 2, 3]
    assert isinstance(plain.weights.layers[0]["out"], torch.Tensor) and "out_heads" not in plain.weights.layers[0]
    tokens = [3, 4]
    got, want = decode(packed, tokens), decode(plain, tokens)
    assert got.abs().max() > 0 and rel_err(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch_engine, _ = make_engine(path, kernels="torch")  # the torch path reads it dequantized, in order: the same
    assert rel_err(decode(torch_engine, tokens), want) < 1e-5
    from autoconfig.facts import read_model

    facts = read_model(path, bytes_per_param=4, packed=True)  # autoconfig counts it at its packed size
    counted = sum(facts.dense_bytes) + sum(facts.expert_bytes) + facts.embed_bytes + facts.head_bytes
    heads = sum(layer["out_heads"].numel() * 8 for layer in packed.weights.layers.values() if "out_heads" in layer)
    assert counted + heads == packed.weights.nbytes() + (facts.embed_bytes if facts.tie_embeddings else 0)


@pytest.mark.parametrize("gguf_model", ["qwen3moe"], indirect=True)
def test_experts_split_with_the_pool_stay_packed(gguf_model, engines, packed_logits, reference):
    """Half the experts resident (`--expert-budget-gb`): the device's stay packed, the pool's q4_k experts stay
    4-bit (`strata.experts.pool.Int4Expert`: layer 0's gate and up, layer 1's down), the others (q6_k, q5_k) are
    written out for it; the logits are the all-resident packed engine's to the pool's float32 rounding (its row
    invariance: tests/test_experts.py)."""
    from strata.experts.pool import Int4Expert
    from tests.test_experts import half

    case, path = gguf_model[0], gguf_model[1]
    whole = engines[0][0]
    split, _ = make_engine(path, kernels="triton", expert_budget_gb=[half(whole.spec)])
    for i, layer in split.weights.layers.items():
        assert isinstance(layer["experts_gate_up"], PackedWeight) and layer["experts_gate_up"].shape[0] == 2
        pool = split.stages[0].forward.pools[i]
        gate_up_fmt = whole.weights.layers[i]["experts_gate_up"].fmt
        down_fmt = whole.weights.layers[i]["experts_down"].fmt
        assert (gate_up_fmt, down_fmt) == (("q4_k", "q6_k"), ("q5_k", "q4_k"))[i]
        assert isinstance(pool.gate_up[0], Int4Expert) == (gate_up_fmt == "q4_k"), (case, i)
        assert isinstance(pool.down[0], Int4Expert) == (down_fmt == "q4_k"), (case, i)
    got, want = decode(split, reference[0]), packed_logits
    assert rel_err(got, want) < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert sum(p.pairs_here for p in split.stages[0].forward.pools.values()) > 0  # the pool did compute pairs


def test_packed_plan_and_the_compile_workers_weights(gguf_model, engines):
    """`ModelFiles.packed_plan` (a dry load on the meta device) says what the load keeps packed; the compile
    workers cut the model to one layer of each kind and set of formats and pack their random weights so."""
    from strata.model.random_weights import random_stage_weights
    from strata.runtime.precompile import Job, _packed_as, kind_layers

    packed = engines[0][0]
    files = ModelFiles.open(gguf_model[1])
    plan, head = files.packed_plan(torch.float32)
    held = {i: {k: w.fmt for k, w in layer.items() if isinstance(w, PackedWeight)}
            for i, layer in packed.weights.layers.items()}
    assert plan == held and any(plan.values())
    assert head == (packed.weights.lm_head.fmt if isinstance(packed.weights.lm_head, PackedWeight) else None)
    spec = files.spec
    keep = kind_layers(spec, plan)
    assert keep == [0, 1] and kind_layers(spec) == [0]  # the two layers differ in formats, not in kind
    from dataclasses import replace

    cut = replace(spec, layers=tuple(spec.layers[i] for i in keep))
    formats = tuple(tuple(sorted(plan[i].items())) for i in keep)
    job = Job(spec, "cpu", torch.float32, 16, 4, 1, 0, layers=tuple(keep), formats=formats, head_format=head)
    weights = _packed_as(random_stage_weights(cut, range(len(keep)), torch.device("cpu"), torch.float32), job)
    got = {j: {k: w.fmt for k, w in layer.items() if isinstance(w, PackedWeight)} for j, layer in weights.layers.items()}
    assert got == {j: plan[i] for j, i in enumerate(keep)}


def test_compile_workers_fit_beside_the_packed_size(gguf_model, monkeypatch):
    """The room left for compile workers is the GPU's free memory less the model as the engine will hold it: a
    quantized model at its packed size (`read_model(packed=True)`), not at bfloat16's. Sizing only: the GPU's
    free memory is given and the workers are not started."""
    from autoconfig.facts import read_model
    from strata.runtime import precompile

    spec = ModelFiles.open(gguf_model[1]).spec
    packed = read_model(gguf_model[1], bytes_per_param=2, packed=True).weight_bytes
    assert read_model(ModelFiles.open(gguf_model[1]), bytes_per_param=2, packed=True).weight_bytes == packed  # as cli
    plain = read_model(gguf_model[1], bytes_per_param=2).weight_bytes
    each = precompile.worker_bytes(spec, 1, 16, torch.bfloat16)
    free = plain + 3 * each  # (90 % of the room is used) at least two workers beside the packed model
    started = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(precompile, "usable_cores", lambda: 16)
    monkeypatch.setattr(precompile, "CompileWorkers", lambda job, count: started.append(count) or count)
    kw = dict(device=torch.device("cuda"), dtype=torch.bfloat16, kernels="triton", max_cells=16, max_window_tokens=4,
              num_slots=1, lookahead=0, single_stage=True)
    assert packed < plain
    assert precompile.start_compile_workers(spec, **kw, model_bytes=packed) == started[-1] >= 2
    assert precompile.start_compile_workers(spec, **kw, model_bytes=plain + each) is None  # one only: none
    assert len(started) == 1
