"""strata:expert_residency{gpu}: from the engine's READY facts to a scrape, and through a real `strata serve` whose
engine keeps half of each MoE layer's experts resident and answers requests with the CPU pool."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers

from serve.metrics import Metrics, gpu_label
from strata.experts.residency import expert_bytes
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from tests.server_process import Server
from tests.tiny_models import VOCAB, build


def residency_samples(body: str) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.name == "strata:expert_residency"}


def test_gpu_label_is_the_nvml_index_like_the_other_gpu_gauges(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_label("cuda:1") == "1" and gpu_label("cpu") == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_label("cuda:0") == "2" and gpu_label("cuda:1") == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d1f")  # UUIDs: CUDA's own index
    assert gpu_label("cuda:0") == "0"


def test_residency_gauge_per_device_from_the_engine_facts(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    m = Metrics("tiny-moe", 1024, 2)
    body, _ = m.render("text/plain", None)
    assert residency_samples(body.decode()) == {}, "no series before the engine is READY"
    m.set_engine_facts({"family": "qwen3_next", "expert_residency": {"cuda:0": 0.31, "cuda:1": 0.46}})
    body, _ = m.render("text/plain", None)
    assert residency_samples(body.decode()) == {"0": 0.31, "1": 0.46}
    assert m.facts()["engine_facts"]["expert_residency"] == {"cuda:0": 0.31, "cuda:1": 0.46}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint with a word-level tokenizer ("t0" .. "t159"), so the server can take text."""
    folder = tmp_path_factory.mktemp("qwen3_moe-served")
    build("qwen3_moe-gqa4", folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return folder


def test_a_served_engine_with_the_pool_reports_its_residency_and_answers(tiny_moe):
    files = ModelFiles.open(tiny_moe)
    spec = files.spec
    half = (spec.num_layers * spec.moe.num_experts // 2 + 0.5) * expert_bytes(spec, 4) / 1e9
    prompts = [[(i * 13 + j * 7 + 3) % VOCAB for j in range(6 + i)] for i in range(2)]
    reference = Engine(files, max_cells=128)  # every expert resident
    want = [reference.generate(p, 8, stop_ids=frozenset()).ids for p in prompts]
    server = Server("--model", str(tiny_moe), "--expert-budget-gb", f"{half:.9f}", "--cpu-threads", "1",
                    "--batch", "2", "--max-cells", "128")
    try:
        scrape = httpx.get(server.url + "/metrics", headers={"Accept": "text/plain"}, timeout=10).text
        assert residency_samples(scrape) == {"cpu": 0.5}
        facts = httpx.get(server.url + "/metrics", timeout=10).json()
        assert facts["engine_facts"]["expert_residency"] == {"cpu": 0.5}
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for prompt, ids in zip(prompts, want):
            reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": " ".join(f"t{i}" for i in prompt), "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            reply.raise_for_status()
            assert reply.json()["choices"][0]["text"].split() == [f"t{i}" for i in ids]
        deadline = time.monotonic() + 10  # the engine says its totals once it is idle
        while (pairs := httpx.get(server.url + "/metrics", timeout=10).json()["expert_pairs"])["cpu"] == 0:
            assert time.monotonic() < deadline, pairs
            time.sleep(0.2)
        assert pairs["device"] > 0 and pairs["cpu"] > 0
        scrape = httpx.get(server.url + "/metrics", headers={"Accept": "text/plain"}, timeout=10).text
        samples = {s.labels["where"]: s.value for family in text_string_to_metric_families(scrape)
                   for s in family.samples if s.name == "strata:expert_pairs_total"}
        assert samples == {"device": pairs["device"], "cpu": pairs["cpu"], "uploaded": 0}
    finally:
        server.stop()
