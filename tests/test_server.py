"""A real `strata serve` on the embedded default, driven by the official `openai` SDK and a plain HTTP client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import time
from unittest.mock import ANY

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.load import Answer, Prompt, ask
from tests.server_process import Server

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def solo_answers(client):
    """Each prompt's greedy answer when it runs alone."""
    return [complete(client, p) for p in PROMPTS]


def complete(client, prompt: str, **kw) -> str:
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text


def scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Accept": "text/plain"}).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")) + "}")
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_chat_completion_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=30, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client, solo_answers):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == solo_answers[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert chunks[-1].usage == whole.usage and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                               max_tokens=10, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_end_the_answer(client, solo_answers):
    full = solo_answers[0]
    cut = full.index(".")
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=["."])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=["."], stream=True) if c.choices)
    assert streamed == full[:cut]
    assert complete(client, PROMPTS[1]) == complete(client, PROMPTS[1])  # the stopped answer left nothing behind


def test_seeds_reproduce_sampled_answers(client):
    a = complete(client, PROMPTS[1], temperature=0.9, top_p=0.95, seed=7)
    b = complete(client, PROMPTS[1], temperature=0.9, top_p=0.95, seed=7)
    c = complete(client, PROMPTS[1], temperature=0.9, top_p=0.95, seed=8)
    assert a == b and a != c
    kw = dict(temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"repetition_penalty": 1.2, "top_k": 40, "min_p": 0.05})
    assert complete(client, PROMPTS[2], **kw) == complete(client, PROMPTS[2], **kw)


def test_a_second_turn_reuses_the_parked_first_and_the_metrics_show_it(server, client):
    chat = lambda messages: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,  # noqa: E731
                                                            temperature=0)
    history = [{"role": "user", "content": "Name a fruit that is yellow."}]
    first = chat(history)
    chat([{"role": "user", "content": "Count to three."}])  # takes the solo session: the first chat is parked
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And a red one?"}]
    before = scrape(server)
    second = chat(history)
    after = scrape(server)
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    assert delta("vllm:prefix_cache_queries_total{}") == second.usage.prompt_tokens
    hits = delta("vllm:prefix_cache_hits_total{}")
    assert first.usage.prompt_tokens <= hits < second.usage.prompt_tokens  # only the new turn was read
    assert delta("vllm:gpu_prefix_cache_hits_total{}") == hits
    assert after["strata:parked_conversations{tier=ram}"] >= 1 and after["strata:parked_bytes{tier=ram}"] > 0
    assert after["strata:parked_conversations{tier=disk}"] == after["strata:parked_bytes{tier=vram}"] == 0
    facts = httpx.get(server.url + "/metrics").json()
    assert facts["parked_conversations"] >= 1 and facts["parked_bytes"] > 0


async def _concurrently(server, prompts, **kw):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    results = await asyncio.gather(*[aclient.completions.create(model=MODEL, prompt=p, **kw) for p in prompts])
    return [r.choices[0].text for r in results]


def test_concurrent_requests_get_their_solo_answers_and_metrics_count_them(server, solo_answers):
    before = scrape(server)
    answers = asyncio.run(_concurrently(server, PROMPTS[:3]))
    assert answers == solo_answers[:3]
    after = scrape(server)
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    assert delta("vllm:request_success_total{finished_reason=length}") + delta("vllm:request_success_total{finished_reason=stop}") == 3
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert delta(f"vllm:{hist}_count{{}}") == 3, hist
    generated = delta("vllm:generation_tokens_total{}")
    assert 3 <= generated <= 120
    assert delta("vllm:inter_token_latency_seconds_count{}") == generated - 3


def test_more_requests_than_slots_wait_and_still_match(server, solo_answers):
    prompts = PROMPTS + PROMPTS[:2]  # 6 requests, 4 slots
    answers = asyncio.run(_concurrently(server, prompts))
    assert answers == solo_answers + solo_answers[:2]


def test_a_client_that_disconnects_mid_stream_leaves_the_next_answers_intact(server, solo_answers):
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    # the abandoned answer must not leak into the next requests, alone or together
    assert asyncio.run(_concurrently(server, PROMPTS[:2])) == solo_answers[:2]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert complete(client, PROMPTS[0]) == solo_answers[0]
    deadline = time.monotonic() + 30
    while scrape(server).get("vllm:num_requests_running{}", 1) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(server)["vllm:num_requests_running{}"] == 0


def test_with_lookahead_answers_match_and_a_disconnect_mid_stream_is_clean(solo_answers):
    """`--lookahead 1` (the GPU default; here on the CPU): batch windows launched before the host reads the one in
    flight give every request its solo answer, and a client leaving mid-stream (its slot stopped with windows in
    flight) leaves the next answers intact and nothing running."""
    srv = Server("--batch", "4", "--lookahead", "1")
    try:
        facts = httpx.get(srv.url + "/metrics", headers={"Accept": "application/json"}).json()
        assert facts["engine_facts"]["lookahead"] == 1  # the flag reached the engine process
        assert asyncio.run(_concurrently(srv, PROMPTS)) == solo_answers
        body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(6))
            # alone, it runs in a slot (its windows one ahead)
            facts = httpx.get(srv.url + "/metrics", headers={"Accept": "application/json"}).json()
            assert facts["slots_in_use"] == 1 and facts["requests_running"] == 1
        assert asyncio.run(_concurrently(srv, PROMPTS[:3] + PROMPTS[:1])) == solo_answers[:3] + solo_answers[:1]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert complete(client, PROMPTS[2]) == solo_answers[2]  # a lone request, through a slot
        deadline = time.monotonic() + 30
        while scrape(srv).get("vllm:num_requests_running{}", 1) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scrape(srv)["vllm:num_requests_running{}"] == 0
    finally:
        srv.stop()


def test_metrics_formats(server):
    text = httpx.get(server.url + "/metrics", params={"format": "prometheus"}).text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:time_per_output_token_seconds", "strata:live_tok_s"):
        assert name in names, name
    facts = httpx.get(server.url + "/metrics").json()
    assert facts["model"] == MODEL and facts["slots_total"] == 4 and facts["requests_total"] > 0
    assert httpx.get(server.url + "/").text.lstrip().lower().startswith("<!doctype html")


def test_models_health_version(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json() == {**models["data"][0], "created": ANY}
    other = httpx.get(server.url + "/v1/models/gpt-17")
    assert other.status_code == 404 and "`gpt-17` does not exist" in other.json()["error"]["message"]


BAD_INPUT = [  # (body, status, words in the message): malformed requests and values the server refuses
    ("{not json", 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "maximum context length"),  # context_length_exceeded
    ({"model": "gpt-17", "prompt": "hi"}, 404, "gpt-17"),
    ({"model": MODEL, "prompt": "hello " * 5000}, 400, "maximum context length"),  # context_length_exceeded
    ('{"model": "%s", "prompt": "\\ud800 lone"}' % MODEL, 400, "surrogate"),
    ("[" * 100000 + "]" * 100000, 400, "nests too deeply"),
    ({"model": MODEL, "prompt": "hi", "n": 65}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"fifty": 5}}, 400, "logit_bias: key 'fifty'"),
    ({"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix: Strata does not support"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": [1, 99999999]}, 400, "vocabulary"),
]

OUT_OF_RANGE = [  # (field, value): each outside what OpenAI (or vLLM, for its own fields) accepts
    ("top_k", 100000000000000000000), ("top_k", -2), ("temperature", float("inf")), ("temperature", 1e308),
    ("temperature", 2.5), ("top_p", float("nan")), ("max_tokens", True), ("max_tokens", 2.0), ("seed", 2**64),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**64]), ("stop_token_ids", [99999999]), ("stream", "yes"),
    ("repetition_penalty", 1e308), ("presence_penalty", float("-inf")), ("n", True),
]

UNKNOWN_PATHS = [("GET", "/v1/nothing", 404), ("DELETE", "/v1/completions", 405), ("GET", "/v1/chat/completions", 405)]


def openai_error(r: httpx.Response, status: int, row) -> dict:
    """The error object of a reply that must be `status` in OpenAI's shape."""
    assert r.status_code == status, (row, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (row, error)
    return error


def test_bad_input_gets_openai_errors_while_another_users_stream_runs_untouched(server, solo_answers):
    """Every row of the bad-input tables (malformed bodies, values outside what OpenAI or vLLM accept, unknown paths
    and methods) gets a 4xx in OpenAI's error shape, `code` OpenAI's string where it names the case, else the
    status, as vLLM sends it; meanwhile another user's greedy stream runs through the whole table and ends
    normally with its solo answer, and the engine is never restarted: nothing bad reached it."""
    pid = httpx.get(server.url + "/metrics").json()["engine_facts"]["pid"]
    other = Prompt("completions", PROMPTS[1], 40)  # 40 tokens alone, no early end: it outlasts the table
    url = server.url + "/v1/completions"

    async def scenario() -> tuple[Answer, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            started = asyncio.Event()
            stream = asyncio.create_task(ask(http, server.url, other, True, Answer(1, True), started))
            await started.wait()
            for row in BAD_INPUT:
                body, status, words = row
                content = body if isinstance(body, str) else json.dumps(body)
                r = await http.post(url, content=content, headers={"Content-Type": "application/json"})
                error = openai_error(r, status, row)
                code = "context_length_exceeded" if "context" in words else status
                assert words in error["message"] and error["code"] == code, (row, error)
                assert error["type"] == ("invalid_request_error" if status == 400 else "NotFoundError"), (row, error)
            for row in OUT_OF_RANGE:
                field, value = row
                body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, field: value})  # inf/nan as JSON
                r = await http.post(url, content=body, headers={"Content-Type": "application/json"})
                error = openai_error(r, 400, row)
                assert error["param"].startswith(field) and field in error["message"] and error["code"] == 400, row
            for row in UNKNOWN_PATHS:
                method, path, status = row
                error = openai_error(await http.request(method, server.url + path), status, row)
                assert error["code"] == status and path in error["message"], (row, error)
            table_done = time.monotonic()
            return await stream, table_done

    answer, table_done = asyncio.run(scenario())
    assert answer.error is None and answer.finish == "length", answer
    assert answer.text == solo_answers[1]
    assert answer.end > table_done, "the stream ended before the table did: make it longer"
    assert httpx.get(server.url + "/metrics").json()["engine_facts"]["pid"] == pid  # never restarted


def test_the_engine_process_is_restarted_and_in_flight_requests_fail_clearly(server, solo_answers):
    """The engine killed under a stream and a non-streaming answer: the stream ends with an error event and [DONE],
    the other answer is 503 (retry) in OpenAI's shape; the engine comes back and answers right."""
    pid = httpx.get(server.url + "/metrics").json()["engine_facts"]["pid"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            deadline = time.monotonic() + 30
            while httpx.get(server.url + "/metrics").json()["requests_running"] < 2:  # both run
                assert time.monotonic() < deadline, "the non-streaming request never ran"
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        cut = whole.result()
    assert any("engine process exited" in line for line in rest)
    assert rest[-1] == "data: [DONE]"
    assert cut.status_code == 503, cut.text
    error = cut.json()["error"]
    assert error["type"] == "service_unavailable" and "retry" in error["message"] and error["code"] == 503
    server.wait_healthy()
    facts = httpx.get(server.url + "/metrics").json()
    assert facts["engine_facts"]["pid"] != pid and facts["engine_restarts_total"] == 1
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert complete(client, PROMPTS[0]) == solo_answers[0]


def test_api_key():
    srv = Server("--api-key", "sesame")
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sesame", max_retries=0)
        assert "Paris" in complete(good, PROMPTS[0], max_tokens=5)
        assert httpx.get(srv.url + "/health").status_code == 200  # health and metrics stay open, as in vLLM
    finally:
        srv.stop()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_stops_server_and_engine_without_a_restart(tmp_path, sig):
    """Ctrl-C in a terminal, `timeout` or a service manager signal the whole process group: the server must stop
    its engine itself, not see it die first, log an error and start another."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.server_process import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        engine_pid = httpx.get(url + "/metrics").json()["engine_facts"]["pid"]
        os.killpg(proc.pid, getattr(signal, sig))
        assert proc.wait(timeout=60) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "restarting" not in text and "ERROR" not in text, text[-2000:]

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + 20
    while running(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(engine_pid), "the engine process outlived its server"


def test_iteration_tokens_count_every_row_of_the_windows(server):
    """vllm:iteration_tokens_total: a request alone on the server puts its unread prompt rows and one row per
    generated token but the last into windows (the last token is sampled, never read back)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = scrape(server)
    r = client.completions.create(model=MODEL, prompt="Seven quiet herons stood in the", max_tokens=12, temperature=0)
    after = scrape(server)
    delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    read = r.usage.prompt_tokens - delta("vllm:prefix_cache_hits_total{}")
    assert delta("vllm:iteration_tokens_total_sum{}") == read + r.usage.completion_tokens - 1
    assert delta("vllm:iteration_tokens_total_count{}") == r.usage.completion_tokens  # one window a token


async def wait_until(http: httpx.AsyncClient, url: str, key: str, value: float, deadline_s: float = 30) -> None:
    """Poll /metrics until the series `key` reads `value`."""
    deadline = time.monotonic() + deadline_s
    while True:
        text = (await http.get(url + "/metrics", headers={"Accept": "text/plain"})).text
        if key.split("{")[0] in text and _series(text).get(key) == value:
            return
        assert time.monotonic() < deadline, f"{key} did not reach {value}"
        await asyncio.sleep(0.05)


def _series(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                          if k not in ("model_name", "engine")) + "}"
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_the_waiting_line_is_bounded_and_clients_that_leave_free_their_place(solo_answers):
    """One slot, a line of one: a third request gets 429 (OpenAI's error shape, Retry-After); a client that leaves
    while waiting, and one that leaves while its prompt is read, free their places at once; the next requests
    still get their solo answers."""
    srv = Server("--batch", "1", "--max-waiting", "1", "--max-window-tokens", "8")
    url = srv.url + "/v1/completions"
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 300, "temperature": 0, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            facts = (await http.get(srv.url + "/metrics", headers={"Accept": "application/json"})).json()
            assert facts["engine_facts"]["max_waiting"] == 1 and facts["engine_facts"]["max_window_tokens"] == 8
            async with http.stream("POST", url, json={**body, "stream": True}) as first:
                lines = first.aiter_lines()  # read by hand: leaving an `async for` would close the stream
                while not (await lines.__anext__()).startswith("data: {"):
                    pass  # it runs
                leaver = httpx.AsyncClient(timeout=60)  # a client of its own: closing it closes its connection
                waiting = asyncio.create_task(leaver.post(url, json={**body, "prompt": PROMPTS[1]}))
                await wait_until(http, srv.url, "vllm:num_requests_waiting{}", 1)
                full = await http.post(url, json=body)
                assert full.status_code == 429 and full.headers["retry-after"] == "1"
                error = full.json()["error"]
                assert error["type"] == "rate_limit_exceeded" and "--max-waiting" in error["message"]
                sdk = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await sdk.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5)
                waiting.cancel()  # the client leaves while waiting: its place is free at once
                await leaver.aclose()
                await wait_until(http, srv.url, "vllm:num_requests_waiting{}", 0)
            await wait_until(http, srv.url, "vllm:num_requests_running{}", 0)
            long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # ~400 tokens: 50 windows
            leaver = httpx.AsyncClient(timeout=60)
            reading = asyncio.create_task(leaver.post(url, json={**body, "prompt": long_prompt}))
            await wait_until(http, srv.url, "vllm:num_requests_running{}", 1)
            reading.cancel()  # the client leaves while its prompt is read
            await leaver.aclose()
            await wait_until(http, srv.url, "vllm:num_requests_running{}", 0, deadline_s=10)

    try:
        asyncio.run(scenario())
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert complete(client, PROMPTS[0]) == solo_answers[0]  # the slot runs the next request as alone
        assert scrape(srv)["vllm:request_success_total{finished_reason=abort}"] == 3
    finally:
        srv.stop()


def test_a_non_streaming_client_that_leaves_mid_answer_stops_its_request(server, solo_answers):
    """A client of a non-streaming answer that goes away while the tokens come (a client-side timeout, say) aborts
    its request at once: the slot is free long before max_tokens would have been reached, and the next request
    gets its solo answer."""
    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}

    async def scenario() -> float:
        async with httpx.AsyncClient(timeout=60) as http:
            await wait_until(http, server.url, "vllm:num_requests_running{}", 0)
            before = _series((await http.get(server.url + "/metrics", headers={"Accept": "text/plain"})).text)
            leaver = httpx.AsyncClient(timeout=60)
            answer = asyncio.create_task(leaver.post(url, json=body))
            deadline = time.monotonic() + 60
            while True:  # until it decodes
                now = _series((await http.get(server.url + "/metrics", headers={"Accept": "text/plain"})).text)
                if now["vllm:generation_tokens_total{}"] - before["vllm:generation_tokens_total{}"] >= 3:
                    break
                assert time.monotonic() < deadline, "the request never decoded"
                await asyncio.sleep(0.05)
            answer.cancel()  # the client leaves mid-answer
            await leaver.aclose()
            await wait_until(http, server.url, "vllm:num_requests_running{}", 0, deadline_s=10)
            after = _series((await http.get(server.url + "/metrics", headers={"Accept": "text/plain"})).text)
            return after["vllm:generation_tokens_total{}"] - before["vllm:generation_tokens_total{}"]

    generated = asyncio.run(scenario())
    assert generated < 300, f"{generated} tokens were generated for a client that had left"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert complete(client, PROMPTS[0]) == solo_answers[0]


def _gone(pid: int, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_drains_within_the_grace_and_ends_what_still_runs():
    """SIGTERM under two long streams (both slots) and a non-streaming request waiting for a slot: readiness goes
    false at once; when --shutdown-grace is over each stream gets an error event saying why, then [DONE], and the
    waiting request 503 (retry); the server exits and its engine goes with it."""
    srv = Server("--batch", "2", "--shutdown-grace", "3")
    engine_pid = httpx.get(srv.url + "/metrics").json()["engine_facts"]["pid"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    url = srv.url + "/v1/completions"
    try:
        with contextlib.ExitStack() as streams, concurrent.futures.ThreadPoolExecutor(1) as pool:
            lines = []
            for prompt in PROMPTS[1:3]:
                r = streams.enter_context(httpx.stream("POST", url, json={**body, "prompt": prompt, "stream": True},
                                                       timeout=60))
                lines.append(r.iter_lines())
                assert next(lines[-1]).startswith("data: {")  # it runs
            waiting = pool.submit(httpx.post, url, json=body, timeout=60)
            deadline = time.monotonic() + 30
            while httpx.get(srv.url + "/metrics").json()["requests_waiting"] < 1:
                assert time.monotonic() < deadline, "the third request never reached the waiting line"
                time.sleep(0.05)
            signalled = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            try:
                health = httpx.get(srv.url + "/health", timeout=5).status_code
            except httpx.HTTPError:
                health = None  # the listening socket may already be closed: either way, not ready
            assert health in (503, None)
            for stream in lines:
                rest = [line for line in stream if line]
                ended = time.monotonic() - signalled
                assert any("shutting down" in line and '"error"' in line for line in rest), rest[-3:]
                assert rest[-1] == "data: [DONE]"
                assert 2.5 < ended < 20, ended  # not before the grace, not long after it
            cut = waiting.result()
        assert cut.status_code == 503 and "shutting down" in cut.json()["error"]["message"], cut.text
        assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn ends by the signal it handled
        assert _gone(engine_pid, 15), "the engine outlived its server"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_an_engine_never_outlives_a_killed_server():
    srv = Server("--batch", "1")
    engine_pid = httpx.get(srv.url + "/metrics").json()["engine_facts"]["pid"]
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)
    assert _gone(engine_pid, 15), "the engine kept running after its server was killed"


def test_liveness_fails_for_a_hung_engine_and_recovers():
    """`/live` is apart from readiness: it fails while the engine is stopped mid-answer (SIGSTOP: silent while a
    request runs) and passes again once it goes on; the answer then completes."""
    srv = Server("--batch", "1", "--engine-silence", "1.5")
    engine_pid = httpx.get(srv.url + "/metrics").json()["engine_facts"]["pid"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        assert httpx.get(srv.url + "/live").json() == {"status": "alive"}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 20
                while (live := httpx.get(srv.url + "/live", timeout=5)).status_code == 200:
                    assert time.monotonic() < deadline, "/live kept passing while the engine was stopped"
                    time.sleep(0.2)
                assert live.status_code == 503 and "said nothing" in live.json()["reason"]
                assert httpx.get(srv.url + "/health").status_code == 200  # readiness is another question
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        assert httpx.get(srv.url + "/live").status_code == 200
    finally:
        srv.stop()


def test_the_openapi_schema_describes_the_request_bodies(server):
    """A fuzzer (schemathesis) or a client generator reads the bodies from /openapi.json, with their ranges."""
    schema = httpx.get(server.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model, field in [("/v1/chat/completions", "ChatCompletionRequest", "messages"),
                               ("/v1/completions", "CompletionRequest", "prompt")]:
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        props = components[model]["properties"]
        assert field in components[model]["required"]
        temperature = next(t for t in props["temperature"]["anyOf"] if t.get("type") == "number")
        assert temperature["minimum"] == 0 and temperature["maximum"] == 2
    message = components["ChatCompletionRequest"]["properties"]["messages"]["items"]["$ref"].rsplit("/", 1)[1]
    assert "role" in components[message]["properties"]  # every $ref resolves under components
