"""serve.metrics: vLLM-compatible Prometheus scrape and Strata's JSON facts, driven through the HTTP layer's calls."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Metrics,
    RequestRecord,
    build_1_2_5_buckets,
)

MODEL = "tiny-moe"
MAX_MODEL_LEN = 4096
DASHBOARDS = Path(__file__).parents[2] / "shared/peer/vllm-dashboards"
ROUTER_METRICS = {"vllm:current_qps", "vllm:healthy_pods_total"}  # the production-stack router's, not an engine's
TARGET_LABELS = {"endpoint", "instance", "job", "namespace", "pod", "service"}  # added by Prometheus at scrape

# Every engine metric the server issue names, as scraped sample names (counters end in _total,
# histograms are checked through their _bucket series), with the labels beyond model_name/engine.
ISSUE_SERIES = {
    "vllm:num_requests_running": set(),
    "vllm:num_requests_waiting": set(),
    "vllm:kv_cache_usage_perc": set(),
    "vllm:prompt_tokens_total": set(),
    "vllm:generation_tokens_total": set(),
    "vllm:request_success_total": {"finished_reason"},
    "vllm:prefix_cache_queries_total": set(),
    "vllm:prefix_cache_hits_total": set(),
    "vllm:gpu_prefix_cache_queries_total": set(),
    "vllm:gpu_prefix_cache_hits_total": set(),
    "vllm:num_preemptions_total": set(),
    "vllm:spec_decode_num_drafts_total": set(),
    "vllm:spec_decode_num_draft_tokens_total": set(),
    "vllm:spec_decode_num_accepted_tokens_total": set(),
    **{f"vllm:{h}_bucket": {"le"} for h in (
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_prompt_tokens", "request_generation_tokens", "time_per_output_token_seconds",
        "request_time_per_output_token_seconds", "request_max_num_generation_tokens")},
}


def _three_requests() -> tuple[Metrics, list[RequestRecord]]:
    """Three overlapping requests whose tokens interleave; `b` finishes first, then `a`, then `c`."""
    m = Metrics(MODEL, MAX_MODEL_LEN, num_slots=4)
    m.set_engine_facts({"family": "qwen3_moe", "vocab_size": 151936, "max_cells": 8192, "batch": 4,
                        "weights": Path("/models/tiny.gguf")})
    t0 = time.monotonic() - 5.0
    a = RequestRecord("a", prompt_tokens=12, max_tokens=16, arrival=t0)
    b = RequestRecord("b", prompt_tokens=30, max_tokens=4, arrival=t0 + 0.01)
    c = RequestRecord("c", prompt_tokens=7, max_tokens=64, arrival=t0 + 0.02)
    for r in (a, b, c):
        m.queued(r)
    m.scheduled(a, t0 + 0.05)
    m.scheduled(b, t0 + 0.06)
    m.set_load(running=2, waiting=1, slots_in_use=2, kv_cache_usage=0.25)
    m.token(a, t0 + 0.20)
    m.token(b, t0 + 0.30)
    m.scheduled(c, t0 + 0.31)
    m.token(a, t0 + 0.35)
    m.token(c, t0 + 0.50)
    m.token(b, t0 + 0.52)
    m.token(a, t0 + 0.60)
    m.token(c, t0 + 0.62)
    m.token(b, t0 + 0.70, num_tokens=2)  # two accepted draft tokens in one step
    m.finished(b, "length", t0 + 0.71)
    m.token(a, t0 + 0.80)
    m.finished(a, "stop", t0 + 0.81)
    m.token(c, t0 + 0.90)
    m.finished(c, "abort", t0 + 1.50)
    m.finished(c, "stop", t0 + 1.60)  # a second finish of the same request is ignored
    m.preempted()
    m.prefix_cache(queries=49, hits=16)
    m.set_parked(conversations=2, nbytes=3_000_000, disk_conversations=5, disk_bytes=9_000_000,
                 reused_bytes=1_000)  # its PARKED events: a running total of bytes re-parks did not copy
    m.set_parked(conversations=2, nbytes=3_000_000, disk_conversations=5, disk_bytes=9_000_000, reused_bytes=4_000)
    m.set_parked(conversations=2, nbytes=3_000_000, disk_conversations=5, disk_bytes=9_000_000,
                 reused_bytes=500, vram_conversations=1, vram_bytes=2_000_000)  # a new engine process counts from
    # 0: the counter goes on from 4,000
    m.restored(0.004, "ram")  # its RESTORED events
    m.restored(0.03, "ram")
    m.restored(0.3, "disk")
    m.restored(0.0015, "vram")
    m.spec_decode(drafts=1, draft_tokens=2, accepted=2)
    m.set_load(running=0, waiting=0, slots_in_use=0, kv_cache_usage=0.0)
    return m, [a, b, c]


@pytest.fixture(scope="module")
def three():
    return _three_requests()


@pytest.fixture(scope="module")
def samples(three) -> dict[str, list]:
    m, _ = three
    body, content_type = m.render("text/plain", None)
    assert content_type.startswith("text/plain")
    by_name: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            by_name.setdefault(s.name, []).append(s)
    return by_name


def _value(samples, name, **labels) -> float:
    return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def _dashboard_queries() -> set[tuple[str, frozenset[str]]]:
    """(series name, label names it filters on or groups by) for every vllm:* series the dashboards query."""
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    exprs.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in sorted(DASHBOARDS.glob("*.json")):
        walk(json.loads(path.read_text()))
    queries = set()
    for expr in exprs:
        grouped = {label.strip() for by in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in by.split(",")}
        for name, matchers in re.findall(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?", expr):
            filtered = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
            labels = (filtered | grouped) - TARGET_LABELS - {""}
            if name not in ROUTER_METRICS:
                queries.add((name, frozenset(labels)))
    return queries


def test_scrape_has_every_metric_of_the_issue(samples):
    for name, extra in ISSUE_SERIES.items():
        assert name in samples, name
        assert any({"model_name", "engine", *extra} <= set(s.labels) for s in samples[name]), name
        assert all(s.labels["model_name"] == MODEL and s.labels["engine"] == "0" for s in samples[name]), name


def test_scrape_has_every_engine_series_the_dashboards_query(samples):
    queries = _dashboard_queries()
    assert len(queries) >= 15, "the dashboards were not found or not parsed"
    for name, labels in sorted(queries):
        if name.endswith("_bucket"):
            labels = labels | {"le"}
        assert name in samples, name
        assert any(labels <= set(s.labels) for s in samples[name]), (name, sorted(labels))


def test_counters_and_histograms_count_all_three_requests(samples, three):
    _, recs = three
    assert _value(samples, "vllm:request_success_total") == 3
    assert _value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(samples, "vllm:request_success_total", finished_reason="error") == 0
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_time_per_output_token_seconds",
              "request_max_num_generation_tokens"):
        assert _value(samples, f"vllm:{h}_count") == 3, h
    assert _value(samples, "vllm:prompt_tokens_total") == sum(r.prompt_tokens for r in recs) == 49
    assert _value(samples, "vllm:generation_tokens_total") == sum(r.generation_tokens for r in recs) == 11
    assert _value(samples, "vllm:request_prompt_tokens_sum") == 49
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == 11 - 3 - 1  # one per later step, not token
    assert _value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.81 + 0.70 + 1.48)
    assert _value(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.20 + 0.29 + 0.48)
    assert _value(samples, "vllm:num_preemptions_total") == 1
    assert _value(samples, "vllm:prefix_cache_hits_total") == _value(samples, "vllm:gpu_prefix_cache_hits_total") == 16
    assert _value(samples, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert _value(samples, "vllm:num_requests_running") == 0


def test_bucket_boundaries_are_vllms(samples):
    def bounds(name):
        return [float(s.labels["le"]) for s in samples[f"vllm:{name}_bucket"]][:-1]  # drop +Inf

    assert bounds("time_to_first_token_seconds") == TTFT_BUCKETS == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    assert ITL_BUCKETS == itl
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds",
                 "request_time_per_output_token_seconds"):
        assert bounds(name) == itl, name
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]
    assert REQUEST_LATENCY_BUCKETS == latency
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert bounds(name) == latency, name
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(MAX_MODEL_LEN) == tokens
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens"):
        assert bounds(name) == tokens, name


def test_strata_facts_in_the_scrape(samples, three):
    m, _ = three
    facts = m.facts()
    for key in ("live_tok_s", "uptime_s", "slots_total", "slots_in_use", "requests_running", "requests_waiting",
                "requests_total", "prompt_tokens_total", "generation_tokens_total", "kv_cache_usage"):
        (s,) = samples[f"strata:{key}"]
        assert s.labels["model_name"] == MODEL
        if key not in ("live_tok_s", "uptime_s"):
            assert s.value == facts[key], key
    assert _value(samples, "strata:requests_total") == 3
    assert _value(samples, "strata:slots_total") == 4
    # the parked conversations and bytes by tier, one family each (as the JSON facts have them)
    tiers = {name: {s.labels["tier"]: s.value for s in samples[f"strata:{name}"]}
             for name in ("parked_conversations", "parked_bytes")}
    assert tiers == {"parked_conversations": {"ram": 2, "disk": 5, "vram": 1},
                     "parked_bytes": {"ram": 3e6, "disk": 9e6, "vram": 2e6}}
    assert all(s.labels["model_name"] == MODEL for s in samples["strata:parked_bytes"])
    assert not {"strata:parked_disk_bytes", "strata:parked_vram_conversations"} & set(samples)
    assert _value(samples, "strata:parked_reused_bytes_total") == 4_500
    restores = {(s.labels["tier"], s.labels["le"]): s.value for s in samples["strata:parked_restore_seconds_bucket"]}
    assert restores[("ram", "0.005")] == 1 and restores[("ram", "0.05")] == 2 and restores[("ram", "+Inf")] == 2
    assert restores[("disk", "0.2")] == 0 and restores[("disk", "0.5")] == 1
    assert restores[("vram", "0.001")] == 0 and restores[("vram", "0.002")] == 1
    for s in samples.get("strata:gpu_util", []):
        assert {"gpu", "model_name"} <= set(s.labels)


def test_json_facts(three):
    m, recs = three
    facts = m.facts()
    assert json.loads(json.dumps(facts)) == facts
    assert set(facts) == {
        "model", "engine", "uptime_s", "live_tok_s", "slots_total", "slots_in_use", "requests_running",
        "requests_waiting", "requests_total", "requests_success", "prompt_tokens_total", "generation_tokens_total",
        "kv_cache_usage", "engine_restarts_total", "pipeline_groups", "parked_conversations", "parked_bytes",
        "parked_disk_conversations", "parked_disk_bytes", "parked_vram_conversations", "parked_vram_bytes",
        "parked_reused_bytes_total", "expert_pairs", "expert_pool",
        "gpu_util", "gpu_memory_used_bytes",
        "gpu_memory_total_bytes", "latency", "history", "engine_facts"}
    assert facts["model"] == MODEL and facts["engine"] == "strata"
    assert facts["engine_restarts_total"] == 0
    assert facts["parked_conversations"] == 2 and facts["parked_bytes"] == 3_000_000
    m.engine_restarted()
    assert m.facts()["engine_restarts_total"] == 1
    assert facts["requests_total"] == 3
    assert facts["requests_success"] == {"stop": 1, "length": 1, "abort": 1, "error": 0}
    assert facts["prompt_tokens_total"] == 49 and facts["generation_tokens_total"] == 11
    assert facts["live_tok_s"] == pytest.approx(11 / 10.0)  # all eleven tokens within the last 10 s
    assert facts["slots_total"] == 4 and facts["slots_in_use"] == 0
    assert facts["requests_running"] == 0 and facts["requests_waiting"] == 0
    assert isinstance(facts["gpu_util"], dict)
    assert facts["engine_facts"]["family"] == "qwen3_moe"
    assert facts["engine_facts"]["weights"] == "/models/tiny.gguf"  # what JSON cannot hold arrives as a string

    history = facts["history"]
    assert [h["id"] for h in history] == ["c", "a", "b"]  # newest first
    assert set(history[0]) == {"id", "prompt_tokens", "generation_tokens", "ttft_s", "e2e_s", "tok_s",
                               "finish_reason", "finished_at"}
    assert [h["finish_reason"] for h in history] == ["abort", "stop", "length"]
    assert [h["generation_tokens"] for h in history] == [3, 4, 4]
    assert history[0]["finished_at"] >= history[1]["finished_at"] >= history[2]["finished_at"]
    assert abs(history[0]["finished_at"] - time.time()) < 60
    assert history[1]["ttft_s"] == pytest.approx(0.20) and history[1]["e2e_s"] == pytest.approx(0.81)
    assert history[1]["tok_s"] == pytest.approx(3 / 0.60, rel=1e-3)

    for key in ("ttft_s", "itl_s", "e2e_s"):
        p = facts["latency"][key]
        assert None not in p.values(), key
        assert p["p50"] <= p["p90"] <= p["p99"], key
    assert facts["latency"]["e2e_s"]["p50"] == pytest.approx(0.81)


def test_latency_is_null_before_any_request():
    facts = Metrics(MODEL, MAX_MODEL_LEN, 2).facts()
    assert facts["latency"]["ttft_s"] == {"p50": None, "p90": None, "p99": None}
    assert facts["history"] == [] and facts["requests_total"] == 0 and facts["live_tok_s"] == 0


def test_request_aborted_in_the_queue():
    m = Metrics(MODEL, MAX_MODEL_LEN, 2)
    t0 = time.monotonic()
    rec = RequestRecord("q", prompt_tokens=9, max_tokens=8, arrival=t0)
    m.queued(rec)
    assert m.facts()["requests_waiting"] == 1
    m.finished(rec, "abort", t0 + 2.0)
    facts = m.facts()
    assert facts["requests_waiting"] == 0 and facts["requests_running"] == 0
    assert facts["requests_success"]["abort"] == 1 and facts["prompt_tokens_total"] == 0
    assert facts["history"][0]["ttft_s"] is None and facts["history"][0]["tok_s"] is None
    assert facts["latency"]["ttft_s"]["p50"] is None and facts["latency"]["e2e_s"]["p50"] == pytest.approx(2.0)
    body, _ = m.render("text/plain", None)
    scraped = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if "le" not in s.labels and s.labels.get("finished_reason") in (None, "abort")}
    assert scraped["vllm:request_queue_time_seconds_sum"] == pytest.approx(2.0)
    assert scraped["vllm:request_prefill_time_seconds_count"] == scraped["vllm:e2e_request_latency_seconds_count"] == 1
    assert scraped["vllm:time_to_first_token_seconds_count"] == 0
    assert scraped["vllm:request_success_total"] == 1


def test_render_negotiates_on_accept_and_format(three):
    m, _ = three
    assert m.render("application/json", None) is None
    assert m.render(None, None) is None
    assert m.render("*/*", None) is None
    body, content_type = m.render("text/plain; version=0.0.4", None)
    assert content_type.startswith("text/plain") and b"vllm:e2e_request_latency_seconds_count" in body
    for accept in ("application/json", None, "*/*"):
        body, content_type = m.render(accept, "prometheus")
        assert content_type.startswith("text/plain") and b"vllm:num_requests_running" in body

    # Prometheus' own scrape header prefers OpenMetrics
    scrape = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    body, content_type = m.render(scrape, None)
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert text.endswith("# EOF\n")
    names = {s.name for family in parse_openmetrics(text) for s in family.samples}
    assert {"vllm:request_success_total", "vllm:e2e_request_latency_seconds_bucket", "strata:live_tok_s"} <= names
    assert not any(n.startswith("vllm_") for n in names)  # colons kept on sample lines


def test_concurrent_requests_from_threads_are_all_recorded():
    m = Metrics(MODEL, MAX_MODEL_LEN, num_slots=8)
    num_threads, num_tokens = 8, 200

    def serve(i):
        rec = RequestRecord(f"r{i}", prompt_tokens=5, max_tokens=num_tokens, arrival=time.monotonic())
        m.queued(rec)
        m.scheduled(rec, time.monotonic())
        for _ in range(num_tokens):
            m.token(rec, time.monotonic())
            if i == 0:
                m.facts()
                m.render("text/plain", None)
        m.finished(rec, "length", time.monotonic())

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    facts = m.facts()
    assert facts["requests_total"] == num_threads and len(facts["history"]) == num_threads
    assert facts["generation_tokens_total"] == num_threads * num_tokens
    assert facts["requests_running"] == 0 and facts["requests_waiting"] == 0
    body, _ = m.render(None, "prometheus")
    scraped = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if not s.labels.get("le") and not s.labels.get("finished_reason")}
    assert scraped["vllm:generation_tokens_total"] == num_threads * num_tokens
    assert scraped["vllm:inter_token_latency_seconds_count"] == num_threads * (num_tokens - 1)


def test_gpu_facts_from_nvml(monkeypatch):
    """With NVML present (here a stand-in module: CI has no GPU), each GPU's use and memory are exported."""
    import sys
    import types

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) * 2**30, total=141 * 2**30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    m = Metrics(MODEL, MAX_MODEL_LEN, 2)
    facts = m.facts()
    assert facts["gpu_util"] == {"0": 40.0, "1": 41.0}
    assert facts["gpu_memory_used_bytes"] == {"0": 2.0**30, "1": 2.0**31}
    body, _ = m.render("text/plain", None)
    values = {(s.name, s.labels.get("gpu")): s.value
              for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert values[("strata:gpu_util", "1")] == 41.0
    assert values[("strata:gpu_memory_total_bytes", "0")] == 141 * 2**30


def test_expert_pairs_counter_follows_the_engine_totals_across_restarts():
    """EXPERTS carries an engine's running totals; the counter adds their growth, and a total that drops (a new
    engine process, counting from 0) adds the new totals instead of going back."""
    from serve.metrics import Metrics

    m = Metrics("m", 128, 2)
    for device, cpu, seconds, nbytes, up, up_bytes in [(10, 4, 0.5, 1000, 2, 300), (15, 6, 0.75, 1500, 3, 450),
                                                       (3, 1, 0.25, 200, 1, 100)]:
        m.expert_pairs(device, cpu, seconds, nbytes, up, up_bytes)  # the third comes from a restarted engine
    assert m.facts()["expert_pairs"] == {"device": 18, "cpu": 7, "uploaded": 4}
    assert m.facts()["expert_pool"] == {"seconds": 1.0, "bytes": 1700, "upload_bytes": 550}
    body, _ = m.render("text/plain", None)
    lines = [line for line in body.decode().splitlines() if line.startswith("strata:expert_pairs_total")]
    assert 'where="device"} 18.0' in lines[0] and 'where="cpu"} 7.0' in lines[1]
    text = body.decode()
    assert 'strata:expert_pool_seconds_total{engine="0",model_name="m"} 1.0' in text
    assert 'strata:expert_pool_read_bytes_total{engine="0",model_name="m"} 1700.0' in text
    assert 'strata:expert_upload_bytes_total{engine="0",model_name="m"} 550.0' in text
    assert 'where="uploaded"} 4.0' in lines[2]
    m.expert_pairs(20, 9)  # an older engine's EXPERTS line, without the pool's fields: they stay where they were
    assert m.facts()["expert_pool"] == {"seconds": 1.0, "bytes": 1700, "upload_bytes": 550}
