"""Shared fixtures: the embedded default model and its `transformers` reference, each loaded once per session."""

from __future__ import annotations

import os

# CI has no GPU: Triton kernels run under Triton's interpreter, on CPU tensors. This must be set before
# anything imports triton (the kernel modules do at import time).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.model.loader import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def default_gguf():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf):
    """transformers loading the same GGUF file into float32 (slow: load it once)."""
    import transformers  # GGUF loading also needs `accelerate`

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def default_engine():
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    return Engine(ModelFiles.open("default"), max_cells=1024)
