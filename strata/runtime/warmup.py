"""Warm-up: every kernel compiled and every decode graph captured before the engine says it is ready.

Triton compiles a kernel the first time it sees a new specialization (a new constexpr, an integer argument
that is or is not 1 or a multiple of 16), and a decode window of a new row count is captured as a CUDA graph
on first use. Either costs from milliseconds to seconds, and must not fall on a request's path. So before
`READY` the engine runs, on its own idle slots:

1. a decode window of every row count a group can hold (1 .. the largest group), which captures its graph;
2. prompt windows of the chunk sizes the budget gives (powers of two and their neighbours up to
   `--max-window-tokens`), read one after another so later chunks start past position 0;
3. the sampler over greedy, sampled and penalised rows of several counts.

Nothing is committed: the slots are reset afterwards, so the first request finds them empty. On the torch
references (the CPU) there is nothing to compile and the warm-up is skipped.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

import torch

from strata.runtime.sampling import SamplingParams, sample, token_counts
from strata.runtime.slots import Slots
from strata.runtime.window import Window

log = logging.getLogger("strata.engine")


def prompt_sizes(budget: int) -> list[int]:
    """Chunk sizes that cover the specializations a prompt window of up to `budget` rows can meet."""
    sizes = {2, 3, 15, 16, 17, budget, max(2, budget - 1)}
    p = 4
    while p < budget:
        sizes |= {p, p + 1}
        p *= 2
    return sorted(s for s in sizes if 2 <= s <= budget)


def sample_counts(num_slots: int) -> list[int]:
    return sorted({1, 2, 3, 16, 17, num_slots} & set(range(1, num_slots + 1)) | {num_slots})


def progress_printer(total: int, stream=None) -> Callable[[int, str], None]:
    """A progress bar on a terminal, else a log line every tenth of the work."""
    stream = sys.stderr if stream is None else stream
    tty = hasattr(stream, "isatty") and stream.isatty()
    said = [-1]

    def show(done: int, what: str) -> None:
        if tty:
            filled = 30 * done // max(total, 1)
            stream.write(f"\rwarm-up [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<40}")
            if done == total:
                stream.write("\n")
            stream.flush()
        elif 10 * done // max(total, 1) > said[0]:
            said[0] = 10 * done // max(total, 1)
            log.info("warm-up: %d/%d (%s)", done, total, what)

    return show


@torch.inference_mode()
def warm_up(slots: Slots, progress: Callable[[int, str], None] | None = None) -> float:
    """Compile and capture what the slots' windows can need (see the module's text); the seconds it took."""
    engine = slots.engine
    if engine.kernels != "triton" or slots.in_flight or slots.active:
        return 0.0
    start = time.perf_counter()
    rows = list(range(1, max(len(g) for g in slots.groups) + 1))
    sizes = prompt_sizes(min(slots.budget, engine.max_cells - 1))
    counts = sample_counts(len(slots))
    total = len(rows) + len(sizes) + len(counts)
    show = progress or progress_printer(total)
    done = 0
    states = [s.state for s in slots.slots]
    for r in rows:  # decode windows: one graph per row count
        engine.forward(Window.build([(states[i], [0], False) for i in range(r)], engine.device))
        done += 1
        show(done, f"decode window of {r} row(s)")
    reader = states[0]
    for n in sizes:  # prompt windows, later chunks past position 0
        if reader.length + n >= reader.max_cells:
            reader.reset()
        window = Window.build([(reader, [0] * n, False)], engine.device)
        engine.forward(window)
        window.commit()
        done += 1
        show(done, f"prompt chunk of {n} rows")
    vocab, device = engine.spec.vocab_size, engine.stages[-1].device
    for r in counts:  # the sampler: greedy rows, sampled rows, penalised rows
        logits = torch.zeros(r, vocab, device=device)
        positions = list(range(r))
        sample(logits, [SamplingParams()] * r, positions)
        sample(logits, [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05)] * r, positions)
        seen = token_counts(torch.zeros(r, 1, dtype=torch.int64, device=device), vocab) > 0
        counts_ = token_counts(torch.zeros(r, 1, dtype=torch.int64, device=device), vocab)
        sample(logits, [SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5)] * r, positions,
               seen, counts_)
        done += 1
        show(done, f"sampler over {r} row(s)")
    for state in states:
        state.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    log.info("warm-up: %d decode graphs, %d prompt chunk sizes and the sampler in %.1f s", len(rows), len(sizes), took)
    return took
