"""Load time and decode speed of the embedded default (SmolLM2-135M GGUF) on the CPU, beside its anchors.

Anchors, measured in the same run: `transformers` loading the same GGUF file and decoding greedily with its
cache, the roofline of a decode step (measured copy bandwidth over the bytes of weights a step reads), and the same
engine with its decode rows' work between the products run layer by layer (`cpu_decode.attention` and `rms_norm`, a
call each) and on torch's ops (`strata.kernels.cpu_decode`): the three take turns, the best of `--rounds` kept.

    python bench/cpu_default.py [--tokens 64] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def bench_strata(prompt: str, tokens: int, rounds: int) -> dict:
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    start = time.perf_counter()
    engine = Engine(ModelFiles.open("default"))
    load = time.perf_counter() - start
    ids = engine.tokenizer.encode(prompt)
    engine.generate(ids, 4, stop_ids=frozenset())  # warm-up
    forward = engine.stages[0].forward
    stage, host = forward.host_stage, forward.host_decode
    paths = {"one call a stage": (stage, host), "one call a layer": (None, host), "torch's ops": (None, False)}
    if stage is None:  # (a stage the one call does not take, or no library: what runs is the first path)
        paths = {"as it runs": (stage, host)}
    rates = dict.fromkeys(paths, 0.0)
    for _ in range(rounds):
        for name, (forward.host_stage, forward.host_decode) in paths.items():
            rates[name] = max(rates[name], decode_rate(engine, ids, tokens))
    forward.host_stage, forward.host_decode = stage, host
    w = engine.weights
    weight_bytes = w.nbytes()
    if w.embed is not None and w.lm_head is not w.embed:  # a head of its own (oneDNN's copy, or packed): a step
        weight_bytes -= w.embed.numel() * w.embed.element_size()  # reads one row of the embedding table
    return {"load_s": load, "tok_s": next(iter(rates.values())), "paths": rates, "weight_bytes": weight_bytes,
            "ids": ids}


def decode_rate(engine, ids: list[int], tokens: int) -> float:
    """Greedy decode steps a second after reading `ids` in a fresh state."""
    state = engine.new_state()
    logits = engine.run(state, ids)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = engine.run(state, [int(logits[-1].argmax())])
    return tokens / (time.perf_counter() - start)


def bench_transformers(ids: list[int], tokens: int) -> dict:
    import transformers

    from strata.model.loader import default_model_path

    path = default_model_path()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False)
        decode = time.perf_counter() - start - prefill
    return {"load_s": load, "tok_s": tokens / decode}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each decode path (the best is kept)")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    bw = copy_bandwidth()
    ours = bench_strata(args.prompt, args.tokens, args.rounds)
    roofline = bw / ours["weight_bytes"]
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s; weights read per decode step: {ours['weight_bytes'] / 1e6:.0f} MB "
          f"-> roofline {roofline:.1f} tok/s")
    print(f"{'':14}{'load s':>9}{'decode tok/s':>14}")
    print(f"{'strata':14}{ours['load_s']:9.2f}{ours['tok_s']:14.1f}   ({ours['tok_s'] / roofline:.0%} of roofline)")
    for name, rate in list(ours["paths"].items())[1:]:
        print(f"  decode rows' work between the products {name}: {rate:.1f} tok/s "
              f"(one call a stage {ours['tok_s'] / rate:.2f}x)")
    if not args.skip_transformers:
        ref = bench_transformers(ours["ids"], args.tokens)
        print(f"{'transformers':14}{ref['load_s']:9.2f}{ref['tok_s']:14.1f}")
        print(f"strata / transformers: load {ref['load_s'] / ours['load_s']:.1f}x faster, "
              f"decode {ours['tok_s'] / ref['tok_s']:.1f}x faster")


if __name__ == "__main__":
    main()
