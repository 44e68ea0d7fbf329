"""Checkpoints read lazily: a Hugging Face safetensors folder or a GGUF file.

Both expose the same small interface (`config`, `names`, `shape`, `load`, `tokenizer`), with tensor
names in the Hugging Face convention, so a stage reads only the tensors of its own layers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from strata.errors import CheckpointError
from strata.model.quantization import read_quantization
from strata.model.tokenizer import Tokenizer
from strata.quant.packed import PackedWeight


class Checkpoint(Protocol):
    path: Path
    config: dict

    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...
    def tokenizer(self) -> Tokenizer | None: ...


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _check_safetensors_file(path: Path) -> None:
    """Refuse a truncated file before any tensor is read: the header announces the data's length."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, file of {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not a safetensors file (unreadable header)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: its tensors need {8 + header_len + end} bytes, the file has {size}; "
            "download it again"
        )


class SafetensorsCheckpoint:
    """A Hugging Face model folder: config.json, one or more *.safetensors (with an index when sharded), tokenizer files."""

    def __init__(self, path: Path):
        self.path = path
        self.config = _read_json(path / "config.json")
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = _read_json(index).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files in the model folder")
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            file = path / name
            if not file.exists():
                raise CheckpointError(f"{file}: listed in {index.name} but missing; download the checkpoint again")
            _check_safetensors_file(file)
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    self._files[key] = file
                    self._shapes[key] = tuple(f.get_slice(key).get_shape())
        missing = sorted(k for k in weight_map if k not in self._files)
        if missing:
            raise CheckpointError(f"{index}: lists {len(missing)} tensors not found in the shards, e.g. {missing[0]}")
        self._handles: dict[Path, object] = {}
        self.quantization = read_quantization(self.config, str(path / "config.json"))

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor {name!r}")
        return self._shapes[name]

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        file = self._files.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor {name!r}")
        tensor = self._read(file, name)
        scale = f"{name}_scale_inv"
        if self.quantization is not None and scale in self._files:  # FP8 blocks: dequantized as read
            return self.quantization.dequantize(tensor, self._read(self._files[scale], scale), name).to(dtype)
        return tensor.to(dtype)

    def packed_format(self, name: str) -> str | None:
        """"fp8" where `load_packed` keeps the tensor quantized (e4m3 with block scales 128 columns wide, 2-D), else
        None; reads the file's header, not the tensor."""
        scale = f"{name}_scale_inv"
        if self.quantization is None or scale not in self._files or self.quantization.block[1] != 128:
            return None
        shape = self.shape(name)
        if self.qtype_name(name) != "float8_e4m3fn" or len(shape) != 2 or shape[1] % 128:
            return None  # `load` says what is wrong with it, or reads it dequantized
        return "fp8"

    def load_packed(self, name: str, dtype: torch.dtype = torch.bfloat16) -> PackedWeight | None:
        """An FP8 weight kept quantized (`strata.quant.packed`'s fp8: its codes, one scale per row and 128 columns),
        when `packed_format` says so; None for any other tensor (`load` it)."""
        if self.packed_format(name) is None:
            return None
        scale = f"{name}_scale_inv"
        weight = self._read(self._files[name], name)
        scales = self.quantization.row_scales(weight, self._read(self._files[scale], scale), name)
        return PackedWeight("fp8", tuple(weight.shape), weight.contiguous(), scales, dtype=dtype)

    def qtype_name(self, name: str) -> str:
        """How the tensor is stored (its dtype), for the load's summary."""
        file = self._files.get(name)
        if file is None:
            return "?"
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, "pt")
        stored = handle.get_slice(name).get_dtype()  # safetensors' name (F8_E4M3, BF16, ...), from the header
        return _SAFETENSORS_DTYPES.get(stored, stored.lower())

    def _read(self, file: Path, name: str) -> torch.Tensor:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, "pt")
        return handle.get_tensor(name)

    def tokenizer(self) -> Tokenizer | None:
        return Tokenizer.from_folder(self.path)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open `path` (a model folder or a .gguf file) without reading any tensor data."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder; give a Hugging Face model folder or a .gguf file")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            path = ggufs[0]
        else:
            return SafetensorsCheckpoint(path)
    from strata.model.gguf import GGUFCheckpoint

    return GGUFCheckpoint(path)


# safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16", "F16": "float16",
                       "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64"}


class StateDictCheckpoint:
    """An in-memory checkpoint: a config dict and a name -> tensor map (a `transformers` model's state_dict).

    Benchmarks load the very weights a `transformers` model runs, without writing them to disk; tensors already
    on the right device, dtype and layout are shared, not copied.
    """

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], path: str = "<in memory>"):
        self.path, self.config, self._tensors = Path(path), config, tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor {name!r}")
        return self._tensors[name].to(dtype)

    def tokenizer(self) -> Tokenizer | None:
        return None
