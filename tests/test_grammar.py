"""strata/grammar: constraints compiled by llguidance against the embedded default's real tokenizer, walked by
sampling uniformly among the tokens each mask allows (seeded), until the grammar ends."""

import json
import re

import jsonschema
import pytest
import torch

from strata.errors import StrataError
from strata.grammar import (
    Constraint, GrammarMatcher, Grammars, GrammarVocab, allowed_tokens, apply_bitmask, fill_bitmask, new_bitmask,
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
