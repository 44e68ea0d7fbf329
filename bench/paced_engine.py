"""A stand-in for `strata engine` that speaks its line protocol at a set pace, for bench/serve_overhead.py.

It computes nothing: every `--interval-ms` it "runs a window" that gives one token to each running request (up
to `--batch` of them; the rest wait in arrival order), with the protocol's own formatters (`strata.protocol`),
so `strata serve` in front of it is measured alone: what the HTTP server, the pipes and the streaming clients
cost per token at the rate the engine on a GPU produces tokens. Not a model: the tokens are a fixed cycle of ids
that decode to text with SmolLM2's tokenizer.

    python bench/paced_engine.py --batch 64 --interval-ms 8   # then write ADD lines on its stdin
    python bench/paced_engine.py serve --port 8000 --batch 64 --interval-ms 8   # strata serve in front of it

bench/serve.py --paced-engine MS runs the second form and measures it.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # the repository, not bench/ (whose serve.py would hide the `serve` package)

from strata import protocol  # noqa: E402
from strata.protocol import Abort, Add, ProtocolError, Quit  # noqa: E402

TOKENS = [504, 1536, 2910, 314, 260, 3458, 30, 378, 1113, 2127, 281, 253, 1166, 28]  # words of SmolLM2's vocabulary


def serve(argv: list[str]) -> None:
    """`strata serve` (its app, as the CLI builds it) with this stand-in as its engine process."""
    import logging

    import uvicorn

    import serve.app
    from serve.config import ServeSettings

    p = argparse.ArgumentParser(description="strata serve in front of the paced stand-in engine")
    p.add_argument("--model", default="default", help="where the server takes its tokenizer and config from")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-cells", type=int, default=8192)
    p.add_argument("--interval-ms", type=float, default=8.0)
    args = p.parse_args(argv)
    engine = [sys.executable, str(Path(__file__).resolve()), "--batch", str(args.batch), "--interval-ms",
              str(args.interval_ms), "--max-cells", str(args.max_cells)]
    serve.app.engine_argv = lambda settings: engine
    settings = ServeSettings(model=args.model, host=args.host, port=args.port, batch=args.batch,
                             max_cells=args.max_cells)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(serve.app.create_app(settings), host=args.host, port=args.port, log_level="warning")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=8.0, help="one window (a token per running request) this often")
    p.add_argument("--max-cells", type=int, default=8192)
    args, _ = p.parse_known_args(argv)  # the server passes every engine flag: the others mean nothing here

    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    out = sys.stdout
    facts = {"family": "paced", "vocab_size": 49152, "num_layers": 0, "max_cells": args.max_cells,
             "batch": args.batch, "batch_groups": 1, "max_window_tokens": 512, "max_waiting": 256, "lookahead": 1,
             "stages": 1, "device": "none", "dtype": "none", "expert_residency": {}, "pid": os.getpid()}
    out.write(protocol.ready(facts) + "\n")
    out.flush()
    waiting: OrderedDict[str, Add] = OrderedDict()
    running: dict[str, list[int]] = {}  # id -> [tokens given, max_new, prompt length]
    interval = args.interval_ms / 1e3
    next_window = time.monotonic()
    closed = False
    while not (closed and not running and not waiting):
        timeout = max(0.0, next_window - time.monotonic()) if running or waiting else None
        batch = []
        try:
            batch.append(lines.get(timeout=timeout))
            while True:
                batch.append(lines.get_nowait())
        except queue.Empty:
            pass
        said = []
        for line in batch:
            if line is None:
                closed = True
                continue
            if not line.strip():
                continue
            try:
                command = protocol.parse_command(line)
            except ProtocolError as e:
                said.append(protocol.err(protocol.command_id(line), protocol.ERR_INVALID, str(e)))
                continue
            if isinstance(command, Quit):
                return
            if isinstance(command, Add):
                waiting[command.id] = command
                said.append(protocol.wait(command.id))
            elif isinstance(command, Abort):
                if waiting.pop(command.id, None) is not None or command.id in running:
                    n = running.pop(command.id, [0, 0, 0])
                    said.append(protocol.end(command.id, "abort", n[2], n[0], 0))
        while waiting and len(running) < args.batch:
            rid, add = waiting.popitem(last=False)
            running[rid] = [0, add.request.max_new, len(add.request.ids)]
            said.append(protocol.run(rid, 0))
        if running and time.monotonic() >= next_window:
            pairs = []
            for rid, n in running.items():
                pairs.append((rid, TOKENS[n[0] % len(TOKENS)]))
                n[0] += 1
            said.append(protocol.window(len(pairs), 0))
            said.append(protocol.tokens(pairs))
            for rid in [rid for rid, n in running.items() if n[0] >= n[1]]:
                n = running.pop(rid)
                said.append(protocol.end(rid, "length", n[2], n[0], 0))
            next_window = max(next_window + interval, time.monotonic() - interval)
        if said:
            out.write("".join(line + "\n" for line in said))
            out.flush()


if __name__ == "__main__":
    main()
