"""The live monitor page (`serve/static/monitor.html`) in a real headless browser.

A tiny FastAPI app serves the page at `/` and a fake `/metrics` JSON endpoint whose numbers change on
every call; Debian's Chromium, driven by Playwright, loads the page and the tests read what it shows.

Needs `pip install playwright` and `apt-get install chromium` (/usr/bin/chromium). Playwright's own
browser download (`playwright install`) is NOT used. Missing pieces make the tests FAIL, not skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

PAGE = Path(__file__).resolve().parent.parent / "serve" / "static" / "monitor.html"
CHROMIUM = os.environ.get("STRATA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-proxy-server",
]
API_KEY = "sk-test-monitor-123"
DEADLINE_MS = 8000


# --------------------------------------------------------------------------- fake server


class FakeMetrics:
    """State behind the fake `/metrics`: `mode` is "ok", "error" (HTTP 500) or "auth" (401 unless Bearer matches)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.mode = "ok"
        self.auth_headers: list[str | None] = []

    def payload(self) -> dict:
        with self.lock:
            n = self.calls
            self.calls += 1
        now = time.time()
        return {
            "model": "fake-moe-30b",
            "engine": "strata",
            "uptime_s": 3725.0 + n,
            "live_tok_s": 100.0 + 10.0 * n,  # 100.0, 110.0, 120.0, ... shown as "100.0", "110.0", ...
            "slots_total": 8,
            "slots_in_use": 3,
            "requests_running": 3,
            "requests_waiting": 2,
            "requests_total": 41 + n,
            "requests_success": {"stop": 37 + n, "length": 4},
            "prompt_tokens_total": 123456 + 100 * n,
            "generation_tokens_total": 98765 + 50 * n,
            "kv_cache_usage": 0.42,
            "parked_conversations": 2,
            "parked_bytes": 3_500_000,
            "expert_pairs": {"device": 900, "cpu": 100},
            "gpu_util": {"0": 87.0, "1": 64.5},
            "latency": {
                "ttft_s": {"p50": 0.1234, "p90": 0.25, "p99": 0.5},
                "itl_s": {"p50": 0.012, "p90": 0.02, "p99": None},
                "e2e_s": {"p50": 1.5, "p90": 3.0, "p99": 6.25},
            },
            "history": [
                {"id": "req-aaa", "prompt_tokens": 512, "generation_tokens": 128, "ttft_s": 0.11,
                 "e2e_s": 1.9, "tok_s": 67.4, "finish_reason": "stop", "finished_at": now - 1},
                {"id": "req-bbb", "prompt_tokens": 64, "generation_tokens": 256, "ttft_s": 0.09,
                 "e2e_s": 3.2, "tok_s": 80.0, "finish_reason": "length", "finished_at": now - 5},
                {"id": "req-<ccc>", "prompt_tokens": 7, "generation_tokens": 1, "ttft_s": None,
                 "e2e_s": None, "tok_s": None, "finish_reason": "stop", "finished_at": now - 9},
            ],
            "engine_facts": {"dtype": "bfloat16", "max_cells": 65536, "tp": 2, "kernels": "triton"},
        }


def _make_app(state: FakeMetrics) -> FastAPI:
    app = FastAPI()

    @app.get("/")
    def index() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/metrics")
    def metrics(request: Request):
        if state.mode == "error":
            return JSONResponse({"error": "boom"}, status_code=500)
        if state.mode == "auth":
            header = request.headers.get("authorization")
            state.auth_headers.append(header)
            if header != f"Bearer {API_KEY}":
                return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        assert "application/json" in request.headers.get("accept", "")
        return JSONResponse(state.payload())

    return app


@pytest.fixture()
def fake_server():
    import uvicorn

    state = FakeMetrics()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held open so nothing can take it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "uvicorn thread died while starting"
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


# --------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: `pip install playwright` (do not run `playwright install`)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        found = shutil.which("chromium")
        pytest.fail(f"Chromium not found at {CHROMIUM} (which chromium: {found}): `apt-get install -y chromium`")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=30000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" and "401" not in msg.text
          and "500" not in msg.text else None)
    pg.js_errors = errors
    yield pg
    context.close()


def _text(page, selector: str) -> str:
    return page.locator(selector).inner_text().strip()


# --------------------------------------------------------------------------- tests


def test_page_has_no_external_resources():
    html = PAGE.read_text(encoding="utf-8")
    for needle in ("http://", "https://", 'src="//', "href=\"//", "@import", "url("):
        assert needle not in html, f"monitor.html must be self-contained, found {needle!r}"


def test_live_numbers_refresh_history_and_disconnect(fake_server, page):
    base, state = fake_server
    page.goto(base + "/", wait_until="domcontentloaded")

    # The fake's live_tok_s is 100 + 10*n: wait until the page shows one of those values ...
    page.wait_for_function(
        """() => { const t = document.getElementById('live-tok-s').textContent.trim();
                   const v = parseFloat(t.replace(/,/g, ''));
                   return /^[\\d,]+\\.0$/.test(t) && v >= 100 && (v - 100) % 10 === 0; }""",
        timeout=DEADLINE_MS,
    )
    first = _text(page, "#live-tok-s")
    # ... then until it changes: the page polls by itself.
    page.wait_for_function(
        "first => document.getElementById('live-tok-s').textContent.trim() !== first",
        arg=first,
        timeout=DEADLINE_MS,
    )
    second = float(_text(page, "#live-tok-s").replace(",", ""))
    assert second > float(first.replace(",", ""))
    assert state.calls >= 2

    assert page.get_attribute("#status", "data-state") == "live"
    assert "disconnected" not in _text(page, "#status").lower()
    assert _text(page, "#slots").replace(" ", "") == "3/8"
    assert _text(page, "#parked") == "parked in host RAM: 2 conversations, 3.5 MB"
    assert _text(page, "#experts") == "expert pairs on the GPU: 90.0% (the CPU pool computed 100)"
    assert _text(page, "#requests-running") == "3"
    assert _text(page, "#requests-waiting") == "2"
    assert int(_text(page, "#requests-total").replace(",", "")) >= 41
    assert _text(page, "#ttft-p50") == "123"  # 0.1234 s shown in ms
    assert _text(page, "#itl-p50") == "12.0"
    assert _text(page, "#itl-p99") == "—"  # null percentile
    assert _text(page, "#e2e-p99") == "6,250"
    assert _text(page, "#kv-cache") == "42.0%"
    assert _text(page, "#model") == "fake-moe-30b"
    gpu = _text(page, "#gpu-util")
    assert "GPU 0" in gpu and "87%" in gpu and "GPU 1" in gpu
    facts = _text(page, "#engine-facts")
    assert "bfloat16" in facts and "max_cells" in facts and "65536" in facts

    rows = page.locator("#history tbody tr")
    assert rows.count() == 3
    ids = [rows.nth(i).locator("td").first.inner_text().strip() for i in range(3)]
    assert ids == ["req-aaa", "req-bbb", "req-<ccc>"]  # newest first; text is escaped, not parsed as HTML
    first_row = [c.strip() for c in rows.nth(0).locator("td").all_inner_texts()]
    assert first_row[:7] == ["req-aaa", "512", "128", "110", "1.90", "67.4", "stop"]

    # Sparkline gets drawn once there are two samples.
    assert page.get_attribute("#spark polyline", "points").count(",") >= 2

    page.screenshot(path="/tmp/monitor.png", full_page=True)

    # The endpoint starts failing: the page says so, and keeps retrying.
    state.mode = "error"
    page.wait_for_function(
        "() => document.getElementById('status').textContent.toLowerCase().includes('disconnected')",
        timeout=DEADLINE_MS,
    )
    assert page.get_attribute("#status", "data-state") == "disconnected"
    assert page.locator("#banner").is_visible()
    page.screenshot(path="/tmp/monitor-disconnected.png", full_page=True)

    # ... and recovers when the endpoint comes back.
    state.mode = "ok"
    page.wait_for_function(
        "() => document.getElementById('status').getAttribute('data-state') === 'live'",
        timeout=DEADLINE_MS,
    )
    assert not page.locator("#banner").is_visible()
    assert page.js_errors == []


def test_api_key_prompt_on_401(fake_server, page):
    base, state = fake_server
    state.mode = "auth"
    page.goto(base + "/", wait_until="domcontentloaded")

    key_input = page.locator("#api-key")
    key_input.wait_for(state="visible", timeout=DEADLINE_MS)
    assert page.get_attribute("#status", "data-state") == "unauthorized"
    assert _text(page, "#live-tok-s") == "—"
    page.screenshot(path="/tmp/monitor-auth.png", full_page=True)

    key_input.fill(API_KEY)
    page.locator("#api-key-save").click()
    page.wait_for_function(
        "() => /^[\\d,]+\\.0$/.test(document.getElementById('live-tok-s').textContent.trim())",
        timeout=DEADLINE_MS,
    )
    assert page.get_attribute("#status", "data-state") == "live"
    assert not key_input.is_visible()
    assert f"Bearer {API_KEY}" in state.auth_headers
    assert page.evaluate("() => localStorage.getItem('strata.monitor.apiKey')") == API_KEY

    # The key is remembered: a reload connects without asking again.
    page.reload(wait_until="domcontentloaded")
    page.wait_for_function(
        "() => document.getElementById('status').getAttribute('data-state') === 'live'",
        timeout=DEADLINE_MS,
    )
    assert not key_input.is_visible()
    assert page.js_errors == []


def test_page_on_a_real_server_shows_its_requests(page):
    """The page served by a real `strata serve` (no --batch: one slot, requests wait in the engine's line)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.server_process import Server

    server = Server()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ask = lambda p: client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=12, temperature=0)  # noqa: E731
        with ThreadPoolExecutor(2) as pool:  # two at once: the second waits for the first (FIFO)
            answers = list(pool.map(ask, ["The capital of France is", "Once upon a time"]))
        assert answers[0].choices[0].text.startswith(" Paris")
        page.goto(server.url + "/")
        page.wait_for_function("() => document.querySelector('#requests-total').innerText.trim() === '2'", timeout=20000)
        page.wait_for_function("() => document.querySelectorAll('#history tbody tr').length === 2", timeout=20000)
        assert _text(page, "#status").lower().startswith("live")
        page.screenshot(path="/tmp/monitor-real.png", full_page=True)
        assert not page.js_errors, page.js_errors
    finally:
        server.stop()
