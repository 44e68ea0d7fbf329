"""Prompt reading (prefill) on the GPU at a real MoE shape, against the measured bf16 matmul rate.

Prefill is compute-bound: the run prints the tokens/s of reading one prompt of `--prompt-len` tokens (in
windows of `--chunk` rows) and the fraction of the card's measured bf16 matmul rate that the prompt's
arithmetic (the projections, the routed experts each token uses, attention) represents.

    python bench/prefill.py --shape qwen3-30b-a3b --prompt-len 4096
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


def matmul_rate(device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def prompt_flops(spec, tokens: int) -> float:
    """Multiply-adds x 2 of one prompt: every per-token product plus causal attention."""
    h, a = spec.hidden_size, spec.attention
    total = 0.0
    for layer in spec.layers:
        if layer.mixer == "attention":
            q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
            total += 2 * tokens * h * (q_out + 2 * a.num_kv_heads * a.head_dim + a.num_heads * a.head_dim)
            total += 2 * 2 * a.num_heads * a.head_dim * tokens * tokens / 2  # QK^T and PV, causal half
        else:
            g = spec.gdn
            total += 2 * tokens * h * (g.conv_dim + g.value_dim + 2 * g.num_v_heads + g.value_dim)
        if layer.mlp == "moe":
            m = spec.moe
            total += 2 * tokens * m.top_k * 3 * h * m.expert_dim + 2 * tokens * h * m.num_experts
            total += 2 * tokens * 3 * h * m.shared_dim
        else:
            total += 2 * tokens * 3 * h * spec.dense_dim
    return total + 2 * h * spec.vocab_size  # the last row's logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096)
    args = p.parse_args()
    spec = shape(args.shape, args.layers)
    weights = random_stage_weights(spec, range(spec.num_layers), torch.device("cuda"), torch.bfloat16)
    engine = Engine(None, device="cuda", dtype=torch.bfloat16, max_cells=args.prompt_len + 8, spec=spec,
                    weights=weights, prefill_chunk=args.chunk)
    rate = matmul_rate("cuda")
    ids = [(11 + 7 * j) % spec.vocab_size for j in range(args.prompt_len)]
    engine.run(engine.new_state(), ids[:256])  # warm-up (compiles the kernels)
    state = engine.new_state()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run(state, ids)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    flops = prompt_flops(spec, args.prompt_len)
    print(f"{args.shape} ({spec.num_layers} layers), bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"measured bf16 matmul rate: {rate / 1e12:.0f} TFLOP/s")
    print(f"prompt of {args.prompt_len} tokens in windows of {args.chunk}: {seconds:.2f} s, "
          f"{args.prompt_len / seconds:.0f} tokens/s, {flops / seconds / 1e12:.1f} TFLOP/s = "
          f"{flops / seconds / rate:.1%} of the matmul rate")


if __name__ == "__main__":
    main()
