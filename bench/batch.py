"""Total decode tokens/s with 1, 2, 4, 8 ... conversations in batch slots, against one conversation at a time.

Anchor, in the same run: one conversation at a time (decode windows of one row, the same prompts). A batch window reads
the weights once for all its rows, so total tokens/s should grow with the number of conversations. The run
also checks that every batched conversation produced exactly its solo tokens.

    python bench/batch.py                                   # the embedded default on the CPU
    python bench/batch.py --shape qwen3-30b-a3b --layers 8 --device cuda --concurrency 1,8,32,64
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_engine(args):
    from strata.runtime.generate import Engine

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    if args.shape:
        from shapes import shape

        from strata.model.random_weights import random_stage_weights

        spec = shape(args.shape, args.layers)
        weights = random_stage_weights(spec, range(spec.num_layers), torch.device(args.device), dtype)
        return Engine(None, device=args.device, dtype=dtype, max_cells=args.max_cells, spec=spec, weights=weights)
    from strata.model.loader import ModelFiles

    return Engine(ModelFiles.open(args.model), device=args.device, dtype=dtype, max_cells=args.max_cells)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--shape", help="random weights at a real shape instead of --model (see bench/shapes.py)")
    p.add_argument("--layers", type=int, help="with --shape: keep the first N layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=48, help="tokens per conversation")
    p.add_argument("--max-cells", type=int, default=512)
    args = p.parse_args()
    counts = [int(c) for c in args.concurrency.split(",")]

    engine = make_engine(args)
    vocab = engine.spec.vocab_size
    prompts = [[(1000 + 7919 * i + 104729 * j) % vocab for j in range(12 + i % 5)] for i in range(max(counts))]
    no_stop = frozenset()
    print(f"{args.shape or args.model} ({engine.spec.num_layers} layers) on {args.device} "
          f"({platform.processor() or platform.machine()}), {str(engine.dtype)[6:]}, torch {torch.__version__}")

    engine.generate(prompts[0], 4, stop_ids=no_stop)  # warm-up
    solo_ids, solo_time = [], 0.0
    for ids in prompts[: max(counts)]:
        state = engine.new_state()
        logits = engine.run(state, ids)
        out = [int(logits[-1].argmax())]
        sync(args.device)
        t = time.perf_counter()
        for _ in range(args.tokens - 1):
            out.append(int(engine.run(state, [out[-1]])[-1].argmax()))
        sync(args.device)
        solo_time += time.perf_counter() - t
        solo_ids.append(out)
    solo_rate = len(solo_ids) * (args.tokens - 1) / solo_time
    print(f"one at a time: {solo_rate:.1f} tok/s")
    print(f"{'conversations':>13} {'total tok/s':>12} {'per conv':>9} {'vs solo':>8}  identical to solo")
    for n in counts:
        slots = engine.init_slots(n)
        got = {i: [slots.admit_now(i, prompts[i], args.tokens, stop_ids=no_stop).token] for i in range(n)}
        sync(args.device)
        t = time.perf_counter()
        while slots.active:
            for e in slots.commit_slots(slots.run_slots()):
                got[e.slot].append(e.token)
        sync(args.device)
        rate = n * (args.tokens - 1) / (time.perf_counter() - t)
        same = all(got[i] == solo_ids[i] for i in range(n))
        print(f"{n:>13} {rate:>12.1f} {rate / n:>9.1f} {rate / solo_rate:>7.2f}x  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
