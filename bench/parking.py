"""Parking on a GPU: what a parked conversation's follow-up costs against reading its history again, in one run.

Random weights at a real shape (`--shape`, `--layers`), the engine in-process, two slots. For each context length:
conversation A (random tokens) is read and answers one token (the time of that fresh read is the anchor); B takes
A's slot, so A is parked (host time of the park, bytes); then A's follow-up (A + `--new` tokens) comes back to that
slot: the restore (from host RAM into the slot, the checks included, timed to the device's end), the follow-up's
time to first token, and the same prompt read from nothing in the other slot. With GDN layers and
`--checkpoint-every`, also a follow-up whose history was rewritten 100 tokens before its end (as a chat template
that drops an earlier answer's thinking does): the tokens it reads.

    python bench/parking.py --shape qwen3-30b-a3b --contexts 4096,9216
    python bench/parking.py --shape qwen3-next-80b-a3b --layers 24 --contexts 4096,9216 --checkpoint-every 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TIMES: dict[str, float] = {}


def instrument() -> None:
    """Time each restore to the device's end (`Snapshot.restore`, its checks included)."""
    from strata.state import parking

    restore = parking.Snapshot.restore

    def timed(self, *a, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = restore(self, *a, **kw)
        torch.cuda.synchronize()
        TIMES["restore"] = time.perf_counter() - t
        return out

    parking.Snapshot.restore = timed


def first_token(slots, index: int, ids: list[int]) -> tuple[float, int]:
    """Admit `ids` into slot `index` for one token; (seconds to its token, prompt tokens reused)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    reused = slots.admit(index, ids, 1, stop_ids=frozenset())
    while slots.active or slots.in_flight:
        slots.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t, reused


def main(argv: list[str] | None = None) -> None:
    from shapes import shape

    from strata.model.random_weights import random_stage_weights
    from strata.runtime.generate import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--contexts", default="4096,9216")
    p.add_argument("--new", type=int, default=16, help="tokens the follow-up adds")
    p.add_argument("--park-gb", type=float, default=8.0)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--repeat", type=int, default=2, help="rounds over the contexts; the first compiles and captures "
                   "what a follow-up at that length needs, so only the last is printed")
    args = p.parse_args(argv)
    spec = shape(args.shape, args.layers)
    contexts = [int(x) for x in args.contexts.split(",")]
    device = torch.device("cuda")
    engine = Engine(None, device=device, dtype=torch.bfloat16, max_cells=max(contexts) + 256, spec=spec,
                    park_gb=args.park_gb, checkpoint_every=args.checkpoint_every,
                    weights=lambda layers, dev, trim: random_stage_weights(spec, layers, dev, torch.bfloat16))
    instrument()
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    slots = engine.init_slots(2)
    show = args.repeat < 2
    first_token(slots, 0, rand(600))  # compiles, captures, allocates the ring
    first_token(slots, 1, rand(600))
    print(f"{args.shape} ({spec.num_layers} layers: {len(spec.attention_layers())} attention, "
          f"{len(spec.gdn_layers())} GDN), random weights, {torch.cuda.get_device_name(device)}; follow-ups add "
          f"{args.new} tokens; --checkpoint-every {args.checkpoint_every}")
    print(f"{'context':>7} {'parked MB':>9} {'park ms':>8} {'restore ms':>10} {'GB/s':>5} {'follow-up TTFT ms':>17} "
          f"{'re-read TTFT ms':>15} {'ratio':>6} {'reused':>7}")
    for n in [n for _ in range(args.repeat - 1) for n in contexts] + [None] + contexts:
        if n is None:
            show = True
            continue
        a, b = rand(n), rand(8)
        read_s, _ = first_token(slots, 0, a)
        torch.cuda.synchronize()
        t = time.perf_counter()
        slots.admit(0, b, 1, stop_ids=frozenset())  # A is parked (its copies run on the device's stream)
        park_s = time.perf_counter() - t
        while slots.active or slots.in_flight:
            slots.step()
        parked = max((s for s in engine.parking._snapshots.values() if s.tokens[:n] == a), key=lambda s: s.length)
        follow = a + rand(args.new)  # (its answer's token stood in for by any: the same reuse)
        TIMES.clear()
        ttft_s, reused = first_token(slots, 0, follow)
        for slot in slots.slots:  # nothing held or parked: the same prompt read from nothing
            slot.state.reset()
        engine.parking.clear()
        fresh_s, fresh_reused = first_token(slots, 1, follow)
        assert fresh_reused == 0, "the fresh read found something to reuse"
        restore = TIMES.get("restore", float("nan"))
        if show:
            print(f"{n:>7} {parked.nbytes / 1e6:>9.1f} {park_s * 1e3:>8.2f} {restore * 1e3:>10.2f} "
                  f"{parked.nbytes / restore / 1e9:>5.1f} {ttft_s * 1e3:>17.2f} {fresh_s * 1e3:>15.2f} "
                  f"{fresh_s / ttft_s:>5.1f}x {reused:>7}")
        if show and args.checkpoint_every is not None and spec.gdn_layers():
            rewritten = follow[: n - 100] + rand(100 + args.new)  # slot 1 holds `follow`, with its checkpoints
            _, reused = first_token(slots, 0, rewritten)
            print(f"{'':>7} rewritten 100 tokens before the end: reused {reused}, read {len(rewritten) - reused} "
                  f"of {len(rewritten)}")
        for slot in slots.slots:
            slot.state.reset()
        engine.parking.clear()
        _ = read_s


if __name__ == "__main__":
    main()
