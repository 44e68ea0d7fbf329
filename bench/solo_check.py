"""The solo path (`Engine.stream`) one step ahead against reading each step first, on the GPU: same tokens (greedy
and sampled; the read-first run is repeated, since a run that differs from itself says nothing of lookahead)
and tokens/s of each, at a real model's shape (random weights, the first N layers).

    python bench/solo_check.py --shape qwen3-30b-a3b --layers 48 --tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import shape  # noqa: E402

from strata.model.random_weights import random_stage_weights  # noqa: E402
from strata.runtime.generate import Engine  # noqa: E402
from strata.runtime.sampling import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    spec = shape(args.shape, args.layers)
    weights = random_stage_weights(spec, range(spec.num_layers), torch.device("cuda"), torch.bfloat16)
    engine = Engine(None, device="cuda", dtype=torch.bfloat16, max_cells=1024, spec=spec, weights=weights)
    prompt = [(11 + 7 * j) % spec.vocab_size for j in range(64)]
    print(f"{args.shape}, {spec.num_layers} layers, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)):
        out = {}
        for ahead in (0, 1):
            engine.lookahead = ahead
            engine.generate(prompt, 8, params, stop_ids=frozenset())  # warm up: compile, capture
            torch.cuda.synchronize()
            start = time.perf_counter()
            ids = engine.generate(prompt, args.tokens, params, stop_ids=frozenset()).ids
            torch.cuda.synchronize()
            out[ahead] = (ids, args.tokens / (time.perf_counter() - start))
        engine.lookahead = 0
        again = engine.generate(prompt, args.tokens, params, stop_ids=frozenset()).ids  # the anchor's own repeat
        same = out[0][0] == out[1][0]
        print(f"{'greedy' if params.is_greedy else 'sampled'}: read first {out[0][1]:.1f} tok/s, one step ahead "
              f"{out[1][1]:.1f} tok/s ({out[1][1] / out[0][1]:.2f}x); same tokens: {'yes' if same else 'NO'} "
              f"(read first twice: {'same' if again == out[0][0] else 'DIFFERENT: the run itself varies'})")


if __name__ == "__main__":
    main()
