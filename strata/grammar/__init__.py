"""Structured output: the grammar layer between a request's constraint and the engine's logits.

Built on llguidance, chosen over xgrammar by `bench/grammar.py` (docs/PERFORMANCE.md, "Grammar masks"): half the
mask cost at 150K tokens (3 us a row more at 49K), a compile 17-72 times shorter, no dependency of its own, the
tokenizer.json read as it is. Nothing here knows the engine; the engine calls it per row:

    vocab = GrammarVocab.build(tokenizer, logits_width)        # once per model
    grammars = Grammars(vocab)                                 # once per model: the compile cache
    matcher = GrammarMatcher(grammars.compile(constraint))     # per request (StrataError -> HTTP 400)
    bitmask = new_bitmask(rows, vocab)                         # per window (or one kept and refilled)
    fill_bitmask(bitmask, [(matcher, row), ...])               # the constrained rows
    apply_bitmask(logits, bitmask, rows=[row, ...])            # before sampling
    matcher.accept(token); matcher.is_finished()               # after it

- `Constraint` (constraint.py): what the server received, as a hashable value: `json_object()`,
  `json_schema(schema)`, `regex(pattern)`, `choice(options)`, `grammar(text)` (Lark, or GBNF / EBNF converted).
  JSON is written as json.dumps writes it (", " and ": ", no other whitespace).
- `GrammarVocab.build(tokenizer, width)` (vocab.py), once per tokenizer: the library's view of Strata's
  `Tokenizer` (its tokenizer.json, special tokens kept special), the tokenizer's size and the model's logits
  width (the bitmask covers both; columns past the tokenizer's tokens are never allowed), the stop tokens.
- `Grammars(vocab)` (compile.py): `compile(constraint) -> CompiledGrammar`, one least-recently-used cache keyed by
  the constraint; a constraint the library cannot compile raises `StrataError` naming the kind and the reason (the
  server answers 400).
- `GrammarMatcher(compiled)` (matcher.py), one per sequence: `fill(bitmask, row)`, `accept(token) -> bool`,
  `valid_prefix(tokens)`, `rollback(n)` (drafts), `can_end()`, `is_finished()`; `fill_bitmask(bitmask,
  [(matcher, row), ...])` fills a window's rows in one call on the library's threads.
- `new_bitmask(rows, vocab)`, `apply_bitmask(logits, bitmask, rows)` (bitmask.py): one int32 bitmask
  [rows, ceil(V / 32)] per window on the host; applying it sets forbidden logits to -inf in the constrained rows
  only (others bit for bit untouched), on the CPU or on the logits' GPU without waiting for it (one Triton kernel,
  `strata.kernels.bitmask`). `HostBitmask(vocab, device)`: the engine's, one buffer reused every window (pinned
  for a GPU, refilled once the device has read it).
- `tool_call_schema(tools, name)`, `tool_call_constraint(tools, name, wrap=None | "hermes" | "qwen3_coder")`
  (tools.py): the constraint behind `tool_choice: "required"` or a named function: one call `{"name": <const>,
  "arguments": <its parameters schema>}` (an anyOf over the tools, so the arguments follow the function named);
  for Hermes / Qwen the same schema inline in a Lark grammar, on its own line between a `<tool_call>` line and a
  `</tool_call>` line; for Qwen3-Coder / Qwen3.5 the XML block (`xml_call_grammar`: `<function=NAME>`, one
  `<parameter=KEY>` element per parameter, a string's value raw text without the closing markers, any other
  value inline JSON of its schema); one call, or with `parallel` several blocks a newline apart.

Stop tokens: the vocabulary's `stop_ids` (EOS among them) are the grammar's end-of-sequence tokens: the mask
allows them exactly where the text so far is a whole answer (`can_end()`), and nowhere else, so a constrained
answer cannot stop early. When the grammar cannot go on (`is_finished()`: a closed object, a choice spelled out)
the mask allows only the stop tokens; the engine ends the answer there without a step for it.
"""

from strata.grammar.bitmask import HostBitmask, allowed_tokens, apply_bitmask, new_bitmask
from strata.grammar.compile import CompiledGrammar, Grammars
from strata.grammar.constraint import Constraint
from strata.grammar.matcher import GrammarMatcher, fill_bitmask
from strata.grammar.tools import tool_call_constraint, tool_call_schema
from strata.grammar.vocab import GrammarVocab

__all__ = [
    "CompiledGrammar", "Constraint", "HostBitmask", "GrammarMatcher", "GrammarVocab", "Grammars", "allowed_tokens", "apply_bitmask",
    "fill_bitmask", "new_bitmask", "tool_call_constraint", "tool_call_schema",
]
