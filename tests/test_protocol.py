"""A real `strata engine` subprocess driven through its pipes: requests by id, the waiting line, aborts, bad input."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch

from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from tests.protocol_lines import tokens
from tests.tiny_models import VOCAB, build

DEADLINE_S = 60


class EngineProcess:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "engine", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read_until(self, predicate) -> list[str]:
        """Every line up to and including the first that satisfies `predicate`, within the deadline."""
        out, deadline = [], time.monotonic() + DEADLINE_S
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            out.append(line)
            if predicate(line):
                return out

    def close(self) -> int:
        self.send("QUIT")
        return self.proc.wait(timeout=DEADLINE_S)


def ended(rid: str):
    return lambda line: line.startswith(f"END {rid} ")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    build("qwen3_next", folder)
    return folder


@pytest.fixture(scope="module")
def reference(model):
    engine = Engine(ModelFiles.open(model), max_cells=512)
    return lambda ids, n: engine.generate(ids, n, stop_ids=frozenset()).ids


def start(model, *args: str) -> EngineProcess:
    proc = EngineProcess("--model", str(model), "--max-cells", "512", *args)
    ready = proc.read_until(lambda line: line.startswith("READY"))[-1]
    proc.facts = json.loads(ready.split(" ", 1)[1])
    return proc


@pytest.fixture
def engine(model):
    proc = start(model, "--batch", "4", "--max-window-tokens", "16")
    assert proc.facts["batch"] == 4 and proc.facts["max_cells"] == 512 and proc.facts["vocab_size"] == VOCAB
    assert proc.facts["max_window_tokens"] == 16 and proc.facts["max_waiting"] == 256
    yield proc
    if proc.proc.poll() is None:
        proc.proc.kill()


def test_a_request_streams_tokens_then_ends(engine, reference):
    engine.send("ADD a 20 ignore_eos=1 1 2 3 4")
    lines = engine.read_until(ended("a"))
    assert lines[:2] == ["WAIT a", "RUN a 0"]  # nothing held to reuse: all 4 prompt tokens read
    assert lines[-1] == "END a length 4 20 0"
    assert tokens(lines, "a") == reference([1, 2, 3, 4], 20)
    wins = [list(map(int, line.split()[1:])) for line in lines if line.startswith("WIN ")]
    assert wins[0] == [0, 4] and all(w == [1, 0] for w in wins[1:]) and len(wins) == 20
    assert engine.close() == 0


def test_a_scored_prompt_gives_each_tokens_log_probability(engine, model, reference):
    """`prompt_logprobs=`: after RUN, a PLP line per prompt token after the first, transformers' log-softmax at it
    given the tokens before (Qwen3-Next: GDN layers too), read in windows of --max-window-tokens; then the answer
    as without it."""
    import transformers

    ids = list(range(3, 23))  # 20 tokens: two windows of 16 and 4
    engine.send("ADD s 3 ignore_eos=1 prompt_logprobs=2 " + " ".join(map(str, ids)))
    lines = engine.read_until(ended("s"))
    assert lines[:2] == ["WAIT s", "RUN s 0"]
    scored = [line.split()[2:] for line in lines if line.startswith("PLP s ")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(scored) == len(ids) - 1
    for p, words in enumerate(scored, 1):
        values, top = ref[p - 1].topk(2)
        assert float(words[0]) == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert [int(w) for w in words[1::2]] == top.tolist()
    wins = [list(map(int, line.split()[1:])) for line in lines if line.startswith("WIN ")]
    assert wins[:2] == [[0, 16], [0, 4]]
    assert tokens(lines, "s") == reference(ids, 3)
    assert engine.close() == 0


@pytest.mark.parametrize("lookahead", [0, 1])
def test_requests_added_at_staggered_times_equal_their_solo_runs(model, reference, lookahead):
    """With lookahead 1 (the GPU's default) the second request is admitted while the first one's windows stay in
    flight; either way both answers are their solo runs."""
    engine = start(model, "--batch", "4", "--max-window-tokens", "16", "--lookahead", str(lookahead))
    long = [(3 + 5 * j) % VOCAB for j in range(70)]  # read over several 16-row windows beside the decoding rows
    engine.send("ADD first 40 ignore_eos=1 5 6 7")
    lines = engine.read_until(lambda line: line.startswith("TOK"))
    engine.send("ADD second 30 ignore_eos=1 " + " ".join(map(str, long)))
    seen: set[str] = set()
    lines += engine.read_until(lambda line: line.startswith("END") and seen.add(line.split()[1]) is None and len(seen) == 2)
    assert tokens(lines, "first") == reference([5, 6, 7], 40)
    assert tokens(lines, "second") == reference(long, 30)
    assert "END first length 3 40 0" in lines and "END second length 70 30 0" in lines
    wins = [list(map(int, line.split()[1:])) for line in lines if line.startswith("WIN ")]
    assert all(d + p <= 16 for d, p in wins)
    assert sum(p for _, p in wins) == 73 and sum(1 for d, p in wins if d and p) >= 4  # read beside the decoding row
    assert engine.close() == 0


def test_abort_a_running_request_then_another_runs_clean(engine, reference):
    engine.send("ADD x 400 ignore_eos=1 3 1 4 1 5")
    engine.read_until(lambda line: line.startswith("TOK"))
    engine.send("ABORT x")
    lines = engine.read_until(ended("x"))
    reason, num_prompt, num_generated = lines[-1].split()[2:5]
    assert reason == "abort" and num_prompt == "5" and 1 <= int(num_generated) < 400
    engine.send("ABORT x")  # idempotent: nothing more is said about an ended request
    engine.send("ADD y 12 ignore_eos=1 2 7 1 8")
    lines = engine.read_until(ended("y"))
    assert not tokens(lines, "x") and tokens(lines, "y") == reference([2, 7, 1, 8], 12)


def test_the_waiting_line_is_bounded_and_aborts_free_places(model, reference):
    """One slot and a line of two: the fourth request is refused (`full`); a waiting request aborted leaves at once,
    a request aborted while its prompt is read frees the slot for the next."""
    engine = start(model, "--batch", "1", "--max-waiting", "2", "--max-window-tokens", "8")
    engine.send("ADD a 300 ignore_eos=1 1 2 3")
    engine.read_until(lambda line: line.startswith("TOK"))
    long = " ".join(str((7 + 3 * j) % VOCAB) for j in range(200))  # 25 windows of 8 rows
    for rid in ("b", "c", "d"):
        engine.send(f"ADD {rid} 5 ignore_eos=1 {long}")
    lines = engine.read_until(lambda line: line.startswith("ERR d"))
    assert "WAIT b" in lines and "WAIT c" in lines and lines[-1].startswith("ERR d full ")
    engine.send("ABORT c")  # waiting: leaves the line at once
    lines = engine.read_until(ended("c"))
    assert lines[-1] == "END c abort 200 0 0"
    engine.send("ABORT a")
    lines = engine.read_until(lambda line: line.startswith("RUN b"))  # b gets the slot at the next window
    engine.send("ABORT b")  # mid-prompt: ends with nothing generated
    lines = engine.read_until(ended("b"))
    assert lines[-1].startswith("END b abort 200 0 ")
    engine.send("ADD e 6 ignore_eos=1 4 4 4")
    lines = engine.read_until(ended("e"))
    assert tokens(lines, "e") == reference([4, 4, 4], 6)
    assert engine.close() == 0


def test_bad_input_answers_err_and_the_engine_carries_on(engine, reference):
    engine.send("ADD run 200 ignore_eos=1 5 6 7")
    engine.read_until(lambda line: line == "RUN run 0")
    bad = [
        ("HELLO", "ERR - invalid", "unknown command"),
        ("ADD", "ERR - invalid", "needs"),
        ("ADD b@d 5 1 2", "ERR - invalid", "request id"),
        ("ADD run 5 1 2", "ERR run invalid", "already in use"),
        (f"ADD v 5 1 {VOCAB + 1}", "ERR v invalid", "vocabulary"),
        ("ADD m 5 " + " ".join(["1"] * 600), "ERR m invalid", "max_cells"),
        ("ADD t 5 temperature=-1 1 2", "ERR t invalid", "temperature"),
        ("ADD ti 5 temperature=inf 1 2", "ERR ti invalid", "temperature"),
        ("ADD rp 5 repetition_penalty=nan 1 2", "ERR rp invalid", "repetition_penalty"),
        ("ADD sd 5 seed=99999999999999999999 1 2", "ERR sd invalid", "seed"),
        ("ADD k 5 colour=blue 1 2", "ERR k invalid", "unknown key"),
        ("ADD z 0 1 2", "ERR z invalid", "at least one token"),
        ("ABORT", "ERR - invalid", "wrong number"),
    ]
    lines = []
    for line, head, words in bad:
        engine.send(line)
        lines += engine.read_until(lambda out: out.startswith("ERR"))
        assert lines[-1].startswith(head) and words in lines[-1], (line, lines[-1])
    lines += engine.read_until(ended("run"))
    assert lines[-1] == "END run length 3 200 0"  # the running request was never disturbed
    engine.send("ADD after 6 ignore_eos=1 4 4 4")
    lines = engine.read_until(ended("after"))
    assert tokens(lines, "after") == reference([4, 4, 4], 6)
    # a top_k past the vocabulary (here past 64 bits) means no top_k: it samples, and the engine is still there
    engine.send("ADD huge 4 ignore_eos=1 temperature=0.8 seed=3 top_k=100000000000000000000 4 4 4")
    engine.send("ADD plain 4 ignore_eos=1 temperature=0.8 seed=3 4 4 4")
    ends: set[str] = set()
    lines = engine.read_until(lambda line: line.startswith("END") and ends.add(line.split()[1]) is None and len(ends) == 2)
    assert tokens(lines, "huge") == tokens(lines, "plain") and len(tokens(lines, "huge")) == 4
    assert engine.close() == 0


def test_end_of_input_finishes_work_in_flight(model, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "engine", "--model", str(model), "--batch", "2"],
        input="ADD a 10 ignore_eos=1 1 2\nADD b 10 ignore_eos=1 3 4\n", capture_output=True, text=True, timeout=DEADLINE_S,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert tokens(lines, "a") == reference([1, 2], 10) and tokens(lines, "b") == reference([3, 4], 10)


def test_parse_and_format_round_trip():
    from strata import protocol
    from strata.runtime.sampling import SamplingParams

    line = "ADD r-3 50 temperature=0.7 top_p=0.9 top_k=40 seed=11 presence_penalty=0.5 stop=2,13 ignore_eos=1 10 11 12"
    cmd = protocol.parse_command(line)
    assert isinstance(cmd, protocol.Add) and cmd.id == "r-3"
    r = cmd.request
    assert r.max_new == 50 and r.ids == [10, 11, 12] and r.stop_ids == {2, 13} and r.ignore_eos
    assert r.params == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=11, presence_penalty=0.5)
    assert protocol.parse_command(protocol.add("r-3", r)) == cmd
    assert protocol.parse_command("ABORT r-3") == protocol.Abort("r-3")
    biased = protocol.parse_command("ADD b 4 logit_bias=28:-100,3:2.5 min_tokens=3 prompt_logprobs=2 1 2").request
    assert biased.params == SamplingParams(logit_bias=((3, 2.5), (28, -100.0)), min_tokens=3)
    assert biased.prompt_logprobs == 2 and r.prompt_logprobs is None
    assert protocol.parse_command(protocol.add("b", biased)).request == biased
    for bad, words in [("ADD x", "needs"), ("ADD x 5", "no prompt"), ("ADD x 5 1 top_k=3", "keys come first"),
                       ("ADD x -1 1", "at least one"), ("QUIT now", "wrong number"), ("ADD x 5 seed=x 1", "not a number"),
                       ("ADD " + "x" * 65 + " 5 1", "request id"), ("GEN 5 1", "unknown command"),
                       ("ADD x 5 logit_bias=3 1", "token:bias"), ("ADD x 5 logit_bias=3:1,3:2 1", "twice"),
                       ("ADD x 5 logit_bias=a:1 1", "not an integer"), ("ADD x 5 logprobs=50 1", "0 to 20"),
                       ("ADD x 5 prompt_logprobs=-1 1", "prompt_logprobs=-1")]:
        with pytest.raises(protocol.ProtocolError, match=words):
            protocol.parse_command(bad)


def test_a_window_that_fails_ends_only_its_requests(model, reference):
    """Defence in depth: a fault inside a window (here injected into the sampler, the way an unforeseen setting
    would fail there) ends the requests that window ran with ERR internal; the waiting line and the engine carry
    on, and the next request gets its exact answer."""
    from strata.runtime import slots as slots_module
    from strata.runtime.scheduler import Scheduler

    engine = Engine(ModelFiles.open(model), max_cells=512)
    said: list[str] = []
    scheduler = Scheduler(engine, 1, said.append)
    scheduler.handle("ADD a 30 ignore_eos=1 1 2 3")
    scheduler.handle("ADD b 5 ignore_eos=1 4 5 6")  # waits: one slot
    real_sample = slots_module.sample
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise ValueError("injected fault")
        return real_sample(*args, **kwargs)

    slots_module.sample = failing
    try:
        while scheduler.busy:
            scheduler.step()
    finally:
        slots_module.sample = real_sample
    errs = [line for line in said if line.startswith("ERR")]
    assert errs == ["ERR a internal internal error in a window: ValueError: injected fault"]
    assert len(tokens(said, "a")) == 3 and not [line for line in said if line.startswith("END a")]
    assert tokens(said, "b") == reference([4, 5, 6], 5) and "END b length 3 5 0" in said
    assert not scheduler.running and not scheduler.slots.active
