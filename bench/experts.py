"""Experts beyond VRAM: decode speed with part of each MoE layer's experts in host RAM, against its roofline.

Random weights at a real shape (`--shape`, `--layers`; the same layers for every row), the engine in-process on
one GPU. For each share of the routed experts kept on the GPU (`--resident`, through `expert_budget_gb`) and each
count of decoding conversations (`--rows`): tokens per second, and the roofline computed in the same run:

    a window's floor = the all-resident window's time (measured here)
                     + the bytes of the distinct host experts the window's rows route to / the host's read bandwidth

where the host's read bandwidth is measured here too (a streaming read of a 1 GiB buffer by torch's threads; the
best of a float32 sum and an int32 max) and the bytes come from the pools' own counts (`ExpertPool.experts_read`).
Also printed: the CPU pool's host time per window, the host's wait for each layer's rows to arrive from the GPU,
and the rate the pool read the weights at (bytes / its time), and the
PCIe upload rate (pinned, 256 MB). With `--pcie-frac F1,F2,...` each partly resident row is run at each share of the
host experts uploaded for the GPU to compute (`strata.experts.pool`), and the roofline's second term becomes the
longer of the CPU's bytes at the host's read rate and the uploaded bytes at the PCIe rate.

    python bench/experts.py --shape qwen3-30b-a3b --layers 8 --resident 1,0.5,0.25,0.1 --rows 1,8
    python bench/experts.py --layers 8 --resident 0.5,0.25 --rows 8 --skew 2 --settle 256 --expert-residency hot
    python bench/experts.py --layers 8 --resident 1,0.5,0.25 --rows 1,8 --weights q4_k
    python bench/experts.py --layers 8 --resident 1,0.5,0.25 --rows 1,8 --pcie-frac 0,0.3,0.5

`--weights q4_k` quantizes the random weights as they load (`strata.quant.online`): the GPU keeps them packed and
the CPU pool reads its experts 4-bit (`strata.experts.pool.Int4Expert`); the roofline counts those bytes.

The last column is the share of the pooled layers' (row, expert) pairs computed on the GPU (the resident set's hit
rate): with `--skew` (a few hot experts, as trained routers have) compare `--expert-residency fixed` and `hot`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def host_read_gbps(threads: int) -> dict[str, float]:
    """GB/s of streaming reads of a 1 GiB buffer by `threads` torch threads (touched first: no page faults)."""
    torch.set_num_threads(threads)
    buf = torch.ones(256 * 2**20, dtype=torch.float32)
    out = {}
    for name, fn in (("float32 sum", lambda: buf.sum()), ("int32 max", lambda: buf.view(torch.int32).max())):
        fn()
        best = min(_timed(fn) for _ in range(5))
        out[name] = buf.nbytes / best / 1e9
    return out


def pcie_gbps(device: torch.device) -> float:
    host = torch.ones(256 * 2**20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    dev.copy_(host)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return host.nbytes / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(engine, rows: int, tokens: int, prompt_len: int, settle: int = 0) -> dict[str, float]:
    """Decode `tokens` tokens for `rows` conversations (prompts read, and `settle` windows run with hot residency's
    refreshes, before the clock starts): tok/s, and per window the CPU pools' host seconds and the bytes of the
    experts they read, and the share of the pooled layers' pairs computed on the device."""
    from strata.experts import native
    from strata.experts.hotness import REFRESH_WINDOWS

    pools = [p for stage in engine.stages for p in stage.forward.pools.values()]
    windows = [0]
    slots = engine.init_slots(rows)
    vocab = engine.spec.vocab_size
    for i in range(rows):
        slots.admit_now(i, [(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)], tokens + settle + 8,
                        stop_ids=frozenset())
    for k in range(3 + settle):
        slots.step()
        if (k + 1) % REFRESH_WINDOWS == 0:
            engine.refresh_experts()  # as the scheduler does (a fixed engine: nothing)
    sync(engine.device)
    before = [(p.busy_s, p.experts_read) for p in pools]
    phases = sum((p.phase_s.clone() for p in pools), torch.zeros(len(native.PHASES), dtype=torch.float64))
    uploads = [p.experts_uploaded for p in pools]
    pairs = [(p.pairs_here, p.pairs_total) for p in pools]
    waited = sum(p.wait_s for p in pools)
    start = time.perf_counter()
    produced = 0
    while produced < rows * tokens:
        produced += len(slots.step())
        windows[0] += 1
    sync(engine.device)
    elapsed = time.perf_counter() - start
    slots.flush()
    busy = sum(p.busy_s - b for p, (b, _) in zip(pools, before))
    read = sum((p.experts_read - n) * p.expert_bytes for p, (_, n) in zip(pools, before))
    up = sum((p.experts_uploaded - n) * p.upload_expert_bytes for p, n in zip(pools, uploads))
    here = sum(p.pairs_here - a for p, (a, _) in zip(pools, pairs))
    total = sum(p.pairs_total - b for p, (_, b) in zip(pools, pairs))
    phases = sum((p.phase_s for p in pools), torch.zeros_like(phases)) - phases
    return {"tps": produced / elapsed, "window_s": elapsed / windows[0], "pool_s": busy / windows[0],
            "phases_s": (phases / windows[0]).tolist(),
            "hit": 1 - here / total if total else 1.0,
            "pool_bytes": read / windows[0], "upload_bytes": up / windows[0], "wait_s": (sum(p.wait_s for p in pools) - waited) / windows[0]}


def skewed(weights, spec, factor: float):
    """Random weights whose routers pick an eighth of the experts (the highest ids) more often: those experts'
    router rows scaled by `factor` (a wider spread of their logits puts them in the top-k more often), as trained
    routers have hot experts. 1: unchanged."""
    if factor != 1.0:
        e = spec.moe.num_experts
        for w in weights.layers.values():
            if "router" in w:
                w["router"][e - e // 8 :] *= factor
    return weights


def quantized(weights, fmt: str):
    """`weights` with every projection, expert stack and the head quantized in `fmt` and kept packed."""
    from strata.quant.online import quantize_weight
    from strata.quant.packed import FORMATS

    if fmt == "bf16":
        return weights
    group, superblock, _ = FORMATS[fmt]
    fits = lambda t: isinstance(t, torch.Tensor) and t.dim() in (2, 3) and t.shape[-1] % max(group, superblock) == 0  # noqa: E731
    keys = ("qkv", "o", "gate_up", "down", "in_proj", "out", "experts_gate_up", "experts_down", "shared_gate_up",
            "shared_down")
    for layer in weights.layers.values():
        for key in keys:
            if key in layer and fits(layer[key]):
                layer[key] = quantize_weight(layer[key], fmt, layer[key].dtype)
    if fits(weights.lm_head) and weights.lm_head is not weights.embed:
        weights.lm_head = quantize_weight(weights.lm_head, fmt, weights.lm_head.dtype)
    return weights


def decode_tokens(engine, rows: int, tokens: int, prompt_len: int, together: bool = True) -> list[list[int]]:
    """Greedy tokens of `rows` conversations decoding together, and of the first one alone (its list last, its
    prompt read alone)."""
    vocab = engine.spec.vocab_size
    prompts = [[(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len + i)] for i in range(rows)]
    slots = engine.init_slots(rows)
    got: list[list[int]] = [[] for _ in range(rows)]
    for i in range(rows):
        if together:  # the prompts read in shared windows
            slots.admit(i, prompts[i], tokens, stop_ids=frozenset())
        else:  # each prompt read alone, then the decode rows together
            got[i].append(slots.admit_now(i, prompts[i], tokens, stop_ids=frozenset()).token)
    for e in _run(slots):
        got[e.slot].append(e.token)
    alone = engine.init_slots(1)  # a fresh slot: nothing of the runs before is reused (parking is off here)
    first = alone.admit_now(0, prompts[0], tokens, stop_ids=frozenset()).token
    solo = [first] + [e.token for e in _run(alone)]
    return got + [solo]


def _run(slots):
    while slots.active or slots.in_flight:
        yield from slots.step()


def check(make_engine, rows: int, tokens: int, prompt_len: int) -> bool:
    """Greedy outputs with the stage's windows eager and replayed from segment graphs (`GraphedPooledDecode`):
    batched == solo within each (the prompts read in shared windows, and each alone), and token for token the
    same across the two."""
    from strata.runtime import fast_decode

    runs = {}
    for graphs in (False, True):
        fast_decode.POOL_GRAPHS = graphs
        engine = make_engine()
        for together in (True, False):
            runs[graphs, together] = decode_tokens(engine, rows, tokens, prompt_len, together)
        del engine
        torch.cuda.empty_cache()
    ok = True
    for (graphs, together), got in runs.items():
        solo_ok = got[0] == got[-1]
        ok &= solo_ok or together  # prompts read beside others may round otherwise (docs/BATCHING.md): not held
        where = "" if solo_ok else f" (from token {next(i for i, (a, b) in enumerate(zip(got[0], got[-1])) if a != b)})"
        print(f"check: {'segment graphs' if graphs else 'eager'}, prompts read {'together' if together else 'alone'}: "
              f"first conversation batched == solo: {solo_ok}{where}")
    same = runs[False, True] == runs[True, True] and runs[False, False] == runs[True, False]
    print(f"check: eager == segment graphs, {rows} conversations x {tokens} tokens: {same}")
    return ok and same


def main(argv: list[str] | None = None) -> None:
    from shapes import shape

    from strata.experts import native
    from strata.experts.residency import expert_bytes
    from strata.model.random_weights import random_stage_weights
    from strata.runtime.generate import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--resident", default="1,0.5,0.25,0.1", help="shares of each layer's routed experts on the GPU")
    p.add_argument("--rows", default="1,8", help="decoding conversations")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--eager", action="store_true", help="run pooled decode windows eagerly, not from segment graphs "
                   "(STRATA_POOL_GRAPHS=0; the default replays them: `GraphedPooledDecode`)")
    p.add_argument("--expert-residency", default="fixed", choices=("fixed", "hot"))
    p.add_argument("--skew", type=float, default=1.0, help="make an eighth of each layer's experts (the highest ids, "
                   "in host RAM under the fixed choice) hot: their router rows scaled by this (>1: routed more often)")
    p.add_argument("--settle", type=int, default=0, help="windows run before the clock starts (hot residency's "
                   "refreshes happen every 64)")
    p.add_argument("--weights", default="bf16", choices=("bf16", "q4_k", "q8_0", "q6_k", "q5_k", "iq3_s", "fp8"),
                   help="quantize the weights so and keep them packed (the pool reads q4_k experts 4-bit)")
    p.add_argument("--pcie-frac", default="0", help="shares of the host experts uploaded for the GPU to compute, "
                   "e.g. 0,0.3,0.5 (each partly resident row is run at each)")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a check of the script, not a figure)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--prompt-read", type=int, default=0, help="also time one prompt of this many tokens read")
    p.add_argument("--check", action="store_true", help="first check greedy outputs at each resident share: eager "
                   "== segment graphs, batched == solo (exit 1 if not)")
    args = p.parse_args(argv)
    if args.eager:
        from strata.runtime import fast_decode

        fast_decode.POOL_GRAPHS = False
    spec = shape(args.shape, args.layers)
    device = torch.device(args.device)
    threads = args.cpu_threads or torch.get_num_threads()
    reads = host_read_gbps(threads)
    host_bw = max(reads.values())
    moe_layers = sum(1 for layer in spec.layers if layer.mlp == "moe")
    all_experts_gb = moe_layers * spec.moe.num_experts * expert_bytes(spec, 2) / 1e9
    print(f"{args.shape}, {args.layers} layers ({moe_layers} MoE, {spec.moe.num_experts} experts of "
          f"{expert_bytes(spec, 2) / 1e6:.1f} MB in bf16, top-{spec.moe.top_k}), random weights, {args.weights}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; {threads} CPU threads")
    link_bw = pcie_gbps(device) if device.type == "cuda" else float("inf")
    pcie = f"; PCIe upload {link_bw:.1f} GB/s" if device.type == "cuda" else ""
    print("host read: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in reads.items()) + pcie)
    print(f"{'resident':>8} {'pcie':>4} {'rows':>4} {'tok/s':>8} {'roofline':>8} {'of it':>6} {'window ms':>9} "
          f"{'pool ms':>8} {'wait ms':>8} {'pool MB':>8} {'pool GB/s':>9} {'up MB':>6} {'on device':>9}")
    fracs = [float(x) for x in args.pcie_frac.split(",")]

    def make_engine(share: float, frac: float = 0.0) -> Engine:
        budget = [share * all_experts_gb] if share < 1 else None
        return Engine(None, device=device, dtype=torch.bfloat16, max_cells=max(args.prompt_len + args.tokens + args.settle, args.prompt_read) + 96,
                      spec=spec, expert_budget_gb=budget, cpu_threads=args.cpu_threads, park_gb=0,
                      expert_residency=args.expert_residency, pcie_frac=frac if budget else 0.0,
                      weights=lambda layers, dev, trim: quantized(skewed(
                          random_stage_weights(spec, layers, dev, torch.bfloat16), spec, args.skew), args.weights))

    if args.check:
        from strata.runtime import fast_decode

        graphs = fast_decode.POOL_GRAPHS
        good = all([check(lambda: make_engine(share, frac), 8, args.tokens, args.prompt_len)
                    for share in (float(x) for x in args.resident.split(",")) for frac in fracs])
        fast_decode.POOL_GRAPHS = graphs
        if not good:
            sys.exit(1)
    full: dict[int, float] = {}
    runs = [(share, frac) for share in (float(x) for x in args.resident.split(","))
            for frac in (fracs if share < 1 else [0.0])]
    for share, frac in runs:
        engine = make_engine(share, frac)
        if args.prompt_read:
            prompt = [(11 + 13 * j) % spec.vocab_size for j in range(args.prompt_read)]
            times = []
            for k in range(3):
                sync(device)
                start = time.perf_counter()
                engine.generate([k + 1] + prompt, 1, stop_ids=frozenset())  # another first token: nothing reused
                sync(device)
                times.append(time.perf_counter() - start)
            print(f"{share:>8.0%} prompt of {args.prompt_read} tokens read in {min(times) * 1e3:.1f} ms "
                  f"({args.prompt_read / min(times):.0f} tok/s)", flush=True)
        for rows in (int(x) for x in args.rows.split(",")):
            m = measure(engine, rows, args.tokens, args.prompt_len, args.settle)
            if share >= 1:
                full[rows] = m["window_s"]
            # the CPU's bytes and the uploads run at once: the longer of the two
            floor = full.get(rows, float("nan")) + max(m["pool_bytes"] / (host_bw * 1e9),
                                                        m["upload_bytes"] / (link_bw * 1e9))
            roof = rows / floor
            pool_rate = m["pool_bytes"] / m["pool_s"] / 1e9 if m["pool_s"] else float("nan")
            print(f"{share:>8.0%} {frac:>4.2g} {rows:>4} {m['tps']:>8.1f} {roof:>8.1f} {m['tps'] / roof:>6.0%} "
                  f"{m['window_s'] * 1e3:>9.2f} {m['pool_s'] * 1e3:>8.2f} {m['wait_s'] * 1e3:>8.2f} {m['pool_bytes'] / 1e6:>8.1f} "
                  f"{pool_rate:>9.1f} {m['upload_bytes'] / 1e6:>6.1f} {m['hit']:>9.1%}", flush=True)
            if any(m["phases_s"]):
  # the pool's own kernel: where its time went, per window over all layers
                print(f"{'':>19}pool kernel ms a window: " + ", ".join(
                    f"{name} {t * 1e3:.2f}" for name, t in zip(native.PHASES, m["phases_s"])), flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
