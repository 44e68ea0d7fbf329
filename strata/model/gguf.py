"""A lazy reader for GGUF checkpoints: metadata at open, one tensor at a time on demand.

Names, shapes and the config follow transformers' conventions, so a model built for an HF
checkpoint loads a GGUF one unchanged:

    ckpt = GGUFCheckpoint(path)
    ckpt.config["num_hidden_layers"], ckpt.shape("model.layers.0.self_attn.q_proj.weight")
    weight = ckpt.load("model.layers.0.self_attn.q_proj.weight")  # float32, dequantized

Tensors llama.cpp's converter changed are changed back as they are read: Llama's Q/K rows here, the hybrid
family's (`qwen3next`, `qwen35moe`) in `strata.model.gguf_hybrid`.

The header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy view per array
element and takes 1.5 s on the 49k-token vocabulary of a 135M model; `gguf` still provides the
type tables and the dequantization.
"""

import functools
import mmap
import re
import struct
from math import prod
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from strata.errors import CheckpointError
from strata.model import gguf_hybrid as hybrid
from strata.model.tokenizer import Tokenizer as StrataTokenizer
from strata.quant.gguf_blocks import SUPPORTED as SUPPORTED_BLOCKS
from strata.quant.gguf_blocks import from_gguf
from strata.quant.packed import PackedWeight, cat as packed_cat

# GGUF architecture -> (transformers model_type, architectures entry); the hybrid ones: `strata.model.gguf_hybrid`
_ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    **hybrid.ARCHS,
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
    "post_attention_norm": "post_attention_layernorm",
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
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# stacked experts [E, out, in]: named like transformers' fused expert parameters, without a suffix
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                 "ffn_gate_up_exps": "gate_up_proj"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")

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


class _Source(NamedTuple):
    """Where a transformers tensor comes from: one GGUF tensor, or two (Qwen3-Next's `in_proj_qkvz`)."""

    parts: tuple[_TensorInfo, ...]
    shape: tuple[int, ...]  # the transformers shape
    undo: Callable[..., np.ndarray] | None  # the parts' dequantized arrays -> the transformers values (None: as stored)


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


def _hf_name(gguf_name: str, arch: str, num_layers: int) -> str | None:
    """The transformers name of a GGUF tensor, or None for one transformers has no place for. Blocks from
    `num_layers` on are the multi-token-prediction layers (`mtp.*`)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, suffix = int(match[1]), match[2], match[3] or ""
    prefix = f"model.layers.{layer}."
    if layer >= num_layers:
        if part in hybrid.NEXTN_PARTS:  # the head's own tensors, written again into every MTP block: the first's
            return hybrid.NEXTN_PARTS[part] if layer == num_layers and suffix == "weight" else None
        prefix = f"mtp.layers.{layer - num_layers}."
    if part in _EXPERT_NAMES and suffix == "weight":
        return f"{prefix}mlp.experts.{_EXPERT_NAMES[part]}"
    if part in _BLOCK_NAMES and suffix:
        return f"{prefix}{_BLOCK_NAMES[part]}.{suffix}"
    if arch in hybrid.ARCHS and (part, suffix) in hybrid.PARTS:
        return prefix + hybrid.PARTS[part, suffix]
    return None


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (pairs interleaved) to transformers' (halves)."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _permutation(out: np.ndarray, n: int) -> torch.Tensor | None:
    """`out` [n, 2]: two equal columns of numbers that undoing a conversion moved; the order they came out in when
    that is a permutation of 0 .. n - 1 with the columns still equal (only whole rows or columns moved), else None."""
    if out.shape != (n, 2) or not np.array_equal(out[:, 0], out[:, 1]) or not np.array_equal(np.sort(out[:, 0]),
                                                                                              np.arange(n)):
        return None
    return torch.from_numpy(np.ascontiguousarray(out[:, 0]).astype(np.int64))


@functools.cache
def _readable(qtype: GGMLQuantizationType) -> bool:
    """Whether the loader's dequantizer reads tensors of this type (one zero block tried)."""
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        return True
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return False


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
        self.config = self._build_config({info.gguf_name: info.shape for info in infos})
        self._tensors = self._sources(infos)
        self._check_types()

    def _check_types(self) -> None:
        """Refuse at open a tensor the model needs whose type nothing here reads (an integer tensor, a block type
        `gguf` has no dequantizer for): loading it would fail half-way through the weights."""
        for name, source in self._tensors.items():
            for info in source.parts:
                if not _readable(info.qtype):
                    known = ", ".join(t.name for t in GGMLQuantizationType if _readable(t))
                    raise CheckpointError(
                        f"{self.path}: tensor {info.gguf_name!r} ({name}) is stored as {info.qtype.name}, a type "
                        f"Strata cannot read (it reads {known}); write the file again with one of them (llama.cpp's "
                        "llama-quantize)")

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

    def _build_config(self, shapes: dict[str, tuple[int, ...]]) -> dict:
        """config.json's keys from the metadata; `shapes`: every GGUF tensor's (torch order)."""
        model_type, architecture = _ARCHS[self.arch]
        hidden, num_heads = self._key("embedding_length"), self._key("attention.head_count")
        head_dim = self._key("attention.key_length", hidden // num_heads)
        vocab = self._key("vocab_size", None) or len(self._meta.get("tokenizer.ggml.tokens", ()))
        # llama.cpp appends multi-token-prediction layers as blocks after the model's own
        num_layers = self._key("block_count") - self._key("nextn_predict_layers", 0)
        config = {
            "model_type": model_type,
            "architectures": [architecture],
            "hidden_size": hidden,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": self._key("attention.head_count_kv", num_heads),
            "head_dim": head_dim,
            "intermediate_size": self._key("feed_forward_length", None),
            "rms_norm_eps": self._key("attention.layer_norm_rms_epsilon"),
            "rope_parameters": self._rope(shapes, head_dim),
            "vocab_size": vocab,
            "max_position_embeddings": self._key("context_length"),
            "tie_word_embeddings": "output.weight" not in shapes,
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
        if self.arch in hybrid.ARCHS:
            config |= hybrid.config(self._key, num_layers, shapes, str(self.path))
        return config

    def _rope(self, shapes: dict[str, tuple[int, ...]], head_dim: int) -> dict:
        """The rotary embedding's parameters in config.json's form (`strata.model.rope_scaling`)."""
        rope = {"rope_type": "default", "rope_theta": self._key("rope.freq_base", 10000.0)}
        rotary_dim = self._key("rope.dimension_count", head_dim)
        if rotary_dim != head_dim:  # partial rotary (Qwen3-Next, Qwen3.5: a quarter of each head)
            rope["partial_rotary_factor"] = rotary_dim / head_dim
        if "rope_freqs.weight" in shapes:
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

    def _sources(self, infos: list[_TensorInfo]) -> dict[str, _Source]:
        """Each transformers tensor's GGUF tensors, its shape, and what undoes the converter's changes to it."""
        num_layers = self.config["num_hidden_layers"]
        sources = {}
        for info in infos:
            hf = _hf_name(info.gguf_name, self.arch, num_layers)
            if hf is None:
                continue
            shape, undo = info.shape, None
            if self.arch in _PERMUTED_QK and (part := info.gguf_name.split(".")[-2]) in ("attn_q", "attn_k"):
                heads = self.config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
                undo = lambda w, heads=heads: _unpermute_rows(w, heads)  # noqa: E731
            elif self.arch in hybrid.ARCHS:
                shape, undo = hybrid.undo(hf, info.shape, self.arch, self.config)
            sources[hf] = _Source((info,), shape, undo)
        if self.arch == "qwen3next":
            self._fuse_qkvz(sources)
        return sources

    def _fuse_qkvz(self, sources: dict[str, _Source]) -> None:
        """Qwen3-Next: each Gated DeltaNet layer's `attn_qkv` and `attn_gate` are one transformers tensor."""
        for qkv_name in [n for n in sources if n.endswith(".linear_attn.in_proj_qkv.weight")]:
            layer = qkv_name.removesuffix(".in_proj_qkv.weight")
            qkv, z = sources.pop(qkv_name), sources.pop(f"{layer}.in_proj_z.weight", None)
            if z is None:
                qkv_gguf = qkv.parts[0].gguf_name
                raise CheckpointError(f"{self.path}: tensor {qkv_gguf.replace('attn_qkv', 'attn_gate')!r} is missing; "
                                      f"{layer}.in_proj_qkvz is read from it and {qkv_gguf!r}")
            cfg = self.config
            value_rows = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            qkv_rows = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + value_rows
            if len(qkv.shape) != 2 or qkv.shape[0] != qkv_rows or z.shape != (value_rows, qkv.shape[1]):
                raise CheckpointError(f"{self.path}: tensors {qkv.parts[0].gguf_name!r} {list(qkv.shape)} and "
                                      f"{z.parts[0].gguf_name!r} {list(z.shape)} do not have the metadata's "
                                      f"{qkv_rows} and {value_rows} rows")
            shape = (qkv.shape[0] + z.shape[0], qkv.shape[1])
            undo = lambda qkv, z: hybrid.fuse_qkvz(qkv, z, self.config)  # noqa: E731
            sources[f"{layer}.in_proj_qkvz.weight"] = _Source(qkv.parts + z.parts, shape, undo)
        stray = [s.parts[0].gguf_name for n, s in sources.items() if n.endswith(".linear_attn.in_proj_z.weight")]
        if stray:
            raise CheckpointError(f"{self.path}: tensor {stray[0]!r} has no attn_qkv beside it")

    def names(self) -> list[str]:
        return list(self._tensors)

    def _source(self, name: str) -> _Source:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} (it has {len(self._tensors)} tensors)")
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source(name).shape

    def _read(self, info: _TensorInfo) -> np.ndarray:
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
        return dequantize(raw.reshape(*info.shape[:-1], -1), info.qtype).reshape(info.shape)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        source = self._source(name)  # its tensors' extents were checked against the file size at open
        weights = [self._read(info) for info in source.parts]
        try:
            weight = source.undo(*weights) if source.undo is not None else weights[0]
        except ValueError as e:  # a reshape the config's head counts and sizes do not fit
            shapes = ", ".join(f"{info.gguf_name} {list(info.shape)}" for info in source.parts)
            raise CheckpointError(f"{self.path}: tensor {name!r} cannot be read from {shapes} with the head "
                                  f"counts and sizes of the metadata ({e})") from None
        if not weight.flags.writeable or not weight.flags.c_contiguous:
            weight = np.array(weight, order="C")  # F32 data is a view of the read-only map
        return torch.from_numpy(weight).to(dtype)

    def load_packed(self, name: str, dtype: torch.dtype = torch.bfloat16) -> PackedWeight | None:
        """The tensor kept quantized (`strata.quant.packed`), when its GGUF type has a packed form (Q8_0, Q4_K, Q5_K,
        Q6_K) and it is stored as transformers reads it (or with its rows reordered); else None (`load` it).
        `dtype`: the activations' dtype its tiles are rounded to."""
        if self.packed_format(name) is None:
            return None
        source = self._source(name)
        parts = [self._packed_part(info, dtype) for info in source.parts]
        weight = packed_cat(parts) if len(parts) > 1 else parts[0]
        rows = self._row_order(source) if source.undo is not None else None
        return weight.rows(rows) if rows is not None else weight

    def packed_format(self, name: str) -> str | None:
        """The packed format (`strata.quant.packed`) `load_packed` keeps the tensor in, or None: GGUF tensors of one
        type with a packed form, 2-D or 3-D, stored as transformers reads them or with whole rows moved (Llama's q/k
        rows per head, the hybrid families' Gated DeltaNet projections regrouped; parts of one tensor stacked)."""
        source = self._source(name)
        info = source.parts[0]
        if info.qtype not in SUPPORTED_BLOCKS or len(info.shape) not in (2, 3) or any(
                p.qtype != info.qtype or p.shape[1:] != info.shape[1:] for p in source.parts):
            return None
        if source.undo is not None and (len(info.shape) != 2 or self._row_order(source) is None):
            return None  # a conversion other than a row order (values, columns): read dequantized
        return SUPPORTED_BLOCKS[info.qtype]

    def load_packed_columns(self, name: str, dtype: torch.dtype = torch.bfloat16) -> tuple[PackedWeight, torch.Tensor] | None:
        """A 2-D tensor the converter changed only by moving whole columns (Qwen3.5's `out_proj`, its value heads
        tiled), kept packed as stored, and the order: transformers' column j is the stored column `order[j]` (a packed
        row's blocks cannot be reordered, so the caller moves its input instead). None for any other tensor."""
        found = self.column_order(name)
        return None if found is None else (self._packed_part(self._source(name).parts[0], dtype), found[1])

    def _packed_part(self, info: _TensorInfo, dtype: torch.dtype) -> PackedWeight:
        """One GGUF tensor's blocks as they are stored, as a packed weight."""
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
        return from_gguf(torch.from_numpy(raw.reshape(*info.shape[:-1], -1).copy()), info.qtype, info.shape, dtype)

    def column_order(self, name: str) -> tuple[str, torch.Tensor] | None:
        """The packed format and column order `load_packed_columns` gives, without reading the tensor; else None."""
        source = self._source(name)
        info = source.parts[0]
        if len(source.parts) != 1 or info.qtype not in SUPPORTED_BLOCKS or len(info.shape) != 2 or source.undo is None \
                or self._row_order(source) is not None:
            return None
        order = self._column_order(source)
        return None if order is None else (SUPPORTED_BLOCKS[info.qtype], order)

    @staticmethod
    def _column_order(source: _Source) -> torch.Tensor | None:
        """As `_row_order`, for a tensor whose undoing only moves whole columns: two equal rows of column numbers."""
        (info,) = source.parts
        try:
            out = np.asarray(source.undo(np.repeat(np.arange(info.shape[1])[None, :], 2, axis=0)))
        except (ValueError, IndexError):
            return None
        return _permutation(out.T, info.shape[1])

    @staticmethod
    def _row_order(source: _Source) -> torch.Tensor | None:
        """When undoing the converter only moves whole rows (of the parts' rows, stacked in order), which stored row
        each transformers row is; None when it changes values or moves columns. Found by undoing row numbers: two
        equal columns of them must come out as a permutation, still equal."""
        start, numbers = 0, []
        for info in source.parts:
            numbers.append(np.repeat(np.arange(start, start + info.shape[0])[:, None], 2, axis=1))
            start += info.shape[0]
        try:
            out = np.asarray(source.undo(*numbers))
        except (ValueError, IndexError):  # a reshape that only columns of the real width fit
            return None
        return _permutation(out, start)

    def qtype_name(self, name: str) -> str:
        """The GGUF type the tensor is stored in (e.g. 'Q4_K'), for the load's summary."""
        return "+".join(sorted({info.qtype.name for info in self._source(name).parts}))

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
