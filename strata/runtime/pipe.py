"""The `strata engine` process: moves lines between stdin/stdout and the scheduler, nothing more.

A reader thread feeds stdin's lines into a queue; the loop drains the queue without blocking while work is
in flight (so admissions and stops take effect at the next window) and blocks on it when idle.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import TextIO

from strata import protocol
from strata.runtime.scheduler import Scheduler

_CONTROL = ("GEN", "BGEN", "STOP", "BSTOP", "QUIT", "DONE", "BADM", "BDONE", "ERR", "READY", "PARKED", "EXPERTS")


class Pipe:
    def __init__(self, stdin: TextIO, stdout: TextIO, trace: bool | None = None):
        self.stdin, self.stdout = stdin, stdout
        self.trace = os.environ.get("STRATA_BATCH_TRACE") == "1" if trace is None else trace
        self.lines: queue.Queue[str | None] = queue.Queue()

    def emit(self, line: str) -> None:
        if self.trace and line.startswith(_CONTROL):
            print(f"[strata trace] -> {line}", file=sys.stderr, flush=True)
        self.stdout.write(line + "\n")
        self.stdout.flush()

    def _read(self) -> None:
        for line in self.stdin:
            self.lines.put(line)
        self.lines.put(None)

    def serve(self, scheduler: Scheduler) -> None:
        threading.Thread(target=self._read, name="strata-stdin", daemon=True).start()
        self.emit(protocol.ready(scheduler.facts()))
        closed = False
        while not (closed and not scheduler.busy):
            pending = []
            try:
                if not closed:
                    pending.append(self.lines.get(block=not scheduler.busy))
                while True:
                    pending.append(self.lines.get_nowait())
            except queue.Empty:
                pass
            for line in pending:
                if line is None:
                    closed = True  # end of input: finish what is in flight, then exit
                    continue
                if not line.strip():
                    continue
                if self.trace:
                    print(f"[strata trace] <- {line.strip()}", file=sys.stderr, flush=True)
                if not scheduler.handle(line):
                    return
            scheduler.step()
