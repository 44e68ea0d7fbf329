"""Prompt reading (prefill) on the GPU at a real MoE shape, against the measured bf16 matmul rate.

Prefill is compute-bound: the run prints the tokens/s of reading one prompt of `--prompt-len` tokens (in
windows of `--chunk` rows) and the fraction of the card's measured bf16 matmul rate that the prompt's
arithmetic (the projections, the routed experts each token uses, attention) represents.

    python bench/prefill.py --shape qwen3-30b-a3b --prompt-len 4096

Then, where the time goes: the GPU kernels of one prompt read (torch.profiler), grouped by kind, and each
main part of one layer timed alone at the prompt's size against its own floor (its FLOPs at the measured
matmul rate): the fused projections (torch's GEMM), the routed experts (Triton grouped GEMMs, prompt tiles)
and the causal attention (Triton prefill kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import gpu_seconds, matmul_rate, print_kernel_table  # noqa: E402
from shapes import shape  # noqa: E402

from strata.kernels.attention import prefill_attention_triton  # noqa: E402
from strata.kernels.gdn import gated_delta_rule_chunked, gated_delta_rule_chunked_triton  # noqa: E402
from strata.kernels.moe import PROMPT_TILES, fused_experts_triton, route_triton  # noqa: E402
from strata.model.random_weights import random_stage_weights  # noqa: E402
from strata.runtime.generate import Engine  # noqa: E402


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


def layer_parts(spec, tokens: int, rate: float) -> None:
    """Each main part of one layer at `tokens` rows, alone, against its floor (its FLOPs at `rate`)."""
    dev, dt, h = "cuda", torch.bfloat16, spec.hidden_size
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    parts = []
    a = spec.attention
    q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    qkv = torch.randn(q_out + 2 * a.num_kv_heads * a.head_dim, h, device=dev, dtype=dt) / h**0.5
    parts.append(("qkv projection (torch GEMM)", lambda: torch.nn.functional.linear(x, qkv),
                  2 * tokens * h * qkv.shape[0]))
    q = torch.randn(tokens, a.num_heads, a.head_dim, device=dev, dtype=dt)
    kv = torch.randn(tokens, a.num_kv_heads, a.head_dim, device=dev, dtype=dt)
    pos = torch.arange(tokens, device=dev)
    parts.append(("causal attention (Triton prefill)",
                  lambda: prefill_attention_triton(q, kv, kv, pos, a.head_dim**-0.5),
                  2 * 2 * a.num_heads * a.head_dim * tokens * tokens / 2))
    if spec.moe is not None:
        m = spec.moe
        gate_up = torch.randn(m.num_experts, 2 * m.expert_dim, h, device=dev, dtype=dt) / h**0.5
        down = torch.randn(m.num_experts, h, m.expert_dim, device=dev, dtype=dt) / m.expert_dim**0.5
        weights, ids = route_triton(torch.randn(tokens, m.num_experts, device=dev), m.top_k, True)
        parts.append(("routed experts (Triton, prompt tiles)",
                      lambda: fused_experts_triton(x, weights, ids, gate_up, down, PROMPT_TILES),
                      2 * tokens * m.top_k * 3 * h * m.expert_dim))
    if spec.gdn is not None:
        g = spec.gdn
        gq = torch.nn.functional.normalize(torch.randn(tokens, g.num_k_heads, g.k_head_dim, device=dev), dim=-1).to(dt)
        gk = torch.nn.functional.normalize(torch.randn(tokens, g.num_k_heads, g.k_head_dim, device=dev), dim=-1).to(dt)
        gv = torch.randn(tokens, g.num_v_heads, g.v_head_dim, device=dev).to(dt)
        decay = -torch.rand(tokens, g.num_v_heads, device=dev) * 0.5  # log decay
        beta = torch.rand(tokens, g.num_v_heads, device=dev).to(dt)
        state = torch.zeros(g.num_v_heads, g.k_head_dim, g.v_head_dim, device=dev)
        want, want_state = gated_delta_rule_chunked(gq, gk, gv, decay, beta, state)
        got, got_state = gated_delta_rule_chunked_triton(gq, gk, gv, decay, beta, state)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        print(f"\nGated DeltaNet prefill, Triton against the float32 torch reference at {tokens} rows: relative error "
              f"{rel(got, want):.2e} (output), {rel(got_state, want_state):.2e} (state)")
        chunks = tokens // 64
        rule_flops = 2 * g.num_v_heads * chunks * (64 * 64 * (g.k_head_dim + g.v_head_dim) * 2
                                                   + 64 * g.k_head_dim * g.v_head_dim * 4)
        parts.append(("Gated DeltaNet chunked rule (Triton)",
                      lambda: gated_delta_rule_chunked_triton(gq, gk, gv, decay, beta, state), rule_flops))
        parts.append(("  the same, chunk inverted by substitution",  # the fifth session's: 63 sequential steps
                      lambda: gated_delta_rule_chunked_triton(gq, gk, gv, decay, beta, state, solve_block=64),
                      rule_flops))
    print(f"\none layer's parts at {tokens} rows, alone (floor: the FLOPs at {rate / 1e12:.0f} TFLOP/s):")
    print(f"{'part':40} {'ms':>8} {'floor ms':>9} {'TFLOP/s':>8} {'of rate':>8}")
    for name, fn, flops in parts:
        sec = gpu_seconds(fn)
        print(f"{name:40} {sec * 1e3:8.3f} {flops / rate * 1e3:9.3f} {flops / sec / 1e12:8.0f} {flops / sec / rate:8.1%}")


def check_against_float32(shape_name: str, ids: list[int], layers: int = 4) -> None:
    """The Triton prompt path and the torch reference ops, both in bfloat16, against the torch ops in float32 on
    the same random weights (the first `layers` layers of the shape, so float32 fits): how far each is off."""
    spec = shape(shape_name, layers)
    weights = random_stage_weights(spec, range(spec.num_layers), torch.device("cuda"), torch.float32)
    as_bf16 = lambda t: t.to(torch.bfloat16) if t is not None and t.dtype == torch.float32 and t.dim() > 1 else t  # noqa: E731
    low = replace(weights, layers={i: {k: as_bf16(v) for k, v in tensors.items()} for i, tensors in weights.layers.items()},
                  embed=as_bf16(weights.embed), lm_head=as_bf16(weights.lm_head))  # the same values in bf16 (norms stay)
    runs = {}
    for name, dtype, w, kernels in [("float32 torch", torch.float32, weights, "torch"),
                                    ("bf16 torch", torch.bfloat16, low, "torch"),
                                    ("bf16 triton", torch.bfloat16, low, "triton")]:
        engine = Engine(None, device="cuda", dtype=dtype, max_cells=len(ids) + 8, spec=spec, weights=w,
                        max_window_tokens=len(ids), kernels=kernels, cuda_graphs=False)
        runs[name] = engine.run(engine.new_state(), ids, all_logits=True).float()
    want = runs["float32 torch"]
    print(f"accuracy on {len(ids)} prompt tokens, first {layers} layers, against the float32 torch ops:")
    for name in ("bf16 torch", "bf16 triton"):
        got = runs[name]
        err = ((got - want).norm() / want.norm()).item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"  {name:12} relative error {err:.2e}, greedy next tokens agree on {agree:.1%} of rows")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--check-len", type=int, default=512, help="prompt tokens compared with the torch reference ops")
    args = p.parse_args()
    spec = shape(args.shape, args.layers)
    weights = random_stage_weights(spec, range(spec.num_layers), torch.device("cuda"), torch.bfloat16)
    engine = Engine(None, device="cuda", dtype=torch.bfloat16, max_cells=args.prompt_len + 8, spec=spec,
                    weights=weights, max_window_tokens=args.chunk)
    rate = matmul_rate("cuda")
    ids = [(11 + 7 * j) % spec.vocab_size for j in range(args.prompt_len)]
    engine.run(engine.new_state(), ids)  # warm-up: compiles the kernels, fills the stage stream's memory cache
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
    check_against_float32(args.shape, ids[: args.check_len])
    print_kernel_table(lambda: engine.run(engine.new_state(), ids), "GPU kernels of one prompt read", top=30)
    layer_parts(spec, args.prompt_len, rate)


if __name__ == "__main__":
    main()
