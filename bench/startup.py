"""Start-up: where the seconds between `strata serve` and readiness go (loading, then the warm-up's phases).

Loads the engine as `strata engine` does, then runs the warm-up (`strata.runtime.warmup.warm_up`) timing every
item of it (each decode graph, each prompt chunk size, each sampler count, each request round, the device
synchronised after each), and prints per phase: items, seconds, the first item, the median and the slowest. Run it
twice on a fresh machine: the first run compiles every Triton kernel (a cold cache), the second finds them in
Triton's cache, so the difference is compilation and the rest is capture and running. `--profile N` adds the N
functions of most cumulative time (cProfile) over the whole warm-up.

    python bench/startup.py --shape qwen3-30b-a3b --layers 24 --device cuda --batch 64 --max-cells 8192 \\
        --tokenizer DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import random_checkpoint  # noqa: E402

PHASES = ("decode window", "prompt chunk", "sampler", "requests")


def triton_cache_entries() -> int:
    folder = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face folder or .gguf file (instead of --shape)")
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--checkpoint-dir", default="~/.cache/strata-bench")
    p.add_argument("--tokenizer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-cells", type=int, default=8192)
    p.add_argument("--max-window-tokens", type=int)
    p.add_argument("--compile-workers", type=int, help="as strata engine's flag (default: its default; 0: none)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions of most cumulative time")
    p.add_argument("--again", action="store_true",
                   help="run the warm-up a second time in the same process (graphs kept): what each item costs warm")
    args = p.parse_args(argv)

    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine, default_window_tokens
    from strata.runtime.precompile import start_compile_workers
    from strata.runtime.scheduler import Scheduler
    from strata.runtime.warmup import warm_up

    model = args.model or str(random_checkpoint(args))
    cache_before = triton_cache_entries()
    t0 = time.perf_counter()
    files = ModelFiles.open(model)
    device = torch.device(args.device)
    workers = start_compile_workers(
        files.spec, device=device, dtype=torch.bfloat16, kernels="auto", max_cells=args.max_cells,
        max_window_tokens=args.max_window_tokens or default_window_tokens(device), num_slots=args.batch,
        lookahead=None, single_stage=True, workers=args.compile_workers)
    engine = Engine(files, device=device, dtype=torch.bfloat16, max_cells=args.max_cells,
                    max_window_tokens=args.max_window_tokens)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    compile_s = workers.wait() if workers is not None else 0.0
    waited_s = time.perf_counter() - t0 - load_s
    scheduler = Scheduler(engine, args.batch, lambda line: None)
    items: list[tuple[str, float]] = []
    last = [time.perf_counter()]

    def progress(done: int, what: str) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        items.append((what, now - last[0]))
        last[0] = now

    profiler = cProfile.Profile() if args.profile else None
    last[0] = time.perf_counter()
    if profiler:
        profiler.enable()
    took = warm_up(scheduler.slots, progress)
    if profiler:
        profiler.disable()
    print(f"{args.shape if not args.model else model} ({engine.spec.num_layers} layers) on {args.device}: "
          f"load {load_s:.1f} s, compile workers {len(workers.procs) if workers else 0} ({compile_s:.1f} s from their "
          f"start, {waited_s:.1f} s waited for after the load), warm-up {took:.1f} s; start-up "
          f"{load_s + waited_s + took:.1f} s; Triton cache entries {cache_before} -> {triton_cache_entries()}")
    report(items)
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.profile)
        print(out.getvalue())
    if args.again:
        items.clear()
        last[0] = time.perf_counter()
        took = warm_up(scheduler.slots, progress)
        print(f"the warm-up again, in the same process: {took:.1f} s")
        report(items)


def report(items: list[tuple[str, float]]) -> None:
    print(f"{'phase':<14} {'items':>5} {'seconds':>8} {'first':>8} {'median':>8} {'slowest':>8}  slowest item")
    for phase in PHASES:
        mine = [(w, s) for w, s in items if w.startswith(phase) or phase == "requests" and "requests" in w]
        if not mine:
            continue
        secs = [s for _, s in mine]
        worst = max(mine, key=lambda m: m[1])
        print(f"{phase:<14} {len(mine):>5} {sum(secs):>8.2f} {secs[0]:>8.3f} {statistics.median(secs):>8.3f} "
              f"{worst[1]:>8.3f}  {worst[0]}")
    print("items in order (seconds):", " ".join(f"{w.split(' of ')[-1].split(' ')[0]}:{s:.2f}" for w, s in items))


if __name__ == "__main__":
    main()
