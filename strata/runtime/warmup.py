"""Warm-up: every kernel compiled and every decode graph captured before the engine says it is ready.

Triton compiles a kernel the first time it sees a new specialization (a new constexpr, an integer argument
that is or is not 1 or a multiple of 16), and a decode window of a new row count is captured as a CUDA graph
on first use. Either costs from milliseconds to seconds, and must not fall on a request's path. So before
`READY` the engine runs, on its own idle slots:

1. a decode window of every row count a group can hold (1 .. the largest group; with `--spec` ngram:K up to
   (1 + K) rows a slot; plus the rows of short prompt chunks, `Slots.short_chunk_rows` (on a GPU), on models
   without GDN layers;
   within the budget), which captures its graph;
2. prompt windows of the chunk sizes a window can hold (every size up to 64 rows, then every 8th, and the
   budget less each possible count of decoding rows), read one after another so later chunks start past position
   0: besides Triton's specializations, torch's GEMMs load a kernel the first time a row count of theirs comes;
3. the sampler over greedy, sampled and penalised rows of several counts, and a grammar's mask on them;
4. requests through the slots as the engine runs them: several prompts read together in mixed windows beside
   decoding rows (several logit rows in a prompt part, tokens fed on the device with lookahead).

The slots are reset and the parking lot emptied afterwards, so the first request finds the engine as new; the
parking lot's host memory is pinned here too (`strata.state.parking.HostRing`), and the parked files of
`--park-dir` are neither read nor written during it (its prompts could match one). On
the torch references (the CPU) there is nothing to compile and the warm-up is skipped.
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


def prompt_sizes(budget: int, decode_rows: int) -> list[int]:
    """Prompt-part row counts that cover the kernels a window of up to `budget` rows can meet, `decode_rows` at
    most of them decoding: every count up to 64, every 8th above, and the budget less each decoding count."""
    sizes = set(range(2, 65)) | set(range(64, budget + 1, 8)) | {budget - d for d in range(decode_rows + 1)}
    return sorted(s for s in sizes if 2 <= s <= budget)


def sample_counts(num_slots: int) -> list[int]:
    return sorted({1, 2, 3, 16, 17, num_slots} & set(range(1, num_slots + 1)) | {num_slots})


def mixed_rounds(slots: Slots) -> list[list[list[int]]]:
    """Prompts for the request rounds of the warm-up: one long prompt beside short ones (windows mixing decode
    rows and chunks of several prompts), then a short prompt in every slot (many logit rows in a prompt part)."""
    n, budget = len(slots), slots.budget
    cells = slots.engine.max_cells - 4
    longest = min(2 * budget + 7, cells)
    k = min(n, 8)  # the short prompts first: they decode while the long one (the last) is read beside them
    first = [[1 + (7 * j) % 97 for j in range(min(longest if i == k - 1 else 3 + 5 * i, cells))] for i in range(k)]
    second = [[1 + (11 * j + i) % 97 for j in range(min(1 + i % 17, cells))] for i in range(n)]
    return [first, second]


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
def warm_up(slots: Slots, progress: Callable[[int, str], None] | None = None,
            share: tuple[int, int] | None = None) -> float:
    """Compile and capture what the slots' windows can need (see the module's text); the seconds it took.

    `share` (k, n): run only every n-th item from the k-th, as a compile worker does (`strata.runtime.precompile`);
    the prompt chunks it skips still advance the reading sequence, so the chunks it runs start where they start in
    the whole warm-up. A share leaves the parking memory alone."""
    engine = slots.engine
    if engine.kernels != "triton" or slots.in_flight or slots.active:
        return 0.0
    start = time.perf_counter()
    disk, engine.parking.disk = engine.parking.disk, None  # parked files (--park-dir): not read or written here
    largest = max(len(g) for g in slots.groups)
    drafts = engine.speculative.num_speculative_tokens if engine.speculative else 0
    short = slots.short_chunk_rows  # short prompt chunks join the decode rows
    rows = list(range(1, min(largest * (1 + drafts) + short, slots.budget) + 1))  # drafting slots add rows too
    sizes = prompt_sizes(min(slots.budget, engine.max_cells - 1), largest)
    counts = sample_counts(rows[-1])
    rounds = mixed_rounds(slots)
    states = [s.state for s in slots.slots]
    vocab, device = engine.spec.vocab_size, engine.stages[-1].device
    reader = states[0]

    def decode_window(r: int) -> None:  # one graph per row count; past one row a slot, a slot's drafted rows
        per_slot = [r // len(states) + (i < r % len(states)) for i in range(min(r, len(states)))]
        engine.forward(Window.build([(states[i], [0] * m, "apart") for i, m in enumerate(per_slot)], engine.device))

    def prompt_chunk(n: int, run: bool = True) -> None:  # later chunks past position 0
        if reader.length + n >= reader.max_cells:
            reader.reset()
        window = Window.build([(reader, [0] * n, False)], engine.device)
        if run:
            engine.forward(window)
        window.commit()

    def sampler(r: int) -> None:  # greedy rows, sampled rows, penalised rows
        logits = torch.zeros(r, vocab, device=device)
        positions = list(range(r))
        sample(logits, [SamplingParams()] * r, positions)
        sample(logits, [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05)] * r, positions)
        seen = token_counts(torch.zeros(r, 1, dtype=torch.int64, device=device), vocab) > 0
        counts_ = token_counts(torch.zeros(r, 1, dtype=torch.int64, device=device), vocab)
        sample(logits, [SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5)] * r, positions,
               seen, counts_)
        if device.type == "cuda":  # a grammar's mask on constrained rows (structured output): all allowed here
            from strata.kernels.bitmask import apply_bitmask_triton

            apply_bitmask_triton(logits, torch.full((r, (vocab + 31) // 32), -1, dtype=torch.int32, device=device),
                                 torch.arange(r, dtype=torch.int32, device=device))

    def request_round(requests: list[list[int]]) -> None:  # mixed windows, lookahead, many logit rows
        for state in states:  # empty slots: an admission has nothing to park
            state.reset()
        for i, prompt in enumerate(requests):
            slots.admit(i, prompt, 3, SamplingParams(), frozenset())
        while slots.active or slots.in_flight:
            slots.step()

    items: list[tuple[str, str, Callable[..., None], object]] = [  # (phase, what, run, its argument)
        *(("decode graphs", f"decode window of {r} row(s)", decode_window, r) for r in rows),
        *(("prompt chunks", f"prompt chunk of {n} rows", prompt_chunk, n) for n in sizes),
        *(("sampler", f"sampler over {r} row(s)", sampler, r) for r in counts),
        *(("request rounds", f"{len(q)} requests through the slots", request_round, q) for q in rounds),
    ]
    k, n = share or (0, 1)
    mine = [item for j, item in enumerate(items) if j % n == k]
    show = progress or progress_printer(len(mine))
    phases: dict[str, float] = {}  # seconds per phase, for the log line
    mark, done = time.perf_counter(), 0
    for j, (name, what, run, arg) in enumerate(items):
        if j % n != k:
            if run is prompt_chunk:
                prompt_chunk(arg, run=False)
            continue
        run(arg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark, done = now, done + 1
        show(done, what)
    for state in states:
        state.reset()
    engine.parking.disk = disk
    if share is not None:
        return time.perf_counter() - start
    engine.parking.clear()
    engine.parking.ring.reserve(pinned=device.type == "cuda")  # parking's host memory, pinned once, here
    if engine.parking.vram is not None:  # --park-vram-gb: its block on each GPU (a size that does not fit stops here)
        engine.parking.vram.reserve({stage.device for stage in engine.stages})
    phases["parking memory"] = time.perf_counter() - mark
    took = time.perf_counter() - start
    log.info("warm-up: %d decode graphs, %d prompt chunk sizes, the sampler and %d request rounds in %.1f s (%s)",
             len(rows), len(sizes), len(rounds), took, ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    return took
