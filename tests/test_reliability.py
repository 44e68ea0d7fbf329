"""The reliability suite's short runs (issue 25) against the shared real server (`server` in conftest.py): many
clients at once, some leaving mid-answer, and schemathesis over /openapi.json, each through bench/load.py's own
functions. bench/load.py makes the long runs and the faults, and prints their figures (docs/RELIABILITY.md); the
faults' checks are in test_server.py."""

from __future__ import annotations

import asyncio

from bench.load import Prompt, fuzz, run_load, solo_answers

LOAD_PROMPTS = [  # short answers, so a 15 s run holds a few dozen requests on two cores
    Prompt("completions", "The capital of France is", 12, stop="\n"),
    Prompt("completions", "def fibonacci(n):", 12),
    Prompt("chat", "List three prime numbers.", 12),
    Prompt("chat", "Write a haiku about the sea.", 12),
]
FUZZ_EXAMPLES = 25  # twice as many cases per operation, valid and invalid; bench/load.py --fuzz-examples: a long run


def test_clients_that_leave_at_random_cross_no_answer_and_leak_no_slot(server):
    """6 clients on 4 slots for 15 s, streaming or not, 30 % of the requests left by their client at a random
    moment: every answer that completed equals its solo answer, no request runs or waits once the clients are
    done, no error of any kind (no 5xx), no engine restart."""
    solo, seconds = asyncio.run(solo_answers(server.url, LOAD_PROMPTS))
    report = asyncio.run(run_load(server.url, LOAD_PROMPTS, solo, seconds=15, clients=6, disconnect_fraction=0.3,
                                  solo_seconds=seconds))
    left = sum(a.left for a in report.answers)
    assert len(report.completed) >= 6 and left >= 2, (len(report.completed), left)  # it ran, and clients left
    assert {a.stream for a in report.completed} == {True, False}
    assert report.crossed == []
    assert report.left_running is None
    assert not report.errors()
    assert report.engine_restarts == 0


def test_schemathesis_finds_no_server_error_and_every_4xx_in_openai_shape(server):
    """schemathesis's cases over the real /openapi.json (request bodies included), valid and invalid, against the
    live server: no 5xx, every 4xx in OpenAI's error shape, no error event in a stream answered 200. Generated
    bodies may ask for thousands of tokens (or give no max_tokens: the rest of the context), minutes on two cores:
    bench/load.py's `capped` lowers a max_tokens the server would honour to FUZZ_MAX_TOKENS and sets it when none
    is given, so every case ends within a second or two; values the server must refuse are sent as generated."""
    report = fuzz(server.url, FUZZ_EXAMPLES)
    assert report.found == []
    for operation in ("POST /v1/chat/completions", "POST /v1/completions", "GET /metrics"):
        assert report.cases[operation] == 2 * FUZZ_EXAMPLES, report.cases
    # the cases are the same every run (bench/load.py fuzzes derandomized); chat bodies reach the engine and are
    # answered; completion bodies valid by the schema are mostly refused by what the schema cannot say (token ids
    # past the vocabulary, several prompts), so both operations must have been refused and chat answered too
    assert report.statuses["POST /v1/chat/completions", 200] > 0, report.statuses
    for operation in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert report.statuses[operation, 400] > 0, report.statuses
