"""Every option is one field of a pydantic-settings model: a CLI flag (`--max-cells`), an environment
variable (`STRATA_MAX_CELLS`) and a key of a config file (`max_cells`), with one name and one default.

Precedence: command line, then environment, then the config file named by `--config` (or
`STRATA_CONFIG`), then the default.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from strata.runtime.drafts import DEFAULT_SPEC_MAX_ACTIVE, parse_spec
from strata.errors import StrataError

_config_file: Path | None = None

# `json` is the option's one name (flag, variable, key); it shadows pydantic's deprecated BaseModel.json().
warnings.filterwarnings("ignore", message='Field name "json" in "GenerateSettings" shadows')


def use_config_file(path: str | Path | None) -> None:
    """Name the config file that settings read (the CLI calls this before parsing)."""
    global _config_file
    if path is None:
        _config_file = None
        return
    path = Path(path)
    if not path.is_file():
        raise StrataError(f"config file {path} does not exist")
    if path.suffix not in (".json", ".toml"):
        raise StrataError(f"config file {path}: use a .json or .toml file")
    _config_file = path


class StrataSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STRATA_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore", validate_default=True
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file or (Path(os.environ["STRATA_CONFIG"]) if os.environ.get("STRATA_CONFIG") else None)
        if path is not None:
            if path.suffix == ".toml":
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
            else:
                sources.append(JsonConfigSettingsSource(settings_cls, json_file=path))
        return tuple(sources)


class EngineSettings(StrataSettings):
    model: str = Field("default", description="a Hugging Face model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct)")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto is float32 on the CPU and bfloat16 on a GPU"
    )
    max_cells: int = Field(4096, gt=0, description="positions each sequence can hold (prompt + answer)")
    batch: int = Field(1, ge=1, le=256, description="slots: requests run together, one decoding row each per window")
    max_window_tokens: int | None = Field(
        None, ge=1, description="rows per window (vLLM's max_num_batched_tokens): a row per decoding slot, then prompt "
        "rows up to this budget; at least --batch; default 2048 on a GPU, 256 on the CPU"
    )
    max_waiting: int = Field(256, ge=0, description="requests that may wait for a slot; beyond them: 429")
    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto", description="kernels: triton (GPU default; prompt projections stay on torch GEMMs), torch references (CPU default)"
    )
    cuda_graphs: bool = Field(True, description="replay decode windows from CUDA graphs (with the triton kernels)")
    dequantize_weights: bool = Field(
        False, description="a quantized checkpoint's weights (GGUF Q8_0 / Q4_K / Q5_K / Q6_K / IQ3_S, FP8) dequantized to "
        "--dtype at load instead of kept packed for the triton kernels (more memory; for comparison)"
    )
    quantization: Literal["q8_0", "q4_k", "q5_k", "q6_k", "iq3_s", "fp8"] | None = Field(
        None, description="a float checkpoint's matrices (projections, experts, head) quantized to this format as they "
        "load (plain roundings, as GGUF's types and FP8 blocks store them), kept packed for the triton kernels; "
        "refused for a checkpoint stored quantized"
    )
    layer_split: str | None = Field(
        None, description="layers per stage, e.g. 12,12,12,12 (or proportions, e.g. 3,2); stages on cuda:0..n-1"
    )
    split_device: str | None = Field(None, description="put every stage of --layer-split on this one device (testing)")
    batch_groups: int = Field(1, ge=1, description="slot groups pipelined through the stages of --layer-split")
    trim_stage_weights: bool = Field(False, description="each stage loads only its own layers' tensors")
    lookahead: int | None = Field(
        None, ge=0, le=1, description="batch windows each slot group launches ahead of the one the host reads "
        "(1: the next window's tokens stay on the device, so the host works while it computes); default 1 on a GPU, "
        "0 on the CPU"
    )
    expert_budget_gb: str | None = Field(
        None, description="GB of routed experts each card keeps resident, per stage (e.g. 10,10,12,12)"
    )
    cpu_threads: int | None = Field(None, ge=1, description="threads of the CPU pool that computes offloaded experts")
    expert_residency: Literal["fixed", "hot"] = Field(
        "fixed", description="which routed experts stay on the device with --expert-budget-gb: fixed (the lowest ids: "
        "every run repeats exactly) or hot (the most routed ones, swapped in as traffic changes)"
    )
    pcie_frac: float = Field(
        0.0, ge=0.0, le=1.0, description="share of the experts in host RAM (--expert-budget-gb) that the GPU computes "
        "after uploading their weights when a window routes to them, so the PCIe link and the CPU pool work at once "
        "(0: the CPU computes them all)"
    )
    park_gb: float | None = Field(
        None, description="GB of host RAM for parked conversations (default 4, at most a quarter of the RAM; 0: off)"
    )
    park_dir: str | None = Field(
        None, description="a folder where parked conversations are also written (created if missing, its parent must "
        "exist), so that they outlive the process: a restarted engine continues them (default: none, host RAM only)"
    )
    park_disk_gb: float | None = Field(
        None, description="GB of files in --park-dir, the least recently used deleted first (default 20, at most half "
        "the file system; 0: off)"
    )
    park_vram_gb: float = Field(
        0.0, description="on a GPU: GB of VRAM (on each GPU) where the conversations parked last are also copied, so "
        "a follow-up is restored at the GPU's own speed instead of over the host link (reserved at start, beside the "
        "model and --max-cells; host RAM keeps every parked conversation either way; 0: off)"
    )
    checkpoint_every: int = Field(
        0, ge=0, description="models with Gated DeltaNet layers: also keep their state every this many prompt tokens "
        "(host RAM: one GDN state each), besides the one kept before each prompt's last token, so a prompt that "
        "shares only a prefix with a held or parked conversation reads from the latest checkpoint in it (0: only "
        "the prompt-end checkpoints)"
    )
    compile_workers: int | None = Field(
        None, ge=0, le=64, description="processes that compile the Triton kernels while the weights load, so the "
        "warm-up finds them compiled (default: up to 8, by cores and the GPU memory beside the model; 0: none)"
    )
    spec: str | None = Field(
        None, description="draft tokens and verify them in the windows: ngram:K (K tokens looked up in the sequence's "
        "own text, 1 to 8) or mtp:K (the checkpoint's multi-token-prediction layer, chained); answers gain the "
        "accepted ones, unchanged; needs --lookahead 0 (taken by default with --spec)"
    )
    spec_max_active: int | None = Field(
        None, ge=0, description="with --spec: no slot drafts in a window while more than this many slots are active "
        "(drafts pay while a window is bound by reading weights; default by measurement: 4 on the CPU, 16 on a GPU)"
    )

    @field_validator("spec")
    @classmethod
    def _spec_parses(cls, value: str | None) -> str | None:
        from strata.runtime.drafts import parse_spec

        try:
            parse_spec(value)
        except StrataError as e:
            raise PydanticCustomError("spec", str(e)) from None
        return value

    @field_validator("park_gb")
    @classmethod
    def _park_gb_fits(cls, value: float | None) -> float | None:
        from strata.state.parking import park_gb_problem

        problem = None if value is None else park_gb_problem(value)
        if problem:
            raise PydanticCustomError("park_gb", problem)
        return value

    @field_validator("park_dir")
    @classmethod
    def _park_dir_usable(cls, value: str | None) -> str | None:
        from strata.state.park_disk import park_dir_problem

        problem = None if value is None else park_dir_problem(value)
        if problem:
            raise PydanticCustomError("park_dir", problem)
        return value

    @field_validator("park_disk_gb")
    @classmethod
    def _park_disk_gb_fits(cls, value: float | None, info: ValidationInfo) -> float | None:
        from strata.state.park_disk import park_disk_gb_problem

        problem = None if value is None else park_disk_gb_problem(value, info.data.get("park_dir"))
        if problem:
            raise PydanticCustomError("park_disk_gb", problem)
        return value

    @field_validator("park_vram_gb")
    @classmethod
    def _park_vram_gb_fits(cls, value: float) -> float:
        from strata.state.park_vram import park_vram_gb_problem

        problem = park_vram_gb_problem(value)
        if problem:
            raise PydanticCustomError("park_vram_gb", problem)
        return value

    def torch_device(self) -> torch.device:
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise StrataError(f"--device {self.device!r} is not a device; use cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise StrataError(f"--device {self.device}: no CUDA GPU is visible here; use --device cpu")
        return device

    def open_model(self):
        """The checkpoint of --model opened (`ModelFiles`), read through --quantization's quantizer if set."""
        from strata.model.loader import ModelFiles

        return ModelFiles.open(self.model, self.quantization, self.torch_device() if self.quantization else None)

    def stage_options(self) -> dict:
        """The layer-split settings, as `Engine` takes them."""
        budget = None
        if self.expert_budget_gb is not None:
            try:
                budget = [float(v) for v in self.expert_budget_gb.split(",")]
            except ValueError:
                raise StrataError(f"--expert-budget-gb {self.expert_budget_gb!r}: expected numbers, e.g. 10,10,12") from None
        if self.pcie_frac and budget is None:
            raise StrataError(f"--pcie-frac {self.pcie_frac}: no expert is in host RAM to upload; it shares out the "
                              "experts that --expert-budget-gb leaves off the GPU")
        return dict(layer_split=self.layer_split, split_device=self.split_device, batch_groups=self.batch_groups,
                    trim_stage_weights=self.trim_stage_weights, expert_budget_gb=budget, cpu_threads=self.cpu_threads,
                    expert_residency=self.expert_residency, pcie_frac=self.pcie_frac,
                    dequantize_weights=self.dequantize_weights, park_vram_gb=self.park_vram_gb,
                    lookahead=self.lookahead, checkpoint_every=self.checkpoint_every, speculative=parse_spec(
                        self.spec, DEFAULT_SPEC_MAX_ACTIVE[self.torch_device().type]
                        if self.spec_max_active is None else self.spec_max_active))

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device().type == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)


class GenerateSettings(EngineSettings):
    prompt: str | None = Field(None, description="the prompt text")
    chat: bool = Field(False, description="wrap the prompt as a user message in the model's chat template")
    prompt_ids: str | None = Field(None, description='the prompt as token ids, e.g. "1 2 3" (instead of --prompt)')
    max_tokens: int = Field(64, ge=0, description="tokens to generate at most")
    temperature: float = Field(0.0, description="0 is greedy")
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    json: bool = Field(False, description="print one JSON object with prompt_ids, ids, text and finish_reason")
