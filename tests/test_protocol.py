"""A real `strata engine` subprocess driven through its pipes."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest

from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
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


def tokens(lines: list[str], prefix: str) -> list[int]:
    return [int(line.split()[-1]) for line in lines if line.startswith(prefix + " ")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    build("qwen3_next", folder)
    return folder


@pytest.fixture(scope="module")
def reference(model):
    engine = Engine(ModelFiles.open(model), max_cells=512)
    return lambda ids, n: engine.generate(ids, n, stop_ids=frozenset()).ids


@pytest.fixture
def engine(model):
    proc = EngineProcess("--model", str(model), "--batch", "4", "--max-cells", "512")
    ready = proc.read_until(lambda line: line.startswith("READY"))[-1]
    facts = json.loads(ready.split(" ", 1)[1])
    assert facts["batch"] == 4 and facts["max_cells"] == 512 and facts["vocab_size"] == VOCAB
    yield proc
    if proc.proc.poll() is None:
        proc.proc.kill()


def test_solo_generation_streams_tokens_then_done(engine, reference):
    engine.send("GEN 20 ignore_eos=1 1 2 3 4")
    lines = engine.read_until(lambda line: line.startswith("DONE"))
    assert lines[-1] == "DONE length 4 20 0"  # nothing held to reuse: all 4 prompt tokens read
    assert tokens(lines, "T") == reference([1, 2, 3, 4], 20)
    assert engine.close() == 0


def test_slots_admitted_at_staggered_times_equal_solo(engine, reference):
    engine.send("BGEN 0 40 ignore_eos=1 5 6 7")
    first = engine.read_until(lambda line: line.startswith("BADM 0"))
    assert first[-1] == "BADM 0 1 0"
    engine.send("BGEN 2 30 ignore_eos=1 9 8 7 6 5")  # joins while slot 0 is mid-flight
    seen: set[str] = set()
    lines = first + engine.read_until(lambda line: line.startswith("BDONE") and seen.add(line[:7]) is None and len(seen) == 2)
    assert tokens(lines, "BT 0") == reference([5, 6, 7], 40)
    assert tokens(lines, "BT 2") == reference([9, 8, 7, 6, 5], 30)
    assert "BDONE 0 length 3 40" in lines and "BDONE 2 length 5 30" in lines


def test_stop_a_slot_then_reuse_it(engine, reference):
    engine.send("BGEN 1 400 ignore_eos=1 3 1 4 1 5")
    engine.read_until(lambda line: line.startswith("BADM 1"))
    engine.send("BSTOP 1")
    lines = engine.read_until(lambda line: line.startswith("BDONE 1"))
    reason, num_prompt, num_generated = lines[-1].split()[2:]
    assert reason == "abort" and num_prompt == "5" and 1 <= int(num_generated) < 400
    engine.send("BSTOP 1")  # idempotent: nothing more is said about a finished slot
    engine.send("BGEN 1 12 ignore_eos=1 2 7 1 8")
    lines = engine.read_until(lambda line: line.startswith("BDONE 1"))
    assert tokens(lines, "BT 1") == reference([2, 7, 1, 8], 12)  # nothing of the stopped answer leaks in


def test_stop_the_solo_generation(engine):
    engine.send("GEN 400 ignore_eos=1 1 2 3")
    engine.read_until(lambda line: line.startswith("T "))
    engine.send("STOP")
    done = engine.read_until(lambda line: line.startswith("DONE"))[-1]
    assert done.startswith("DONE abort 3 ")


def test_bad_input_answers_err_and_the_engine_carries_on(engine, reference):
    engine.send("BGEN 0 200 ignore_eos=1 5 6 7")
    engine.read_until(lambda line: line == "BADM 0 1 0")
    bad = [
        ("HELLO", "unknown command"),
        ("BGEN x 5 1 2", "slot 'x' is not an integer"),
        ("BGEN 9 5 1 2", "slot 9 does not exist"),
        ("BGEN 0 5 1 2", "busy"),
        (f"BGEN 3 5 1 {VOCAB + 1}", "vocabulary"),
        ("BGEN 3 5 " + " ".join(["1"] * 600), "max_cells"),
        ("GEN 5 temperature=-1 1 2", "temperature"),
        ("GEN 5 colour=blue 1 2", "unknown key"),
    ]
    lines = []
    for line, words in bad:
        engine.send(line)
        lines += engine.read_until(lambda out: out.startswith("ERR"))
        assert words in lines[-1], (line, lines[-1])
    lines += engine.read_until(lambda line: line.startswith("BDONE 0"))
    assert "BADM 3 0" in lines
    assert lines[-1] == "BDONE 0 length 3 200"  # the running slot was never disturbed
    engine.send("GEN 6 ignore_eos=1 4 4 4")
    lines = engine.read_until(lambda line: line.startswith("DONE"))
    assert tokens(lines, "T") == reference([4, 4, 4], 6)


def test_end_of_input_finishes_work_in_flight(model, reference):
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "engine", "--model", str(model), "--batch", "2"],
        input="BGEN 0 10 ignore_eos=1 1 2\nGEN 10 ignore_eos=1 3 4\n", capture_output=True, text=True, timeout=DEADLINE_S,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert tokens(lines, "BT 0") == reference([1, 2], 10) and tokens(lines, "T") == reference([3, 4], 10)


def test_parse_and_format_round_trip():
    from strata import protocol
    from strata.runtime.sampling import SamplingParams

    line = "BGEN 3 50 temperature=0.7 top_p=0.9 top_k=40 seed=11 presence_penalty=0.5 stop=2,13 ignore_eos=1 10 11 12"
    cmd = protocol.parse_command(line)
    assert isinstance(cmd, protocol.BGen) and cmd.slot == 3
    r = cmd.request
    assert r.max_new == 50 and r.ids == [10, 11, 12] and r.stop_ids == {2, 13} and r.ignore_eos
    assert r.params == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=11, presence_penalty=0.5)
    assert protocol.parse_command("BGEN 3 " + protocol.format_request(r)) == cmd
    assert protocol.parse_command("GEN 4 7") == protocol.Gen(protocol.Request(4, SamplingParams(), frozenset(), False, [7]))
    for bad, words in [("GEN", "needs"), ("GEN 5", "no prompt"), ("GEN 5 1 top_k=3", "keys come first"),
                       ("GEN -1 1", "negative"), ("STOP now", "wrong number"), ("GEN 5 seed=x 1", "not a number")]:
        with pytest.raises(protocol.ProtocolError, match=words):
            protocol.parse_command(bad)
