"""Drafts (`--spec ngram:K`): decode tokens/s with drafts against the same engine without them, in one run.

Greedy answers to two kinds of prompt, at 1, 4 and 8 slots: one that asks the model to repeat a given text (where
a lookup in the conversation's own text finds what comes next) and one that asks a question (where it mostly
does not). Both engines read the same weights; each batch's answers are checked equal with and without drafts
(drafts never change a greedy answer). Prints tok/s with and without, their ratio, and the acceptance per draft
position.

    python bench/spec.py                       # the embedded default on the CPU
    python bench/spec.py --spec ngram:6 --slots 1 --tokens 128
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

TEXT = ("The lighthouse keeper climbed the spiral stairs each evening at dusk, lit the great lamp, wound the clockwork "
        "that turned the lens, and wrote the weather, the ships he saw and the hour in a leather book.")
PROMPTS = {
    "repeat": f"Repeat the following text exactly, word for word.\n\n{TEXT}",
    "question": "Explain in a few sentences why the sky is blue.",
}


def decode(engine, prompts: list[list[int]], tokens: int):
    """Every prompt in a slot of its own, admitted together and run to `tokens` tokens; (answers, decode tokens/s
    after every first token, the slots)."""
    slots = engine.init_slots(len(prompts))
    for i, ids in enumerate(prompts):
        slots.admit(i, ids, tokens, stop_ids=frozenset())
    out: dict[int, list[int]] = {}
    start = None
    while slots.active or slots.in_flight:
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        if start is None and len(out) == len(prompts):
            start = time.perf_counter()
            first = sum(len(v) for v in out.values())
    took = time.perf_counter() - start
    return [out[i] for i in range(len(prompts))], (sum(len(v) for v in out.values()) - first) / took, slots


def main(argv: list[str] | None = None) -> None:
    from strata.runtime.drafts import parse_spec
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--spec", default="ngram:4")
    p.add_argument("--slots", default="1,4,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-cells", type=int, default=1024)
    args = p.parse_args(argv)

    files = ModelFiles.open(args.model)
    tok = files.tokenizer
    plain = Engine(files, max_cells=args.max_cells)
    drafting = Engine(files, max_cells=args.max_cells, speculative=parse_spec(args.spec))
    print(f"{args.model} on cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"--spec {args.spec}, {args.tokens} tokens each, greedy")
    print(f"{'prompt':>9} {'slots':>5} {'tok/s without':>14} {'with':>8} {'ratio':>6} {'accepted / drafted':>19} "
          f"{'accepted per position':>22}")
    for name, text in PROMPTS.items():
        ids = tok.encode_chat([{"role": "user", "content": text}])
        for n in (int(x) for x in args.slots.split(",")):
            answers, base, _ = decode(plain, [ids] * n, args.tokens)
            drafted_answers, fast, slots = decode(drafting, [ids] * n, args.tokens)
            if drafted_answers != answers:
                raise SystemExit(f"{name}, {n} slots: the answers with drafts differ from those without")
            counts = slots.spec_counts
            rate = counts["accepted"] / max(counts["draft_tokens"], 1)
            per_pos = " ".join(f"{c / max(counts['drafts'], 1):.2f}" for c in slots.spec_accepted_per_pos)
            print(f"{name:>9} {n:>5} {base:>14.1f} {fast:>8.1f} {fast / base:>5.2f}x "
                  f"{counts['accepted']:>8} / {counts['draft_tokens']:<8} {rate:>4.0%} {per_pos:>22}")
    print("\nanswers with drafts equal those without: yes")


if __name__ == "__main__":
    main()
