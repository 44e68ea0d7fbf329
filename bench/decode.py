"""Decode speed on the GPU at real MoE shapes, against `transformers` on the same weights and the roofline.

For each number of concurrent conversations it prints, side by side: Strata's total tokens/s (batch slots,
Triton decode kernels, CUDA graphs, stepped as the engine process steps them: each window launched before the
host reads the one in flight), the same with no window ahead (`lookahead` 0) and with each kernel launched
only once the one before it has finished (no programmatic dependent launch), `transformers.generate` on the very same weights (its model's tensors are
shared with Strata's, not copied), and the step's roofline: measured copy bandwidth over the bytes the step
must read (dense weights, the distinct experts its rows actually routed to, the K/V cells and GDN states).
Before timing it checks that a row's logits are bitwise the same alone and in a batch, that greedy
conversations in a batch equal their solo runs, and whether seeded sampling repeats itself run to run.
`--chain 1` then breaks a 1-row step down by each kernel's share of its critical path, per layer (`--profile 1`:
by each kernel's own GPU time, which overlaps the next kernel's under programmatic dependent launch).

    python bench/decode.py --shape qwen3-30b-a3b --concurrency 1,8,32,64
    python bench/decode.py --shape qwen3-next-80b-a3b --layers 24 --concurrency 1,8,32,64 --chain 1

`--weights q4_k` (q8_0, q5_k, q6_k, iq3_s, fp8) adds the same weights quantized by the project's own packer
(`strata.quant.online`) and kept packed on the GPU (`strata.kernels.packed`): its tok/s beside bf16's and beside
the roofline over the packed bytes, both engines' weight memory, and, on a model of `--check-layers` layers of the
shape, one prompt window's logits packed (bf16) against the same dequantized weights in float32, bitwise against
the same weights dequantized at load in bf16, eight one-row decode windows' logits against the same reference
(the K-quants' decode products take the integer codes: not bitwise, nearer the reference), and the quantization's
own effect (the float32 logits of the dequantized weights against the original ones). `STRATA_PACKED_EXACT=1`
runs the K-quants' decode products on dequantized tiles instead (the A/B of `strata.kernels.packed.scaled_after`).

    python bench/decode.py --weights q4_k --concurrency 1,8,32,64 --skip-transformers --skip-checks
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timing import copy_bandwidth, print_chain_table, print_kernel_table  # noqa: E402

from strata.kernels.pdl import enabled as pdl_enabled  # noqa: E402


def hf_model(shape: str, num_layers: int | None, device: str):
    """A `transformers` model at the shape, random weights (its own init, std 0.02: near-uniform routing), bf16."""
    import transformers

    if shape == "qwen3-30b-a3b":
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, num_hidden_layers=num_layers or 48, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        n = num_layers or 48
        cfg = transformers.Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, num_hidden_layers=n, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            intermediate_size=5120, norm_topk_prob=True,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
        cls = transformers.Qwen3NextForCausalLM
    with torch.device("meta"):
        model = cls(cfg).to(torch.bfloat16)  # on the meta device: the real tensors are made in bf16 directly
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen, device=device) * 0.1 + (0.0 if "norm" in name and shape != "qwen3-30b-a3b" else 0.95))
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def strata_engine(model, device: str, max_cells: int = 1024, weights: str = "bf16", dtype=torch.bfloat16,
                  dequantize: bool = False):
    """Strata on `model`'s weights: shared (bf16), or quantized in `weights` as they load and kept packed (unless
    `dequantize`: the same quantized weights written out in `dtype`)."""
    from strata.model.checkpoint import StateDictCheckpoint
    from strata.model.families import build_spec
    from strata.model.weights import load_stage_weights
    from strata.quant.online import QuantizingCheckpoint
    from strata.runtime.generate import Engine

    config = model.config.to_dict()
    ckpt = StateDictCheckpoint(config, dict(model.state_dict()))
    if weights != "bf16":
        ckpt = QuantizingCheckpoint(ckpt, weights)
    family, spec = build_spec(config, "bench")
    w = load_stage_weights(ckpt, family, spec, range(spec.num_layers), torch.device(device), dtype,
                           packed=weights != "bf16")
    if dequantize:
        from strata.quant.packed import PackedWeight, dequantize as written_out

        plain = lambda t: written_out(t).to(dtype) if isinstance(t, PackedWeight) else t  # noqa: E731
        w.layers = {i: {name: plain(t) for name, t in layer.items()} for i, layer in w.layers.items()}
        w.lm_head = plain(w.lm_head)
    # parking off: the checks compare fresh reads (a reused prefix reads its last token again on the decode path)
    return Engine(None, device=device, dtype=dtype, max_cells=max_cells, spec=spec, weights=w, park_gb=0)


def check_packed(shape: str, layers: int, fmt: str, device: str) -> str:
    """On a `layers`-layer model of the shape: one 64-token prompt window's logits, packed in bf16, against the
    dequantized weights in float32 (the reference), and so on (see the module)."""
    model = hf_model(shape, layers, device)
    prompt = [(3 + 7919 * j) % model.config.vocab_size for j in range(64)]

    def run(e):  # the prompt window's logits, and 8 one-row decode windows' after a 56-token prompt
        read = e.run(e.new_state(), prompt, all_logits=True).float()
        state = e.new_state()
        e.run(state, prompt[:-8])
        return read, torch.stack([e.run(state, [t]).float().reshape(-1) for t in prompt[-8:]])

    (packed, packed_steps), (written, written_steps) = (run(strata_engine(model, device, weights=fmt)),
                                                        run(strata_engine(model, device, weights=fmt, dequantize=True)))
    reference, reference_steps = run(strata_engine(model, device, weights=fmt, dtype=torch.float32, dequantize=True))
    original, _ = run(strata_engine(model.float(), device, dtype=torch.float32))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    agree = lambda a, b: (a.argmax(-1) == b.argmax(-1)).float().mean().item()  # noqa: E731
    del model
    torch.cuda.empty_cache()
    return (f"{fmt} on {layers} layers, one 64-token prompt window: packed bf16 vs the dequantized float32 "
            f"reference: relative error {rel(packed, reference):.2e}, argmax agrees at {agree(packed, reference):.0%}; "
            f"packed == dequantized at load (bf16) bitwise: {'yes' if torch.equal(packed, written) else 'NO'}; "
            f"8 one-row decode windows: packed vs the reference {rel(packed_steps, reference_steps):.2e} (dequantized "
            f"at load, bf16: {rel(written_steps, reference_steps):.2e}), argmax agrees at "
            f"{agree(packed_steps, reference_steps):.0%}; "
            f"the quantization itself (float32, dequantized vs original weights): relative error "
            f"{rel(reference, original):.2e}, argmax agrees at {agree(reference, original):.0%}")


def step_bytes(engine, rows: int, context: int, distinct_experts: float) -> float:
    """Bytes one decode step over `rows` conversations at `context` positions must read."""
    from strata.quant.packed import PackedWeight

    spec, w = engine.spec, engine.weights
    size = lambda t: t.nbytes() if isinstance(t, PackedWeight) else t.numel() * t.element_size()  # noqa: E731
    total = size(w.lm_head) + rows * spec.hidden_size * 2
    for i, layer in w.layers.items():
        for name, t in layer.items():
            if name.startswith("experts_"):
                total += size(t) / spec.moe.num_experts * distinct_experts
            else:
                total += size(t)
        if spec.layers[i].mixer == "attention":
            a = spec.attention
            total += rows * context * 2 * a.num_kv_heads * a.head_dim * 2
        else:
            g = spec.gdn
            total += rows * 2 * g.num_v_heads * g.k_head_dim * g.v_head_dim * 4
    return total


def distinct_experts(spec, rows: int) -> float:
    """Expected distinct experts per layer for `rows` rows routed uniformly (the random weights route so)."""
    if spec.moe is None:
        return 0.0
    e, k = spec.moe.num_experts, spec.moe.top_k
    return e * (1 - (1 - k / e) ** rows)


def check_sampled_repeats(engine, vocab: int, tokens: int = 48) -> tuple[bool, bool, int | None]:
    """Seeded sampling (temperature 0.8, top-p 0.9) run twice the same way: (the prompt read's logits are bitwise
    the same both times, the tokens are the same both times, the first decode step whose logits differ when two
    new states are fed the first run's tokens one at a time — None when none does, so the sampler is where runs
    part). It found the sampler at fault on the H200: torch.cumsum over one long row did not add in a fixed order,
    so a number close to a token boundary picked either token (`strata/kernels/sampling.py` fixed it)."""
    from strata.runtime.sampling import SamplingParams

    prompt = [(3 + 7919 * j) % vocab for j in range(96)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    reads, runs = [], []
    for _ in range(2):
        reads.append(engine.run(engine.new_state(), prompt).clone())
        runs.append(engine.generate(prompt, tokens, params, stop_ids=frozenset()).ids)
        engine.generate([1, 2], 1, stop_ids=frozenset())  # the solo slot lets go of the prompt: the next run reads it
    states = engine.new_state(), engine.new_state()
    for state in states:
        engine.run(state, prompt)
    first_diff = None
    for step, token in enumerate(runs[0][:-1]):
        a, b = (engine.run(state, [token]) for state in states)
        if not torch.equal(a, b):
            first_diff = step
            break
    return torch.equal(reads[0], reads[1]), runs[0] == runs[1], first_diff


def check_invariance_and_batch(engine, vocab: int, n: int = 8, tokens: int = 150) -> tuple[bool, bool]:
    prompts = [[(1000 + 7919 * i + 104729 * j) % vocab for j in range(16 + i)] for i in range(64)]
    none = frozenset()
    # bitwise: the first decode step's logits of conversation 0 alone, in 8, in 64
    logits = []
    for count in (1, 8, 64):
        slots = engine.init_slots(count)
        for i in range(count):
            slots.admit_now(i, prompts[i], 4, stop_ids=none)  # each prompt read alone: the decode rows compare
        sw = slots.run_slots()
        logits.append(sw.logits[0].clone())
        slots.commit_slots(sw)
    # and the 8 rows' logits with a prompt chunk of another slot beside them (a mixed window)
    from strata.runtime.window import Window

    slots = engine.init_slots(9)
    for i in range(8):
        slots.admit_now(i, prompts[i], 4, stop_ids=none)
    states = [s.state for s in slots.slots]
    parts = [(states[i], [slots.slots[i].next_token], False) for i in range(8)]
    gdn = [t for st in states for t in (*st.conv.values(), *st.recurrent.values())]  # a window advances them
    saved = [t.clone() for t in gdn]
    alone = engine.forward(Window.build(parts, engine.device))  # (no commit: the mixed window runs the same rows)
    for t, v in zip(gdn, saved):
        t.copy_(v)
    mixed = engine.forward(Window.build(parts + [(states[8], prompts[9] * 8, False)], engine.device))
    logits.append(mixed[0].clone())
    invariant = all(torch.equal(logits[0], other) for other in logits[1:]) and torch.equal(alone, mixed[:8])
    # greedy: each prompt read alone (prompt rows read beside others may round otherwise, docs/BATCHING.md), then
    # decoded alone in a fresh slot and among n
    def decode(batch: list[list[int]], lookahead: int) -> list[list[int]]:
        slots = engine.init_slots(len(batch), lookahead=lookahead)
        got = [[slots.admit_now(i, p, tokens, stop_ids=none).token] for i, p in enumerate(batch)]
        while slots.active or slots.in_flight:
            for e in slots.step():
                got[e.slot].append(e.token)
        return got

    solo = [decode([p], 0)[0] for p in prompts[:n]]
    same = all(decode(prompts[:n], lookahead) == solo for lookahead in (0, 1))  # the next window launched
    # before the host reads the last one, or not
    return invariant, same


def time_strata(engine, rows: int, tokens: int, prompt_len: int, lookahead: int = 1, sampled: bool = False) -> float:
    """Tokens per second of `rows` conversations stepped as the engine process steps them (`Slots.step`); greedy,
    or `sampled` (temperature 0.8, top-p 0.9, a seed per conversation)."""
    from strata.runtime.sampling import SamplingParams

    vocab = engine.spec.vocab_size
    slots = engine.init_slots(rows, lookahead=lookahead)
    for i in range(rows):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=i) if sampled else SamplingParams()
        slots.admit_now(i, [(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)], tokens + 8, params,
                        stop_ids=frozenset())  # prompts read outside the timed decode windows
    for _ in range(3):  # capture the graph for this row count
        slots.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    produced = 0
    while produced < rows * tokens:
        produced += len(slots.step())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    slots.flush()
    return produced / elapsed


def time_transformers(model, rows: int, tokens: int, prompt_len: int) -> float:
    vocab = model.config.vocab_size
    ids = torch.tensor([[(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)] for i in range(rows)], device=model.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **kw)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    return rows * tokens / ((t2 - t1) - (t1 - t0))


def captured_step(engine, rows: int, prompt_len: int, bw: float):
    """`rows` conversations past their prompts with their decode step captured: (a function that runs one step,
    the step's roofline floor in seconds)."""
    vocab = engine.spec.vocab_size
    slots = engine.init_slots(rows)
    for i in range(rows):
        slots.admit_now(i, [(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)], 64, stop_ids=frozenset())
    for _ in range(2):  # capture
        slots.commit_slots(slots.run_slots())
    floor = step_bytes(engine, rows, prompt_len, distinct_experts(engine.spec, rows)) / bw
    return (lambda: slots.commit_slots(slots.run_slots())), floor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "qwen3-next-80b-a3b"])
    p.add_argument("--layers", type=int)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-cells", type=int, default=1024, help="K/V cells a conversation may hold (the decode "
                   "attention spreads rows past 512 cells over chunks: --prompt-len 8000 --max-cells 8192 for long contexts)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--weights", default="bf16", choices=["bf16", "q8_0", "q4_k", "q5_k", "q6_k", "iq3_s", "fp8"],
                   help="also time the weights quantized so and kept packed, beside bf16")
    p.add_argument("--check-layers", type=int, default=4, help="layers of the model --weights' accuracy is checked on")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--profile", default="", help="row counts whose decode step is broken down by kernel, e.g. 1,8 "
                   "(with STRATA_PDL=0 in the environment each kernel's time is its own, not overlapped)")
    p.add_argument("--chain", default="", help="row counts whose decode step is broken down by each kernel's share "
                   "of the critical path (kernels overlapping as they run), per layer, e.g. 1")
    args = p.parse_args()
    device = "cuda"

    if args.weights != "bf16":
        print(check_packed(args.shape, args.check_layers, args.weights, device), flush=True)
        return time_packed(args, device)
    model = hf_model(args.shape, args.layers, device)
    engine = strata_engine(model, device, args.max_cells)
    spec = engine.spec
    bw = copy_bandwidth(device)
    print(f"{args.shape}, {spec.num_layers} layers, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {engine.weights.nbytes() / 1e9:.1f} GB; programmatic dependent "
          f"launch {'on' if pdl_enabled(torch.device(device)) else 'off'}")
    if not args.skip_checks:
        invariant, same = check_invariance_and_batch(engine, spec.vocab_size)
        print(f"row logits bitwise equal alone / in 8 / in 64 / in 8 beside a prompt chunk: {'yes' if invariant else 'NO'}; "
              f"greedy 8 x 150 batch == solo: {'yes' if same else 'NO'}")
        read_same, sampled_same, first_diff = check_sampled_repeats(engine, spec.vocab_size)
        print(f"seeded sampling run twice: prompt-read logits bitwise equal: {'yes' if read_same else 'NO'}; "
              f"tokens equal: {'yes' if sampled_same else 'NO'}; two states fed the same tokens: logits "
              + ("bitwise equal at every step" if first_diff is None else f"first differ at decode step {first_diff}"))
    print(f"{'conv':>5} {'strata tok/s':>13} {'sampled':>8} {'no lookahead':>13} {'no PDL':>8} {'transformers':>13} {'speedup':>8} "
          f"{'experts/layer':>14} {'roofline tok/s':>15} {'of roofline':>12}")
    for rows in [int(c) for c in args.concurrency.split(",")]:
        ours = time_strata(engine, rows, args.tokens, args.prompt_len)
        sampled = time_strata(engine, rows, args.tokens, args.prompt_len, sampled=True)
        plain = time_strata(engine, rows, args.tokens, args.prompt_len, lookahead=0)
        before = os.environ.get("STRATA_PDL")
        os.environ["STRATA_PDL"] = "0"  # kernels launched one after the other (strata/kernels/pdl.py)
        no_pdl = time_strata(engine, rows, args.tokens, args.prompt_len)
        if before is None:
            del os.environ["STRATA_PDL"]
        else:
            os.environ["STRATA_PDL"] = before
        ref = None if args.skip_transformers else time_transformers(model, rows, args.tokens, args.prompt_len)
        experts = distinct_experts(spec, rows)
        roof = rows * bw / step_bytes(engine, rows, args.prompt_len + args.tokens // 2, experts)
        ref_s = f"{ref:13.1f}" if ref else f"{'-':>13}"
        speed = f"{ours / ref:7.1f}x" if ref else f"{'-':>8}"
        print(f"{rows:>5} {ours:13.1f} {sampled:8.1f} {plain:13.1f} {no_pdl:8.1f} {ref_s} {speed} {experts:14.1f} {roof:15.1f} {ours / roof:11.0%}")
    for rows, chain in [(int(c), False) for c in args.profile.split(",") if c] + \
            [(int(c), True) for c in args.chain.split(",") if c]:
        step, floor = captured_step(engine, rows, args.prompt_len, bw)
        title = f"decode step at {rows} rows (its roofline floor: {floor * 1e3:.3f} ms)"
        if chain:
            print_chain_table(step, title, spec.num_layers)
        else:
            print_kernel_table(step, title, top=20, steps=8)


def time_packed(args, device: str) -> None:
    """bf16 and `args.weights` packed, side by side, each against its own roofline."""
    model = hf_model(args.shape, args.layers, device)
    bf16 = strata_engine(model, device, args.max_cells)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    packed = strata_engine(model, device, args.max_cells, weights=args.weights)
    torch.cuda.synchronize()
    spec, bw = bf16.spec, copy_bandwidth(device)
    print(f"{args.shape}, {spec.num_layers} layers, {torch.cuda.get_device_name()}, torch {torch.__version__}; copy "
          f"bandwidth {bw / 1e12:.2f} TB/s; weights: bf16 {bf16.weights.nbytes() / 1e9:.2f} GB, {args.weights} "
          f"{packed.weights.nbytes() / 1e9:.2f} GB (its engine allocated {(torch.cuda.memory_allocated() - before) / 1e9:.2f} GB "
          f"with {args.max_cells} cells a slot before its first window)")
    print(f"{'conv':>5} {'bf16 tok/s':>11} {'of roofline':>12} {args.weights + ' tok/s':>11} {'of roofline':>12} "
          f"{'vs bf16':>8} {'packed roofline':>16}")
    for rows in [int(c) for c in args.concurrency.split(",")]:
        experts = distinct_experts(spec, rows)
        context = args.prompt_len + args.tokens // 2
        roof_b = rows * bw / step_bytes(bf16, rows, context, experts)
        roof_p = rows * bw / step_bytes(packed, rows, context, experts)
        b = time_strata(bf16, rows, args.tokens, args.prompt_len)
        q = time_strata(packed, rows, args.tokens, args.prompt_len)
        print(f"{rows:>5} {b:11.1f} {b / roof_b:11.0%} {q:11.1f} {q / roof_p:11.0%} {q / b:7.2f}x {roof_p:16.1f}",
              flush=True)
    for rows in [int(c) for c in args.chain.split(",") if c]:
        step, floor = captured_step(packed, rows, args.prompt_len, bw)
        print_chain_table(step, f"{args.weights} decode step at {rows} rows (its roofline floor: "
                          f"{floor * 1e3:.3f} ms)", spec.num_layers)


if __name__ == "__main__":
    main()
