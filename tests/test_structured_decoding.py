"""Constrained rows inside the engine's windows (structured output): each constrained slot samples only what its
grammar allows, beside unconstrained slots whose greedy answers stay what they are alone, with windows run ahead
(`lookahead`) and with drafts configured; the embedded default model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from strata.errors import StrataError
from strata.grammar import Constraint
from strata.runtime.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
COLOURS = ["red", "green", "blue"]


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def run(slots, admissions: list[dict]) -> dict[int, tuple[list[int], str]]:
    for i, a in enumerate(admissions):
        slots.admit(i, a["ids"], a.get("max_new", 24), a.get("params", SamplingParams()), grammar=a.get("grammar"))
    tokens, reasons = {i: [] for i in range(len(admissions))}, {}
    while slots.active or slots.in_flight:
        for e in slots.step():
            tokens[e.slot].append(e.token)
            if e.finish_reason:
                reasons[e.slot] = e.finish_reason
    return {i: (tokens[i], reasons[i]) for i in tokens}


@pytest.mark.parametrize("lookahead", [0, 1])
def test_constrained_rows_beside_unconstrained_ones(default_engine, lookahead):
    tok = default_engine.tokenizer
    plain = [prompt(tok, "Tell me about Paris."), prompt(tok, "Count to five.")]
    alone = [default_engine.generate(ids, 16, stop_ids=tok.stop_ids).ids for ids in plain]
    slots = default_engine.init_slots(4, lookahead=lookahead)
    out = run(slots, [
        {"ids": prompt(tok, "Plan a trip: which city and how many days? Answer in JSON."),
         "grammar": Constraint.json_schema(SCHEMA), "max_new": 40},
        {"ids": plain[0], "max_new": 16},
        {"ids": prompt(tok, "Pick a colour."), "grammar": Constraint.choice(COLOURS),
         "params": SamplingParams(temperature=1.0, seed=3)},
        {"ids": plain[1], "max_new": 16},
    ])
    answer, reason = out[0]
    jsonschema.validate(json.loads(tok.decode(answer, skip_special_tokens=True)), SCHEMA)
    assert reason == "stop"  # ended by the grammar (or the stop token it allowed), not by max_new
    assert tok.decode(out[2][0], skip_special_tokens=True) in COLOURS
    assert [out[1][0], out[3][0]] == alone


def test_a_regex_row_and_drafts_configured(tmp_path_factory, default_engine):
    from strata.model.loader import ModelFiles
    from strata.runtime.drafts import parse_spec
    from strata.runtime.generate import Engine

    engine = Engine(ModelFiles.open("default"), max_cells=512, speculative=parse_spec("ngram:3", max_active=8))
    tok = engine.tokenizer
    repeat = prompt(tok, "Repeat exactly: one two three one two three one two three")
    out = run(engine.init_slots(2), [
        {"ids": prompt(tok, "Give a date."), "grammar": Constraint.regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")},
        {"ids": repeat, "max_new": 20},
    ])
    import re

    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", tok.decode(out[0][0], skip_special_tokens=True))
    assert out[1][0] == default_engine.generate(repeat, 20, stop_ids=tok.stop_ids).ids


def test_a_constraint_that_does_not_compile_is_refused_at_admission(default_engine):
    slots = default_engine.init_slots(1)
    with pytest.raises(StrataError, match="regex cannot be compiled"):
        slots.admit(0, [1, 2, 3], 4, grammar=Constraint.regex("(unclosed"))
    assert not slots.slots[0].active


def test_a_constrained_row_reports_the_raw_log_probabilities(default_engine):
    """Masks go on the logits in place unless a constrained row asks for log-probabilities: those stay the raw
    distribution's, the same as an unconstrained row's on the same prompt."""
    tok = default_engine.tokenizer
    ids = prompt(tok, "Pick a colour.")
    slots = default_engine.init_slots(2, lookahead=1)
    slots.admit(0, ids, 1, logprobs=4)
    slots.admit(1, ids, 1, grammar=Constraint.choice(["zebra"]), logprobs=4)
    first = {}
    while slots.active or slots.in_flight:
        for e in slots.step():
            first.setdefault(e.slot, e)
    free, forced = first[0].logprobs, first[1].logprobs
    assert tok.decode([first[1].token]) in "zebra" and first[1].token != first[0].token
    assert [t for t, _ in forced[1]] == [t for t, _ in free[1]]  # the raw top 4, not the mask's one token
    assert [lp for _, lp in forced[1]] == pytest.approx([lp for _, lp in free[1]], abs=1e-4)
    assert forced[0] < free[1][-1][1]  # the forced token's raw log-probability: below the raw top 4
