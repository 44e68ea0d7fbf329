"""The server's side of the engine process: owns `strata engine`, admits requests, routes its events.

Admission (with `--batch N`): a request alone takes the solo path (GEN, the fastest single stream when the
engine reads each window before launching the next). When another arrives, the solo run is STOPped and, at its
DONE, continues in a slot (BGEN ... resume=g with its prompt plus what it generated: the engine reuses its state,
so the answer is unchanged) and the newcomer is admitted beside it. An engine that runs windows ahead of the
host (its READY facts say `lookahead` 1, the GPU default) gets every request in a slot, a lone one too: a slot
is then as fast alone and never has to move when a second request arrives. When every slot is busy, requests
wait in FIFO order. Without `--batch`, requests queue FIFO for the solo path.

A request that is abandoned (client gone, stop string, consumer done) is stopped and its solo run or slot is
freed only at its DONE / BDONE, so no token of the abandoned answer reaches the next request. All state
changes happen in plain (non-async) methods on the event loop, so they never interleave.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from serve.metrics import Metrics, RequestRecord
from strata import protocol
from strata.protocol import Request

log = logging.getLogger("strata.serve")


class EngineDied(RuntimeError):
    """The engine process exited while a request was in flight."""


class EngineRefused(RuntimeError):
    """The engine answered ERR to a request's command."""


@dataclass
class Job:
    request: Request
    record: RequestRecord
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then a final ("done", reason) / exception
    generated: list[int] = field(default_factory=list)
    where: str = "waiting"  # waiting | solo | slot | done
    slot: int | None = None
    moving: bool = False  # STOPped on the solo path to continue in a slot
    abandoned: bool = False
    admitted: bool = False  # BADM 1 seen (or GEN's first token)
    queried: int = 0  # prompt tokens of the GEN / BGEN sent for it: the prefix-cache lookup the engine answers
    refusal: str | None = None  # the engine's ERR reason, when it refused the job
    final_reason: str | None = None  # what the metrics record when the server ended the job itself
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class EngineClient:
    def __init__(self, argv: list[str], metrics: Metrics, num_slots: int):
        self.argv, self.metrics, self.num_slots = argv, metrics, num_slots
        self.proc: asyncio.subprocess.Process | None = None
        self.facts: dict = {}
        self.ready = asyncio.Event()
        self.waiting: deque[Job] = deque()
        self.solo: Job | None = None
        self.slots: list[Job | None] = [None] * num_slots
        self._pending: deque[Job] = deque()  # GEN / BGEN sent, not yet acknowledged (an ERR belongs to the oldest)
        self._closing = False
        self._task: asyncio.Task | None = None
        self.restarts = 0

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
                start_new_session=True,
            )
            log.info("engine process started (pid %d): %s", self.proc.pid, " ".join(self.argv))
            while line := await self.proc.stdout.readline():
                self._on_line(line.decode().rstrip("\n"))
            code = await self.proc.wait()
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
        if not self.ready.is_set():
            raise EngineDied("the engine is not ready yet")
        job = Job(request, record)
        self.waiting.append(job)
        self.metrics.queued(record)
        self._schedule()
        return job

    def abandon(self, job: Job, reason: str = "abort") -> None:
        """The consumer stopped reading (`reason` "abort"), or a stop string ended the answer ("stop"): stop the
        job's generation. Its solo run / slot is freed at its DONE / BDONE."""
        if job.where == "done" or job.abandoned:
            return
        job.abandoned, job.final_reason = True, reason
        if job.where == "waiting":
            self.waiting.remove(job)
            self._finish(job, "abort")
        elif job.where == "solo":
            self._send("STOP")
        elif job.where == "slot" and job.admitted:
            self._send(f"BSTOP {job.slot}")
        # a slot admission in flight is stopped when its BADM arrives

    def _schedule(self) -> None:
        if not self.ready.is_set():
            return
        if self.num_slots == 0:
            if self.solo is None and self.waiting:
                self._start_solo(self.waiting.popleft())
            return
        if self.solo is not None:
            if self.waiting and not self.solo.moving and not self.solo.abandoned:
                self.solo.moving = True  # continues in a slot at its DONE
                self._send("STOP")
            return
        free = [i for i, j in enumerate(self.slots) if j is None]
        if len(free) == self.num_slots and len(self.waiting) == 1 and not self.facts.get("lookahead"):
            self._start_solo(self.waiting.popleft())  # alone: the fastest single stream (see the module's text)
            return
        while self.waiting and free:
            self._admit(self.waiting.popleft(), free.pop(0))
        self._update_load()

    def _start_solo(self, job: Job) -> None:
        job.where = "solo"
        self.solo = job
        self.metrics.scheduled(job.record, time.monotonic())
        job.queried = len(job.request.ids)
        self._pending.append(job)
        self._send("GEN " + protocol.format_request(job.request))
        self._update_load()

    def _admit(self, job: Job, slot: int, resume: list[int] | None = None) -> None:
        job.where, job.slot, job.admitted = "slot", slot, False
        self.slots[slot] = job
        request = job.request
        if resume:
            request = Request(request.max_new, request.params, request.stop_ids, request.ignore_eos,
                              request.ids + resume, len(resume))
        else:
            self.metrics.scheduled(job.record, time.monotonic())
        job.queried = len(request.ids)
        self._pending.append(job)
        self._send(f"BGEN {slot} " + protocol.format_request(request))

    # events

    def _on_line(self, line: str) -> None:
        words = line.split()
        if not words:
            return
        kind = words[0]
        if kind == "READY":
            self.facts = json.loads(line.split(" ", 1)[1])
            self.metrics.set_engine_facts(self.facts)
            self.metrics.set_parked(0, 0)  # a new engine process holds no parked conversation
            self.metrics.expert_pairs(0, 0)  # and counts its expert pairs from 0
            self.ready.set()
            self._schedule()
        elif kind == "T" and self.solo is not None:
            self._ack(self.solo)
            self._token(self.solo, int(words[1]))
        elif kind == "DONE" and self.solo is not None:
            self._ack(self.solo)
            self.metrics.prefix_cache(self.solo.queried, _field(words, 4))
            self._solo_done(self.solo, words[1])
        elif kind == "BADM":
            job = self.slots[int(words[1])]
            if job is not None:
                self._ack(job)
                if words[2] == "1":
                    job.admitted = True
                    self.metrics.prefix_cache(job.queried, _field(words, 3))
                    if job.abandoned:
                        self._send(f"BSTOP {job.slot}")
                else:
                    self.slots[job.slot] = None
                    self._finish(job, "error")
                    self._schedule()
        elif kind == "BT":
            job = self.slots[int(words[1])]
            if job is not None:
                self._token(job, int(words[2]))
        elif kind == "BDONE":
            slot = int(words[1])
            job = self.slots[slot]
            self.slots[slot] = None
            if job is not None:
                self._finish(job, words[2])
            self._schedule()
        elif kind == "PARKED":
            self.metrics.set_parked(_field(words, 1), _field(words, 2))
        elif kind == "EXPERTS":
            self.metrics.expert_pairs(_field(words, 1), _field(words, 2))
        elif kind == "ERR":
            log.warning("engine: %s", line)
            job = self._pending.popleft() if self._pending else None
            if job is not None and job.where == "solo":
                self.solo = None
                job.events.put_nowait(EngineRefused(line[4:]))
                self._finish(job, "error")
                self._schedule()
            elif job is not None:
                job.refusal = line[4:]  # BADM <slot> 0 follows and finishes it

    def _ack(self, job: Job) -> None:
        if job in self._pending:
            self._pending.remove(job)

    def _token(self, job: Job, token: int) -> None:
        job.generated.append(token)
        self.metrics.token(job.record, time.monotonic())
        if not job.abandoned:
            job.events.put_nowait(token)

    def _solo_done(self, job: Job, reason: str) -> None:
        self.solo = None
        if reason == "abort" and job.moving and not job.abandoned:
            job.moving = False
            self._admit(job, self.slots.index(None), resume=list(job.generated))
        else:
            self._finish(job, reason)
        self._schedule()

    def _finish(self, job: Job, reason: str) -> None:
        if job.where == "done":
            return
        job.where = "done"
        if job.final_reason and reason == "abort":
            reason = job.final_reason
        self.metrics.finished(job.record, reason, time.monotonic())
        refused = job.refusal is not None and reason == "error"
        job.events.put_nowait(EngineRefused(job.refusal) if refused else ("done", reason))
        job.finished.set()
        self._update_load()

    def _fail_all(self, error: Exception) -> None:
        jobs = [j for j in (self.solo, *self.slots, *self.waiting) if j is not None]
        self.solo, self.slots, self._pending = None, [None] * self.num_slots, deque()
        self.waiting.clear()
        for job in jobs:
            job.events.put_nowait(error)
            self._finish(job, "error")

    def _update_load(self) -> None:
        running = [j for j in (self.solo, *self.slots) if j is not None]
        held = sum(len(j.request.ids) + len(j.generated) for j in running)
        capacity = max(1, self.facts.get("max_cells", 1) * max(1, self.num_slots))
        self.metrics.set_load(len(running), len(self.waiting), sum(j is not None for j in self.slots), held / capacity)


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
