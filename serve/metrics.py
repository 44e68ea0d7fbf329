"""Request metrics: vLLM-compatible Prometheus series and Strata's JSON facts, from one set of events.

The HTTP layer reports each request's life (queued, scheduled, token, finished) and the engine's load;
`render()` answers a Prometheus scrape, `facts()` the JSON view of the same numbers.
Metric names, labels (`model_name`, `engine`) and buckets follow vLLM v1's PrometheusStatLogger,
so its Grafana dashboards work unchanged.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE_INDEX = "0"  # vLLM v1 labels its single engine core "0"
LIVE_WINDOW_S = 10.0
NUM_LATENCY_SAMPLES = 200
NUM_HISTORY = 50
# top-level numeric JSON keys exported as `strata:<key>` gauges
STRATA_GAUGES = ("live_tok_s", "uptime_s", "slots_total", "slots_in_use", "requests_running",
                 "requests_waiting", "requests_total", "prompt_tokens_total", "generation_tokens_total",
                 "kv_cache_usage")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


@dataclass
class RequestRecord:
    """One request's timeline (time.monotonic() stamps); Metrics fills in everything after `arrival`."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    scheduled: float | None = None  # left the queue: its prompt starts being read
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    generation_tokens: int = 0
    finish_reason: str | None = None  # "stop", "length", "abort", "error"


def _percentiles(values) -> dict[str, float | None]:
    xs = sorted(values)
    if not xs:
        return {"p50": None, "p90": None, "p99": None}

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


class _GpuUtil:
    """Utilization percent per NVML device index; {} without `pynvml` (nvidia-ml-py) or a GPU."""

    def __init__(self):
        self._nvml = None
        self._handles: list | None = None

    def read(self) -> dict[str, float]:
        if self._handles is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
                self._nvml = pynvml
            except Exception:
                self._handles = []
        util = {}
        for i, handle in enumerate(self._handles):
            try:
                util[str(i)] = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                pass
        return util


class _StrataCollector(Collector):
    """`strata:<key>` gauges computed from facts() at scrape time."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        facts = self._metrics.facts()
        labels = [facts["model"], ENGINE_INDEX]
        for key in STRATA_GAUGES:
            family = GaugeMetricFamily(f"strata:{key}", f"Strata fact {key}", labels=["model_name", "engine"])
            family.add_metric(labels, float(facts[key]))
            yield family
        family = GaugeMetricFamily("strata:gpu_util", "GPU utilization percent (NVML)",
                                   labels=["model_name", "engine", "gpu"])
        for gpu, percent in facts["gpu_util"].items():
            family.add_metric(labels + [gpu], percent)
        yield family


class Metrics:
    """All request and engine metrics of one served model, in its own registry; every method is thread-safe."""

    def __init__(self, model_name: str, max_model_len: int, num_slots: int):
        self.model_name = model_name
        self.num_slots = num_slots
        self.registry = CollectorRegistry()
        self._lock = threading.RLock()
        self._start = time.monotonic()
        self._gpu = _GpuUtil()
        self._engine_facts: dict = {}
        self._running = self._waiting = 0
        self._slots_in_use: int | None = None  # None until set_load(): then the engine's count
        self._kv_cache_usage = 0.0
        self._prompt_tokens = self._generation_tokens = self._num_finished = 0
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._token_events: deque[list] = deque()  # [monotonic time, tokens] for live_tok_s
        self._ttft: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._itl: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)  # per-request mean inter-token latency
        self._e2e: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._history: deque[dict] = deque(maxlen=NUM_HISTORY)

        labels = [model_name, ENGINE_INDEX]
        reg = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name", "engine"], registry=reg).labels(*labels)

        def counter(name, doc):
            return Counter(name, doc, ["model_name", "engine"], registry=reg).labels(*labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name", "engine"], buckets=buckets, registry=reg).labels(*labels)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage_perc = gauge("vllm:gpu_cache_usage_perc",
                                          "GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        self.gpu_prefix_cache_queries = counter("vllm:gpu_prefix_cache_queries",
                                                "DEPRECATED: Use vllm:prefix_cache_queries instead.")
        self.gpu_prefix_cache_hits = counter("vllm:gpu_prefix_cache_hits",
                                             "DEPRECATED: Use vllm:prefix_cache_hits instead.")
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "engine", "finished_reason"], registry=reg)
        self.request_success = {r: success.labels(model_name, ENGINE_INDEX, r) for r in FINISH_REASONS}
        self._request_success_family = success

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS)
        self.request_time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                                       "Histogram of time_per_output_token_seconds per request.",
                                                       ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.",
                                            REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram("vllm:request_inference_time_seconds",
                                                "Histogram of time spent in RUNNING phase for request.",
                                                REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        reg.register(_StrataCollector(self))

    # events from the HTTP layer and the engine

    def set_engine_facts(self, facts: dict) -> None:
        with self._lock:
            self._engine_facts = dict(facts)

    def queued(self, rec: RequestRecord) -> None:
        with self._lock:
            self._waiting += 1
            self.num_requests_waiting.set(self._waiting)

    def scheduled(self, rec: RequestRecord, now: float) -> None:
        with self._lock:
            if rec.scheduled is not None or rec.finished is not None:
                return
            rec.scheduled = now
            self.request_queue_time.observe(now - rec.arrival)
            self._waiting = max(self._waiting - 1, 0)
            self._running += 1
            self.num_requests_waiting.set(self._waiting)
            self.num_requests_running.set(self._running)

    def token(self, rec: RequestRecord, now: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens of `rec` came out at `now` (more than one when drafts were accepted)."""
        with self._lock:
            if rec.finished is not None:
                return
            if rec.scheduled is None:
                self.scheduled(rec, now)
            if rec.first_token is None:
                rec.first_token = now
                self.time_to_first_token.observe(now - rec.arrival)
                self.request_prefill_time.observe(now - rec.scheduled)
                self.prompt_tokens.inc(rec.prompt_tokens)
                self._prompt_tokens += rec.prompt_tokens
            else:
                self.inter_token_latency.observe(now - rec.last_token)
                self.time_per_output_token.observe(now - rec.last_token)
            rec.last_token = now
            rec.generation_tokens += num_tokens
            self.generation_tokens.inc(num_tokens)
            self._generation_tokens += num_tokens
            if self._token_events and now - self._token_events[-1][0] < 0.1:
                self._token_events[-1][1] += num_tokens
            else:
                self._token_events.append([now, num_tokens])

    def finished(self, rec: RequestRecord, reason: str, now: float) -> None:
        """Records `rec` once; a second call (an abort racing a stop) is ignored."""
        with self._lock:
            if rec.finished is not None:
                return
            rec.finished, rec.finish_reason = now, reason
            if rec.scheduled is None:  # never left the queue
                self.request_queue_time.observe(now - rec.arrival)
                self._waiting = max(self._waiting - 1, 0)
            else:
                self._running = max(self._running - 1, 0)
            self.num_requests_waiting.set(self._waiting)
            self.num_requests_running.set(self._running)

            scheduled = rec.scheduled if rec.scheduled is not None else now
            first = rec.first_token if rec.first_token is not None else now
            last = rec.last_token if rec.last_token is not None else first
            e2e, decode = now - rec.arrival, last - first
            n = rec.generation_tokens
            tpot = decode / (n - 1) if n > 1 else 0.0  # as vLLM: 0 for single-token requests
            self.e2e_request_latency.observe(e2e)
            self.request_inference_time.observe(last - scheduled)
            self.request_decode_time.observe(decode)
            self.request_prompt_tokens.observe(rec.prompt_tokens)
            self.request_generation_tokens.observe(n)
            self.request_max_num_generation_tokens.observe(n)  # n=1 sampling: the one sequence's length
            if rec.max_tokens:
                self.request_params_max_tokens.observe(rec.max_tokens)
            self.request_time_per_output_token.observe(tpot)
            if reason not in self.request_success:
                self.request_success[reason] = self._request_success_family.labels(
                    self.model_name, ENGINE_INDEX, reason)
            self.request_success[reason].inc()
            self._success[reason] = self._success.get(reason, 0) + 1
            self._num_finished += 1

            ttft = rec.first_token - rec.arrival if rec.first_token is not None else None
            self._e2e.append(e2e)
            if ttft is not None:
                self._ttft.append(ttft)
            if n > 1:
                self._itl.append(tpot)
            self._history.append({
                "id": rec.request_id,
                "prompt_tokens": rec.prompt_tokens,
                "generation_tokens": n,
                "ttft_s": None if ttft is None else round(ttft, 4),
                "e2e_s": round(e2e, 4),
                "tok_s": round((n - 1) / decode, 2) if n > 1 and decode > 0 else None,  # decode speed
                "finish_reason": reason,
                "finished_at": time.time() - (time.monotonic() - now),
            })

    def preempted(self) -> None:
        self.num_preemptions.inc()

    def set_load(self, running: int, waiting: int, slots_in_use: int, kv_cache_usage: float) -> None:
        """The engine's own counts after a step; they replace the counts kept from request events."""
        with self._lock:
            self._running, self._waiting = running, waiting
            self._slots_in_use, self._kv_cache_usage = slots_in_use, kv_cache_usage
            self.num_requests_running.set(running)
            self.num_requests_waiting.set(waiting)
            self.kv_cache_usage_perc.set(kv_cache_usage)
            self.gpu_cache_usage_perc.set(kv_cache_usage)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Increments (tokens looked up, tokens found) since the last call, not running totals."""
        for counter, value in ((self.prefix_cache_queries, queries), (self.gpu_prefix_cache_queries, queries),
                               (self.prefix_cache_hits, hits), (self.gpu_prefix_cache_hits, hits)):
            counter.inc(value)

    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        """Increments since the last call, not running totals."""
        self.spec_decode_num_drafts.inc(drafts)
        self.spec_decode_num_draft_tokens.inc(draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(accepted)

    # views

    def facts(self) -> dict:
        now = time.monotonic()
        with self._lock:
            while self._token_events and self._token_events[0][0] < now - LIVE_WINDOW_S:
                self._token_events.popleft()
            live = sum(n for _, n in self._token_events) / LIVE_WINDOW_S
            facts = {
                "model": self.model_name,
                "engine": "strata",
                "uptime_s": now - self._start,
                "live_tok_s": live,
                "slots_total": self.num_slots,
                "slots_in_use": self._running if self._slots_in_use is None else self._slots_in_use,
                "requests_running": self._running,
                "requests_waiting": self._waiting,
                "requests_total": self._num_finished,
                "requests_success": dict(self._success),
                "prompt_tokens_total": self._prompt_tokens,
                "generation_tokens_total": self._generation_tokens,
                "kv_cache_usage": self._kv_cache_usage,
                "latency": {"ttft_s": _percentiles(self._ttft), "itl_s": _percentiles(self._itl),
                            "e2e_s": _percentiles(self._e2e)},
                "history": list(reversed(self._history)),
                "engine_facts": dict(self._engine_facts),
            }
        facts["gpu_util"] = self._gpu.read()
        return facts

    def render(self, accept: str | None, fmt: str | None) -> tuple[bytes, str] | None:
        """(body, content type) for a Prometheus scrape; None when the caller should answer facts() as JSON."""
        accept = accept or ""
        if fmt != "prometheus" and "text/plain" not in accept and "openmetrics" not in accept:
            return None
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
