"""`strata generate` as a user runs it: a real subprocess, its output and its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import build


def strata(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata.cli", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build("qwen3_moe-gqa4", folder)
    return folder


def test_generate_json_on_the_default_model():
    out = strata("generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"prompt_ids", "ids", "text", "finish_reason"}
    assert len(result["ids"]) == 4 and result["finish_reason"] == "length"
    assert result["text"].startswith(" Paris")


def test_generate_streams_text_and_reports_speed():
    out = strata("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "30")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tokens/s" in out.stderr


def test_prompt_ids_sampling_and_seed_reproducible(tiny):
    args = ["generate", "--model", str(tiny), "--prompt-ids", "1 2 3", "--max-tokens", "12", "--json",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "7"]
    a, b = strata(*args), strata(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["ids"] == json.loads(b.stdout)["ids"]
    assert json.loads(a.stdout)["text"] is None  # no tokenizer in that folder


def test_settings_from_environment_and_config_file(tiny, tmp_path):
    config = tmp_path / "strata.json"
    config.write_text(json.dumps({"max_tokens": 3, "model": str(tiny)}))
    out = strata("generate", "--config", str(config), "--prompt-ids", "1 2 3", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["ids"]) == 3
    out = strata("generate", "--config", str(config), "--prompt-ids", "1 2 3", "--json", env={"STRATA_MAX_TOKENS": "5"})
    assert len(json.loads(out.stdout)["ids"]) == 5  # the environment overrides the file
    out = strata("generate", "--config", str(config), "--prompt-ids", "1 2 3", "--json", "--max-tokens", "2",
                 env={"STRATA_MAX_TOKENS": "5"})
    assert len(json.loads(out.stdout)["ids"]) == 2  # the command line overrides both


def _fails(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in out.stderr, out.stderr


def test_missing_model(tmp_path):
    _fails(strata("generate", "--model", str(tmp_path / "nope"), "--prompt", "x"), "nope", "no such file")


def test_serve_refuses_a_model_without_a_tokenizer(tiny):
    assert not (tiny / "tokenizer.json").exists()  # the tiny checkpoint: config and weights only
    _fails(strata("serve", "--model", str(tiny)), str(tiny), "has no tokenizer", "tokenizer.json",
           "--prompt-ids")


def test_truncated_safetensors(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny / "config.json").read_text())
    data = (tiny / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(strata("generate", "--model", str(broken), "--prompt-ids", "1"), "model.safetensors", "truncated")


def test_unknown_architecture(tiny, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (odd / "config.json").write_text(json.dumps(config))
    (odd / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    _fails(strata("generate", "--model", str(odd), "--prompt-ids", "1"), "MambaForCausalLM", "Qwen3MoeForCausalLM")


def test_tensor_of_the_wrong_shape(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    tensors = load_file(str(tiny / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(bad / "model.safetensors"))
    _fails(strata("generate", "--model", str(bad), "--prompt-ids", "1"), "model.layers.1.self_attn.k_proj.weight", "[7, 64]")


def test_prompt_longer_than_max_cells(tiny):
    ids = " ".join(str(i) for i in range(1, 21))
    _fails(strata("generate", "--model", str(tiny), "--prompt-ids", ids, "--max-cells", "16"), "20 tokens", "max_cells=16")


def test_token_outside_the_vocabulary(tiny):
    _fails(strata("generate", "--model", str(tiny), "--prompt-ids", "1 99999"), "99999", "vocabulary")


def test_bad_settings():
    _fails(strata("generate", "--prompt", "x", "--top-p", "1.5"), "top_p")
    _fails(strata("generate", "--prompt", "x", "--max-tokens", "many"), "--max-tokens")
    _fails(strata("generate", "--prompt", "x", "--device", "abacus"), "abacus")
    if not torch.cuda.is_available():
        _fails(strata("generate", "--prompt", "x", "--device", "cuda"), "no CUDA GPU")


def test_bad_spec_values_exit_2_naming_them(tiny):
    _fails(strata("generate", "--model", str(tiny), "--prompt-ids", "1", "--spec", "mtp:2"),
           "--spec mtp:2", "no multi-token-prediction weights")
    _fails(strata("generate", "--model", str(tiny), "--prompt-ids", "1", "--spec", "ngram:12"), "between 1 and 8")
    _fails(strata("generate", "--model", str(tiny), "--prompt-ids", "1", "--spec", "medusa:2"), "unknown method 'medusa'")
