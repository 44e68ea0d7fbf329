"""The `strata engine` process: moves lines between stdin/stdout and the scheduler, nothing more.

A reader thread feeds stdin's lines into a queue, the lines of one read together (the server writes a request's
`n` samples in one write, so they are admitted in one turn and share their prompt's read); the loop drains the
queue without blocking while work is in flight (so requests and aborts take effect at the next window) and blocks
on it when idle. The events of one turn (the commands' answers, one window's tokens) leave in one write.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import sys
import threading
from typing import TextIO

from strata import protocol
from strata.runtime.scheduler import Scheduler

EXIT_WITH_PARENT = "STRATA_EXIT_WITH_PARENT"  # the server sets it to its pid for the engine process it starts


def exit_with_parent() -> None:
    """In an engine process started by `strata serve` (EXIT_WITH_PARENT set): ask Linux to send SIGTERM when the
    server dies, by SIGKILL too, so an engine never outlives its server; exit at once if it is already gone.
    Elsewhere a no-op (the engine still exits when its input closes)."""
    parent = os.environ.get(EXIT_WITH_PARENT)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the server died before the request took effect
        os._exit(1)


_CONTROL = ("ADD", "ABORT", "QUIT", "WAIT", "RUN", "END", "ERR", "READY", "PARKED", "RESTORED", "EXPERTS", "SPEC")


class Pipe:
    def __init__(self, stdin: TextIO, stdout: TextIO, trace: bool | None = None):
        self.stdin, self.stdout = stdin, stdout
        self.trace = os.environ.get("STRATA_TRACE") == "1" if trace is None else trace
        self.lines: queue.Queue[list[str] | None] = queue.Queue()  # the whole lines of one read
        self._out: list[str] = []

    def emit(self, line: str) -> None:
        if self.trace and line.startswith(_CONTROL):
            print(f"[strata trace] -> {line[:300]}", file=sys.stderr, flush=True)
        self._out.append(line + "\n")

    def flush(self) -> None:
        if self._out:
            self.stdout.write("".join(self._out))
            self.stdout.flush()
            self._out.clear()

    def _read(self) -> None:
        try:
            fd = self.stdin.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):  # not a file (tests): a line at a time
            for line in self.stdin:
                self.lines.put([line])
            self.lines.put(None)
            return
        rest = b""
        while chunk := os.read(fd, 1 << 20):
            *whole, rest = (rest + chunk).split(b"\n")
            if whole:
                self.lines.put([line.decode() for line in whole])
        if rest:
            self.lines.put([rest.decode()])
        self.lines.put(None)

    def serve(self, scheduler: Scheduler) -> None:
        threading.Thread(target=self._read, name="strata-stdin", daemon=True).start()
        self.emit(protocol.ready(scheduler.facts()))
        self.flush()
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
            for line in (line for read in pending for line in (read or [None])):
                if line is None:
                    closed = True  # end of input: finish what is in flight, then exit
                    continue
                if not line.strip():
                    continue
                if self.trace:
                    print(f"[strata trace] <- {line.strip()[:300]}", file=sys.stderr, flush=True)
                if not scheduler.handle(line):
                    self.flush()
                    return
            self.flush()  # answers to the commands (WAIT, ERR) before the window runs
            scheduler.step()
            self.flush()
