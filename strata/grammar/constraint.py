"""What a request constrains its answer to, as a hashable value (the compiled-grammar cache's key), and the
llguidance grammar it stands for. Pure: no tokenizer, nothing compiled."""

from __future__ import annotations

import json
from dataclasses import dataclass

from strata.errors import StrataError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# JSON is written as json.dumps writes it: ", " between items, ": " after keys, no other whitespace. A model is
# free to pick its tokens within that, but not to pad with whitespace, so an answer cannot run away in blanks and
# tool-call arguments come out in the form chat templates print them.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """`kind` one of KINDS; `text` the constraint in canonical text: a schema as JSON (property order kept: it is
    the order the answer writes them in), a regex, a choice as a JSON list of strings, a Lark or GBNF grammar."""

    kind: str
    text: str

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        if schema is True:  # the schema that allows any JSON value
            schema = {}
        if schema is False:
            raise StrataError("json_schema: the schema `false` allows no answer")
        if not isinstance(schema, dict):
            raise StrataError(f"json_schema: a schema is a JSON object, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """The whole answer matches `pattern` (Rust `regex` syntax, as llguidance reads it)."""
        if not isinstance(pattern, str):
            raise StrataError(f"regex: a pattern is a string, not {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "Constraint":
        """The answer is exactly one of `options`."""
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
            raise StrataError("choice: a non-empty list of strings is needed")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A context-free grammar: llguidance's Lark syntax (`start: ...`, `%json {...}` inside), or llama.cpp's
        GBNF (`root ::= ...`, the EBNF vLLM's `guided_grammar` takes), converted to Lark."""
        if not isinstance(text, str) or not text.strip():
            raise StrataError("grammar: a non-empty grammar text is needed")
        return cls("grammar", text)

    def to_llguidance(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles from; StrataError when the text cannot
        even be read (a schema or GBNF that does not parse). Errors found while compiling come later."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind in ("json_object", "json_schema"):
            return LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_STYLE)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            options = json.loads(self.text)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        if self.kind == "grammar":
            try:
                return LLMatcher.grammar_from_lark(any_to_lark(self.text))
            except Exception as e:  # the GBNF converter raises plain exceptions
                raise StrataError(f"grammar: the GBNF grammar does not parse: {e}") from None
        raise StrataError(f"unknown constraint kind {self.kind!r} (known: {', '.join(KINDS)})")
