"""Start a real `strata serve` on loopback and a free port, and wait until it is ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

STARTUP_DEADLINE_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`strata serve <args>`; its output goes to `log` (a file path) when given, else to the terminal (nowhere with
    STRATA_TEST_QUIET set)."""

    def __init__(self, *args: str, log: str | os.PathLike | None = None, startup_s: float = STARTUP_DEADLINE_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if log is not None:
            self.log = open(log, "w")
        else:
            self.log = open(os.devnull, "w") if os.environ.get("STRATA_TEST_QUIET") else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self.log, stderr=self.log,
        )
        self.wait_healthy(startup_s)

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"strata serve exited with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"strata serve was not healthy within {deadline_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
