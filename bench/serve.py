"""What a user gets through `strata serve`, measured with real streaming HTTP clients, against the in-process engine.

One run, one set of weights. It starts `strata serve` as a subprocess and measures, over HTTP:

- start-up: from the process start to the first `/health` 200;
- the first request after start (its TTFT) against the same kind of request once warm (a new prompt, so no
  prefix is reused; the same prompt again is shown too, with its prefix reused);
- waves of N simultaneous streaming clients (`--concurrency`, capped by `--batch`): each sends its own
  128-token prompt of token ids to /v1/completions (greedy, `ignore_eos`, `--tokens` tokens, `stream: true`)
  over its own connection; the clients are spread over `--client-procs` processes, so parsing the streams is
  not what limits a wave. Per wave: total tokens/s (every generated token over the time from the first send
  to the last token), median and p99 TTFT, median and p99 gap between the text chunks of a stream, and the
  CPU time the server process (not its engine) spent per token;
- the stall case: up to 8 streams run (one slot is left free), then one `--long-prompt`-token prompt arrives
  (max_tokens 1): the streams' worst gap while it is read and overall, and its TTFT against its TTFT on the
  idle server.

Then it stops the server (freeing the device) and runs the in-process anchor on the same weights and settings:
`Engine` + `warm_up` + batch slots stepped as the engine process steps them, the same prompts admitted
together, tokens/s over the same span (prompt reading included). Each HTTP wave prints its ratio to it.

With `--paced-engine MS` the server runs in front of a stand-in engine (bench/paced_engine.py) that computes
nothing and gives every running request a token each MS milliseconds: only the waves run, against that pace as
the anchor, so what is measured is the HTTP server, the pipes and the clients at a GPU's token rate (8 ms: the
H200's 64-row windows of the Qwen3-30B-A3B shape) on any machine.

The model is `--model` (a Hugging Face folder, a .gguf file, or `default`: the embedded SmolLM2-135M), or
`--shape NAME --layers N`: a random-weight safetensors folder at a real shape (bench/shapes.py), written once
with SmolLM2's tokenizer (hence `--vocab 49152`: every generated id decodes to text) and reused from
`--checkpoint-dir`.

    # the CPU (a few minutes on two cores)
    python bench/serve.py --model default --batch 8 --concurrency 1,4,8 --tokens 32 --long-prompt 1000 --max-cells 2048
    # the server alone, at a GPU's pace (any machine)
    python bench/serve.py --paced-engine 8 --batch 64 --concurrency 1,8,16,32,64 --tokens 256 --max-cells 8192
    # two long conversations alternating on one slot (parked and restored every turn)
    python bench/serve.py --model default --alternate 1500,3 --max-cells 2048
    # a GPU
    python bench/serve.py --shape qwen3-30b-a3b --layers 24 --device cuda --batch 64 --concurrency 1,8,16,32,64 \\
        --max-cells 8192 --json serve.json
    # the same weights quantized to Q4_K as they load (`strata serve --quantization q4_k`), on both sides
    python bench/serve.py --shape qwen3-30b-a3b --layers 24 --device cuda --quantization q4_k ...
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import random_checkpoint, write_tokenizer  # noqa: E402
from strata.quant.packed import FORMATS  # noqa: E402

PROMPT_LEN = 128
STALL_STREAMS = 8
STALL_STREAM_TOKENS = 1024
STALL_SETTLE_S = 1.0  # the streams run this long before the long prompt arrives, and after it is answered
STARTUP_DEADLINE_S = 1800
HTTP_TIMEOUT = httpx.Timeout(1800.0, connect=60.0)


# the model: a given path, or a random-weight folder at a real shape (bench/checkpoints.py)


def model_path(args) -> str:
    return str(random_checkpoint(args)) if args.shape else args.model


def prompts(tag: str, count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids (ids below 100, SmolLM2's special tokens, are left out);
    each tag draws its own, so no prompt shares a prefix the engine could reuse."""
    out = []
    for i in range(count):
        rng = random.Random(f"{tag}/{i}")
        out.append([rng.randrange(100, vocab) for _ in range(length)])
    return out


# the server


def open_model(model: str, args):
    """The model as the server's engine opens it (with --quantization's quantizer)."""
    from strata.model.loader import ModelFiles

    quantization = getattr(args, "quantization", None)
    return ModelFiles.open(model, quantization, args.device if quantization else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch),
             "--max-cells", str(args.max_cells)]
    if args.max_window_tokens is not None:
        flags += ["--max-window-tokens", str(args.max_window_tokens)]
    if getattr(args, "spec", None):  # drafts (bench/spec.py --server): every slot count drafts
        flags += ["--spec", args.spec, "--spec-max-active", "256"]
    if getattr(args, "park_vram_gb", 0):
        flags += ["--park-vram-gb", str(args.park_vram_gb)]
    if getattr(args, "quantization", None):
        flags += ["--quantization", args.quantization]
    if getattr(args, "expert_budget_gb", None):
        flags += ["--expert-budget-gb", args.expert_budget_gb]
    if getattr(args, "cpu_threads", None):
        flags += ["--cpu-threads", str(args.cpu_threads)]
    return flags


def expert_options(args) -> dict:
    """--expert-budget-gb and --cpu-threads as `Engine` takes them (the server gets them as flags)."""
    budget = getattr(args, "expert_budget_gb", None)
    return dict(expert_budget_gb=[float(v) for v in budget.split(",")] if budget else None,
                cpu_threads=getattr(args, "cpu_threads", None))


class ServerProcess:
    """`strata serve` on loopback and a free port, its output in a log file."""

    def __init__(self, model: str, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="strata-serve-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        argv = [sys.executable, "-m", "strata.cli", "serve", "--model", model, "--host", "127.0.0.1",
                "--port", str(self.port), *engine_flags(args)]
        if args.paced_engine is not None:
            argv = [sys.executable, str(Path(__file__).resolve().parent / "paced_engine.py"), "serve", "--model", model,
                    "--port", str(self.port), "--batch", str(args.batch), "--max-cells", str(args.max_cells),
                    "--interval-ms", str(args.paced_engine)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.engine_pid: int | None = None

    def wait_healthy(self) -> float:
        """Poll /health until it answers 200; the seconds since the process started."""
        deadline = self.started + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"strata serve exited with code {self.proc.returncode}; see {self.log_path}:\n"
                                 + self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    took = time.monotonic() - self.started
                    self.engine_pid = self.facts().get("engine_facts", {}).get("pid")
                    return took
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"strata serve was not healthy within {STARTUP_DEADLINE_S} s; see {self.log_path}")

    def facts(self) -> dict:
        return httpx.get(self.url + "/metrics", timeout=10).json()

    def windows(self) -> tuple[float, float]:
        """(windows read, rows in them) so far: vllm:iteration_tokens_total's count and sum."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", headers={"accept": "text/plain"}, timeout=10).text
        found = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_tokens_total"
                 for s in f.samples if s.name.endswith(("_count", "_sum"))}
        return found.get("vllm:iteration_tokens_total_count", 0.0), found.get("vllm:iteration_tokens_total_sum", 0.0)

    def wait_idle(self, deadline_s: float = 120.0) -> None:
        """Until the server runs and holds no request (aborted streams end a moment after their clients go)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            facts = self.facts()
            if facts["requests_running"] == 0 and facts["requests_waiting"] == 0:
                return
            time.sleep(0.1)
        raise SystemExit(f"the server still runs requests after {deadline_s} s")

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "".join(Path(self.log_path).read_text().splitlines(keepends=True)[-lines:])

    def stop(self) -> None:
        """SIGTERM the server (it stops its engine), then wait until the engine process is gone too."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.engine_pid is not None and not wait_gone(self.engine_pid, 30):
            print(f"the engine process {self.engine_pid} outlived the server; stopping it", file=sys.stderr)
            os.kill(self.engine_pid, signal.SIGTERM)
            wait_gone(self.engine_pid, 30)
        self.log.close()


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


# streaming clients


@dataclass
class Stream:
    """One streaming request as its client saw it (time.monotonic seconds: one clock for every process)."""

    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of each SSE chunk that carried text
    end: float = 0.0  # arrival of the chunk with the finish reason
    tokens: int = 0  # completion tokens (the usage chunk)
    error: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set at the first text chunk, or at the end

    @property
    def ttft(self) -> float | None:
        """Until the first text chunk (or the end, for an answer that showed no text)."""
        first = self.chunks[0] if self.chunks else self.end
        return first - self.sent if first else None

    def gaps(self, start: float = float("-inf"), stop: float = float("inf")) -> list[float]:
        """Gaps between consecutive text chunks; with a span, only the gaps that overlap it."""
        return [b - a for a, b in zip(self.chunks, self.chunks[1:]) if b > start and a < stop]


def completion_body(ids: list[int], max_tokens: int) -> dict:
    return {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_stream(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int, s: Stream) -> Stream:
    """Send one streaming completion and record when its chunks arrive into `s`."""
    s.sent = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=completion_body(ids, max_tokens)) as reply:
            if reply.status_code != 200:
                s.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return s
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.monotonic(), json.loads(line[6:])
                if "error" in chunk:
                    s.error = chunk["error"].get("message", "error")
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        s.chunks.append(now)
                        s.started.set()
                    if choice.get("finish_reason"):
                        s.end = now
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.started.set()  # also when it failed or ended without text: nobody waits for it forever
    return s


async def one_request(url: str, ids: list[int], max_tokens: int) -> Stream:
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        return await run_stream(client, url, ids, max_tokens, Stream())


async def warm_client(url: str) -> None:
    """One streamed GET of /health from this process's async HTTP stack. A client process's first async request
    pays httpx's and httpcore's lazy set-up, 30-50 ms on a 2-core machine: without this the first-request figure
    measured the benchmark's own client (warming the client against an unrelated HTTP server removed the whole
    difference; warming the server from another process removed none of it)."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        async with client.stream("GET", url + "/health") as r:
            async for line in r.aiter_lines():
                json.loads(line)


async def wave(url: str, wave_prompts: list[list[int]], max_tokens: int, start_at: float | None = None) -> list[Stream]:
    """All prompts sent at once (at `start_at`, a time.monotonic time, when given), each by its own client over its
    own connection."""
    clients = [httpx.AsyncClient(timeout=HTTP_TIMEOUT) for _ in wave_prompts]
    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        return list(await asyncio.gather(*(run_stream(c, url, ids, max_tokens, Stream())
                                           for c, ids in zip(clients, wave_prompts))))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def wave_share(url: str, share: list[list[int]], max_tokens: int, start_at: float) -> list[dict]:
    """A client process's share of a wave (`ClientProcesses`): its streams as plain fields."""
    streams = asyncio.run(wave(url, share, max_tokens, start_at))
    return [{"sent": s.sent, "chunks": s.chunks, "end": s.end, "tokens": s.tokens, "error": s.error} for s in streams]


class ClientProcesses:
    """Worker processes that run a wave's clients together, each its share (one process's event loop parsing 64
    streams' chunks would be measured instead of the server). A wave starts in every process at one agreed
    time.monotonic time (one clock for every process on the machine)."""

    START_DELAY_S = 0.5

    def __init__(self, count: int):
        self.count = count
        self.pool = (concurrent.futures.ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"))
                     if count > 1 else None)

    async def wave(self, url: str, wave_prompts: list[list[int]], max_tokens: int) -> list[Stream]:
        if self.pool is None or len(wave_prompts) < 2:
            return await wave(url, wave_prompts, max_tokens)
        shares = [wave_prompts[k :: self.count] for k in range(self.count)]
        start_at = time.monotonic() + self.START_DELAY_S
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(loop.run_in_executor(self.pool, wave_share, url, share, max_tokens, start_at)
                                      for share in shares if share))
        return [Stream(**fields) for share in done for fields in share]

    def warm(self, url: str) -> None:
        """Start every worker (imports included) before a wave is timed."""
        if self.pool is not None:
            list(self.pool.map(wave_share, [url] * self.count, [[]] * self.count, [1] * self.count,
                               [0.0] * self.count))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolated between the nearest ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    x = (len(v) - 1) * q / 100
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def wave_figures(streams: list[Stream]) -> dict:
    done = [s for s in streams if s.error is None]
    gaps = [g for s in done for g in s.gaps()]
    ttfts = [s.ttft for s in done if s.ttft is not None]
    wall = max((s.end for s in done), default=0.0) - min(s.sent for s in streams)
    tokens = sum(s.tokens for s in done)
    return {"clients": len(streams), "errors": len(streams) - len(done), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99),
            "first_error": next((s.error for s in streams if s.error), None)}


# the server's scenarios


async def first_requests(server: ServerProcess, vocab: int, max_tokens: int) -> dict:
    """(c) The first request after start, a new one of the same kind once warm, and the first one's prompt again."""
    first, second = prompts("first", 2, PROMPT_LEN, vocab)
    await warm_client(server.url)
    cold = await one_request(server.url, first, max_tokens)
    warm = await one_request(server.url, second, max_tokens)
    again = await one_request(server.url, first, max_tokens)
    for s in (cold, warm, again):
        if s.error or s.ttft is None:
            raise SystemExit(f"the first requests failed: {s.error}; see {server.log_path}:\n{server.log_tail()}")
    return {"cold_ttft_s": cold.ttft, "warm_ttft_s": warm.ttft, "cold_over_warm": cold.ttft / warm.ttft,
            "same_prompt_ttft_s": again.ttft}


def cpu_seconds(pid: int | None) -> float:
    """The user + system CPU seconds a process has used so far (0 when it is not known)."""
    import psutil

    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def waves(server: ServerProcess, wave_prompts: dict[int, list[list[int]]], max_tokens: int,
                clients: ClientProcesses) -> dict[int, dict]:
    """(a) A wave of N simultaneous streams for each N, and the CPU the server and its engine spent on it."""
    out = {}
    clients.warm(server.url)
    for n, batch in wave_prompts.items():
        server.wait_idle()
        cpu = (cpu_seconds(server.proc.pid), cpu_seconds(server.engine_pid))
        windows = server.windows()
        figures = out[n] = wave_figures(await clients.wave(server.url, batch, max_tokens))
        spent = (cpu_seconds(server.proc.pid) - cpu[0], cpu_seconds(server.engine_pid) - cpu[1])
        tokens = max(figures["tokens"], 1)
        figures.update(server_cpu_s=spent[0], engine_cpu_s=spent[1], server_cpu_per_token_s=spent[0] / tokens)
        after = server.windows()
        figures.update(windows=after[0] - windows[0], window_rows=after[1] - windows[1])
        print(f"  wave of {n}: {figures['tok_s']:.1f} tok/s; the server's CPU {spent[0] / figures['wall_s']:.0%} of a "
              f"core ({spent[0] / tokens * 1e6:.0f} us a token), the engine's {spent[1] / figures['wall_s']:.0%}",
              flush=True)
    return out


async def stall_case(server: ServerProcess, args, vocab: int, num_streams: int, stream_tokens: int) -> dict:
    """(b) Streams run; one long prompt arrives: how long do the streams stall, and how long does it wait?"""
    idle_prompt, busy_prompt = prompts("long", 2, args.long_prompt, vocab)
    server.wait_idle()
    idle = await one_request(server.url, idle_prompt, 1)
    streams = [Stream() for _ in range(num_streams)]
    clients = [httpx.AsyncClient(timeout=HTTP_TIMEOUT) for _ in streams]
    tasks = [asyncio.create_task(run_stream(c, server.url, ids, stream_tokens, s))
             for c, ids, s in zip(clients, prompts("stall", num_streams, PROMPT_LEN, vocab), streams)]
    try:
        await asyncio.gather(*(s.started.wait() for s in streams))
        await asyncio.sleep(STALL_SETTLE_S)
        long = await one_request(server.url, busy_prompt, 1)
        await asyncio.sleep(STALL_SETTLE_S)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in clients))
    long_done = long.sent + (long.ttft or 0.0)
    errors = [s.error for s in (idle, long, *streams) if s.error]
    return {"streams": num_streams, "long_prompt": args.long_prompt,
            "idle_ttft_s": idle.ttft, "busy_ttft_s": long.ttft,
            "busy_over_idle": long.ttft / idle.ttft if idle.ttft and long.ttft else None,
            "gap_p50_before_s": percentile([g for s in streams for g in s.gaps(stop=long.sent)], 50),
            "worst_gap_during_s": max((g for s in streams for g in s.gaps(long.sent, long_done)), default=None),
            "gap_p99_during_s": percentile([g for s in streams for g in s.gaps(long.sent, long_done)], 99),
            "worst_gap_overall_s": max((g for s in streams for g in s.gaps()), default=None),
            "streams_ended_early": sum(1 for s in streams if s.end and s.end < long_done),
            "first_error": errors[0] if errors else None}


async def measure_server(server: ServerProcess, args, vocab: int, wave_prompts: dict[int, list[list[int]]]) -> dict:
    out = {"first_request": await first_requests(server, vocab, min(args.tokens, 16))}
    print("  first request done", flush=True)
    clients = ClientProcesses(args.client_procs)
    try:
        out["waves"] = await waves(server, wave_prompts, args.tokens, clients)
    finally:
        clients.close()
    num_streams = min(STALL_STREAMS, args.batch - 1)  # one slot stays free for the long prompt
    stream_tokens = min(STALL_STREAM_TOKENS, args.max_cells - PROMPT_LEN - 1)
    if num_streams < 1:
        print("  stall case skipped: --batch 1 leaves no slot beside a stream")
    elif args.skip_stall:
        print("  stall case skipped (--skip-stall)")
    else:
        out["stall"] = await stall_case(server, args, vocab, num_streams, stream_tokens)
    return out


# the in-process anchor


def torch_dtype(args) -> torch.dtype:
    if args.dtype == "auto":
        return torch.float32 if args.device == "cpu" else torch.bfloat16
    return getattr(torch, args.dtype)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class InProcess:
    """The engine in this process driven as `strata engine` drives it: protocol lines into a `Scheduler`, its
    events stamped as they come (so TTFT and the gaps between a request's tokens are measured as over HTTP, less
    the HTTP server and the pipes)."""

    def __init__(self, scheduler, device: str):
        self.scheduler, self.device = scheduler, device
        self.stamps: dict[str, list[float]] = {}  # request id -> when each of its tokens came
        self.added: dict[str, float] = {}
        self.ended: set[str] = set()
        self.count = 0
        self.windows = [0, 0]  # windows read, rows in them (the engine's WIN events)
        scheduler.emit = self._event

    def _event(self, line: str) -> None:
        words = line.split()
        now = time.monotonic()
        if words[0] == "TOK":
            for k in range(1, len(words) - 1, 2):
                self.stamps.setdefault(words[k], []).append(now)
        elif words[0] == "WIN":
            self.windows[0] += 1
            self.windows[1] += int(words[1]) + int(words[2])
        elif words[0] == "END":
            self.ended.add(words[1])
        elif words[0] == "ERR":
            raise RuntimeError(f"the engine refused a request: {line}")

    def add(self, ids: list[int], max_tokens: int) -> str:
        self.count += 1
        rid = f"b{self.count}"
        self.added[rid] = time.monotonic()
        self.scheduler.handle(f"ADD {rid} {max_tokens} ignore_eos=1 " + " ".join(map(str, ids)))
        return rid

    def step_until(self, done) -> None:
        while not done():
            self.scheduler.step()

    def ttft(self, rid: str) -> float | None:
        return self.stamps[rid][0] - self.added[rid] if self.stamps.get(rid) else None

    def gaps(self, rid: str, start: float = float("-inf"), stop: float = float("inf")) -> list[float]:
        t = self.stamps.get(rid, [])
        return [b - a for a, b in zip(t, t[1:]) if start <= b and a <= stop]

    @torch.inference_mode()
    def wave(self, batch: list[list[int]], max_tokens: int) -> dict:
        """Every prompt added at once, stepped until all are done."""
        sync(self.device)
        start = time.monotonic()
        windows = list(self.windows)
        rids = [self.add(ids, max_tokens) for ids in batch]
        self.step_until(lambda: all(r in self.ended for r in rids))
        sync(self.device)
        wall = time.monotonic() - start
        tokens = sum(len(self.stamps.get(r, [])) for r in rids)
        ttfts = [self.ttft(r) for r in rids]
        gaps = [g for r in rids for g in self.gaps(r)]
        return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ttft_p50_s": percentile(ttfts, 50),
                "gap_p50_s": percentile(gaps, 50), "gap_p99_s": percentile(gaps, 99),
                "windows": self.windows[0] - windows[0], "window_rows": self.windows[1] - windows[1]}

    @torch.inference_mode()
    def stall(self, args, vocab: int, num_streams: int) -> dict:
        """The stall case in process: the long prompt alone, then beside `num_streams` decoding requests."""
        idle_prompt, busy_prompt = prompts("engine-long", 2, args.long_prompt, vocab)
        idle = self.add(idle_prompt, 1)
        self.step_until(lambda: idle in self.ended)
        streams = [self.add(ids, 100_000) for ids in prompts("engine-stall", num_streams, PROMPT_LEN, vocab)]
        self.step_until(lambda: all(len(self.stamps.get(r, [])) >= 20 for r in streams))
        long = self.add(busy_prompt, 1)
        sent = self.added[long]
        self.step_until(lambda: long in self.ended)
        done = self.stamps[long][0]
        for r in streams:
            self.scheduler.handle(f"ABORT {r}")
        self.step_until(lambda: not self.scheduler.busy)
        return {"idle_ttft_s": self.ttft(idle), "busy_ttft_s": self.ttft(long),
                "busy_over_idle": self.ttft(long) / self.ttft(idle),
                "worst_gap_during_s": max((g for r in streams for g in self.gaps(r, sent, done)), default=None),
                "gap_p99_during_s": percentile([g for r in streams for g in self.gaps(r, sent, done)], 99),
                "worst_gap_overall_s": max((g for r in streams for g in self.gaps(r)), default=None)}


def timed(obj, name: str) -> list[float]:
    """Wrap obj.name so that its seconds add up in the returned one-element list."""
    spent = [0.0]
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        start = time.monotonic()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.monotonic() - start

    setattr(obj, name, wrapper)
    return spent


def measure_engine(model: str, args, vocab: int, wave_prompts: dict[int, list[list[int]]],
                   stall_streams: int) -> dict:
    """The same waves and stall case through the engine in this process: `Engine` + `Scheduler` (+ `warm_up`), as
    `strata engine` runs them, protocol lines in, events out."""
    from strata.runtime.generate import Engine
    from strata.runtime.scheduler import Scheduler
    from strata.runtime.warmup import warm_up

    engine = Engine(open_model(model, args), device=args.device, dtype=torch_dtype(args), max_cells=args.max_cells,
                    max_window_tokens=args.max_window_tokens, **expert_options(args))
    scheduler = Scheduler(engine, args.batch, lambda line: None)
    warm_up(scheduler.slots)
    admitting = timed(scheduler, "_admit_waiting")  # where a wave's admissions spend their time (parking, reuse)
    driver = InProcess(scheduler, args.device)
    out: dict = {"waves": {}}
    first = driver.wave(prompts("engine-first", 1, PROMPT_LEN, vocab), 16)  # as the first requests after start
    warm = driver.wave(prompts("engine-warm", 1, PROMPT_LEN, vocab), 16)
    out["first_request"] = {"cold_ttft_s": first["ttft_p50_s"], "warm_ttft_s": warm["ttft_p50_s"]}
    print(f"  first request TTFT {ms(first['ttft_p50_s'])}, warm {ms(warm['ttft_p50_s'])}", flush=True)
    for n, batch in wave_prompts.items():
        admitting[0] = 0.0
        w = out["waves"][n] = driver.wave(batch, args.tokens)
        w["admission_s"] = admitting[0]
        print(f"  {n} at once: {w['tok_s']:.1f} tok/s, TTFT p50 {ms(w['ttft_p50_s'])}, admissions "
              f"{ms(admitting[0])}", flush=True)
    if stall_streams:
        out["stall"] = driver.stall(args, vocab, stall_streams)
    return out


# two conversations taking turns (--alternate)

FOLLOW_UP = 16  # tokens a turn adds


def alternating_turns(args, vocab: int) -> tuple[list[tuple[str, list[int]]], list[int]]:
    """The turns in order (A1, B1, A2, B2, ...), each (name, prompt ids), and a prompt of the last turn's length that
    shares nothing with them (the re-read anchor)."""
    length, _, turns = args.alternate.partition(",")
    length, turns = int(length), int(turns or 3)
    bases = dict(zip("AB", prompts("alternate", 2, length, vocab)))
    order = []
    for k in range(turns):
        for name, base in bases.items():
            extra = prompts(f"alternate-{name}", turns, FOLLOW_UP, vocab)
            order.append((f"{name}{k + 1}", base + [t for e in extra[:k] for t in e]))
    return order, prompts("alternate-fresh", 1, len(order[-1][1]), vocab)[0]


def alternate(model: str, args, vocab: int) -> None:
    """Two long conversations alternating on one slot, through `strata serve` and in process on the same weights."""
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine
    from strata.runtime.scheduler import Scheduler
    from strata.runtime.warmup import warm_up

    args.batch = 1  # each admission parks the conversation the slot held
    order, fresh = alternating_turns(args, vocab)
    answer = 8
    print(f"two conversations alternating on one slot: {len(order[0][1])} tokens, +{FOLLOW_UP} a turn; "
          f"{answer}-token answers", flush=True)
    server = ServerProcess(model, args)
    http: dict[str, float] = {}
    try:
        server.wait_healthy()

        async def turns() -> None:
            await warm_client(server.url)
            for name, ids in [*order, ("fresh", fresh)]:
                s = await one_request(server.url, ids, answer)
                if s.error or s.ttft is None:
                    raise SystemExit(f"turn {name} failed: {s.error}; see {server.log_path}:\n{server.log_tail()}")
                http[name] = s.ttft

        asyncio.run(turns())
        # the server's own TTFT of each turn: its arrival to the engine's first token, text or not (a client sees
        # the first token's text only once it decodes to whole characters: random weights' tokens often do not)
        history = list(reversed(server.facts().get("history", [])[: len(http)]))  # newest first there
        own = dict(zip([name for name, _ in order] + ["fresh"], (h.get("ttft_s") for h in history)))
    finally:
        server.stop()
    engine = Engine(open_model(model, args), device=args.device, dtype=torch_dtype(args), max_cells=args.max_cells,
                    max_window_tokens=args.max_window_tokens, checkpoint_every=0,  # the CLI's parking settings
                    park_vram_gb=args.park_vram_gb, **expert_options(args))
    scheduler = Scheduler(engine, 1, lambda line: None)
    warm_up(scheduler.slots)
    driver = InProcess(scheduler, args.device)
    local: dict[str, float] = {}
    for name, ids in [*order, ("fresh", fresh)]:
        rid = driver.add(ids, answer)
        driver.step_until(lambda: rid in driver.ended)
        local[name] = driver.ttft(rid)
    print(f"{'turn':>6} {'prompt':>7} {'HTTP TTFT ms':>12} {'server TTFT ms':>14} {'engine TTFT ms':>14} "
          f"{'HTTP/engine':>11} {'re-read/HTTP':>12}")
    for name, ids in [*order, ("fresh", fresh)]:
        server_ms = f"{own[name] * 1e3:.1f}" if own.get(name) is not None else "-"
        print(f"{name:>6} {len(ids):>7} {http[name] * 1e3:>12.1f} {server_ms:>14} {local[name] * 1e3:>14.1f} "
              f"{http[name] / local[name]:>10.2f}x {http['fresh'] / http[name]:>11.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "http_ttft_s": http, "engine_ttft_s": local},
                                              indent=1))


# the report


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def print_report(r: dict) -> None:
    c = r["config"]
    print()
    print(f"== strata serve vs the in-process engine: {c['model']} ({c['layers']} layers) on {c['device']}, "
          f"{c['dtype']}" + (f" packed as {c['quantization']}" if c.get("quantization") else "") +
          f", batch {c['batch']}, max_cells {c['max_cells']}, {c['prompt_len']}-token prompts, "
          f"{c['tokens']} tokens each" + (f", --expert-budget-gb {c['expert_budget_gb']}" if c.get("expert_budget_gb")
                                          else ""))
    load = r["load_average"]
    print(f"start-up (process start to /health 200): {r['startup_s']:.1f} s")
    print(f"the machine's 1-minute load average: {load['start']:.2f} at the start, {load['after_server']:.2f} after "
          f"the server, {load['end']:.2f} at the end")
    f = r["server"]["first_request"]
    print(f"first request after start: TTFT {ms(f['cold_ttft_s'])}; warm (a new prompt): {ms(f['warm_ttft_s'])}; "
          f"first / warm {f['cold_over_warm']:.2f}x; the first prompt again (prefix reused): "
          f"{ms(f['same_prompt_ttft_s'])}")
    print()
    head = (f"{'clients':>7} {'HTTP tok/s':>11} {'engine tok/s':>13} {'HTTP/engine':>12} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'gap p50':>8} {'gap p99':>8} {'errors':>6} {'server us/tok':>13} "
            f"{'engine TTFT p50':>16} {'gap p50':>8} {'gap p99':>8}")
    print(head)
    for n, w in r["server"]["waves"].items():
        e = r["engine"]["waves"][n]
        print(f"{n:>7} {w['tok_s']:>11.1f} {e['tok_s']:>13.1f} {w['tok_s'] / e['tok_s']:>11.2f}x "
              f"{ms(w['ttft_p50_s']):>9} {ms(w['ttft_p99_s']):>9} {ms(w['gap_p50_s']):>8} {ms(w['gap_p99_s']):>8} "
              f"{w['errors']:>6} {w['server_cpu_per_token_s'] * 1e6:>13.0f} {ms(e['ttft_p50_s']):>16} "
              f"{ms(e['gap_p50_s']):>8} {ms(e['gap_p99_s']):>8}")
    print("windows per wave, server (in process): " + "; ".join(
        f"{n}: {w['windows']:.0f} of {w['window_rows'] / max(w['windows'], 1):.0f} rows "
        f"({r['engine']['waves'][n]['windows']} of "
        f"{r['engine']['waves'][n]['window_rows'] / max(r['engine']['waves'][n]['windows'], 1):.0f})"
        for n, w in r["server"]["waves"].items()))
    for n, w in r["server"]["waves"].items():
        if w["first_error"]:
            print(f"  wave of {n}: {w['errors']} failed, e.g. {w['first_error']}")
    s = r["server"].get("stall")
    if s:
        print()
        print(f"stall: {s['streams']} streams running, then one {s['long_prompt']}-token prompt (max_tokens 1)")
        ratio = f"{s['busy_over_idle']:.2f}x" if s["busy_over_idle"] else "-"
        print(f"  long prompt TTFT: {ms(s['busy_ttft_s'])} beside the streams, {ms(s['idle_ttft_s'])} on the idle "
              f"server ({ratio})")
        print(f"  the streams' gaps: median {ms(s['gap_p50_before_s'])} before it; while it was read p99 "
              f"{ms(s['gap_p99_during_s'])}, worst {ms(s['worst_gap_during_s'])}; worst {ms(s['worst_gap_overall_s'])} "
              "overall")
        e = r["engine"].get("stall")
        if e:
            print(f"  in process: long prompt TTFT {ms(e['busy_ttft_s'])} beside the streams, {ms(e['idle_ttft_s'])} "
                  f"alone ({e['busy_over_idle']:.2f}x); the streams' gaps while it was read: p99 "
                  f"{ms(e['gap_p99_during_s'])}, worst {ms(e['worst_gap_during_s'])}; worst overall "
                  f"{ms(e['worst_gap_overall_s'])}")
        if s["streams_ended_early"]:
            print(f"  note: {s['streams_ended_early']} stream(s) ended before the long prompt was answered")
        if s["first_error"]:
            print(f"  error: {s['first_error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a Hugging Face folder, a .gguf file, or default (SmolLM2-135M)")
    p.add_argument("--shape", help="instead of --model: random weights at this shape (bench/shapes.py)")
    p.add_argument("--layers", type=int, help="with --shape: keep the first N layers")
    p.add_argument("--vocab", type=int, default=49152,
                   help="with --shape: the vocabulary (default 49152, SmolLM2's: the tokenizer the folder gets)")
    p.add_argument("--checkpoint-dir", default="~/.cache/strata-bench",
                   help="with --shape: where random-weight folders are written and found again")
    p.add_argument("--tokenizer", help="with --shape: a folder with tokenizer.json + tokenizer_config.json to use "
                   "(default: SmolLM2's, from the embedded GGUF)")
    p.add_argument("--write-tokenizer", metavar="DIR", help="only write SmolLM2's tokenizer files into DIR, then exit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=list(FORMATS),
                   help="the server's and the anchor's --quantization: the float weights quantized as they load")
    p.add_argument("--batch", type=int, default=64, help="slots of the server and of the in-process engine")
    p.add_argument("--max-cells", type=int, default=4096)
    p.add_argument("--max-window-tokens", type=int, help="default: the engine's for the device")
    p.add_argument("--concurrency", default="1,8,16,32,64", help="clients per wave (capped by --batch)")
    p.add_argument("--tokens", type=int, default=256, help="max_tokens of each wave request")
    p.add_argument("--long-prompt", type=int, default=6000,
                   help="tokens of the stall case's prompt (max_cells - 2 at most)")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="processes the wave clients are spread over (default: a quarter of the CPUs, 1 to 8)")
    p.add_argument("--paced-engine", type=float, metavar="MS",
                   help="measure the server alone, in front of a stand-in engine giving each running request a token "
                   "every MS milliseconds (bench/paced_engine.py)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--park-vram-gb", type=float, default=0.0, help="the engines' --park-vram-gb (copies of parked "
                   "conversations in VRAM: --alternate's turns are restored from there)")
    p.add_argument("--expert-budget-gb", help="the engines' --expert-budget-gb (GB of routed experts a stage keeps "
                   "in VRAM; the CPU pool computes the rest), e.g. 10 for half the experts of 24 layers of the 30B shape")
    p.add_argument("--cpu-threads", type=int, help="the engines' --cpu-threads (the CPU pool's threads)")
    p.add_argument("--skip-stall", action="store_true", help="leave out the stall case (streams of up to 1,024 "
                   "tokens, then a long prompt): the waves and first requests only")
    p.add_argument("--alternate", metavar="TOKENS[,TURNS]",
                   help="instead of the waves: two conversations of TOKENS tokens take turns on a one-slot server "
                        "(each turn parks the other; TURNS turns each, default 3, adding 16 tokens a turn): every "
                        "turn's TTFT over HTTP and in process, against reading the last turn's prompt from nothing")
    args = p.parse_args(argv)
    if args.shape:
        from shapes import SHAPES

        if args.shape not in SHAPES:
            p.error(f"--shape {args.shape!r}: known shapes are {', '.join(SHAPES)}")
    args.long_prompt = min(args.long_prompt, args.max_cells - 2)
    if PROMPT_LEN + args.tokens > args.max_cells:
        p.error(f"--tokens {args.tokens}: a {PROMPT_LEN}-token prompt and its answer must fit "
                f"--max-cells {args.max_cells}")
    return args


def paced(model: str, args, wave_prompts: dict[int, list[list[int]]]) -> None:
    """The waves through `strata serve` in front of the paced stand-in engine, against the pace itself."""
    print(f"strata serve in front of a stand-in engine: a token for every running request each {args.paced_engine:g} ms "
          f"({os.cpu_count()} CPUs, {args.client_procs} client process(es))", flush=True)
    server = ServerProcess(model, args)
    try:
        server.wait_healthy()
        clients = ClientProcesses(args.client_procs)
        try:
            figures = asyncio.run(waves(server, wave_prompts, args.tokens, clients))
        finally:
            clients.close()
    finally:
        server.stop()
    print()
    print(f"{'clients':>7} {'HTTP tok/s':>11} {'pace tok/s':>11} {'HTTP/pace':>10} {'TTFT p50':>9} {'gap p50':>8} "
          f"{'gap p99':>8} {'errors':>6} {'server CPU':>11} {'server us/tok':>13}")
    for n, w in figures.items():
        pace = n * 1e3 / args.paced_engine
        print(f"{n:>7} {w['tok_s']:>11.1f} {pace:>11.1f} {w['tok_s'] / pace:>9.2f}x {ms(w['ttft_p50_s']):>9} "
              f"{ms(w['gap_p50_s']):>8} {ms(w['gap_p99_s']):>8} {w['errors']:>6} "
              f"{w['server_cpu_s'] / w['wall_s']:>10.0%} {w['server_cpu_per_token_s'] * 1e6:>13.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "waves": figures}, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.write_tokenizer:
        Path(args.write_tokenizer).mkdir(parents=True, exist_ok=True)
        write_tokenizer(Path(args.write_tokenizer))
        return
    from strata.model.loader import ModelFiles

    model = model_path(args)
    spec = ModelFiles.open(model).spec
    vocab = spec.vocab_size
    counts = sorted({min(int(n), args.batch) for n in args.concurrency.split(",")})
    wave_prompts = {n: prompts(f"wave{n}", n, PROMPT_LEN, vocab) for n in counts}
    dtype = str(torch_dtype(args)).removeprefix("torch.")
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name(args.device) if cuda else platform.processor() or platform.machine()
    start_load = os.getloadavg()[0]
    print(f"{args.shape or args.model} on {args.device} ({where}, {os.cpu_count()} CPUs), {dtype}, "
          f"torch {torch.__version__}; load average {start_load:.2f}")

    if args.paced_engine is not None:
        return paced(model, args, wave_prompts)
    if args.alternate:
        return alternate(model, args, vocab)
    print("strata serve:", flush=True)
    server = ServerProcess(model, args)
    try:
        startup = server.wait_healthy()
        print(f"  healthy after {startup:.1f} s (log: {server.log_path})", flush=True)
        for line in server.log_tail(400).splitlines():
            if "model loaded in" in line or "compile workers done" in line or "compiling kernels in" in line \
                    or "warm-up:" in line and "decode graphs" in line:
                print("  server log:", line.strip()[-300:], flush=True)
        served = asyncio.run(measure_server(server, args, vocab, wave_prompts))
    finally:
        server.stop()
    load = {"start": start_load, "after_server": os.getloadavg()[0]}
    print("in-process engine:", flush=True)
    stall_streams = served["stall"]["streams"] if served.get("stall") else 0
    engine = measure_engine(model, args, vocab, wave_prompts, stall_streams)
    load["end"] = os.getloadavg()[0]

    config = dict(vars(args))
    config.update(model=args.shape or args.model, path=model, layers=spec.num_layers, dtype=dtype,
                  prompt_len=PROMPT_LEN, concurrency=counts, machine=where, torch=torch.__version__)
    report = {"config": config, "startup_s": startup, "server": served, "engine": engine, "load_average": load}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
