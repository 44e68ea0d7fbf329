"""Stopping the server: on SIGTERM (or the first Ctrl-C) readiness goes false at once, running answers get
`--shutdown-grace` seconds to finish, then the server ends the rest with an error event and exits; its engine
process goes with it.

uvicorn, on the signal, stops accepting connections and waits for the requests in progress; `GracefulServer`
adds the two things it does not do: `/health` answering 503 "draining" from the first moment (and new requests on
kept-alive connections 503), and the end of the grace, when every answer still running is ended by the server
itself (`EngineClient.end_all`), so a client sees why its answer stopped instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("strata.serve")

DEFAULT_SHUTDOWN_GRACE_S = 30.0


class Drain:
    """The server's shutdown state, shared by the app (readiness, new requests) and the uvicorn server."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.end_all = None  # set by the app: ends every running answer with an error
        self._task: asyncio.Task | None = None

    def begin(self) -> None:
        """Called from the signal handler: mark draining, and end what still runs once the grace is over."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: not ready; running answers get %.0f s (--shutdown-grace) to finish", self.grace_s)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_timer)

    def _start_timer(self) -> None:
        self._task = asyncio.ensure_future(self._end_after_grace())

    async def _end_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        if self.end_all is not None:
            ended = self.end_all(f"the server is shutting down: answers still running after --shutdown-grace "
                                 f"{self.grace_s:g} s are ended; retry the request")
            if ended:
                log.warning("shutdown grace over: ended %d running answer(s)", ended)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with `Drain` told of the first exit signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame) -> None:
        self.drain.begin()
        super().handle_exit(sig, frame)


def serve(app, host: str, port: int, drain: Drain) -> None:
    # uvicorn's own limit on waiting for requests is a backstop past the grace: by then the server has ended them
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=int(drain.grace_s) + 5)
    GracefulServer(config, drain).run()
