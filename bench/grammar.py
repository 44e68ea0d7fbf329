"""Grammar masks: xgrammar against llguidance at the embedded default's vocabulary (SmolLM2, 49,152 tokens) and at
a 150K one, the figures Strata's structured output chose its library by (issue 27).

For each library and vocabulary it times:
- the tokenizer info (built once per tokenizer);
- compiling a tool-call-like JSON schema (nested objects, enums, arrays of objects, a nullable number), with the
  library's cache off, and the first mask after it (llguidance builds its lexer lazily, so compile + first mask is
  the figure to compare);
- walking valid answers token by token: fill the next-token bitmask, then accept the token (each token is checked
  to be allowed by the mask first), for 1 sequence and for 64 (each its own answer, the 64 masks filled by the
  library's batch call into one [64, ceil(V/32)] int32 bitmask, the tokens accepted by its batch call).

The 150K vocabulary: `--vocab-150k PATH` takes a tokenizer.json (Qwen's, say); without it the script trains a
byte-level BPE of 151,643 tokens (Qwen2's size, Qwen2's pre-tokenizer split) on this Python's own library sources
(about 300 MB of text, about 2.5 minutes on 2 cores) once and keeps it in ~/.cache/strata-bench/. Its logits width
is taken as 152,064 (Qwen2.5's padded head), so the padded columns are in the bitmask too.

    python bench/grammar.py                           # both libraries, both vocabularies, 1 and 64 rows
    python bench/grammar.py --libs llguidance --rows 1,8,64 --vocab-150k /models/Qwen3-8B/tokenizer.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

CACHE = Path.home() / ".cache" / "strata-bench"
BPE_150K = 151_643
LOGITS_150K = 152_064
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "plan_trip", "search_flights"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "minLength": 1},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include": {"type": "array", "items": {"type": "string", "enum": ["humidity", "wind", "uv", "rain"]}},
                "stops": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "nights": {"type": "integer", "minimum": 0}},
                        "required": ["city", "nights"],
                        "additionalProperties": False,
                    },
                    "maxItems": 6,
                },
                "flexible": {"type": "boolean"},
                "budget": {"type": ["number", "null"]},
            },
            "required": ["location", "unit", "days", "include", "stops", "flexible", "budget"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

CITIES = ["Paris", "Lisbon", "Kraków", "San Francisco", "Reykjavík", "Osaka", "Buenos Aires", "Nairobi", "Tromsø",
          "Ho Chi Minh City", "Québec", "Zürich"]


def answers(count: int, seed: int = 0) -> list[str]:
    """`count` different valid instances of TOOL_SCHEMA, as a model would write them (json.dumps' separators)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        args = {
            "location": rng.choice(CITIES),
            "unit": rng.choice(["celsius", "fahrenheit"]),
            "days": rng.randint(1, 14),
            "include": rng.sample(["humidity", "wind", "uv", "rain"], rng.randint(0, 4)),
            "stops": [{"city": rng.choice(CITIES), "nights": rng.randint(0, 9)} for _ in range(rng.randint(1, 4))],
            "flexible": rng.random() < 0.5,
            "budget": None if rng.random() < 0.3 else round(rng.uniform(100, 5000), 2),
        }
        out.append(json.dumps({"name": rng.choice(["get_weather", "plan_trip", "search_flights"]), "arguments": args},
                              ensure_ascii=False))
    return out


def train_150k(path: Path) -> None:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    root = Path(os.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if p.stat().st_size < 400_000)

    def texts(limit=300_000_000):
        n = 0
        for p in files:
            text = p.read_text(errors="replace")
            n += len(text)
            yield text
            if n > limit:
                return

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_150K, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    print(f"training a {BPE_150K:,}-token byte-level BPE on {root} (once; kept in {path})", file=sys.stderr)
    tok.train_from_iterator(texts(), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


class Vocab:
    """A tokenizer as both libraries get it: the tokenizer.json text, its vocabulary by id, EOS, logits width."""

    def __init__(self, name: str, backend: HFTokenizer, eos: int, width: int):
        self.name, self.backend, self.eos, self.width = name, backend, eos, width
        self.json = backend.to_str()
        self.size = backend.get_vocab_size(with_added_tokens=True)
        self.special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def vocabularies(path_150k: str | None) -> list[Vocab]:
    from strata.model.loader import ModelFiles
    files = ModelFiles.open("default")
    tok = files.tokenizer
    out = [Vocab(f"SmolLM2 ({tok.vocab_size:,})", tok.backend, tok.eos_token_id, files.spec.vocab_size)]
    path = Path(path_150k) if path_150k else CACHE / f"bpe-{BPE_150K}.json"
    if not path.exists():
        train_150k(path)
    backend = HFTokenizer.from_file(str(path))
    eos = backend.token_to_id("<|im_end|>")
    what = "file" if path_150k else "trained BPE"
    out.append(Vocab(f"150K {what} ({backend.get_vocab_size():,}, logits {LOGITS_150K:,})", backend, eos,
                     max(LOGITS_150K, backend.get_vocab_size())))
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads
        t = time.perf_counter()
        encoded = [""] * vocab.size
        for text, i in vocab.backend.get_vocab(with_added_tokens=True).items():
            # special tokens as "" (xgrammar's mark for a special token): with their text they would be allowed
            # inside JSON strings
            encoded[i] = "" if text in vocab.special else text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(vocab.json)
        self.info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab.width, stop_token_ids=[vocab.eos],
                                      add_prefix_space=meta["add_prefix_space"])
        self.info_s = time.perf_counter() - t
        self.batch = xgr.BatchGrammarMatcher(threads)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        import llguidance as llg
        self.llg = llg
        t = time.perf_counter()
        self.tok = llg.LLTokenizer(vocab.json, n_vocab=vocab.width, eos_token=vocab.eos)
        self.info_s = time.perf_counter() - t
        self.executor = llg.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar, matcher

    def matcher(self, compiled):
        return compiled[1].deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accept_batch(self, matchers, tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens)))


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def time_compile(lib, vocab: Vocab, reps: int) -> tuple[float, float]:
    """Median (compile, first mask) seconds: a fresh compile each time, the library's cache off."""
    compiles, firsts = [], []
    bitmask = torch.zeros(1, (vocab.width + 31) // 32, dtype=torch.int32)
    for _ in range(reps):
        t = time.perf_counter()
        compiled = lib.compile(TOOL_SCHEMA)
        t1 = time.perf_counter()
        lib.fill(lib.matcher(compiled), bitmask)
        t2 = time.perf_counter()
        compiles.append(t1 - t)
        firsts.append(t2 - t1)
    return statistics.median(compiles), statistics.median(firsts)


def walk(lib, vocab: Vocab, compiled, rows: int, reps: int) -> tuple[float, float, int]:
    """`rows` sequences, each walking its own valid answer token by token, for as many steps as the shortest has
    tokens: best of `reps` mean (fill, accept) seconds per step, and the steps. Every token is checked against its
    row's mask first."""
    texts = answers(rows, seed=rows)
    tokens = [vocab.encode(t) for t in texts]
    steps = min(len(t) for t in tokens)
    bitmask = torch.zeros(rows, (vocab.width + 31) // 32, dtype=torch.int32)
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        matchers = [lib.matcher(compiled) for _ in range(rows)]
        fill = accept = 0.0
        for s in range(steps):
            t = time.perf_counter()
            if rows == 1:
                lib.fill(matchers[0], bitmask)
            else:
                lib.fill_batch(matchers, bitmask)
            t1 = time.perf_counter()
            step = [tokens[r][s] for r in range(rows)]
            for r, token in enumerate(step):
                assert allowed(bitmask, r, token), (lib.name, vocab.name, r, s, texts[r])
            t2 = time.perf_counter()
            ok = [lib.accept(matchers[0], step[0])] if rows == 1 else lib.accept_batch(matchers, step)
            t3 = time.perf_counter()
            assert all(ok), (lib.name, vocab.name, s)
            fill += t1 - t
            accept += t3 - t2
        best = min(best, (fill / steps, accept / steps))
    return best[0], best[1], steps


def time_apply(vocab: Vocab, constrained: int, rows: int = 64, reps: int = 20) -> float:
    """Seconds of strata.grammar.apply_bitmask on [rows, width] float32 logits with `constrained` rows masked
    (random bits: what it costs does not depend on which tokens), median of `reps`."""
    from strata.grammar import apply_bitmask
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(rows, vocab.width, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab.width + 31) // 32), dtype=torch.int32)
    which = list(range(constrained))
    times = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        apply_bitmask(logits, bitmask, which)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--rows", default="1,64", help="sequences walked together, comma-separated")
    ap.add_argument("--vocab-150k", help="a tokenizer.json of about 150K tokens (default: a trained BPE, cached)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the libraries' worker threads")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--apply-threads", type=int, default=1,
                    help="torch's CPU threads for the apply timing (on a shared 2-core machine, 2 threads wait on "
                         "each other's busy core: 50 ms to 1 s for the same work)")
    args = ap.parse_args()
    libs = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    rows = [int(r) for r in args.rows.split(",")]
    versions = {}
    for name in args.libs.split(","):
        t = time.perf_counter()
        __import__(name)
        versions[name] = (importlib.metadata.version(name), time.perf_counter() - t)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, threads {args.threads}, "
          f"torch {torch.__version__}, " + ", ".join(f"{n} {v} (import {s:.2f} s)" for n, (v, s) in versions.items()))
    vocabs = vocabularies(args.vocab_150k)
    walked = {}
    head = ["library", "vocabulary", "tokenizer info ms", "compile ms", "first mask ms"]
    for r in rows:
        head += [f"{r} row{'s' * (r > 1)}: fill us/step, first / warm", "accept us/step", "warm fill+accept us/row"]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + " |")
    for vocab in vocabs:
        for name in args.libs.split(","):
            lib = libs[name](vocab, args.threads)
            compile_s, first_s = time_compile(lib, vocab, args.reps)
            cells = [name, vocab.name, f"{lib.info_s * 1e3:.0f}", f"{compile_s * 1e3:.1f}", f"{first_s * 1e3:.2f}"]
            for r in rows:
                compiled = lib.compile(TOOL_SCHEMA)  # fresh: the first walk finds no mask the library built lazily
                cold, _, steps = walk(lib, vocab, compiled, r, 1)
                fill, accept, _ = walk(lib, vocab, compiled, r, args.reps)
                cells += [f"{cold * 1e6:.0f} / {fill * 1e6:.0f}", f"{accept * 1e6:.0f}",
                          f"{(fill + accept) * 1e6 / r:.1f}"]
                walked[r] = steps
            print("| " + " | ".join(cells) + " |", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.apply_threads)
    print(f"\nstrata.grammar.apply_bitmask, [64, width] float32 logits on {device} (torch threads "
          f"{torch.get_num_threads()}): " + ", ".join(
              f"{v.name.split(' (')[0]} {r} of 64 rows constrained {time_apply(v, r) * 1e3:.2f} ms"
              for v in vocabs for r in (1, 64)))
    print(f"\nsteps walked (the shortest answer of the rows): {walked}; fill: the first walk after a fresh compile / "
          f"the best of {args.reps} walks after it; compile: the median of {args.reps}", file=sys.stderr)


if __name__ == "__main__":
    main()
