"""A lazy reader for GGUF checkpoints: metadata at open, one tensor at a time on demand.

Names, shapes and the config follow transformers' conventions, so a model built for an HF
checkpoint loads a GGUF one unchanged:

    ckpt = GGUFCheckpoint(path)
    ckpt.config["num_hidden_layers"], ckpt.shape("model.layers.0.self_attn.q_proj.weight")
    weight = ckpt.load("model.layers.0.self_attn.q_proj.weight")  # float32, dequantized

The header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy view per array
element and takes 1.5 s on the 49k-token vocabulary of a 135M model; `gguf` still provides the
type tables and the dequantization.
"""

import mmap
import re
import struct
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from strata.errors import CheckpointError
from strata.model.tokenizer import Tokenizer as StrataTokenizer

# GGUF architecture -> (transformers model_type, architectures entry)
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# llama.cpp stores the Q/K rows of these interleaved in pairs, for its rotary kernel
_PERMUTED_QK = {"llama"}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# stacked experts [E, out, in]: named like transformers' fused expert parameters, without a suffix
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# `tokenizer.ggml.pre` -> the split llama.cpp applies before byte-level BPE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
# these split every digit apart, then apply GPT-2's split
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_REQUIRED = object()
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class _TensorInfo(NamedTuple):
    gguf_name: str
    shape: tuple[int, ...]  # torch order: GGUF lists the fastest dimension first
    qtype: GGMLQuantizationType
    start: int  # absolute offset in the file
    nbytes: int


class _HeaderParser:
    """Walks the metadata and tensor-info sections of a GGUF file, front to back."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        if self.pos + size > len(self.buf):
            raise EOFError("string runs past the end of the file")
        self.pos += size
        return bytes(self.buf[self.pos - size : self.pos]).decode("utf-8")

    def value(self, vtype: GGUFValueType):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        value = self.scalar(_SCALARS[vtype])
        # the shortest decimal that is the same float32: 1e-05, not 9.999999747378752e-06
        return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else value

    def array(self) -> list:
        vtype, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
        if vtype in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [self.value(vtype) for _ in range(count)]
        dtype = np.dtype(_SCALARS[vtype])
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return values.tolist()

    def metadata(self) -> tuple[dict, int]:
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start of the file")
        self.pos = 4
        version = self.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3 are)")
        num_tensors, num_kv = self.scalar("<Q"), self.scalar("<Q")
        meta = {}
        for _ in range(num_kv):
            key = self.string()
            meta[key] = self.value(GGUFValueType(self.scalar("<I")))
        return meta, num_tensors

    def tensor_infos(self, num_tensors: int, alignment: int) -> list[_TensorInfo]:
        raw = []
        for _ in range(num_tensors):
            name = self.string()
            dims = [self.scalar("<Q") for _ in range(self.scalar("<I"))]
            raw.append((name, dims, GGMLQuantizationType(self.scalar("<I")), self.scalar("<Q")))
        data_start = -(-self.pos // alignment) * alignment
        infos = []
        for name, dims, qtype, offset in raw:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = prod(dims) // block * type_size
            infos.append(_TensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset, nbytes))
        return infos


def _hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None for one transformers has no place for."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, suffix = match.groups()
    if part in _EXPERT_NAMES and suffix == "weight":
        return f"model.layers.{layer}.mlp.experts.{_EXPERT_NAMES[part]}"
    if part in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    return None


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (pairs interleaved) to transformers' (halves)."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """A GGUF file: config and tensor index read at open, tensor data read by `load`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._buf = self._map_file()
        try:
            parser = _HeaderParser(self._buf)
            self._meta, num_tensors = parser.metadata()
            infos = parser.tensor_infos(num_tensors, self._meta.get("general.alignment", 32))
        except (struct.error, EOFError) as e:
            size = len(self._buf)
            raise CheckpointError(f"{self.path}: truncated: the GGUF header runs past its end ({size} bytes)") from e
        except (ValueError, KeyError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._check_extents(infos)
        self.arch = self._architecture()
        gguf_names = {info.gguf_name for info in infos}
        self._tensors = {hf: info for info in infos if (hf := _hf_name(info.gguf_name)) is not None}
        self.config = self._build_config(gguf_names)

    def _map_file(self) -> mmap.mmap:
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such checkpoint file")
        if self.path.stat().st_size < 24:
            raise CheckpointError(f"{self.path}: not a GGUF file (only {self.path.stat().st_size} bytes)")
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _check_extents(self, infos: list[_TensorInfo]) -> None:
        """A tensor whose data is cut short fails here, at open, rather than midway through loading."""
        size = len(self._buf)
        for info in infos:
            if info.start + info.nbytes > size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {info.gguf_name!r} needs bytes up to "
                    f"{info.start + info.nbytes}, the file has {size}"
                )

    def _architecture(self) -> str:
        arch = self._meta.get("general.architecture")
        if arch not in _ARCHS:
            raise CheckpointError(
                f"{self.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHS))})"
            )
        return arch

    def _key(self, name: str, default=_REQUIRED):
        """Metadata `{arch}.{name}`; a missing key without a default is a malformed file."""
        key = f"{self.arch}.{name}"
        if key in self._meta:
            return self._meta[key]
        if default is _REQUIRED:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def _build_config(self, gguf_names: set[str]) -> dict:
        model_type, architecture = _ARCHS[self.arch]
        hidden, num_heads = self._key("embedding_length"), self._key("attention.head_count")
        vocab = self._key("vocab_size", None) or len(self._meta.get("tokenizer.ggml.tokens", ()))
        config = {
            "model_type": model_type,
            "architectures": [architecture],
            "hidden_size": hidden,
            "num_hidden_layers": self._key("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self._key("attention.head_count_kv", num_heads),
            "head_dim": self._key("attention.key_length", hidden // num_heads),
            "intermediate_size": self._key("feed_forward_length", None),
            "rms_norm_eps": self._key("attention.layer_norm_rms_epsilon"),
            "rope_parameters": self._rope(gguf_names),
            "vocab_size": vocab,
            "max_position_embeddings": self._key("context_length"),
            "tie_word_embeddings": "output.weight" not in gguf_names,
            "bos_token_id": self._meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._meta.get("tokenizer.ggml.padding_token_id"),
        }
        if self.arch == "qwen3moe":
            config |= {
                "num_experts": self._key("expert_count"),
                "num_experts_per_tok": self._key("expert_used_count"),
                "moe_intermediate_size": self._key("expert_feed_forward_length"),
                "norm_topk_prob": True,  # llama.cpp renormalizes the chosen experts' weights
            }
        return config

    def _rope(self, gguf_names: set[str]) -> dict:
        """The rotary embedding's parameters in config.json's form (`strata.model.rope_scaling`)."""
        rope = {"rope_type": "default", "rope_theta": self._key("rope.freq_base", 10000.0)}
        if "rope_freqs.weight" in gguf_names:
            raise CheckpointError(f"{self.path}: per-dimension rotary frequency factors (the rope_freqs tensor, "
                                  "llama.cpp's form of Llama 3.1 scaling) are not supported; use the model's "
                                  "safetensors checkpoint, whose config gives rope_type llama3")
        kind = self._key("rope.scaling.type", "none")
        if kind in ("none", ""):
            return rope
        if kind not in ("linear", "yarn"):
            raise CheckpointError(f"{self.path}: rope scaling type {kind!r} is not supported (linear, yarn are)")
        rope |= {"rope_type": kind, "factor": float(self._key("rope.scaling.factor"))}
        if kind == "yarn":
            rope["original_max_position_embeddings"] = int(self._key("rope.scaling.original_context_length"))
        return rope

    def names(self) -> list[str]:
        return list(self._tensors)

    def _info(self, name: str) -> _TensorInfo:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} (it has {len(self._tensors)} tensors)")
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        info = self._info(name)  # its extent was checked against the file size at open
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
        weight = dequantize(raw.reshape(*info.shape[:-1], -1), info.qtype).reshape(info.shape)
        if self.arch in _PERMUTED_QK and (part := info.gguf_name.split(".")[-2]) in ("attn_q", "attn_k"):
            key = "num_attention_heads" if part == "attn_q" else "num_key_value_heads"
            weight = _unpermute_rows(weight, self.config[key])
        if not weight.flags.writeable or not weight.flags.c_contiguous:
            weight = np.array(weight, order="C")  # F32 data is a view of the read-only map
        return torch.from_numpy(weight).to(dtype)

    def tokenizer(self) -> "StrataTokenizer":
        parts = self.tokenizer_parts()
        backend = parts["tokenizer"]
        token = lambda i: backend.id_to_token(i) if i is not None else None  # noqa: E731
        return StrataTokenizer(
            backend,
            chat_template=parts["chat_template"],
            bos_token=token(parts["bos_token_id"]),
            eos_token=token(parts["eos_token_id"]),
            add_bos_token=parts["add_bos_token"],
        )

    def tokenizer_parts(self) -> dict:
        meta = self._meta
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"{self.path}: tokenizer {model!r} is not supported (only 'gpt2', byte-level BPE)")
        tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
        tokenizer = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges", []))
        add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
        tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), add_prefix_space)
        tokenizer.decoder = decoders.ByteLevel()
        special = [tok for tok, kind in zip(tokens, types) if kind == _CONTROL]
        tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in special])
        user = [AddedToken(tok, normalized=False) for tok, kind in zip(tokens, types) if kind == _USER_DEFINED]
        tokenizer.add_tokens(user)
        return {
            "tokenizer": tokenizer,
            "chat_template": meta.get("tokenizer.chat_template"),
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "special_tokens": special,
        }


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    return Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))


def _pre_tokenizer(pre: str | None, add_prefix_space: bool):
    """The split llama.cpp uses for this `tokenizer.ggml.pre`; GPT-2's for any other."""
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
