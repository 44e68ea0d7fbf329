"""strata/grammar: constraints compiled by llguidance against the embedded default's real tokenizer, walked by
sampling uniformly among the tokens each mask allows (seeded), until the grammar ends."""

import json
import re

import jsonschema
import pytest
import torch

from strata.errors import StrataError
from strata.grammar import (
    Constraint, GrammarMatcher, Grammars, GrammarVocab, HostBitmask, allowed_tokens, apply_bitmask, fill_bitmask,
    new_bitmask,
    tool_call_constraint,
)
from strata.model.checkpoint import open_checkpoint
from strata.model.loader import default_model_path

PAD = 64  # logits columns past the tokenizer's 49,152, as a padded head has them

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"enum": ["wind", "rain", "uv"]}, "maxItems": 3},
        "stops": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 5}, "nights": {"type": "integer"}},
                "required": ["name", "nights"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "flexible": {"type": "boolean"},
        "budget": {"type": ["number", "null"]},
    },
    "required": ["city", "unit", "days", "stops"],
    "additionalProperties": False,
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments {}
]


@pytest.fixture(scope="module")
def tokenizer():
    return open_checkpoint(default_model_path()).tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(GrammarVocab.build(tokenizer, tokenizer.vocab_size + PAD))


def walk(grammars, constraint, seed, cap=400):
    """Sample uniformly among the allowed tokens until the grammar ends; (token ids without the stop token, the
    matcher). Every mask is checked to allow only the tokenizer's tokens, never a padded column."""
    matcher = GrammarMatcher(grammars.compile(constraint))
    bitmask = new_bitmask(1, grammars.vocab)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(cap):
        matcher.fill(bitmask, 0)
        allowed = allowed_tokens(bitmask, 0)
        assert len(allowed) and int(allowed[-1]) < grammars.vocab.size
        token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        assert matcher.accept(token), matcher.error
        if token in grammars.vocab.stop_ids:
            break
        out.append(token)
        if matcher.is_finished():
            break
    assert matcher.is_finished(), f"no end after {cap} tokens"
    return out, matcher


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_walk_validates(tokenizer, grammars, seed):
    ids, _ = walk(grammars, Constraint.json_schema(SCHEMA), seed)
    jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


def test_json_object_allows_objects_only(tokenizer, grammars):
    matcher = GrammarMatcher(grammars.compile(Constraint.json_object()))
    bitmask = new_bitmask(1, grammars.vocab)
    matcher.fill(bitmask, 0)
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed_tokens(bitmask, 0).tolist())
    answer = '{"a": [1, 2.5, {"b": null}], "c": "d"}'
    assert all(matcher.accept(t) for t in tokenizer.encode(answer, add_special_tokens=False))
    assert matcher.is_finished()
    matcher = GrammarMatcher(grammars.compile(Constraint.json_object()))
    assert not matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])
    assert matcher.error
    # json.dumps' spacing and no other: no answer padded with blanks
    matcher = GrammarMatcher(grammars.compile(Constraint.json_object()))
    pretty = tokenizer.encode('{\n  "a": 1\n}', add_special_tokens=False)
    assert matcher.valid_prefix(pretty) < len(pretty)


def test_choice_yields_one_of_them(tokenizer, grammars):
    options = ["yes", "yes, gladly", "no", "Über"]
    texts = {tokenizer.decode(walk(grammars, Constraint.choice(options), seed)[0]) for seed in range(16)}
    assert texts <= set(options) and len(texts) > 1


def test_regex_walk_matches(tokenizer, grammars):
    pattern = r"(cat|dog)s? [0-9]{1,3}(\.[0-9])?"
    for seed in range(8):
        assert re.fullmatch(pattern, tokenizer.decode(walk(grammars, Constraint.regex(pattern), seed)[0]))


def test_gbnf_grammar(tokenizer, grammars):
    constraint = Constraint.grammar('root ::= "x=" num\nnum ::= [1-9] [0-9]?')
    for seed in range(4):
        assert re.fullmatch(r"x=[1-9][0-9]?", tokenizer.decode(walk(grammars, constraint, seed)[0]))


@pytest.mark.parametrize("constraint, words", [
    (lambda: Constraint.json_schema({"type": "strin"}), ["json_schema", "strin"]),
    (lambda: Constraint.json_schema({"type": "array", "uniqueItems": True}), ["json_schema", "uniqueItems"]),
    (lambda: Constraint.json_schema({"$ref": "#/$defs/missing"}), ["json_schema", "missing"]),
    (lambda: Constraint.regex("a(b"), ["regex", "unclosed group"]),
    (lambda: Constraint.grammar("start: nowhere"), ["grammar", "nowhere"]),
    (lambda: Constraint.choice([]), ["choice", "non-empty"]),
    (lambda: Constraint.json_schema(["not", "a", "schema"]), ["json_schema", "list"]),
], ids=["type", "unimplemented", "ref", "regex", "lark", "choice", "not-object"])
def test_uncompilable_constraint_names_the_problem(grammars, constraint, words):
    with pytest.raises(StrataError) as e:
        grammars.compile(constraint())
    assert all(w in str(e.value) for w in words), str(e.value)


def test_compiled_once_per_constraint(grammars):
    a = grammars.compile(Constraint.json_schema(SCHEMA))
    assert grammars.compile(Constraint.json_schema(json.loads(json.dumps(SCHEMA)))) is a
    assert grammars.compile(Constraint.json_schema({**SCHEMA, "description": "other"})) is not a


def test_rollback_restores_the_mask(tokenizer, grammars):
    answer = '{"city": "Oslo", "unit": "celsius", "days": 3, "stops": [{"name": "Bergen", "nights": 2}]}'
    answer = answer.replace("Bergen", "Berg")  # maxLength 5
    ids = tokenizer.encode(answer, add_special_tokens=False)
    matcher = GrammarMatcher(grammars.compile(Constraint.json_schema(SCHEMA)))
    masks = new_bitmask(len(ids) + 1, grammars.vocab)
    for i, token in enumerate(ids):
        matcher.fill(masks, i)
        assert matcher.accept(token)
    matcher.fill(masks, len(ids))
    again = new_bitmask(1, grammars.vocab)
    for back in (1, 3, 7, len(ids)):
        matcher.rollback(back)
        matcher.fill(again, 0)
        assert torch.equal(again[0], masks[len(ids) - back])
        assert all(matcher.accept(t) for t in ids[len(ids) - back:])
    # the closing brace finished the grammar: a stop token after it is no step of its own
    assert matcher.is_finished() and matcher.accept(grammars.vocab.stop_ids[0]) and matcher.is_finished()
    matcher.rollback(1)
    matcher.fill(again, 0)
    assert torch.equal(again[0], masks[len(ids) - 1]) and not matcher.is_finished()
    with pytest.raises(ValueError):
        matcher.rollback(len(ids))
    draft = ids[len(ids) - 1:] + ids[:2]
    assert matcher.valid_prefix(draft) == 1


def test_stop_tokens_allowed_only_at_the_end(tokenizer, grammars):
    matcher = GrammarMatcher(grammars.compile(Constraint.json_schema({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False})))
    bitmask = new_bitmask(1, grammars.vocab)
    ids = tokenizer.encode('{"n": 12}', add_special_tokens=False)
    for token in ids:
        matcher.fill(bitmask, 0)
        assert not set(allowed_tokens(bitmask, 0).tolist()) & set(grammars.vocab.stop_ids)
        assert not matcher.can_end() and matcher.accept(token)
    matcher.fill(bitmask, 0)
    assert matcher.can_end() and matcher.is_finished()
    assert allowed_tokens(bitmask, 0).tolist() == sorted(grammars.vocab.stop_ids)
    # where the answer may end or go on, a stop token is a step: it finishes the matcher and rolls back
    matcher = GrammarMatcher(grammars.compile(Constraint.choice(["yes", "yes, gladly"])))
    assert all(matcher.accept(t) for t in tokenizer.encode("yes", add_special_tokens=False))
    matcher.fill(bitmask, 0)
    allowed = set(allowed_tokens(bitmask, 0).tolist())
    assert matcher.can_end() and not matcher.is_finished() and set(grammars.vocab.stop_ids) < allowed
    assert matcher.accept(grammars.vocab.stop_ids[0]) and matcher.is_finished()
    matcher.rollback(1)
    again = new_bitmask(1, grammars.vocab)
    matcher.fill(again, 0)
    assert not matcher.is_finished() and torch.equal(again, bitmask)


def test_batched_fill_equals_rows(tokenizer, grammars):
    constraints = [Constraint.json_schema(SCHEMA), Constraint.regex("[a-z]+"), Constraint.json_object()]
    matchers = [GrammarMatcher(grammars.compile(c)) for c in constraints]
    matchers[0].accept(tokenizer.encode('{"', add_special_tokens=False)[0])
    one, batched = new_bitmask(5, grammars.vocab), new_bitmask(5, grammars.vocab)
    rows = [(matchers[0], 4), (matchers[1], 0), (matchers[2], 2)]
    for m, row in rows:
        m.fill(one, row)
    fill_bitmask(batched, rows)
    assert torch.equal(one, batched)
    assert (batched[[1, 3]] == -1).all()  # rows left to unconstrained sequences: untouched


def test_the_engines_reused_bitmask_is_filled_over_what_the_last_window_left(grammars):
    host = HostBitmask(grammars.vocab, "cpu")
    first = host.take(3)
    first.fill_(0x55555555)  # stale words from a window before
    matcher = GrammarMatcher(grammars.compile(Constraint.json_object()))
    again = host.take(2)
    assert again.data_ptr() == first.data_ptr()  # one buffer, no allocation per window
    fill_bitmask(again, [(matcher, 1)])
    fresh = new_bitmask(2, grammars.vocab)
    fill_bitmask(fresh, [(matcher, 1)])
    assert torch.equal(again[1], fresh[1])  # a filled row is written whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_leaves_unconstrained_rows_bit_identical(grammars, dtype):
    vocab = grammars.vocab
    logits = torch.randn(4, vocab.width, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 5] = float("nan")  # even a NaN of an unconstrained row keeps its bits
    before = logits.clone()
    bitmask = new_bitmask(4, vocab)
    GrammarMatcher(grammars.compile(Constraint.json_object())).fill(bitmask, 1)
    GrammarMatcher(grammars.compile(Constraint.choice(["alpha", "beta"]))).fill(bitmask, 3)
    apply_bitmask(logits, bitmask, rows=[1, 3])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for row in (0, 2):
        assert torch.equal(logits[row].view(bits), before[row].view(bits))
    for row in (1, 3):
        allowed = allowed_tokens(bitmask, row, vocab.width)
        kept = torch.isfinite(logits[row]).nonzero().squeeze(1)
        assert torch.equal(kept, allowed) and 0 < len(kept) < 10
        assert torch.equal(logits[row, kept], before[row, kept])
        assert torch.isinf(logits[row, vocab.size:]).all()  # the padded columns
    # every row at once: rows nobody filled allow everything, so they keep their bits too
    again = before.clone()
    apply_bitmask(again, bitmask)
    assert torch.equal(again.view(bits), logits.view(bits))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_on_the_gpu_equals_the_cpu(grammars, dtype, pinned):
    vocab = grammars.vocab
    logits = torch.randn(5, vocab.width, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask = new_bitmask(5, vocab, pinned=pinned)
    GrammarMatcher(grammars.compile(Constraint.json_object())).fill(bitmask, 2)
    GrammarMatcher(grammars.compile(Constraint.choice(["alpha", "beta"]))).fill(bitmask, 4)
    on_gpu = logits.cuda()
    apply_bitmask(logits, bitmask, rows=[2, 4])  # the CPU's way, row by row
    apply_bitmask(on_gpu, bitmask, rows=[2, 4])  # one kernel (strata.kernels.bitmask)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu().float(), logits.float())


def _call(tokenizer, ids) -> dict:
    return json.loads(tokenizer.decode(ids))


def _check_call(call: dict, names=None):
    functions = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    assert set(call) == {"name", "arguments"} and call["name"] in (names or functions)
    schema = functions[call["name"]] or {"type": "object", "properties": {}, "additionalProperties": False}
    jsonschema.validate(call["arguments"], schema)


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_call_validates(tokenizer, grammars, seed):
    ids, _ = walk(grammars, tool_call_constraint(TOOLS), seed)
    _check_call(_call(tokenizer, ids))


def test_named_tool_call_validates(tokenizer, grammars):
    for seed in range(3):
        ids, _ = walk(grammars, tool_call_constraint(TOOLS, "get_weather"), seed)
        _check_call(_call(tokenizer, ids), names=["get_weather"])
    with pytest.raises(StrataError, match="not_a_tool"):
        tool_call_constraint(TOOLS, "not_a_tool")


@pytest.mark.parametrize("parallel", [False, True])
def test_hermes_tool_call_validates(tokenizer, grammars, parallel):
    for seed in range(3):
        ids, _ = walk(grammars, tool_call_constraint(TOOLS, wrap="hermes", parallel=parallel), seed)
        text = tokenizer.decode(ids)
        blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text
        assert len(blocks) == 1 or parallel
        for block in blocks:
            _check_call(json.loads(block))


# -- Qwen3-Coder's XML calls ------------------------------------------------------------------------------

BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "kind": {"type": "string", "enum": ["hotel", "flat"]},
        "nights": {"type": "integer", "minimum": 1, "maximum": 9},
        "flexible": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["quiet", "view"]}, "maxItems": 2},
        "note": {"type": ["string", "null"], "maxLength": 6},
        "when": {"$ref": "#/$defs/day"},
        "either": {"anyOf": [{"type": "string", "maxLength": 3}, {"const": "none"}]},
        "guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
                  "required": ["name"], "additionalProperties": False},
    },
    "required": ["title", "code", "kind", "nights", "when"],
    "additionalProperties": False,
    "$defs": {"day": {"enum": ["mon", "tue"]}}}}}
XML_TOOLS = [*TOOLS, BOOK]
XML_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in XML_TOOLS}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
XML_BLOCK = re.compile(r"<tool_call>\n<function=([a-z_]+)>\n(?:<parameter=[a-z]+>\n.*?\n</parameter>\n)*"
                       r"</function>\n</tool_call>", re.S)


def _xml_calls(text: str, names=None) -> list:
    """The answer as Qwen3-Coder's template writes calls (blocks a newline apart, nothing else), parsed back
    (serve/tools.py) into calls whose arguments validate against their function's schema."""
    from serve.tools import QWEN3_CODER, parse_tool_calls

    blocks = [m.group(0) for m in XML_BLOCK.finditer(text)]
    assert "\n".join(blocks) == text, text
    content, calls = parse_tool_calls(text, QWEN3_CODER, XML_SCHEMAS)
    assert content is None and len(calls) == len(blocks), text
    for call in calls:
        assert call.name in (names or XML_SCHEMAS)
        jsonschema.validate(json.loads(call.arguments), XML_SCHEMAS[call.name] or NO_PARAMETERS)
    return calls


@pytest.mark.parametrize("parallel", [False, True])
def test_qwen3_coder_tool_call_walks_parse_back_and_validate(tokenizer, grammars, parallel):
    constraint = tool_call_constraint(XML_TOOLS, wrap="qwen3_coder", parallel=parallel)
    grammars.compile(constraint)  # llguidance compiles it
    seen = set()
    for seed in range(8):
        ids, _ = walk(grammars, constraint, seed, cap=1500)
        calls = _xml_calls(tokenizer.decode(ids))
        assert len(calls) == 1 or parallel
        seen |= {c.name for c in calls}
    assert len(seen) > 1  # the walks reach several functions


def test_qwen3_coder_named_call_walks_validate(tokenizer, grammars):
    constraint = tool_call_constraint(XML_TOOLS, "book", wrap="qwen3_coder")
    for seed in range(6):
        ids, _ = walk(grammars, constraint, seed)
        (call,) = _xml_calls(tokenizer.decode(ids), names=["book"])
        arguments = json.loads(call.arguments)
        assert {"title", "code", "kind", "nights", "when"} <= set(arguments)  # required ones always


def _accepts(tokenizer, grammars, constraint, text: str) -> bool:
    matcher = GrammarMatcher(grammars.compile(constraint))
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.can_end()


def test_qwen3_coder_call_as_the_template_writes_it(tokenizer, grammars):
    constraint = tool_call_constraint(XML_TOOLS, wrap="qwen3_coder")

    def call(*params, name="book"):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"

    good = [("title", "Sea\nview"), ("code", "ABC"), ("kind", "flat"), ("nights", "3"), ("tags", '["view"]'),
            ("note", "null"), ("when", "mon"), ("guest", '{"name": "Ada"}')]
    assert _accepts(tokenizer, grammars, constraint, call(*good))
    assert [(c.name, json.loads(c.arguments)) for c in _xml_calls(call(*good))] == [("book", {
        "title": "Sea\nview", "code": "ABC", "kind": "flat", "nights": 3, "tags": ["view"], "note": None,
        "when": "mon", "guest": {"name": "Ada"}})]
    assert _accepts(tokenizer, grammars, constraint, call(name="now"))
    assert _accepts(tokenizer, grammars, constraint, call(("city", "Oslo"), ("unit", "c"), name="get_weather"))
    bad = {
        "a required parameter missing": [p for p in good if p[0] != "code"],
        "out of order": [good[1], good[0], *good[2:]],
        "not in the schema": [*good, ("extra", "1")],
        "an integer out of range": [*good[:3], ("nights", "12"), *good[4:]],
        "a string that breaks the pattern": [good[0], ("code", "abc"), *good[2:]],
        "a string too long": [("title", "a very long title"), *good[1:]],
        "a string holding a closing marker": [("title", "a</function>"), *good[1:]],
        "not an enum value": [*good[:2], ("kind", "tent"), *good[3:]],
        "JSON quotes on a string": [*good[:2], ("kind", '"flat"'), *good[3:]],
    }
    for case, params in bad.items():
        assert not _accepts(tokenizer, grammars, constraint, call(*params)), case
    one = tool_call_constraint(XML_TOOLS, wrap="qwen3_coder")
    assert not _accepts(tokenizer, grammars, one, call(name="now") + "\n" + call(name="now"))  # one call
    several = tool_call_constraint(XML_TOOLS, wrap="qwen3_coder", parallel=True)
    assert _accepts(tokenizer, grammars, several, call(name="now") + "\n" + call(*good))


def test_qwen3_coder_names_that_markup_cannot_hold_are_refused():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}]
    with pytest.raises(StrataError, match="'a>b' cannot be written"):
        tool_call_constraint(tools, wrap="qwen3_coder")
    with pytest.raises(StrataError, match="unknown tool-call wrapper 'xml'"):
        tool_call_constraint(tools, wrap="xml")
