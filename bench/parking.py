"""Parking on a GPU: what a parked conversation's follow-up costs against reading its history again, in one run.

Random weights at a real shape (`--shape`, `--layers`), the engine in-process, two slots. For each context length:
conversation A (random tokens) is read and answers one token (the time of that fresh read is the anchor); B takes
A's slot, so A is parked (host time of the park, bytes); then A's follow-up (A + `--new` tokens) comes back to that
slot: the restore (from host RAM into the slot, the checks included, timed to the device's end), the follow-up's
time to first token; then another prompt takes the slot again, so the restored conversation is parked a second
time (re-park: host time, and the bytes it did not copy again because its first image still holds them); and the
same prompt read from nothing in the other slot. The medians of the rounds after the first (which compiles and
captures what a follow-up at that length needs). With GDN layers and `--checkpoint-every`, also a follow-up whose history was rewritten 100 tokens before its end (as a chat template
that drops an earlier answer's thinking does): the tokens it reads.

    python bench/parking.py --shape qwen3-30b-a3b --contexts 4096,9216 --park-vram-gb 0,4
    python bench/parking.py --shape qwen3-next-80b-a3b --layers 24 --contexts 4096,9216 --checkpoint-every 1024
"""

from __future__ import annotations

import argparse
import statistics
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
    from strata.state.park_vram import VramTier

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int)
    p.add_argument("--contexts", default="4096,9216")
    p.add_argument("--new", type=int, default=16, help="tokens the follow-up adds")
    p.add_argument("--park-gb", type=float, default=8.0)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--park-vram-gb", default="0",
                   help="comma-separated: each a run of the rounds with copies in this many GB of VRAM "
                   "(--park-vram-gb; 0: host RAM only), so the tiers compare in one run")
    p.add_argument("--repeat", type=int, default=4, help="rounds over the contexts; the first compiles and captures "
                   "what a follow-up at that length needs, so the medians of the others are printed")
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
    first_token(slots, 0, rand(600))  # compiles, captures, allocates the ring
    first_token(slots, 1, rand(600))
    print(f"{args.shape} ({spec.num_layers} layers: {len(spec.attention_layers())} attention, "
          f"{len(spec.gdn_layers())} GDN), random weights, {torch.cuda.get_device_name(device)}; follow-ups add "
          f"{args.new} tokens; --checkpoint-every {args.checkpoint_every}; medians of {max(1, args.repeat - 1)} rounds")
    print(f"{'VRAM GB':>7} {'tier':>4} {'context':>7} {'parked MB':>9} {'park ms':>8} {'restore ms':>10} {'GB/s':>5} "
          f"{'follow-up TTFT ms':>17} {'re-read TTFT ms':>15} {'ratio':>6} {'reused':>7} {'re-park ms':>10} "
          f"{'re-park reused MB':>17}")
    for vram_gb in (float(x) for x in args.park_vram_gb.split(",")):
        engine.parking.vram = VramTier(int(vram_gb * 1e9)) if vram_gb else None
        if engine.parking.vram is not None:
            engine.parking.vram.reserve([device])
        rows: dict[int, list[dict]] = {n: [] for n in contexts}
        for r in range(args.repeat):
            for n in contexts:
                row = one_round(engine, slots, n, args.new, rand)
                if r > 0 or args.repeat < 2:
                    rows[n].append(row)
        for n in contexts:
            m = {k: statistics.median(row[k] for row in rows[n]) for k in rows[n][0] if k != "tier"}
            tier = "/".join(sorted({row["tier"] for row in rows[n]}))
            print(f"{vram_gb:>7g} {tier:>4} {n:>7} {m['parked'] / 1e6:>9.1f} {m['park'] * 1e3:>8.2f} "
                  f"{m['restore'] * 1e3:>10.2f} {m['parked'] / m['restore'] / 1e9:>5.1f} {m['ttft'] * 1e3:>17.2f} "
                  f"{m['fresh'] * 1e3:>15.2f} {m['fresh'] / m['ttft']:>5.1f}x {m['reused']:>7.0f} "
                  f"{m['repark'] * 1e3:>10.2f} {m['repark_reused'] / 1e6:>17.1f}", flush=True)
        engine.parking.vram = None
        torch.cuda.empty_cache()
    if args.checkpoint_every is not None and spec.gdn_layers():
        for n in contexts:
            follow = rand(n + args.new)
            first_token(slots, 1, follow)  # slot 1 holds `follow`, with its checkpoints
            rewritten = follow[: n - 100] + rand(100 + args.new)
            _, reused = first_token(slots, 0, rewritten)
            print(f"{n:>7} rewritten 100 tokens before the end: reused {reused}, read {len(rewritten) - reused} "
                  f"of {len(rewritten)}")
            for slot in slots.slots:
                slot.state.reset()
            engine.parking.clear()


def one_round(engine, slots, n: int, new: int, rand) -> dict:
    """One conversation of `n` tokens: read, parked, its follow-up restored, parked again; the same follow-up read
    from nothing. The times in seconds, the sizes in bytes."""
    a, b = rand(n), rand(8)
    first_token(slots, 0, a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    slots.admit(0, b, 1, stop_ids=frozenset())  # A is parked (its copies run on the device's stream)
    park_s = time.perf_counter() - t
    while slots.active or slots.in_flight:
        slots.step()
    parked = max((s for s in engine.parking._snapshots.values() if s.tokens[:n] == a), key=lambda s: s.length)
    follow = a + rand(new)  # (its answer's token stood in for by any: the same reuse)
    TIMES.clear()
    ttft_s, reused = first_token(slots, 0, follow)
    tier = engine.parking.restores[-1][2] if engine.parking.restores else "-"
    before = engine.parking.reused_bytes
    torch.cuda.synchronize()
    t = time.perf_counter()
    slots.admit(0, rand(8), 1, stop_ids=frozenset())  # the follow-up is parked again: only its new cells copied
    repark_s = time.perf_counter() - t
    while slots.active or slots.in_flight:
        slots.step()
    repark_reused = engine.parking.reused_bytes - before
    for slot in slots.slots:  # nothing held or parked: the same prompt read from nothing
        slot.state.reset()
    engine.parking.clear()
    fresh_s, fresh_reused = first_token(slots, 1, follow)
    assert fresh_reused == 0, "the fresh read found something to reuse"
    for slot in slots.slots:
        slot.state.reset()
    engine.parking.clear()
    return {"parked": parked.nbytes, "park": park_s, "restore": TIMES.get("restore", float("nan")), "ttft": ttft_s,
            "fresh": fresh_s, "reused": reused, "repark": repark_s, "repark_reused": repark_reused, "tier": tier}


if __name__ == "__main__":
    main()
