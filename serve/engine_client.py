"""The server's side of the engine process: owns `strata engine`, sends it requests by id, routes its events.

Every request goes to the engine as soon as it arrives (`ADD <id> ...`): the engine owns the waiting line and
decides admission, reading prompts inside the windows beside the decoding rows. The engine answers each `ADD`
with `WAIT` (it waits for a slot), or `ERR <id> full` (the line is full: the HTTP layer answers 429) or
`ERR <id> invalid ...` (400); then `RUN` when it gets a slot, `TOK` lines with its tokens, and one `END`.

A request that is abandoned (client gone, stop string, consumer done) is aborted by id (`ABORT <id>`); the
engine ends it at once, waiting or running, and answers its `END`. Ids are never reused, so no late token of
an abandoned answer can reach another request. All state changes happen in plain (non-async) methods on the
event loop, so they never interleave.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

from serve.metrics import Metrics, RequestRecord
from strata import protocol
from strata.protocol import Request
from strata.runtime.pipe import EXIT_WITH_PARENT

log = logging.getLogger("strata.serve")


RELOAD_LIMIT_S = 600.0  # an engine that went away and is not ready again after this long fails liveness


class EngineDied(RuntimeError):
    """The engine process exited while a request was in flight."""


class EngineRefused(RuntimeError):
    """The engine answered ERR to a request (`code`: "invalid" or "internal")."""

    def __init__(self, message: str, code: str = protocol.ERR_INVALID):
        super().__init__(message)
        self.code = code


class EngineFull(RuntimeError):
    """The engine's waiting line is full: try again later (HTTP 429)."""


@dataclass
class Job:
    id: str
    request: Request
    record: RequestRecord
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then a final ("done", reason) / exception
    generated: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token (LP lines)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # PLP lines
    where: str = "sent"  # sent | waiting | running | done
    abandoned: bool = False
    final_reason: str | None = None  # what the metrics record when the server ended the job itself
    accepted: asyncio.Future | None = None  # set at WAIT / RUN; an exception at ERR
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class EngineClient:
    def __init__(self, argv: list[str], metrics: Metrics, num_slots: int):
        self.argv, self.metrics, self.num_slots = argv, metrics, num_slots
        self.proc: asyncio.subprocess.Process | None = None
        self.facts: dict = {}
        self.ready = asyncio.Event()
        self.jobs: dict[str, Job] = {}  # sent and not ended
        self._ids = itertools.count(1)
        self._closing = False
        self._task: asyncio.Task | None = None
        self.restarts = 0
        self.last_heard = time.monotonic()  # the engine's last line
        self.unready_since: float | None = None  # when a once-ready engine went away (None: ready, or first load)

    def alive(self, silence_s: float, reload_s: float = RELOAD_LIMIT_S) -> str | None:
        """Why the server is not alive (`/live`), None when it is: requests run and the engine has said nothing
        for `silence_s` seconds (hung), or an engine that was ready has not been ready again for `reload_s`."""
        now = time.monotonic()
        if any(j.where == "running" for j in self.jobs.values()) and now - self.last_heard > silence_s:
            return f"the engine has said nothing for {now - self.last_heard:.0f} s while requests run"
        if self.unready_since is not None and now - self.unready_since > reload_s:
            return f"the engine has not been ready for {now - self.unready_since:.0f} s since it went away"
        return None

    # process

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="strata-engine")

    async def close(self) -> None:
        self._closing = True
        if self.proc and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
        if self._task:
            self._task.cancel()

    async def _run(self) -> None:
        while not self._closing:
            # A session of its own: a terminal's Ctrl-C (sent to the whole foreground group) reaches the server
            # only, which then stops the engine itself; the engine also exits when its input closes.
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 24,
                start_new_session=True, env={**os.environ, EXIT_WITH_PARENT: str(os.getpid())},
            )
            log.info("engine process started (pid %d): %s", self.proc.pid, " ".join(self.argv))
            while line := await self.proc.stdout.readline():
                self.last_heard = time.monotonic()
                self._on_line(line.decode().rstrip("\n"))
            code = await self.proc.wait()
            if self.ready.is_set():
                self.unready_since = time.monotonic()
            self.ready.clear()
            if self._closing:
                return
            self.restarts += 1
            self.metrics.engine_restarted()
            log.error("engine process exited with code %s; failing its requests and restarting it", code)
            self._fail_all(EngineDied(f"the engine process exited (code {code}) while this request ran; "
                                      "it is restarting: retry the request"))
            await asyncio.sleep(1.0)

    def _send(self, line: str) -> None:
        if self.proc is None or self.proc.stdin.is_closing():
            raise EngineDied("the engine process is not running")
        self.proc.stdin.write((line + "\n").encode())

    # requests

    def submit(self, request: Request, record: RequestRecord) -> Job:
        """Send the request to the engine; `accept` waits for its answer."""
        return self.submit_all([(request, record)])[0]

    def submit_all(self, requests: list[tuple[Request, RequestRecord]]) -> list[Job]:
        """Send requests to the engine in one write (the samples of one request: the engine admits them in one turn,
        so they share their prompt's read); `accept` waits for each one's answer."""
        if not self.ready.is_set():
            raise EngineDied("the engine is not ready yet")
        jobs = [Job(f"r{next(self._ids)}", request, record, accepted=asyncio.get_running_loop().create_future())
                for request, record in requests]
        self._send("\n".join(protocol.add(job.id, job.request) for job in jobs))
        for job in jobs:
            self.jobs[job.id] = job
            self.metrics.queued(job.record)
        self._update_load()
        return jobs

    async def accept(self, job: Job) -> None:
        """Wait until the engine took the request (WAIT or RUN); raise EngineFull / EngineRefused / EngineDied."""
        await job.accepted

    def abandon(self, job: Job, reason: str = "abort") -> None:
        """The consumer stopped reading (`reason` "abort"), or a stop string ended the answer ("stop"): abort the
        request in the engine, which answers its END."""
        if job.where == "done" or job.abandoned:
            return
        job.abandoned, job.final_reason = True, reason
        try:
            self._send(f"ABORT {job.id}")
        except EngineDied:
            pass  # its end comes with the engine's

    # events

    def _on_line(self, line: str) -> None:
        words = line.split()
        if not words:
            return
        kind = words[0]
        if kind == "TOK":
            now = time.monotonic()
            for k in range(1, len(words) - 1, 2):
                job = self.jobs.get(words[k])
                if job is not None:
                    self._token(job, int(words[k + 1]), now)
            self._update_load()
        elif kind in ("LP", "PLP") and len(words) >= (4 if kind == "LP" else 3):
            job = self.jobs.get(words[1])
            if job is not None:  # LP <id> <token> <logprob> <top...>; PLP <id> <logprob> <top...>
                at = 3 if kind == "LP" else 2
                top = [(int(words[k]), float(words[k + 1])) for k in range(at + 1, len(words) - 1, 2)]
                (job.logprobs if kind == "LP" else job.prompt_logprobs).append((float(words[at]), top))
        elif kind == "WIN":
            self.metrics.window(sum(int(w) for w in words[1:3]))
        elif kind in ("WAIT", "RUN", "END", "ERR") and len(words) >= 2:
            job = self.jobs.get(words[1])
            if kind == "ERR" and job is None:
                log.warning("engine: %s", line)
            elif job is not None:
                getattr(self, f"_on_{kind.lower()}")(job, words, line)
        elif kind == "READY":
            self.facts = json.loads(line.split(" ", 1)[1])
            self.metrics.set_engine_facts(self.facts)
            self.metrics.set_parked(0, 0)  # a new engine process holds no parked conversation
            self.metrics.expert_pairs(0, 0)  # and counts its expert pairs from 0
            self.metrics.spec_totals([])  # and its drafts
            self.unready_since = None
            self.ready.set()
        elif kind == "PARKED":
            self.metrics.set_parked(_field(words, 1), _field(words, 2), _field(words, 3), _field(words, 4),
                                    _field(words, 5), _field(words, 6), _field(words, 7))
        elif kind == "RESTORED" and len(words) >= 4:
            try:
                self.metrics.restored(float(words[1]), words[3])
            except ValueError:
                log.warning("engine: a RESTORED line that does not parse: %s", line)
        elif kind == "EXPERTS":
            try:
                seconds = float(words[3]) if len(words) > 3 else 0.0
                self.metrics.expert_pairs(_field(words, 1), _field(words, 2), seconds, _field(words, 4),
                                          _field(words, 5), _field(words, 6))
            except ValueError:
                log.warning("engine: an EXPERTS line that does not parse: %s", line)
        elif kind == "SPEC":
            self.metrics.spec_totals([_field(words, k) for k in range(1, len(words))])

    def _on_wait(self, job: Job, words: list[str], line: str) -> None:
        job.where = "waiting"
        _resolve(job.accepted)

    def _on_run(self, job: Job, words: list[str], line: str) -> None:
        job.where = "running"
        _resolve(job.accepted)
        self.metrics.scheduled(job.record, time.monotonic())
        self.metrics.prefix_cache(len(job.request.ids), _field(words, 2))
        self._update_load()

    def _on_end(self, job: Job, words: list[str], line: str) -> None:
        _resolve(job.accepted)
        self._finish(job, words[2] if len(words) > 2 else "error")

    def _on_err(self, job: Job, words: list[str], line: str) -> None:
        code = words[2] if len(words) > 2 else protocol.ERR_INTERNAL
        message = line.split(" ", 3)[3] if len(words) > 3 else line
        log.warning("engine: %s", line)
        error = EngineFull(message) if code == protocol.ERR_FULL else EngineRefused(message, code)
        if job.accepted is not None and not job.accepted.done():
            job.accepted.set_exception(error)
            job.accepted.exception()  # retrieved: an unawaited future logs nothing
        self.jobs.pop(job.id, None)
        if code == protocol.ERR_FULL:
            job.where = "done"
            self.metrics.rejected(job.record)
            job.events.put_nowait(error)
            job.finished.set()
        else:
            job.events.put_nowait(error)
            self._finish(job, "error")
        self._update_load()

    def _token(self, job: Job, token: int, now: float) -> None:
        job.generated.append(token)
        self.metrics.token(job.record, now)
        if not job.abandoned:
            job.events.put_nowait(token)

    def _finish(self, job: Job, reason: str) -> None:
        self.jobs.pop(job.id, None)
        if job.where == "done":
            return
        job.where = "done"
        if job.final_reason and reason == "abort":
            reason = job.final_reason
        self.metrics.finished(job.record, reason, time.monotonic())
        job.events.put_nowait(("done", reason))
        job.finished.set()
        self._update_load()

    def end_all(self, message: str) -> int:
        """End every request the engine runs or holds, as the server's own decision (shutdown): each gets an
        error event with `message`, and the engine is told to abort it. Returns how many."""
        jobs = list(self.jobs.values())
        for job in jobs:
            try:
                self._send(f"ABORT {job.id}")
            except EngineDied:
                pass
        self._fail_all(EngineDied(message))
        return len(jobs)

    def _fail_all(self, error: Exception) -> None:
        jobs = list(self.jobs.values())
        self.jobs.clear()
        for job in jobs:
            if job.accepted is not None and not job.accepted.done():
                job.accepted.set_exception(error)
                job.accepted.exception()
            job.events.put_nowait(error)
            self._finish(job, "error")

    def _update_load(self) -> None:
        running = [j for j in self.jobs.values() if j.where == "running"]
        waiting = len(self.jobs) - len(running)
        held = sum(len(j.request.ids) + len(j.generated) for j in running)
        capacity = max(1, self.facts.get("max_cells", 1) * max(1, self.num_slots))
        self.metrics.set_load(len(running), waiting, len(running), held / capacity)


def _resolve(future: asyncio.Future | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


def _field(words: list[str], index: int) -> int:
    """An event's numeric field; 0 when an older engine does not send it."""
    return int(words[index]) if len(words) > index else 0


def engine_argv(settings) -> list[str]:
    """`strata engine` with the server's engine options (the same pydantic fields)."""
    from strata.config import EngineSettings

    argv = [sys.executable, "-m", "strata.cli", "engine"]
    for name in EngineSettings.model_fields:
        flag, value = name.replace("_", "-"), getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv
