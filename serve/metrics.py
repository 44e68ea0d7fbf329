"""Request metrics: vLLM-compatible Prometheus series and Strata's JSON facts, from one set of events.

The HTTP layer reports each request's life (queued, scheduled, token, finished) and the engine's load;
`render()` answers a Prometheus scrape, `facts()` the JSON view of the same numbers.
Metric names, labels (`model_name`, `engine`) and buckets follow vLLM v1's PrometheusStatLogger,
so its Grafana dashboards work unchanged.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE_INDEX = "0"  # vLLM v1 labels its single engine core "0"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
LIVE_WINDOW_S = 10.0
NUM_LATENCY_SAMPLES = 200
NUM_HISTORY = 50
TOKEN_BUCKETS = None  # stands for build_1_2_5_buckets(max_model_len)
# The series of vLLM v1's PrometheusStatLogger that Strata can fill: name after "vllm:", type, help, buckets.
VLLM_METRICS = (
    ("num_requests_running", Gauge, "Number of requests in model execution batches.", None),
    ("num_requests_waiting", Gauge, "Number of requests waiting to be processed.", None),
    ("kv_cache_usage_perc", Gauge, "KV-cache usage. 1 means 100 percent usage.", None),
    ("gpu_cache_usage_perc", Gauge, "GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.", None),
    ("prompt_tokens", Counter, "Number of prefill tokens processed.", None),
    ("generation_tokens", Counter, "Number of generation tokens processed.", None),
    ("num_preemptions", Counter, "Cumulative number of preemption from the engine.", None),
    ("prefix_cache_queries", Counter, "Prefix cache queries, in terms of number of queried tokens.", None),
    ("prefix_cache_hits", Counter, "Prefix cache hits, in terms of number of cached tokens.", None),
    ("gpu_prefix_cache_queries", Counter, "GPU prefix cache queries. DEPRECATED: Use vllm:prefix_cache_queries.", None),
    ("gpu_prefix_cache_hits", Counter, "GPU prefix cache hits. DEPRECATED: Use vllm:prefix_cache_hits.", None),
    ("spec_decode_num_drafts", Counter, "Number of spec decoding drafts.", None),
    ("spec_decode_num_draft_tokens", Counter, "Number of draft tokens.", None),
    ("spec_decode_num_accepted_tokens", Counter, "Number of accepted tokens.", None),
    ("time_to_first_token_seconds", Histogram, "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("inter_token_latency_seconds", Histogram, "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("time_per_output_token_seconds", Histogram,
     "Histogram of time per output token in seconds. DEPRECATED: Use vllm:inter_token_latency_seconds.", ITL_BUCKETS),
    ("request_time_per_output_token_seconds", Histogram, "Histogram of time_per_output_token_seconds per request.",
     ITL_BUCKETS),
    ("e2e_request_latency_seconds", Histogram, "Histogram of e2e request latency in seconds.",
     REQUEST_LATENCY_BUCKETS),
    ("request_queue_time_seconds", Histogram, "Histogram of time spent in WAITING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("request_inference_time_seconds", Histogram, "Histogram of time spent in RUNNING phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("request_prefill_time_seconds", Histogram, "Histogram of time spent in PREFILL phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("request_decode_time_seconds", Histogram, "Histogram of time spent in DECODE phase for request.",
     REQUEST_LATENCY_BUCKETS),
    ("iteration_tokens_total", Histogram, "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS),
    ("request_prompt_tokens", Histogram, "Number of prefill tokens processed.", TOKEN_BUCKETS),
    ("request_generation_tokens", Histogram, "Number of generation tokens processed.", TOKEN_BUCKETS),
    ("request_max_num_generation_tokens", Histogram, "Histogram of maximum number of requested generation tokens.",
     TOKEN_BUCKETS),
    ("request_params_max_tokens", Histogram, "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS),
)
# top-level numeric JSON keys exported as `strata:<key>` gauges
STRATA_GAUGES = ("live_tok_s", "uptime_s", "slots_total", "slots_in_use", "requests_running",
                 "requests_waiting", "requests_total", "prompt_tokens_total", "generation_tokens_total",
                 "kv_cache_usage", "engine_restarts_total", "pipeline_groups")
# the parked conversations and their bytes by tier: `strata:parked_conversations{tier}`, `strata:parked_bytes{tier}`
# (host RAM holds every parked image; the disk tier's files and the copies in VRAM are counted on their own)
PARKED_TIERS = (("ram", "parked_conversations", "parked_bytes"),
                ("disk", "parked_disk_conversations", "parked_disk_bytes"),
                ("vram", "parked_vram_conversations", "parked_vram_bytes"))
RESTORE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # seconds


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
    """Per NVML device index: utilization percent and memory used/total bytes; {} without `pynvml`
    (nvidia-ml-py) or a GPU."""

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

    def memory(self) -> tuple[dict[str, float], dict[str, float]]:
        """(used bytes, total bytes) per device index."""
        self.read()
        used, total = {}, {}
        for i, handle in enumerate(self._handles):
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                used[str(i)], total[str(i)] = float(info.used), float(info.total)
            except Exception:
                pass
        return used, total


def gpu_label(device: str) -> str:
    """The `gpu` label of an engine device: NVML's index for "cuda:N", like strata:gpu_util's (the N-th entry of
    CUDA_VISIBLE_DEVICES when it lists indices; CUDA numbers GPUs as NVML does under CUDA_DEVICE_ORDER=PCI_BUS_ID,
    which autoconfig sets), or the device itself ("cpu")."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        return device
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if all(v.isdigit() for v in visible) and int(index) < len(visible):
        return visible[int(index)]
    return index


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
        for name, doc, column in (
                ("parked_conversations", "Conversations parked, by tier (ram: host RAM, every parked image; disk: "
                 "--park-dir's files; vram: copies in spare VRAM, --park-vram-gb)", 1),
                ("parked_bytes", "Bytes of parked conversations' images, by tier (as parked_conversations)", 2)):
            family = GaugeMetricFamily(f"strata:{name}", doc, labels=["model_name", "engine", "tier"])
            for tier in PARKED_TIERS:
                family.add_metric(labels + [tier[0]], float(facts[tier[column]]))
            yield family
        for key, doc in (("gpu_util", "GPU utilization percent (NVML)"),
                         ("gpu_memory_used_bytes", "GPU memory in use, bytes (NVML)"),
                         ("gpu_memory_total_bytes", "GPU memory, bytes (NVML)")):
            family = GaugeMetricFamily(f"strata:{key}", doc, labels=["model_name", "engine", "gpu"])
            for gpu, value in facts[key].items():
                family.add_metric(labels + [gpu], value)
            yield family
        family = GaugeMetricFamily("strata:expert_residency", "Share of the routed experts held on each device "
                                   "(1: all, or no routed experts); the CPU pool computes the rest",
                                   labels=["model_name", "engine", "gpu"])
        for device, value in (facts["engine_facts"].get("expert_residency") or {}).items():
            family.add_metric(labels + [gpu_label(device)], float(value))
        yield family
        pairs = CounterMetricFamily("strata:expert_pairs", "Routed (row, expert) pairs of the layers whose experts "
                                    "are split with the CPU pool, by where they were computed",
                                    labels=["model_name", "engine", "where"])
        for where, count in facts["expert_pairs"].items():
            pairs.add_metric(labels + [where], float(count))
        yield pairs
        seconds = CounterMetricFamily("strata:expert_pool_seconds", "Host seconds the CPU expert pool spent computing "
                                      "its pairs (per window: divide by vllm:iteration_tokens_total_count)",
                                      labels=["model_name", "engine"])
        seconds.add_metric(labels, float(facts["expert_pool"]["seconds"]))
        yield seconds
        read = CounterMetricFamily("strata:expert_pool_read_bytes", "Bytes of expert weights the CPU expert pool "
                                   "read (each window reads each of its routed host experts once)",
                                   labels=["model_name", "engine"])
        read.add_metric(labels, float(facts["expert_pool"]["bytes"]))
        yield read
        upload = CounterMetricFamily("strata:expert_upload_bytes", "Bytes of host experts' weights uploaded over PCIe "
                                     "for the device to compute their pairs (--pcie-frac; per window: divide by "
                                     "vllm:iteration_tokens_total_count)", labels=["model_name", "engine"])
        upload.add_metric(labels, float(facts["expert_pool"].get("upload_bytes", 0)))
        yield upload
        reused = CounterMetricFamily("strata:parked_reused_bytes", "Bytes of restored conversations' K/V cells that "
                                     "parking them again did not copy again (reuse on re-park)",
                                     labels=["model_name", "engine"])
        reused.add_metric(labels, float(facts["parked_reused_bytes_total"]))
        yield reused


class Metrics:
    """All request and engine metrics of one served model, in its own registry; every method is thread-safe.

    Per request: queued() on arrival, scheduled() when its prompt starts being read, token() for each step that
    emits tokens (it updates the record), finished() once. set_load() after each engine step corrects the
    running/waiting counts that the request events keep.
    """

    def __init__(self, model_name: str, max_model_len: int, num_slots: int):
        self.model_name = model_name
        self.num_slots = num_slots
        self.registry = CollectorRegistry()
        self._lock = threading.RLock()
        self._start = time.monotonic()
        self._gpu = _GpuUtil()
        self._engine_facts: dict = {}
        self._engine_restarts = 0
        self._running = self._waiting = 0
        self._slots_in_use: int | None = None  # None until set_load(): then the engine's count
        self._kv_cache_usage = 0.0
        self._parked = (0, 0, 0, 0, 0, 0)  # conversations parked in host RAM, their bytes; on disk; copies in VRAM
        self._reused_bytes = 0  # bytes re-parks did not copy again, all engines
        self._reused_seen = 0  # the running engine's last total of them
        # pooled layers' routed pairs, by where they ran (device: resident weights; uploaded: --pcie-frac), all engines
        self._expert_pairs = {"device": 0, "cpu": 0, "uploaded": 0}
        self._expert_pairs_seen = (0, 0, 0)  # the running engine's last EXPERTS totals
        self._expert_pool = {"seconds": 0.0, "bytes": 0, "upload_bytes": 0}  # the CPU pools' host seconds and expert bytes read, all engines
        self._expert_pool_seen = (0.0, 0, 0)
        self._prompt_tokens = self._generation_tokens = self._num_finished = 0
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._token_events: deque[list] = deque()  # [monotonic time, tokens] for live_tok_s
        self._ttft: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._itl: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)  # per-request mean inter-token latency
        self._e2e: deque[float] = deque(maxlen=NUM_LATENCY_SAMPLES)
        self._history: deque[dict] = deque(maxlen=NUM_HISTORY)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self._vllm = {}  # name after "vllm:" -> the series of this model and engine
        for name, kind, doc, buckets in VLLM_METRICS:
            extra = {"buckets": buckets or token_buckets} if kind is Histogram else {}
            metric = kind(f"vllm:{name}", doc, ["model_name", "engine"], registry=self.registry, **extra)
            self._vllm[name] = metric.labels(model_name, ENGINE_INDEX)
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        ["model_name", "engine", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, ENGINE_INDEX, reason)
        self._accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft's position in speculative sequence.",
                                         ["model_name", "engine", "position"], registry=self.registry)
        self._spec_seen: list[int] = []  # the running engine's last SPEC totals
        self._restore_seconds = Histogram("strata:parked_restore_seconds",
                                          "Seconds to restore a parked conversation into a sequence, checks included",
                                          ["model_name", "engine", "tier"], buckets=RESTORE_BUCKETS,
                                          registry=self.registry)
        for tier in ("vram", "ram", "disk"):
            self._restore_seconds.labels(model_name, ENGINE_INDEX, tier)
        self.registry.register(_StrataCollector(self))

    # events from the HTTP layer and the engine

    def engine_restarted(self) -> None:
        """The engine process died and was started again."""
        with self._lock:
            self._engine_restarts += 1

    def set_engine_facts(self, facts: dict) -> None:
        """The engine's READY facts, shown under "engine_facts"; values JSON cannot hold become strings."""
        plain = (str, int, float, bool, list, dict, type(None))
        with self._lock:
            self._engine_facts = {str(k): v if isinstance(v, plain) else str(v) for k, v in facts.items()}
        # as vLLM does, a drafting engine's per-position series start at 0: a series first scraped at n would hide
        # its first n accepted tokens from rate() (`speculative` is "ngram:K", None without drafts)
        speculative = str(facts.get("speculative") or "")
        count = speculative.rpartition(":")[2]
        for pos in range(int(count) if count.isdigit() else 0):
            self._accepted_per_pos.labels(self.model_name, ENGINE_INDEX, str(pos))

    def queued(self, rec: RequestRecord) -> None:
        with self._lock:
            self._waiting += 1
            self._vllm["num_requests_waiting"].set(self._waiting)

    def scheduled(self, rec: RequestRecord, now: float) -> None:
        with self._lock:
            if rec.scheduled is not None or rec.finished is not None:
                return
            rec.scheduled = now
            self._vllm["request_queue_time_seconds"].observe(now - rec.arrival)
            self._waiting = max(self._waiting - 1, 0)
            self._running += 1
            self._vllm["num_requests_waiting"].set(self._waiting)
            self._vllm["num_requests_running"].set(self._running)

    def token(self, rec: RequestRecord, now: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens of `rec` came out at `now` (more than one when drafts were accepted)."""
        with self._lock:
            if rec.finished is not None:
                return
            if rec.scheduled is None:
                self.scheduled(rec, now)
            if rec.first_token is None:
                rec.first_token = now
                self._vllm["time_to_first_token_seconds"].observe(now - rec.arrival)
                self._vllm["request_prefill_time_seconds"].observe(now - rec.scheduled)
                self._vllm["prompt_tokens"].inc(rec.prompt_tokens)
                self._prompt_tokens += rec.prompt_tokens
            else:
                self._vllm["inter_token_latency_seconds"].observe(now - rec.last_token)
                self._vllm["time_per_output_token_seconds"].observe(now - rec.last_token)
            rec.last_token = now
            rec.generation_tokens += num_tokens
            self._vllm["generation_tokens"].inc(num_tokens)
            self._generation_tokens += num_tokens
            if self._token_events and now - self._token_events[-1][0] < 0.1:
                self._token_events[-1][1] += num_tokens
            else:
                self._token_events.append([now, num_tokens])

    def rejected(self, rec: RequestRecord) -> None:
        """The engine turned the request away before it waited (its waiting line was full): no other trace."""
        with self._lock:
            if rec.finished is not None:
                return
            rec.finished, rec.finish_reason = time.monotonic(), "rejected"
            self._waiting = max(self._waiting - 1, 0)
            self._vllm["num_requests_waiting"].set(self._waiting)

    def finished(self, rec: RequestRecord, reason: str, now: float) -> None:
        """Records `rec` once; a second call (an abort racing a stop) is ignored."""
        with self._lock:
            if rec.finished is not None:
                return
            rec.finished, rec.finish_reason = now, reason
            if rec.scheduled is None:  # never left the queue
                self._vllm["request_queue_time_seconds"].observe(now - rec.arrival)
                self._waiting = max(self._waiting - 1, 0)
            else:
                self._running = max(self._running - 1, 0)
            self._vllm["num_requests_waiting"].set(self._waiting)
            self._vllm["num_requests_running"].set(self._running)

            scheduled = rec.scheduled if rec.scheduled is not None else now
            first = rec.first_token if rec.first_token is not None else now
            last = rec.last_token if rec.last_token is not None else first
            e2e, decode = now - rec.arrival, last - first
            if rec.first_token is None:  # ended before its first token: all of its running time was prefill
                self._vllm["request_prefill_time_seconds"].observe(now - scheduled)
            n = rec.generation_tokens
            tpot = decode / (n - 1) if n > 1 else 0.0  # as vLLM: 0 for single-token requests
            self._vllm["e2e_request_latency_seconds"].observe(e2e)
            self._vllm["request_inference_time_seconds"].observe(last - scheduled)
            self._vllm["request_decode_time_seconds"].observe(decode)
            self._vllm["request_prompt_tokens"].observe(rec.prompt_tokens)
            self._vllm["request_generation_tokens"].observe(n)
            self._vllm["request_max_num_generation_tokens"].observe(n)  # n=1 sampling: the one sequence's length
            if rec.max_tokens:
                self._vllm["request_params_max_tokens"].observe(rec.max_tokens)
            self._vllm["request_time_per_output_token_seconds"].observe(tpot)
            self._request_success.labels(self.model_name, ENGINE_INDEX, reason).inc()
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

    def window(self, rows: int) -> None:
        """The engine read a window of `rows` rows (decoding and prompt rows)."""
        self._vllm["iteration_tokens_total"].observe(rows)

    def preempted(self) -> None:
        self._vllm["num_preemptions"].inc()

    def set_load(self, running: int, waiting: int, slots_in_use: int, kv_cache_usage: float) -> None:
        """The engine's own counts after a step; they replace the counts kept from request events."""
        with self._lock:
            self._running, self._waiting = running, waiting
            self._slots_in_use, self._kv_cache_usage = slots_in_use, kv_cache_usage
            self._vllm["num_requests_running"].set(running)
            self._vllm["num_requests_waiting"].set(waiting)
            self._vllm["kv_cache_usage_perc"].set(kv_cache_usage)
            self._vllm["gpu_cache_usage_perc"].set(kv_cache_usage)

    def set_parked(self, conversations: int, nbytes: int, disk_conversations: int = 0, disk_bytes: int = 0,
                   reused_bytes: int | None = None, vram_conversations: int = 0, vram_bytes: int = 0) -> None:
        """The engine's parked conversations and the host RAM they take, and those in `--park-dir`'s files, its
        running total of bytes that re-parks did not copy (its PARKED event; a total below the last one means a new
        engine process, which counts from 0), and the copies in VRAM (`--park-vram-gb`) and their bytes."""
        with self._lock:
            self._parked = (conversations, nbytes, disk_conversations, disk_bytes, vram_conversations, vram_bytes)
            if reused_bytes is not None:
                last = self._reused_seen if reused_bytes >= self._reused_seen else 0
                self._reused_bytes += reused_bytes - last
                self._reused_seen = reused_bytes

    def restored(self, seconds: float, tier: str) -> None:
        """A parked conversation restored from `tier` (vram, ram or disk) in `seconds` (the engine's RESTORED event)."""
        self._restore_seconds.labels(self.model_name, ENGINE_INDEX, tier).observe(seconds)

    def expert_pairs(self, on_device: int, on_cpu: int, pool_seconds: float = 0.0, pool_bytes: int = 0,
                     uploaded: int = 0, upload_bytes: int = 0) -> None:
        """The engine's EXPERTS running totals (pairs of its pooled layers computed on the device / by the CPU
        pool, the pools' host seconds and expert bytes read, pairs computed on uploaded weights and the bytes
        uploaded); a total below the last one means a new engine process, which counts from 0."""
        with self._lock:
            last_device, last_cpu, last_uploaded = self._expert_pairs_seen
            last_seconds, last_bytes, last_up_bytes = self._expert_pool_seen
            if (on_device < last_device or on_cpu < last_cpu or uploaded < last_uploaded or pool_seconds < last_seconds
                    or pool_bytes < last_bytes or upload_bytes < last_up_bytes):
                last_device = last_cpu = last_uploaded = last_bytes = last_up_bytes = 0
                last_seconds = 0.0
            self._expert_pairs["device"] += on_device - last_device
            self._expert_pairs["cpu"] += on_cpu - last_cpu
            self._expert_pairs["uploaded"] += uploaded - last_uploaded
            self._expert_pool["seconds"] += pool_seconds - last_seconds
            self._expert_pool["bytes"] += pool_bytes - last_bytes
            self._expert_pool["upload_bytes"] += upload_bytes - last_up_bytes
            self._expert_pairs_seen = (on_device, on_cpu, uploaded)
            self._expert_pool_seen = (pool_seconds, pool_bytes, upload_bytes)

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Increments (tokens looked up, tokens found) since the last call, not running totals."""
        for prefix in ("", "gpu_"):
            self._vllm[f"{prefix}prefix_cache_queries"].inc(queries)
            self._vllm[f"{prefix}prefix_cache_hits"].inc(hits)

    def spec_decode(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: list[int] = ()) -> None:
        """Increments since the last call, not running totals."""
        self._vllm["spec_decode_num_drafts"].inc(drafts)
        self._vllm["spec_decode_num_draft_tokens"].inc(draft_tokens)
        self._vllm["spec_decode_num_accepted_tokens"].inc(accepted)
        for pos, n in enumerate(accepted_per_pos):
            self._accepted_per_pos.labels(self.model_name, ENGINE_INDEX, str(pos)).inc(n)

    def spec_totals(self, totals: list[int]) -> None:
        """The engine's SPEC event: running totals (drafts, draft tokens, accepted, accepted per position), counted
        from the last ones; [] when a new engine process starts, which counts from 0."""
        with self._lock:
            last = self._spec_seen if totals and self._spec_seen and self._spec_seen[0] <= totals[0] else []
            last = last + [0] * (len(totals) - len(last))
            delta = [now - before for now, before in zip(totals, last)]
            self._spec_seen = list(totals)
        if len(delta) >= 3:
            self.spec_decode(delta[0], delta[1], delta[2], delta[3:])

    # views

    def facts(self) -> dict:
        now = time.monotonic()
        gpu_used, gpu_total = self._gpu.memory()
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
                "engine_restarts_total": self._engine_restarts,
                "pipeline_groups": int(self._engine_facts.get("batch_groups", 0) or 0),
                "parked_conversations": self._parked[0],
                "parked_bytes": self._parked[1],
                "parked_disk_conversations": self._parked[2],
                "parked_disk_bytes": self._parked[3],
                "parked_vram_conversations": self._parked[4],
                "parked_vram_bytes": self._parked[5],
                "parked_reused_bytes_total": self._reused_bytes,
                "expert_pairs": dict(self._expert_pairs),
                "expert_pool": dict(self._expert_pool),
                "latency": {"ttft_s": _percentiles(self._ttft), "itl_s": _percentiles(self._itl),
                            "e2e_s": _percentiles(self._e2e)},
                "history": list(reversed(self._history)),
                "gpu_util": self._gpu.read(),
                "gpu_memory_used_bytes": gpu_used,
                "gpu_memory_total_bytes": gpu_total,
                "engine_facts": dict(self._engine_facts),
            }
        return facts

    def render(self, accept: str | None, fmt: str | None) -> tuple[bytes, str] | None:
        """(body, content type) for a Prometheus scrape; None when the caller should answer facts() as JSON."""
        accept = accept or ""
        if "application/openmetrics-text" in accept:
            # ALLOWUTF8 keeps the `:` in sample names: prometheus_client's UNDERSCORES escaping turns
            # `vllm:x_total` into `vllm_x_total` on sample lines only (client_python issue #1177).
            # Every name here is a valid legacy name, so no escaping is needed.
            return openmetrics.generate_latest(self.registry, escaping=openmetrics.ALLOWUTF8), OPENMETRICS_CONTENT_TYPE
        if fmt == "prometheus" or "text/plain" in accept:
            return exposition.generate_latest(self.registry), PROMETHEUS_CONTENT_TYPE
        return None
