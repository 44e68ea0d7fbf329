"""Constraints compiled against one tokenizer, cached: a schema is compiled once (about 1-2 ms for a tool-call
schema at 49K or 150K tokens) and every request that sends it again starts from the same compiled grammar."""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from strata.errors import StrataError
from strata.grammar.constraint import Constraint
from strata.grammar.vocab import GrammarVocab

MAX_ERROR_CHARS = 400


class CompiledGrammar:
    """A constraint's grammar for one tokenizer: a matcher that never moves, which each sequence's matcher copies
    (a copy costs microseconds; building one costs the compile again)."""

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher, vocab: GrammarVocab):
        self.constraint = constraint
        self.template = template
        self.vocab = vocab


class Grammars:
    """The compiled-grammar cache of one tokenizer: `compile(constraint)`, least recently used dropped past
    `max_entries`. Thread-safe (the server may compile while the engine decodes); compiling drops the GIL."""

    def __init__(self, vocab: GrammarVocab, max_entries: int = 256):
        self.vocab = vocab
        self.max_entries = max_entries
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint compiled; StrataError naming the constraint and the library's reason when it cannot be
        (a schema keyword llguidance does not implement, a regex that does not parse, an unknown rule...)."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        compiled = compile_constraint(constraint, self.vocab)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled


def compile_constraint(constraint: Constraint, vocab: GrammarVocab) -> CompiledGrammar:
    try:
        grammar = constraint.to_llguidance()
    except ValueError as e:  # llguidance: a schema that is not JSON
        raise StrataError(f"{constraint.kind} cannot be compiled: {e}") from None
    template = llguidance.LLMatcher(vocab.lltokenizer, grammar, log_level=0)
    if template.is_error():
        raise StrataError(f"{constraint.kind} cannot be compiled: {_short(template.get_error())}")
    return CompiledGrammar(constraint, template, vocab)


def _short(error: str) -> str:
    error = error.strip()
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + "..."
