"""A/B of decode variants in one process: the tree as it is against settings swapped in at run time.

Each session's kernel changes were judged by short probe scripts that built one engine, swapped a setting (a tile
size, a warps rule, a kernel) and timed decode at a few row counts, alternating the variants so that the card's
drift spreads over all of them. This is that script, kept: one engine, the variants given on the command line,
`bench/decode.py`'s timer, the best of `--reps` runs and its ratio to the tree.

    python bench/ab.py --shape qwen3-30b-a3b --rows 1,8 \\
        --variant "norm8=strata.kernels.rmsnorm:add_norm_warps=lambda block, decode=False: 8" \\
        --variant "attn128=strata.kernels.attention:_decode_blocks=lambda d, g: (16, 128, 128)"

A variant is NAME=ASSIGNMENT[;ASSIGNMENT...], an assignment MODULE:ATTR=EXPR: ATTR may be dotted (a function's
`__defaults__`, a class's method), EXPR is evaluated in MODULE's namespace plus `replace` (dataclasses). A name
another module imported with `from ... import` is its own binding there: patch each module that calls it. Every
variant is captured afresh (a new pool per timing), and the tree's values are put back after each. `--checks`
runs `bench/decode.py`'s bitwise and batch == solo checks on every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclasses.dataclass(frozen=True)
class Assignment:
    module: str
    attr: str  # dotted from the module
    expr: str


def parse_variant(text: str) -> tuple[str, list[Assignment]]:
    """"NAME=MODULE:ATTR=EXPR;..." -> (NAME, assignments). Raises ValueError naming what is malformed."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"variant {text!r}: expected NAME=MODULE:ATTR=EXPR[;MODULE:ATTR=EXPR...]")
    out = []
    for part in rest.split(";"):
        target, sep, expr = part.partition("=")
        module, colon, attr = target.strip().partition(":")
        if not sep or not colon or not module or not attr or not expr.strip():
            raise ValueError(f"variant {name!r}: {part.strip()!r} is not MODULE:ATTR=EXPR")
        out.append(Assignment(module, attr, expr.strip()))
    return name.strip(), out


def _owner(assignment: Assignment):
    obj = importlib.import_module(assignment.module)
    *path, last = assignment.attr.split(".")
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, last):
        raise ValueError(f"{assignment.module}:{assignment.attr} does not exist")
    return obj, last


@contextmanager
def applied(assignments: list[Assignment]):
    """The assignments in force inside the block, the previous values back after it (in reverse order)."""
    saved = []
    try:
        for a in assignments:
            obj, last = _owner(a)
            namespace = dict(vars(importlib.import_module(a.module)), replace=dataclasses.replace)
            value = eval(a.expr, namespace)  # noqa: S307 - the user's own command line
            saved.append((obj, last, getattr(obj, last)))
            setattr(obj, last, value)
        yield
    finally:
        for obj, last, value in reversed(saved):
            setattr(obj, last, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "qwen3-next-80b-a3b"])
    p.add_argument("--layers", type=int, help="default: all (24 for qwen3-next-80b-a3b, which fits one H200 so)")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-cells", type=int, default=1024, help="K/V cells a conversation may hold (prompt + tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--checks", action="store_true")
    p.add_argument("--sampled", action="store_true", help="time sampled conversations (bench/decode.py's sampled "
                   "column: temperature 0.8, top-p 0.9, a seed each) instead of greedy ones")
    p.add_argument("--variant", action="append", default=[], help="NAME=MODULE:ATTR=EXPR[;...] (repeatable)")
    args = p.parse_args()
    variants = [("tree", [])] + [parse_variant(v) for v in args.variant]
    for _, assignments in variants:  # fail on a typo before the model is built
        for a in assignments:
            _owner(a)

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode import check_invariance_and_batch, hf_model, strata_engine, time_strata

    layers = args.layers or (24 if args.shape == "qwen3-next-80b-a3b" else None)
    engine = strata_engine(hf_model(args.shape, layers, "cuda"), "cuda", args.max_cells)
    print(f"{args.shape}, {engine.spec.num_layers} layers, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.checks:
        for name, assignments in variants:
            with applied(assignments):
                invariant, same = check_invariance_and_batch(engine, engine.spec.vocab_size)
            print(f"{name}: row logits bitwise alone / in 8 / in 64: {'yes' if invariant else 'NO'}; "
                  f"greedy 8 x 150 batch == solo: {'yes' if same else 'NO'}", flush=True)
    for rows in [int(r) for r in args.rows.split(",")]:
        runs = {name: [] for name, _ in variants}
        for _ in range(args.reps):  # alternated, so the card's drift spreads over every variant
            for name, assignments in variants:
                with applied(assignments):
                    runs[name].append(time_strata(engine, rows, args.tokens, args.prompt_len, sampled=args.sampled))
        base = max(runs["tree"])
        for name, tps in runs.items():
            print(f"rows {rows:>3}  {name:<24} best {max(tps):9.1f} tok/s  {max(tps) / base - 1:+6.1%}  "
                  f"runs {', '.join(f'{t:.1f}' for t in tps)}", flush=True)


if __name__ == "__main__":
    main()
