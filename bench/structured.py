"""Structured output in the engine's windows: what constrained rows cost against unconstrained ones, in one run.

For n slots decoding together (n = 1 and 64 by default), the same engine runs n unconstrained answers, then n
answers each constrained by a JSON schema (an object with an array of free strings, so answers run to
`--tokens`), and prints the decode time per window (after every slot's first token) and the ratio. A constrained
window costs the masks (filled on the host by llguidance, applied to a copy of the logits) and, on a GPU, the
window that no longer runs ahead of the host (a constrained slot's mask needs its last token read: `--lookahead`
acts as 0 for its group), which is why both are printed: with lookahead (the engine's default) and without it.

    python bench/structured.py                                   # the embedded default on the CPU, 1 and 8 slots
    python bench/structured.py --shape qwen3-30b-a3b --layers 24 --device cuda --slots 1,64 \\
        --tokenizer ~/.cache/strata-bench/bpe-151643.json       # random weights at a real shape, a 150K tokenizer
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def build(args):
    """(engine, tokenizer, prompt ids)."""
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    if args.shape is None:
        files = ModelFiles.open(args.model)
        engine = Engine(files, device=args.device, max_cells=1024)
        tok = files.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": "List notes about the sea as JSON."}])
        return engine, tok, ids
    from shapes import shape

    from strata.grammar import GrammarVocab, Grammars
    from strata.model.random_weights import random_stage_weights
    from strata.model.tokenizer import Tokenizer

    spec = shape(args.shape, args.layers)
    engine = Engine(None, device=args.device, dtype=torch.bfloat16, max_cells=1024, spec=spec,
                    weights=lambda layers, dev, trim: random_stage_weights(spec, layers, dev, torch.bfloat16))
    from tokenizers import Tokenizer as HFTokenizer

    tok = Tokenizer(HFTokenizer.from_file(str(Path(args.tokenizer).expanduser())))
    engine._grammars = Grammars(GrammarVocab.build(tok, width=spec.vocab_size))  # the checkpoint has no tokenizer
    ids = torch.randint(0, min(tok.vocab_size, spec.vocab_size), (64,), generator=torch.Generator().manual_seed(0))
    return engine, tok, ids.tolist()


HOST = {"fill": 0.0, "apply": 0.0, "masked": 0.0, "read": 0.0, "accept": 0.0}  # host seconds in the masks' fill and application (`--split`)


def instrument() -> None:
    """Time the host's share of the masks: the fill (llguidance) and the application (launches on a GPU)."""
    import strata.runtime.slots as slots_module

    for name, key in (("fill_bitmask", "fill"), ("apply_bitmask", "apply")):
        fn = getattr(slots_module, name)

        def timed_fn(*a, _fn=fn, _key=key, **kw):
            t = time.perf_counter()
            out = _fn(*a, **kw)
            HOST[_key] += time.perf_counter() - t
            return out

        setattr(slots_module, name, timed_fn)
    for name, key in (("_masked", "masked"), ("_read", "read")):
        fn = getattr(slots_module.Slots, name)

        def timed_method(self, *a, _fn=fn, _key=key, **kw):
            t = time.perf_counter()
            out = _fn(self, *a, **kw)
            HOST[_key] += time.perf_counter() - t
            return out

        setattr(slots_module.Slots, name, timed_method)
    accept = slots_module.GrammarMatcher.accept

    def timed_accept(self, token, _fn=accept):
        t = time.perf_counter()
        out = _fn(self, token)
        HOST["accept"] += time.perf_counter() - t
        return out

    slots_module.GrammarMatcher.accept = timed_accept


def timed(engine, ids: list[int], n: int, tokens: int, constrained: bool, lookahead: int | None) -> tuple[float, int]:
    """ms per decode window after every slot's first token, and the windows timed. A constrained run checks
    that every answer is one the grammar accepts (the masks worked)."""
    from strata.grammar import Constraint, GrammarMatcher

    grammar = Constraint.json_schema(SCHEMA) if constrained else None
    slots = engine.init_slots(n, lookahead=lookahead)
    for i in range(n):
        slots.admit(i, ids, tokens, stop_ids=frozenset(), grammar=grammar)
    seen, start, windows = set(), None, 0
    answers: dict[int, list[int]] = {i: [] for i in range(n)}
    while slots.active or slots.in_flight:
        events = slots.step()
        for e in events:
            answers[e.slot].append(e.token)
        if start is not None:
            windows += 1
        if start is None and len(seen | {e.slot for e in events}) == n:
            HOST.update(fill=0.0, apply=0.0, masked=0.0, read=0.0, accept=0.0)
        seen.update(e.slot for e in events)
        if start is None and len(seen) == n:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    took = (time.perf_counter() - start) * 1e3 / max(windows, 1)
    if constrained:
        for i, tokens_i in answers.items():
            matcher = GrammarMatcher(engine.grammars.compile(grammar))
            if not all(matcher.accept(t) for t in tokens_i):
                raise SystemExit(f"slot {i}: its constrained answer left the grammar ({matcher.error})")
    return took, windows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--shape", help="random weights at this shape (bench/shapes.py) instead of --model")
    p.add_argument("--layers", type=int)
    p.add_argument("--tokenizer", help="with --shape: a tokenizer.json for the grammar")
    p.add_argument("--device", default="cpu")
    p.add_argument("--slots", default="1,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=3, help="runs of each kind, alternated; the medians are printed")
    args = p.parse_args(argv)
    engine, tok, ids = build(args)
    where = torch.cuda.get_device_name(0) if engine.device.type == "cuda" else (
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"{args.shape or args.model} on {where}; tokenizer {tok.vocab_size} tokens, logits "
          f"{engine.spec.vocab_size} wide; {args.tokens} tokens an answer; schema {SCHEMA}")
    lookaheads = sorted({engine.lookahead, 0}, reverse=True)
    instrument()
    print(f"{'slots':>5} {'lookahead':>9} {'unconstrained ms/window':>24} {'constrained':>12} {'ratio':>6} "
          f"{'host ms/window: mask fill':>26} {'apply':>6} {'all masking':>11} {'accept':>6} {'read (waits)':>12}")
    timed(engine, ids, 1, 4, True, None)  # compile the schema, warm every path
    for n in (int(x) for x in args.slots.split(",")):
        for la in lookaheads:
            runs = []
            for _ in range(args.repeat):  # alternated, the median of each kept (the host's share: the last run's)
                runs.append((timed(engine, ids, n, args.tokens, False, la)[0],
                             *timed(engine, ids, n, args.tokens, True, la)))
            plain = sorted(r[0] for r in runs)[len(runs) // 2]
            constrained = sorted(r[1] for r in runs)[len(runs) // 2]
            windows = runs[-1][2]
            fill, apply, masked, accepted, read = (HOST[k] * 1e3 / max(windows, 1)
                                                   for k in ("fill", "apply", "masked", "accept", "read"))
            print(f"{n:>5} {la:>9} {plain:>24.2f} {constrained:>12.2f} {constrained / plain:>5.2f}x "
                  f"{fill:>26.2f} {apply:>6.2f} {masked:>11.2f} {accepted:>6.2f} {read:>12.2f}")
    print("constrained answers checked: each is accepted by its grammar")


if __name__ == "__main__":
    main()
