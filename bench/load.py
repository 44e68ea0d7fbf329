"""Many users at once, some leaving mid-answer, against a real `strata serve`; its engine and the server itself
killed; schemathesis over its schema. What issue 25 asks the server to hold, checked and measured.

Load: `--clients` clients send greedy requests for `--seconds`, each drawn from a fixed prompt set (chat and plain
completions, streaming or not, half each); a share of the requests (`--disconnect-fraction`) are left by their
client at a random moment between the send and the answer's usual end (the connection closed, as a client-side
timeout does). Each prompt's solo answer is taken first, one request at a time through the same server. The run
fails when one of these does not hold:
- every answer that completed equals its prompt's solo answer (0 crossed answers);
- a few seconds after the clients stop, no request runs or waits (no leaked slot);
- no error of any kind (an HTTP error status, an error event in a stream, a broken connection), no engine restart;
- the server's and the engine's RSS, mean of the run's last third against its first, grew less than `--rss-growth`
  percent. The engine parks idle conversations in a ring of `--park-gb` of host RAM whose pages are first touched as
  the ring fills, so its RSS grows by design until the ring has been written once: the server here gets a small
  ring (0.1 GB), filled early in the run, so what the check sees is any other growth.

Fuzz (`--fuzz-examples N`): schemathesis over the server's /openapi.json, 2N generated cases per operation, valid
and invalid ones alike: no 5xx, every 4xx in OpenAI's error shape, no error event in a stream answered 200. Generated bodies
may ask for thousands of tokens: max_tokens is capped (`capped`) so each case ends within a second or two.

Faults (`--faults`), each timed from the signal: the engine SIGKILLed under running streams (each stream's error
event, /health ready again, the next answer equal to its solo answer); SIGTERM to the server under running streams
(readiness off, the streams ended with an error event after `--shutdown-grace`, the server's exit, the engine's);
a fresh server SIGKILLed (its engine gone).

    python bench/load.py --seconds 180 --clients 16 --faults --fuzz-examples 300
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server_process import Server  # noqa: E402

HTTP_TIMEOUT = httpx.Timeout(300.0, connect=30.0)
IDLE_DEADLINE_S = 5.0  # after the clients stop, the server must hold no request within this
FUZZ_MAX_TOKENS = 2  # what a fuzz case may generate at most (see `capped`)


@dataclass(frozen=True)
class Prompt:
    endpoint: str  # "chat" or "completions"
    text: str
    max_tokens: int
    stop: str | None = None
    ignore_eos: bool = False

    def body(self, stream: bool) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        body.update({"messages": [{"role": "user", "content": self.text}]} if self.endpoint == "chat" else
                    {"prompt": self.text})
        if self.stop is not None:
            body["stop"] = [self.stop]
        if self.ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


PROMPTS = [
    Prompt("completions", "The capital of France is", 32),
    Prompt("completions", "def fibonacci(n):", 48),
    Prompt("completions", "Once upon a time", 24),
    Prompt("completions", "The three primary colors are", 40, stop="."),  # ended by a stop string
    Prompt("chat", "What is the capital of France?", 24),
    Prompt("chat", "Write a haiku about the sea.", 40),
    Prompt("chat", "List three prime numbers.", 16),
    Prompt("chat", "Explain in one sentence what a CPU does.", 48),
]
LONG = Prompt("completions", "Once upon a time", 1000, ignore_eos=True)  # the faults' streams


@dataclass
class Answer:
    """One request as its client saw it."""

    prompt: int
    stream: bool
    sent: float = 0.0
    first: float | None = None  # the first text (streams)
    end: float | None = None
    text: str = ""
    finish: str | None = None
    tokens: int = 0
    left: bool = False  # the client left before the end
    error: str | None = None  # what went wrong, by kind: "HTTP 503 service_unavailable", "stream error", ...
    error_at: float | None = None


async def ask(http: httpx.AsyncClient, url: str, prompt: Prompt, stream: bool, answer: Answer,
              started: asyncio.Event | None = None) -> Answer:
    """Send `prompt` and fill `answer` as the reply comes; `started` is set at a stream's first text."""
    answer.sent = time.monotonic()
    try:
        if not stream:
            reply = await http.post(url + prompt.path, json=prompt.body(False))
            answer.end = time.monotonic()
            if reply.status_code != 200:
                answer.error, answer.error_at = f"HTTP {reply.status_code} {_error_type(reply)}", answer.end
                return answer
            data = reply.json()
            choice = data["choices"][0]
            answer.text = choice["message"]["content"] if prompt.endpoint == "chat" else choice["text"]
            answer.finish, answer.tokens = choice["finish_reason"], data["usage"]["completion_tokens"]
            return answer
        async with http.stream("POST", url + prompt.path, json=prompt.body(True)) as reply:
            if reply.status_code != 200:
                await reply.aread()
                answer.error, answer.error_at = f"HTTP {reply.status_code} {_error_type(reply)}", time.monotonic()
                return answer
            parts, done = [], False
            async for line in reply.aiter_lines():
                done = done or line == "data: [DONE]"
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    answer.error = f"stream error {chunk['error'].get('type')}"
                    answer.error_at = time.monotonic()
                for choice in chunk.get("choices", []):
                    text = choice["delta"].get("content") if prompt.endpoint == "chat" else choice.get("text")
                    if text:
                        parts.append(text)
                        if answer.first is None:
                            answer.first = time.monotonic()
                            if started is not None:
                                started.set()
                    answer.finish = choice.get("finish_reason") or answer.finish
                if chunk.get("usage"):
                    answer.tokens = chunk["usage"]["completion_tokens"]
            answer.text, answer.end = "".join(parts), time.monotonic()
            if answer.error is None and (not done or answer.finish is None):
                answer.error, answer.error_at = "stream cut (no finish reason or no [DONE])", answer.end
    except httpx.HTTPError as e:
        answer.error, answer.error_at = f"connection {type(e).__name__}", time.monotonic()
    except (ValueError, KeyError, TypeError) as e:  # a reply that is not what OpenAI's API sends
        answer.error, answer.error_at = f"malformed reply {type(e).__name__}", time.monotonic()
    finally:
        if started is not None:
            started.set()  # also when it failed: nobody waits for it forever
    return answer


def _error_type(reply: httpx.Response) -> str:
    try:
        return reply.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "(not in OpenAI's error shape)"


def facts(url: str) -> dict:
    return httpx.get(url + "/metrics", headers={"Accept": "application/json"}, timeout=30).json()


async def solo_answers(url: str, prompts: list[Prompt]) -> tuple[list[str], list[float]]:
    """Each prompt's answer when it runs alone, and its seconds."""
    texts, seconds = [], []
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        for i, prompt in enumerate(prompts):
            answer = await ask(http, url, prompt, False, Answer(i, False))
            if answer.error:
                raise SystemExit(f"the solo answer of {prompt} failed: {answer.error}")
            texts.append(answer.text)
            seconds.append(answer.end - answer.sent)
    return texts, seconds


# load


@dataclass
class LoadReport:
    seconds: float
    answers: list[Answer]
    crossed: list[tuple[Answer, str]]  # (the answer, its solo answer)
    left_running: dict | None  # requests running / waiting when the server should have been idle, else None
    idle_after_s: float
    generated_tokens: int  # by the server (cancelled answers' tokens too)
    aborted: int  # requests the server ended as "abort" (its clients left; one that left as its answer ended is not)
    engine_restarts: int
    rss: dict[str, tuple[float, float]] = field(default_factory=dict)  # "server" / "engine": (first, last third)

    @property
    def completed(self) -> list[Answer]:
        return [a for a in self.answers if a.error is None and not a.left]

    def errors(self) -> collections.Counter:
        return collections.Counter(a.error for a in self.answers if a.error is not None)

    def rss_growth(self, name: str) -> float:
        first, last = self.rss[name]
        return (last - first) / first * 100

    def failures(self, max_rss_growth: float | None = None) -> list[str]:
        why = []
        if self.crossed:
            why.append(f"{len(self.crossed)} crossed answer(s)")
        if self.left_running is not None:
            why.append(f"requests left after the clients stopped: {self.left_running}")
        if self.errors():
            why.append(f"errors: {dict(self.errors())}")
        if self.engine_restarts:
            why.append(f"the engine restarted {self.engine_restarts} time(s)")
        if max_rss_growth is not None:
            why += [f"{name} RSS grew {self.rss_growth(name):+.1f} %" for name in self.rss
                    if self.rss_growth(name) > max_rss_growth]
        return why


async def run_load(url: str, prompts: list[Prompt], solo: list[str], seconds: float, clients: int,
                   disconnect_fraction: float, seed: int = 0, server_pid: int | None = None,
                   solo_seconds: list[float] | None = None) -> LoadReport:
    """`clients` clients ask for `seconds`, then wait for their last answers; see the module's docstring. With
    `server_pid`, the server's and its engine's RSS are sampled each second."""
    rng = random.Random(seed)
    typical = list(solo_seconds or [5.0] * len(prompts))  # each prompt's last answer's seconds: when to leave
    answers: list[Answer] = []
    before = facts(url)
    start = time.monotonic()
    deadline = start + seconds

    async def client(k: int) -> None:
        crng = random.Random(rng.random())
        http = httpx.AsyncClient(timeout=HTTP_TIMEOUT)
        while time.monotonic() < deadline:
            i, stream = crng.randrange(len(prompts)), crng.random() < 0.5
            answer = Answer(i, stream)
            answers.append(answer)
            work = ask(http, url, prompts[i], stream, answer)
            if crng.random() < disconnect_fraction:
                try:
                    await asyncio.wait_for(work, crng.uniform(0, typical[i]))
                except asyncio.TimeoutError:
                    answer.left = True
                    await http.aclose()  # the connection closes: what the server sees of a client that left
                    http = httpx.AsyncClient(timeout=HTTP_TIMEOUT)
                    continue
            else:
                await work
            if answer.error is None:
                typical[i] = answer.end - answer.sent
        await http.aclose()

    rss: dict[str, list[int]] = {"server": [], "engine": []}
    sampler = asyncio.create_task(_sample_rss(server_pid, before["engine_facts"]["pid"], rss)) if server_pid else None
    await asyncio.gather(*(client(k) for k in range(clients)))
    stopped = time.monotonic()
    if sampler is not None:
        sampler.cancel()
    left_running, idle_after = await _wait_idle(url, IDLE_DEADLINE_S)
    after = facts(url)
    crossed = [(a, solo[a.prompt]) for a in answers if a.error is None and not a.left and a.text != solo[a.prompt]]
    report = LoadReport(stopped - start, answers, crossed, left_running, idle_after - stopped,
                        after["generation_tokens_total"] - before["generation_tokens_total"],
                        after["requests_success"].get("abort", 0) - before["requests_success"].get("abort", 0),
                        after["engine_restarts_total"] - before["engine_restarts_total"])
    for name, samples in rss.items():
        if len(samples) >= 3:
            third = len(samples) // 3
            report.rss[name] = (statistics.fmean(samples[:third]), statistics.fmean(samples[-third:]))
    return report


async def _sample_rss(server_pid: int, engine_pid: int, into: dict[str, list[int]]) -> None:
    import psutil

    procs = {"server": psutil.Process(server_pid), "engine": psutil.Process(engine_pid)}
    while True:
        try:
            for name, proc in procs.items():
                into[name].append(proc.memory_info().rss)
        except psutil.NoSuchProcess:
            return  # an engine restart: counted apart
        await asyncio.sleep(1.0)


async def _wait_idle(url: str, deadline_s: float) -> tuple[dict | None, float]:
    """(None, when) once no request runs or waits; ({running, waiting}, when) if that is not so by the deadline."""
    deadline = time.monotonic() + deadline_s
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            now = (await http.get(url + "/metrics", headers={"Accept": "application/json"})).json()
            held = {"running": now["requests_running"], "waiting": now["requests_waiting"]}
            if not any(held.values()):
                return None, time.monotonic()
            if time.monotonic() > deadline:
                return held, time.monotonic()
            await asyncio.sleep(0.1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, round(q / 100 * (len(ranked) - 1)))]


def print_load(report: LoadReport, args) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1000:,.0f} ms"  # noqa: E731
    done = report.completed
    ttft = [a.first - a.sent for a in done if a.stream and a.first is not None]
    print(f"load: {args.clients} clients sending for {args.seconds:g} s (the last answer {report.seconds:.0f} s after "
          f"the start), disconnect fraction {args.disconnect_fraction}, {len(PROMPTS)} prompts")
    rows = [
        ("requests", f"{len(report.answers)} sent: {len(done)} completed, "
                     f"{sum(a.left for a in report.answers)} cancelled (the client left; {report.aborted} aborted by "
                     f"the server), {sum(a.error is not None for a in report.answers)} errors"),
        ("crossed answers", f"{len(report.crossed)} of {len(done)} completed"),
        ("leaked", "none: idle " + f"{report.idle_after_s:.1f} s after the clients stopped"
         if report.left_running is None else f"{report.left_running} {IDLE_DEADLINE_S:g} s after the clients stopped"),
        ("tokens/s", f"{report.generated_tokens / report.seconds:.1f} generated (server), "
                     f"{sum(a.tokens for a in done) / report.seconds:.1f} delivered in completed answers"),
        ("TTFT (streams)", f"p50 {ms(percentile(ttft, 50))}, p99 {ms(percentile(ttft, 99))}"),
        ("engine restarts", str(report.engine_restarts)),
    ]
    for name, (first, last) in report.rss.items():
        rows.append((f"RSS {name}", f"{first / 2**20:,.1f} MiB -> {last / 2**20:,.1f} MiB "
                                    f"({report.rss_growth(name):+.2f} %, first vs last third)"))
    rows.append(("errors by kind", ", ".join(f"{k}: {n}" for k, n in report.errors().items()) or "none"))
    for name, value in rows:
        print(f"  {name:<16} {value}")
    for answer, expected in report.crossed[:5]:
        print(f"  crossed: prompt {answer.prompt} ({'stream' if answer.stream else 'whole'}) "
              f"got {answer.text!r}, alone {expected!r}")


# fuzz


def capped(body, max_model_len: int):
    """A fuzz case's body with max_tokens (and max_completion_tokens) at most FUZZ_MAX_TOKENS where the server would
    honour more, and set when neither is given (the default is the rest of the context): a generated value in the
    thousands would run for minutes on a CPU. Values the server refuses (past the context, not integers) stay."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and FUZZ_MAX_TOKENS < value < max_model_len:
            body[key] = FUZZ_MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = FUZZ_MAX_TOKENS
    return body


def response_faults(status: int, content_type: str, text: str) -> list[str]:
    """What is wrong with one response to a fuzz case: a 5xx, a 4xx not in OpenAI's error shape, or an error
    event in a stream answered 200."""
    if status >= 500:
        return [f"server error {status}: {text[:300]}"]
    if status >= 400:
        try:
            error = json.loads(text)["error"]
            shaped = set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) \
                and error["message"] and isinstance(error["type"], str) and isinstance(error["code"], (str, int))
        except (ValueError, KeyError, TypeError):
            shaped = False
        return [] if shaped else [f"{status} not in OpenAI's error shape: {text[:300]}"]
    if content_type.startswith("text/event-stream") and '"error"' in text:
        return [f"an error event in a 200 stream: {text[-300:]}"]
    return []


@dataclass
class FuzzReport:
    cases: collections.Counter = field(default_factory=collections.Counter)  # by operation
    statuses: collections.Counter = field(default_factory=collections.Counter)  # by (operation, status code)
    found: list[str] = field(default_factory=list)  # one line per faulty case: operation, fault, body


def fuzz(url: str, examples: int) -> FuzzReport:
    """schemathesis over `url`/openapi.json: 2 x `examples` cases per operation, drawn from its valid and its invalid
    inputs alike (one where the operation takes no input), each sent once (no shrinking: a fault is recorded, not
    raised). Derandomized: the same cases every run, so a check on them does not pass or fail by chance."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    max_model_len = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        strategy = st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
                             operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

        @settings(max_examples=2 * examples, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def send(case) -> None:
            if operation.method.upper() == "POST":
                case.body = capped(case.body, max_model_len)
            report.cases[operation.label] += 1
            try:
                response = case.call(base_url=url, timeout=60)
            except Exception as e:  # a broken connection or a timeout: the server failed this case
                report.found.append(f"{operation.label}: {type(e).__name__}: {e} <- {case.body!r:.300}")
                return
            report.statuses[operation.label, response.status_code] += 1
            content_type = response.headers.get("content-type", [""])[0]  # schemathesis: lowercase keys, lists
            faults = response_faults(response.status_code, content_type, response.text)
            report.found += [f"{operation.label}: {fault} <- {case.body!r:.300}" for fault in faults]

        send()
    return report


def print_fuzz(report: FuzzReport, seconds: float) -> None:
    print(f"fuzz: {sum(report.cases.values())} schemathesis cases in {seconds:.0f} s; by operation: "
          + ", ".join(f"{op} {n}" for op, n in report.cases.items()))
    for label in report.cases:
        codes = sorted((code, n) for (op, code), n in report.statuses.items() if op == label)
        print(f"  {label}: " + ", ".join(f"{n} x {code}" for code, n in codes))
    print(f"  found: {len(report.found)}")
    for line in report.found[:10]:
        print("   ", line)


# faults


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def until(condition, deadline_s: float) -> float | None:
    """Poll `condition()` until true; the time.monotonic() it was, None past the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(condition):
            return time.monotonic()
        await asyncio.sleep(0.05)
    return None


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def running_streams(http: httpx.AsyncClient, url: str, count: int) -> list[asyncio.Task]:
    """`count` long streams, returned once each has shown text."""
    started = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(ask(http, url, LONG, True, Answer(-1, True), started[k])) for k in range(count)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
    return tasks


def _since(t0: float, t: float | None) -> float | None:
    return None if t is None else t - t0


async def engine_killed(url: str, streams: int, prompt: Prompt, solo: str) -> dict:
    """SIGKILL the engine under `streams` running streams: the seconds to their error events and to ready again,
    and whether the next answer equals its solo answer."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        tasks = await running_streams(http, url, streams)
        killed = time.monotonic()
        os.kill(facts(url)["engine_facts"]["pid"], signal.SIGKILL)
        ended = await asyncio.gather(*tasks)
        back = await until(lambda: ready(url), 300)
        after = await ask(http, url, prompt, False, Answer(0, False))
    return {"error_events": sum(a.error is not None and a.error.startswith("stream error") for a in ended),
            "streams": streams, "error_event_s": max(_since(killed, a.error_at) or float("inf") for a in ended),
            "ready_s": _since(killed, back), "next_answer_right": after.error is None and after.text == solo}


async def server_terminated(server: Server, streams: int, grace_s: float) -> dict:
    """SIGTERM the server under `streams` running streams: the seconds to readiness off, to the streams' error events,
    to the server's exit and to its engine's."""
    engine_pid = facts(server.url)["engine_facts"]["pid"]
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
        tasks = await running_streams(http, server.url, streams)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        not_ready = await until(lambda: not ready(server.url), 30)
        ended = await asyncio.gather(*tasks)
    exited = await until(lambda: server.proc.poll() is not None, 60)
    engine_exit = await until(lambda: gone(engine_pid), 60)
    return {"grace_s": grace_s, "not_ready_s": _since(signalled, not_ready),
            "error_events": sum(a.error is not None and a.error.startswith("stream error") for a in ended),
            "streams": streams, "error_event_s": max(_since(signalled, a.error_at) or float("inf") for a in ended),
            "exit_s": _since(signalled, exited), "engine_exit_s": _since(signalled, engine_exit)}


async def server_killed(server: Server) -> dict:
    """SIGKILL the server: the seconds until its engine is gone."""
    engine_pid = facts(server.url)["engine_facts"]["pid"]
    killed = time.monotonic()
    server.proc.send_signal(signal.SIGKILL)
    return {"engine_exit_s": _since(killed, await until(lambda: gone(engine_pid), 60))}


def fault_failures(killed: dict, terminated: dict, server_gone: dict) -> list[str]:
    why = []
    if killed["error_events"] != killed["streams"] or killed["ready_s"] is None or not killed["next_answer_right"]:
        why.append(f"engine SIGKILL: {killed}")
    if terminated["error_events"] != terminated["streams"] or terminated["exit_s"] is None \
            or terminated["engine_exit_s"] is None or terminated["not_ready_s"] is None:
        why.append(f"server SIGTERM: {terminated}")
    if server_gone["engine_exit_s"] is None:
        why.append("server SIGKILL: the engine outlived its server")
    return why


def print_faults(killed: dict, terminated: dict, server_gone: dict) -> None:
    s = lambda v: "never" if v is None else f"{v:.2f} s"  # noqa: E731
    print("faults (seconds from the signal):")
    print(f"  engine SIGKILL, {killed['streams']} streams: error events {killed['error_events']}/{killed['streams']}, "
          f"the last after {s(killed['error_event_s'])}; ready again after {s(killed['ready_s'])}; the next answer "
          f"{'equals' if killed['next_answer_right'] else 'DIFFERS from'} its solo answer")
    print(f"  server SIGTERM, {terminated['streams']} streams, --shutdown-grace {terminated['grace_s']:g}: not ready "
          f"after {s(terminated['not_ready_s'])}; error events {terminated['error_events']}/{terminated['streams']}, "
          f"the last after {s(terminated['error_event_s'])}; server exit {s(terminated['exit_s'])}, "
          f"engine exit {s(terminated['engine_exit_s'])}")
    print(f"  server SIGKILL: engine exit after {s(server_gone['engine_exit_s'])}")


# the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a Hugging Face folder, a .gguf file, or default (SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8, help="the server's slots")
    p.add_argument("--max-cells", type=int, default=2048)
    p.add_argument("--park-gb", type=float, default=0.1,
                   help="the server's parking ring: small, so it is filled early and the RSS check sees other growth")
    p.add_argument("--seconds", type=float, default=60, help="how long the clients send requests")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--disconnect-fraction", type=float, default=0.25,
                   help="the share of requests whose client leaves at a random moment")
    p.add_argument("--rss-growth", type=float, default=5.0,
                   help="percent the server's RSS, or the engine's less its parked conversations, may grow: the "
                   "run's last third against its first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fuzz-examples", type=int, default=0,
                   help="schemathesis: twice this many cases per operation, valid and invalid (0: no fuzz)")
    p.add_argument("--faults", action="store_true", help="also kill the engine, SIGTERM and SIGKILL the server")
    p.add_argument("--fault-streams", type=int, default=2, help="streams running when a fault is injected")
    p.add_argument("--shutdown-grace", type=float, default=3.0, help="the server's --shutdown-grace")
    return p.parse_args(argv)


def start_server(args, log: str) -> Server:
    return Server("--model", args.model, "--device", args.device, "--batch", str(args.batch),
                  "--max-cells", str(args.max_cells), "--park-gb", str(args.park_gb),
                  "--shutdown-grace", str(args.shutdown_grace), log=log, startup_s=1800)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    log = tempfile.mkstemp(prefix="strata-load-", suffix=".log")[1]
    print(f"strata serve --model {args.model} --device {args.device} --batch {args.batch} --max-cells "
          f"{args.max_cells} --park-gb {args.park_gb:g} ({os.cpu_count()} CPUs); server log: {log}", flush=True)
    server = start_server(args, log)
    failures: list[str] = []
    try:
        solo, solo_s = asyncio.run(solo_answers(server.url, PROMPTS))
        print(f"solo answers: {len(PROMPTS)} prompts, {sum(solo_s):.1f} s", flush=True)
        report = asyncio.run(run_load(server.url, PROMPTS, solo, args.seconds, args.clients, args.disconnect_fraction,
                                      args.seed, server.proc.pid, solo_s))
        print_load(report, args)
        failures += report.failures(args.rss_growth)
        if args.fuzz_examples:
            began = time.monotonic()
            found = fuzz(server.url, args.fuzz_examples)
            print_fuzz(found, time.monotonic() - began)
            failures += [f"fuzz: {line}" for line in found.found]
        if args.faults:
            killed = asyncio.run(engine_killed(server.url, args.fault_streams, PROMPTS[0], solo[0]))
            terminated = asyncio.run(server_terminated(server, args.fault_streams, args.shutdown_grace))
            fresh = start_server(args, log + ".2")
            server_gone = asyncio.run(server_killed(fresh))
            print_faults(killed, terminated, server_gone)
            failures += fault_failures(killed, terminated, server_gone)
    finally:
        if server.proc.poll() is None:
            server.stop()
    print("checks: " + ("all held" if not failures else "FAILED"))
    for line in failures:
        print("  " + line)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
