"""Drafts (`--spec ngram:K`, `--spec mtp:K`): decode tokens/s with drafts against the same engine without them,
in one run; on a GPU, what a verify window costs against a one-row step and the speed that implies.

CPU (the default): greedy answers to two kinds of prompt, at 1, 4 and 8 slots: one that asks the model to repeat a
given text (where a lookup in the conversation's own text finds what comes next) and one that asks a question
(where it mostly does not). The engines read the same weights; each batch's answers are checked equal with and
without drafts (drafts never change a greedy answer). Prints tok/s with and without, their ratio, and the
acceptance per draft position, for each `--spec` given (comma-separated; `--fixed` adds each with a fixed draft length,
shown as `mtp:2=`; `--dtype bfloat16` for the engines); `--server` then sends the repeat prompt
through `strata serve` (streaming clients, a server per setting) for the same ratios as a user gets them. `--spec-max-active` is 64 here, so every
slot count may draft (the engine's default stops drafting above 4 active slots); on the CPU MTP drafts take only
the rows the decoding slots leave free in their last block of rows, as the engine does by default
(`SpeculativeConfig.within_row_block`; `--draft-everywhere` turns that off, to see what it saves). `--prompts chat`
(in the default set) answers eight everyday requests, each to its end of turn: the acceptance a chat user sees.

GPU (`--window-cost`): random weights at a real shape, Triton kernels and CUDA graphs. For n slots (each holding a
128-token context) it times a decode window of n x (1 + k) rows, each slot's rows at consecutive positions as a
drafting slot's are, against the n-row step, for k = 1..4: c(k). The drafted rows carry other tokens than the
slot's (they route to other experts), or the slot's own token again (much the same experts): the difference is
the share of c(k) that reading more experts costs. Then the speed implied at an acceptance a per position:
(1 - a^(k+1)) / (1 - a) tokens per window, over c(k) (the drafter's own cost not counted: n-gram lookups cost the
host microseconds; an MTP layer about one layer and a head per draft).

    python bench/spec.py                       # the embedded default on the CPU, n-gram drafts
    python bench/spec.py --spec ngram:4,mtp:3 --slots 1,4,8 --server
    python bench/spec.py --window-cost --shape qwen3-30b-a3b --device cuda --slots 1,8,32
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = ("The lighthouse keeper climbed the spiral stairs each evening at dusk, lit the great lamp, wound the clockwork "
        "that turned the lens, and wrote the weather, the ships he saw and the hour in a leather book.")
PROMPTS = {
    "repeat": f"Repeat the following text exactly, word for word.\n\n{TEXT}",
    "question": "Explain in a few sentences why the sky is blue.",
}
# `--prompts chat`: everyday requests, written for this benchmark (none is among train/mtp_head.py's training or
# held-out prompts), each answered to its end of turn (at most --tokens): what a chat user's answers look like,
# where the two above are one short answer each run past its end (`ignore_eos`).
CHAT = [
    "How do I remove a coffee stain from a white shirt?",
    "Write a short poem about a train crossing the mountains at night.",
    "What are three differences between frogs and toads?",
    "Give me a packing list for a week at the beach.",
    "Explain what compound interest is, with an example.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Why do leaves change colour in the autumn?",
    "Suggest five names for a small bookshop and say why each fits.",
]


def decode(engine, prompts: list[list[int]], tokens: int, stop_ids: frozenset[int] = frozenset()):
    """Every prompt in a slot of its own, admitted together and run to `tokens` tokens (or a stop id); (answers,
    decode tokens/s after every first token, the slots)."""
    slots = engine.init_slots(len(prompts))
    for i, ids in enumerate(prompts):
        slots.admit(i, ids, tokens, stop_ids=stop_ids)
    out: dict[int, list[int]] = {}
    start = None
    while slots.active or slots.in_flight:
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        if start is None and len(out) == len(prompts):
            start = time.perf_counter()
            first = sum(len(v) for v in out.values())
    took = time.perf_counter() - start
    made = sum(len(v) for v in out.values()) - first
    return [out[i] for i in range(len(prompts))], made / took, slots, (made, took)


def decode_set(engine, prompts: list[list[int]], n: int, tokens: int, stop_ids: frozenset[int]):
    """The prompts n at a time (each group admitted together and run to its end): (answers, decode tokens/s over
    all groups, spec counts summed, accepted per position summed)."""
    answers, made, took = [], 0, 0.0
    counts: dict[str, int] = {}
    per_pos: list[int] = []
    for start in range(0, len(prompts), n):
        out, _, slots, (group_made, group_took) = decode(engine, prompts[start:start + n], tokens, stop_ids)
        answers += out
        made += group_made
        took += group_took
        for key, value in getattr(slots, "spec_counts", {}).items():
            counts[key] = counts.get(key, 0) + value
        pos = getattr(slots, "spec_accepted_per_pos", [])
        per_pos = [a + b for a, b in zip(per_pos, pos)] if per_pos else list(pos)
    return answers, made / took, counts, per_pos


def check_forced_drafts(spec, device: torch.device, prompt_len: int = 64, n: int = 24) -> None:
    """Drafts on this device's kernels and graphs give the tokens and state of decoding without them: one
    conversation at `spec` (random weights) answers greedily without drafts, then with drafts configured but none
    proposed (the kernels a drafting engine runs), then with drafts that are its own answer with one token changed
    at a place that moves from window to window (so 0 to 3 of 4 are kept, and GDN layers roll back from their keep
    slots). Prints what it found and where states differ; exits 1 when they do."""
    from unittest import mock

    from strata.model.random_weights import random_stage_weights
    from strata.runtime import slots as slots_module
    from strata.runtime.drafts import SpeculativeConfig
    from strata.runtime.generate import Engine

    weights = lambda layers, dev, trim: random_stage_weights(spec, layers, dev, torch.bfloat16)  # noqa: E731
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    answers, states, truth = [], [], []

    def forced(tokens, k, *_):
        wanted = truth[len(tokens):][:k]
        return [t if j != len(tokens) // 2 % (k + 1) else (t + 1) % spec.vocab_size for j, t in enumerate(wanted)]

    for run in ("plain", "configured", "drafting"):
        engine = Engine(None, device=device, dtype=torch.bfloat16, max_cells=256, spec=spec, weights=weights,
                        speculative=None if run == "plain" else SpeculativeConfig("ngram", 4, adaptive=False))
        slots = engine.init_slots(1)
        slots.admit(0, prompt, n, stop_ids=frozenset())
        out = []
        with mock.patch.object(slots_module, "propose", forced if run == "drafting" else lambda *_: []):
            while slots.slots[0].active or slots.in_flight:
                out += [e.token for e in slots.step()]
        truth = prompt + out
        state = slots.slots[0].state
        answers.append(out)
        states.append({f"{kind}{i}": t[: state.length].clone() if kind == "k" else t.clone()
                       for kind, ts in (("k", state.k), ("v", state.v), ("conv", state.conv),
                                        ("rec", state.recurrent)) for i, t in ts.items()})
        counts = slots.spec_counts, slots.spec_accepted_per_pos
        del engine, slots

    def differ(a: dict, b: dict) -> list[str]:
        return [f"{name} (shape)" if a[name].shape != b[name].shape else
                f"{name} ({float((a[name].float() - b[name].float()).abs().max()):.3g})"
                for name in a if not torch.equal(a[name], b[name])]

    print(f"drafts check ({spec.num_layers} layers, {len(spec.gdn_layers())} GDN): tokens equal: "
          f"{answers[0] == answers[1] == answers[2]}; drafts {counts[0]}, kept per position {counts[1]}")
    print(f"  state differs, plain vs configured: {differ(states[0], states[1]) or 'nowhere'}; configured vs "
          f"drafting: {differ(states[1], states[2]) or 'nowhere'}")
    if not answers[0] == answers[1] == answers[2] or differ(states[0], states[2]):
        sys.exit(1)


def window_cost(args) -> None:
    """`--window-cost`: c(k) on the GPU, random weights (module docstring)."""
    from shapes import shape

    from strata.model.random_weights import random_stage_weights
    from strata.runtime.drafts import SpeculativeConfig
    from strata.runtime.generate import Engine
    from strata.runtime.window import Window

    spec = shape(args.shape, args.layers)
    device = torch.device(args.device)
    counts = [int(x) for x in args.slots.split(",")]
    check_forced_drafts(shape(args.shape, min(4, spec.num_layers)), device)
    # drafts configured, so that a model with GDN layers gets its keep slots (written by the drafted rows)
    engine = Engine(None, device=device, dtype=torch.bfloat16, max_cells=args.max_cells, spec=spec,
                    max_window_tokens=max(counts) * 5, speculative=SpeculativeConfig("ngram", 4, max_active=max(counts)),
                    weights=lambda layers, dev, trim: random_stage_weights(spec, layers, dev, torch.bfloat16))
    print(f"{args.shape} ({spec.num_layers} layers), random weights, {torch.cuda.get_device_name(device)}, Triton "
          f"kernels + CUDA graphs; each slot holds a 128-token context")
    gen = torch.Generator().manual_seed(0)
    pool = engine.new_pool(max(counts))
    states = pool.sessions()
    for state in states:
        engine.run(state, torch.randint(0, spec.vocab_size, (128,), generator=gen).tolist())

    def timed(n: int, k: int, same: bool) -> float:
        parts = []
        for state in states[:n]:
            first = int(torch.randint(0, spec.vocab_size, (1,), generator=gen))
            drafts = [first] * k if same else torch.randint(0, spec.vocab_size, (k,), generator=gen).tolist()
            parts.append((state, [first] + drafts, "apart" if k else False))
        window = Window.build(parts, device)
        for _ in range(3):  # compiles, captures the graph of this many rows, warms
            engine.forward(window)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            engine.forward(window)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / args.iters

    rates = (0.5, 0.7, 0.9)
    head = [float(a) for a in args.head_acceptance.split(",")] if args.head_acceptance else []
    print(f"{'slots':>5} {'1-row step':>10} " + " ".join(f"{'c(' + str(k) + ')':>13}" for k in range(1, 5))
          + "   best k and the speed it implies at an acceptance of " + ", ".join(map(str, rates))
          + (f" per position, and at the head's chained {head}" if head else ""))
    for n in counts:
        base = timed(n, 0, False)
        cells, implied = [], []
        for k in range(1, 5):
            other, same = timed(n, k, False) / base, timed(n, k, True) / base
            cells.append(f"{other:>5.2f} ({same:.2f})")
            implied.append([(1 - a ** (k + 1)) / (1 - a) / other for a in rates])
            if head and k <= len(head):  # the head's chained acceptance: 1 + a_1 + .. + a_k tokens a window
                implied[-1].append((1 + sum(head[:k])) / other)
        best = [max((k for k in range(4) if j < len(implied[k])), key=lambda k: implied[k][j])
                for j in range(len(rates) + bool(head))]
        tok_s = n * 1000 / base
        print(f"{n:>5} {base:>7.2f} ms " + " ".join(f"{c:>13}" for c in cells) + "   " + ", ".join(
            f"k={b + 1}: {implied[b][j]:.2f}x ({tok_s * implied[b][j]:,.0f} tok/s)" for j, b in enumerate(best)))
    print("c(k): a window of 1 + k rows per slot over a 1-row step; drafted rows of other tokens (of the slot's own "
          "token again, in brackets: the same experts, so the difference is the cost of reading more experts)")


def through_server(args, ids: list[int], chat: list[tuple[list[int], int]]) -> None:
    """`--server`: through `strata serve` (streaming /v1/completions clients, bench/serve.py's), without drafts and
    with each --spec: the repeat prompt at each slot count (total tok/s of the wave), and the chat prompts one
    stream at a time (`chat`: each prompt and its answer's length in process, asked for with `ignore_eos`, so the
    server writes the same answers); tok/s and the ratio to the run without drafts."""
    import asyncio
    import importlib.util
    from argparse import Namespace

    loaded = importlib.util.spec_from_file_location("bench_serve", Path(__file__).resolve().parent / "serve.py")
    bench_serve = sys.modules["bench_serve"] = importlib.util.module_from_spec(loaded)  # not `serve`: the server's
    loaded.loader.exec_module(bench_serve)
    counts = [int(x) for x in args.slots.split(",")]
    base: dict[object, float] = {}
    print(f"\nthrough strata serve (streaming clients; the repeat prompt, {args.tokens} tokens each, n at once; the "
          f"{len(chat)} chat prompts one at a time):")
    for value in [None, *args.spec.split(",")]:
        flags = Namespace(device="cpu", dtype=args.dtype, batch=max(counts), max_cells=args.max_cells,
                          max_window_tokens=None, paced_engine=None, spec=value)
        server = bench_serve.ServerProcess(args.model, flags)
        try:
            server.wait_healthy()
            asyncio.run(bench_serve.one_request(server.url, ids, 4))  # the clients' first connection, warmed
            results = []
            for n in counts:
                streams = asyncio.run(bench_serve.wave(server.url, [ids] * n, args.tokens))
                results.append((f"repeat, {n} streams", n, streams))
            if chat:
                streams = [asyncio.run(bench_serve.one_request(server.url, p, length)) for p, length in chat]
                results.append(("chat, 1 stream", "chat", streams))
            for label, key, streams in results:
                errors = [s.error for s in streams if s.error]
                if errors:
                    raise SystemExit(f"--spec {value}: {errors[0]}")
                if key == "chat":  # one after another: each stream's own span
                    span = sum(s.end - s.chunks[0] for s in streams if s.chunks)
                else:
                    span = max(s.end for s in streams) - min(s.chunks[0] for s in streams if s.chunks)
                tok_s = sum(s.tokens - 1 for s in streams) / span
                ratio = "" if value is None else f"  {tok_s / base[key]:.2f}x"
                base.setdefault(key, tok_s)
                print(f"  --spec {value or 'off':>8}, {label}: {tok_s:6.1f} tok/s{ratio}", flush=True)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> None:
    from strata.runtime.drafts import parse_spec
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--spec", default="ngram:4", help="one or more, comma-separated: ngram:4,mtp:3")
    p.add_argument("--slots", default="1,4,8")
    p.add_argument("--tokens", type=int, default=64, help="answer length of the repeat and question prompts")
    p.add_argument("--prompts", default="repeat,question,chat",
                   help="which prompts, comma-separated: repeat, question (one each, --tokens long past their end), "
                   "chat (the CHAT set, each to its end of turn or --chat-tokens)")
    p.add_argument("--chat-tokens", type=int, default=256, help="at most this many tokens a chat answer")
    p.add_argument("--max-cells", type=int, default=1024)
    p.add_argument("--window-cost", action="store_true", help="the GPU part: c(k) at --shape on --device")
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--head-acceptance", default="0.62,0.34,0.16",
                   help="--window-cost: also the speed implied at this chained acceptance per draft position (the "
                   "embedded default's head on the chat prompts, as the CPU run prints it)")
    p.add_argument("--server", action="store_true", help="also through strata serve (the repeat prompt)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the CPU engines' dtype")
    p.add_argument("--draft-everywhere", action="store_true", help="on the CPU, draft in every window (not only in "
                   "the rows free in the decoding slots' last block of rows)")
    p.add_argument("--fixed", action="store_true", help="also draft K tokens every window (not one more than the "
                   "slot's drafts had accepted last time)")
    args = p.parse_args(argv)
    if args.window_cost:
        return window_cost(args)

    files = ModelFiles.open(args.model)
    tok = files.tokenizer
    dtype = getattr(torch, args.dtype)
    plain = Engine(files, max_cells=args.max_cells, dtype=dtype)
    print(f"{args.model} on cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"{args.dtype}, greedy; repeat and question: {args.tokens} tokens each; chat: {len(CHAT)} prompts, each to its "
          f"end of turn (at most {args.chat_tokens})")
    print(f"{'--spec':>8} {'prompt':>9} {'slots':>5} {'tok/s without':>14} {'with':>8} {'ratio':>6} "
          f"{'accepted / drafted':>19} {'accepted per position':>22}")
    import dataclasses

    variants = [(v, True) for v in args.spec.split(",")] + ([(v, False) for v in args.spec.split(",")]
                                                           if args.fixed else [])
    for value, adaptive in variants:
        config = dataclasses.replace(parse_spec(value, max_active=64), adaptive=adaptive,
                                     within_row_block=False if args.draft_everywhere else None)
        drafting = Engine(files, max_cells=args.max_cells, dtype=dtype, speculative=config)
        value = value if adaptive else value + "=" 
        for name in args.prompts.split(","):
            if name == "chat":
                prompts, tokens, stops = [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT], \
                    args.chat_tokens, tok.stop_ids
            else:
                prompts, tokens, stops = [tok.encode_chat([{"role": "user", "content": PROMPTS[name]}])], \
                    args.tokens, frozenset()
            for n in (int(x) for x in args.slots.split(",")):
                group = prompts if name == "chat" else prompts * n
                answers, base, _, _ = decode_set(plain, group, n, tokens, stops)
                drafted_answers, fast, counts, accepted_at = decode_set(drafting, group, n, tokens, stops)
                if drafted_answers != answers:
                    raise SystemExit(f"{value}, {name}, {n} slots: the answers with drafts differ from those without")
                rate = counts["accepted"] / max(counts["draft_tokens"], 1)
                per_pos = " ".join(f"{c / max(counts['drafts'], 1):.2f}" for c in accepted_at)
                print(f"{value:>8} {name:>9} {n:>5} {base:>14.1f} {fast:>8.1f} {fast / base:>5.2f}x "
                      f"{counts['accepted']:>8} / {counts['draft_tokens']:<8} {rate:>4.0%} {per_pos:>22}", flush=True)
    print("\nanswers with drafts equal those without: yes")
    if args.server:
        chat = [tok.encode_chat([{"role": "user", "content": t}]) for t in CHAT] if "chat" in args.prompts else []
        answers = decode_set(plain, chat, 1, args.chat_tokens, tok.stop_ids)[0] if chat else []
        through_server(args, tok.encode_chat([{"role": "user", "content": PROMPTS["repeat"]}]),
                       [(p, len(a)) for p, a in zip(chat, answers)])


if __name__ == "__main__":
    main()
