"""Layer split over two GPUs: one card, two stages, and two stages with pipelined groups, at 8 slots.

Prints total decode tokens/s for each, in one run (anchors: the one-card engine and the ungrouped split; rows with
`lookahead` 0 show the host reading each window before the next is launched), plus each card's VRAM
with and without `--trim-stage-weights`, and whether each configuration's greedy tokens equal the one-card
run's (a layer's random weights do not depend on the stage that draws them). Random bfloat16 weights at a
real shape (bench/shapes.py).

    python bench/pipeline.py --shape qwen3-30b-a3b --slots 8
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import shape  # noqa: E402

from strata.model.random_weights import random_stage_weights  # noqa: E402
from strata.runtime.generate import Engine  # noqa: E402
from strata.runtime.scheduler import Scheduler  # noqa: E402


def engine_for(spec, split, groups, trim, lookahead):
    factory = lambda layers, device, trim_: random_stage_weights(spec, layers, device, torch.bfloat16, trim=trim_)  # noqa: E731
    return Engine(None, device="cuda", dtype=torch.bfloat16, max_cells=512, spec=spec, weights=factory,
                  layer_split=split, batch_groups=groups, trim_stage_weights=trim, lookahead=lookahead)


def count_tokens(lines: list[str]) -> int:
    """Tokens said so far in TOK lines (each a list of request id, token pairs)."""
    return sum((len(line.split()) - 1) // 2 for line in lines if line.startswith("TOK "))


def total_tok_s(engine, slots: int, tokens: int) -> tuple[float, dict[int, list[int]]]:
    """Total decode tokens/s of `slots` conversations, and each slot's tokens."""
    lines: list[str] = []
    sched = Scheduler(engine, slots, lines.append)
    vocab = engine.spec.vocab_size
    for i in range(slots):
        ids = " ".join(str((7 + 13 * i + 5 * j) % vocab) for j in range(64))
        sched.handle(f"ADD s{i} {tokens + 4} ignore_eos=1 {ids}")
    for _ in range(4):  # warm up: compile, capture the graphs, read the prompts
        sched.step()
    for dev in range(torch.cuda.device_count()):
        torch.cuda.synchronize(dev)
    start, before = time.perf_counter(), count_tokens(lines)
    while sched.busy:
        sched.step()
    generated = count_tokens(lines) - before
    rate = generated / (time.perf_counter() - start)
    tokens_of: dict[int, list[int]] = {}
    for line in lines:
        words = line.split()
        if words[0] == "TOK":
            for k in range(1, len(words) - 1, 2):
                tokens_of.setdefault(int(words[k][1:]), []).append(int(words[k + 1]))
    return rate, tokens_of


def vram_gb() -> list[float]:
    return [torch.cuda.memory_allocated(d) / 1e9 for d in range(torch.cuda.device_count())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    spec = shape(args.shape, args.layers)
    half = spec.num_layers // 2
    split = f"{half},{spec.num_layers - half}"
    print(f"{args.shape} ({spec.num_layers} layers), {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, "
          f"{args.slots} slots, torch {torch.__version__}")
    rows = []
    for label, split_, groups, trim, ahead in [
            ("one card", None, 1, True, 1), (f"2 stages {split}", split, 1, True, 1),
            (f"2 stages {split}, 2 groups", split, 2, True, 1),
            (f"2 stages {split}, lookahead 0", split, 1, True, 0),
            (f"2 stages {split}, 2 groups, lookahead 0", split, 2, True, 0),
            (f"2 stages {split}, untrimmed", split, 2, False, 1)]:
        engine = engine_for(spec, split_, groups, trim, ahead)
        vram = vram_gb()
        rate, tokens = total_tok_s(engine, args.slots, args.tokens) if trim or split_ is None else (float("nan"), None)
        rows.append((label, rate, vram, tokens))
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    base, base_tokens, split_rate = rows[0][1], rows[0][3], rows[1][1]
    print(f"{'configuration':44} {'total tok/s':>12} {'vs one card':>12} {'vs 2 stages':>12}  {'same tokens':>11}  "
          "VRAM per card (GB)")
    for label, rate, vram, tokens in rows:
        rate_s = (f"{rate:12.1f} {rate / base:11.2f}x {rate / split_rate:11.2f}x" if rate == rate
                  else f"{'-':>12} {'-':>12} {'-':>12}")
        same = "-" if tokens is None else ("yes" if tokens == base_tokens else "NO")
        if tokens is not None and tokens != base_tokens:  # where it first went apart, to find why
            slot = next(k for k in sorted(base_tokens) if tokens.get(k) != base_tokens[k])
            got, want = tokens.get(slot, []), base_tokens[slot]
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            same += f" (slot {slot}, token {at} of {len(got)}/{len(want)})"
        print(f"{label:44} {rate_s}  {same:>11}  {', '.join(f'{v:.1f}' for v in vram)}")


if __name__ == "__main__":
    main()
