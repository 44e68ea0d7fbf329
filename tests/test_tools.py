"""serve/tools.py: tool calls parsed from answers in each family's format (Hermes / Qwen JSON, Llama 3 JSON,
Qwen3-Coder XML), whole and streamed at every split, and tools, past calls and tool results rendered into the chat
template's input."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from serve.errors import APIError
from serve.tools import (
    HERMES,
    LLAMA3_JSON,
    QWEN3_CODER,
    ToolCallStream,
    join_deltas,
    parse_tool_calls,
    template_messages,
    template_takes_tools,
    tool_format,
    xml_value,
)
from strata.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time", "parameters": {"type": "object", "properties": {}}}}
PARIS = {"city": "Paris", "unit": "celsius"}

# (case, format, the model's answer, content, [(name, arguments)]): answers in the shapes each family writes
HERMES_CASES = [
    ("one call",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", PARIS)]),
    ("text before",
     "I'll check the weather for you.\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "I'll check the weather for you.", [("get_weather", PARIS)]),
    ("thinking before",
     "<think>\nThe user asks about Paris; get_weather does that.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "<think>\nThe user asks about Paris; get_weather does that.\n</think>", [("get_weather", {"city": "Paris"})]),
    ("several calls",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     None, [("get_weather", PARIS), ("get_time", {})]),
    ("nested and escaped",
     '<tool_call>\n{"name": "search", "arguments": {"q": "caf\\u00e9 \\"Le Dôme\\" \\\\ 1/2", '
     '"filters": {"open": true, "stars": [4, 5], "min": -1.5e2, "near": null}}}\n</tool_call>',
     None, [("search", {"q": 'café "Le Dôme" \\ 1/2',
                        "filters": {"open": True, "stars": [4, 5], "min": -150.0, "near": None}})]),
    ("a next call cut off inside its marker (max_tokens)",
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool',
     None, [("get_time", {})]),
    ("text ending like a marker, no call", "Use the tag <tool", "Use the tag <tool", []),
    ("markers inside a string",
     '<tool_call>\n{"name": "write", "arguments": {"text": "</tool_call> then <tool_call>"}}\n</tool_call>',
     None, [("write", {"text": "</tool_call> then <tool_call>"})]),
    ("arguments first", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("no end marker", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("arguments as a string",
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("raw newline in a string",
     '<tool_call>\n{"name": "write", "arguments": {"text": "line 1\nline 2"}}\n</tool_call>',
     None, [("write", {"text": "line 1\nline 2"})]),
    ("text after", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
     "\nDone.", [("get_time", {})]),
    ("no call", "The weather in Paris is mild; x < 3 and <tool is not a marker.\n",
     "The weather in Paris is mild; x < 3 and <tool is not a marker.\n", []),
    ("ends like a marker", "Let me think <tool_c", "Let me think <tool_c", []),
    # malformed before the name is read: the block is plain content
    ("single quotes", "<tool_call>\n{'name': 'get_time', 'arguments': {}}\n</tool_call>",
     "<tool_call>\n{'name': 'get_time', 'arguments': {}}\n</tool_call>", []),
    ("not JSON", '<tool_call>\nget_weather(city="Paris")\n</tool_call> ok',
     '<tool_call>\nget_weather(city="Paris")\n</tool_call> ok', []),
    ("no name", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
     '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', []),
    ("broken, then a good call",
     '<tool_call>\n{"name" "f"}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name" "f"}\n</tool_call>', [("get_time", {})]),
    # malformed after the name is read: the call stands, its arguments closed where the JSON broke
    ("trailing comma", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("missing outer brace", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("junk before the end marker",
     '<tool_call>\n{"name": "get_time", "arguments": {}} (that is all)\n</tool_call>', None, [("get_time", {})]),
    ("cut off in a string", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     None, [("get_weather", {"city": "Par"})]),
    ("cut off after a key", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "un',
     None, [("get_weather", {"city": "Paris"})]),
    ("cut off in an escape", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00',
     None, [("get_weather", {"city": "Par"})]),
    ("cut off before the arguments", '<tool_call>\n{"name": "get_time", "argu', None, [("get_time", {})]),
    ("calls, then a block cut off after its marker",
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n',
     "\n<tool_call>", [("get_time", {}), ("get_time", {})]),
]
LLAMA_CASES = [
    ("one call", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", PARIS)]),
    ("python tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", PARIS)]),
    ("several calls",
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {}}', None, [("get_weather", PARIS), ("get_time", {})]),
    ("several on lines", '{"name": "get_time", "parameters": {}}\n{"name": "get_time", "parameters": {"tz": "UTC"}}',
     None, [("get_time", {}), ("get_time", {"tz": "UTC"})]),
    ("leading whitespace", '\n\n{"name": "get_time", "parameters": {}}\n', None, [("get_time", {})]),
    ("arguments key", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    ("text before", 'Sure: {"name": "get_time", "parameters": {}}',
     'Sure: {"name": "get_time", "parameters": {}}', []),
    ("JSON without a name", '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
    ("malformed", '{"name": get_time, "parameters": {}}', '{"name": get_time, "parameters": {}}', []),
    ("text after", '{"name": "get_time", "parameters": {}}\n\nCalling it now.', "\n\nCalling it now.",
     [("get_time", {})]),
    ("cut off", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "cel',
     None, [("get_weather", {"city": "Paris", "unit": "cel"})]),
]


def xml_call(name: str, *params: tuple[str, str], wrap: bool = True) -> str:
    """A call as Qwen3-Coder writes it: each (key, raw value) as a `<parameter=key>` element."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    call = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{call}\n</tool_call>" if wrap else call


PARIS_XML = xml_call("get_weather", ("city", "Paris"), ("unit", "celsius"))
CODE = 'def f(x):\n    return "<b>" + x  # \\ and \t\n'
XML_CASES = [
    ("one call", PARIS_XML, None, [("get_weather", PARIS)]),
    ("text before", "I'll check the weather for you.\n\n" + PARIS_XML, "I'll check the weather for you.",
     [("get_weather", PARIS)]),
    ("thinking before", "<think>\nget_weather does that.\n</think>\n\n" + PARIS_XML,
     "<think>\nget_weather does that.\n</think>", [("get_weather", PARIS)]),
    ("parallel calls", PARIS_XML + "\n" + xml_call("get_time"), None, [("get_weather", PARIS), ("get_time", {})]),
    ("two functions in one block",
     "<tool_call>\n" + xml_call("get_time", wrap=False) + "\n" + xml_call("get_time", ("tz", "UTC"), wrap=False)
     + "\n</tool_call>", None, [("get_time", {}), ("get_time", {"tz": "UTC"})]),
    ("no wrapper", xml_call("get_weather", ("city", "Paris"), wrap=False), None, [("get_weather", {"city": "Paris"})]),
    ("values as JSON where they read as JSON (no schema)",
     xml_call("plan", ("days", "3"), ("ratio", "0.5"), ("open", "true"), ("stops", '["Rome", "Oslo"]'),
              ("budget", '{"max": 900, "currency": "EUR"}'), ("none", "null"), ("word", "three")),
     None, [("plan", {"days": 3, "ratio": 0.5, "open": True, "stops": ["Rome", "Oslo"],
                      "budget": {"max": 900, "currency": "EUR"}, "none": None, "word": "three"})]),
    ("a multi-line value, one newline stripped at each end",
     xml_call("write", ("path", "a.py"), ("text", "\n" + CODE + "\n")), None,
     [("write", {"path": "a.py", "text": "\n" + CODE + "\n"})]),
    ("an empty value", xml_call("write", ("text", "")), None, [("write", {"text": ""})]),
    ("markers that end no value", xml_call("write", ("text", "use <tool_call> and <function=x> here")), None,
     [("write", {"text": "use <tool_call> and <function=x> here"})]),
    ("text after", PARIS_XML + "\nDone.", "\nDone.", [("get_weather", PARIS)]),
    ("no call", "x < 3, and <function is no marker; <tool_call is none either.\n",
     "x < 3, and <function is no marker; <tool_call is none either.\n", []),
    ("ends like a marker", "Let me think <functi", "Let me think <functi", []),
    # malformed before the name is read: the block is plain content
    ("JSON inside", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ("a name with a newline", "<tool_call>\n<function=get\ntime>\n</function>\n</tool_call> ok",
     "<tool_call>\n<function=get\ntime>\n</function>\n</tool_call> ok", []),
    ("broken, then a good call", "<tool_call>\nget_time()\n</tool_call>\n" + xml_call("get_time"),
     "<tool_call>\nget_time()\n</tool_call>", [("get_time", {})]),
    ("cut off in the name", "Sure. <tool_call>\n<function=get_wea", "Sure. <tool_call>\n<function=get_wea", []),
    ("cut off after the marker", "Sure. <tool_call>\n", "Sure. <tool_call>\n", []),
    # malformed after the name is read: the call stands (as vLLM reads it)
    ("no </parameter> before the next parameter",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=unit>\ncelsius\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get_weather", PARIS)]),
    ("no </parameter> before </function>",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     None, [("get_weather", {"city": "Paris"})]),
    ("no </function>", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</tool_call>\nok",
     "\nok", [("get_time", {"tz": "UTC"})]),
    ("no end marker", "<tool_call>\n<function=get_time>\n</function>", None, [("get_time", {})]),
    ("text between parameters",
     "<tool_call>\n<function=get_weather>\nchecking <b>now</b>\n<parameter=city>\nParis\n</parameter>\n"
     "and <parameter\n</function>\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    ("a parameter named twice", xml_call("get_weather", ("city", "Paris"), ("city", "Rome")), None,
     [("get_weather", {"city": "Paris"})]),
    ("junk before the end marker", xml_call("get_time")[:-len("</tool_call>")] + "(that is all)\n</tool_call>",
     None, [("get_time", {})]),
    ("cut off in a value", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     None, [("get_weather", {"city": "Par"})]),
    ("cut off in the closing marker", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
     None, [("get_weather", {"city": "Paris"})]),
    ("cut off in a parameter's name", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
     "\n<parameter=un", None, [("get_weather", {"city": "Paris"})]),
    ("cut off after the name", "<tool_call>\n<function=get_time>", None, [("get_time", {})]),
    ("calls, then a block cut off after its marker", xml_call("get_time") + "\n" + xml_call("get_time") + "\n"
     "<tool_call>\n", "\n<tool_call>", [("get_time", {}), ("get_time", {})]),
]
CASES = [(f"hermes: {c[0]}", HERMES, *c[1:]) for c in HERMES_CASES]
CASES += [(f"llama3: {c[0]}", LLAMA3_JSON, *c[1:]) for c in LLAMA_CASES]
CASES += [(f"qwen3_coder: {c[0]}", QWEN3_CODER, *c[1:]) for c in XML_CASES]
IDS = [c[0] for c in CASES]


def _ids():
    counter = itertools.count()
    return lambda: f"chatcmpl-tool-{next(counter):032x}"


def _stream(fmt, pieces, names=None) -> tuple[list[dict], bool]:
    stream = ToolCallStream(fmt, names, make_id=_ids())
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    tail, called = stream.finish()
    return deltas + tail, called


@pytest.mark.parametrize("case, fmt, text, content, calls", CASES, ids=IDS)
def test_parse_recorded(case, fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 32 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("case, fmt, text, content, calls", CASES, ids=IDS)
def test_stream_equals_parse_at_every_split(case, fmt, text, content, calls):
    whole = parse_tool_calls(text, fmt, make_id=_ids())
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    rng = random.Random(case)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in [list(text), *splits]:
        deltas, called = _stream(fmt, pieces)
        assert join_deltas(deltas) == whole, pieces
        assert called == bool(calls)


@pytest.mark.parametrize("case, fmt, text, content, calls", CASES, ids=IDS)
def test_delta_shapes(case, fmt, text, content, calls):
    deltas, _ = _stream(fmt, list(text))
    seen: dict[int, str] = {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}) and d.get("content", "x") != ""
        if "content" in d:
            continue
        (piece,) = d["tool_calls"]
        if piece["index"] not in seen:  # the call's first delta: id, type and the whole name, arguments ""
            assert piece["index"] == len(seen) and piece["type"] == "function"
            assert piece["id"].startswith("chatcmpl-tool-")
            assert piece["function"] == {"name": piece["function"]["name"], "arguments": ""}
            seen[piece["index"]] = ""
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            assert piece["index"] == max(seen)  # calls are streamed one after the other
            seen[piece["index"]] += piece["function"]["arguments"]
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert [json.loads(a) for a in seen.values()] == [args for _, args in calls]
    assert [c.arguments for c in parse_tool_calls(text, fmt)[1]] == list(seen.values())


def test_no_partial_marker_in_content():
    """Text that may begin a marker is held back, then let out when it turns out not to be one."""
    stream = ToolCallStream(HERMES)
    shown = ""
    for piece, now in [("a <", "a"), ("tool", "a"), (" b", "a <tool b"), (" <tool_cal", "a <tool b"),
                       ("l", "a <tool b"),
                       ("_c", "a <tool b <tool_call_c"), (" <tool_call>", "a <tool b <tool_call_c"),
                       ('{"name": "get_time", "arguments": {}}', "a <tool b <tool_call_c")]:
        shown += "".join(d.get("content", "") for d in stream.feed(piece))
        assert shown == now, piece
    assert stream.finish() == ([], True)
    deltas, _ = _stream(LLAMA3_JSON, list('ok <|python_tag|>{"name": "get_time", "parameters": {}}'))
    assert [d["content"] for d in deltas if "content" in d] == ["o", "k"]


def test_arguments_stream_before_the_call_ends():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    stream = ToolCallStream(HERMES, make_id=_ids())
    head = text.index('"unit"')
    deltas = stream.feed(text[:head])
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]) == '{"city": "Paris"'


def test_names_limit_what_is_a_call():
    text = '{"name": "Ada", "parameters": {"born": 1815}}'
    assert parse_tool_calls(text, LLAMA3_JSON, names={"get_time"}) == (text, [])
    assert parse_tool_calls(text, LLAMA3_JSON, names={"Ada"})[1][0].name == "Ada"
    text = xml_call("Ada", ("born", "1815"))
    assert parse_tool_calls(text, QWEN3_CODER, names={"get_time"}) == (text, [])
    assert parse_tool_calls(text, QWEN3_CODER, names={"Ada": None})[1][0].arguments == '{"born": 1815}'


# -- Qwen3-Coder's XML values, converted by the function's schema ---------------------------------------------

PLAN = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "open": {"type": "boolean"},
    "nothing": {"type": "null"},
    "stops": {"type": "array", "items": {"type": "string"}},
    "budget": {"type": "object"},
    "note": {"type": ["string", "null"]},
    "unit": {"enum": ["c", "f"]},
    "level": {"enum": [1, 2, 3]},
    "mode": {"$ref": "#/$defs/mode"},
    "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
}, "$defs": {"mode": {"type": "string"}}}
# (raw value, parameter, value): what each parameter's schema makes of the model's text
CONVERSIONS = [
    ("3", "city", "3"), ("null", "city", "null"), ('{"a": 1}', "city", '{"a": 1}'), (" Paris ", "city", " Paris "),
    ("3", "days", 3), ("-12", "days", -12), ("three", "days", "three"), ("3.5", "days", "3.5"), ("3.0", "days", 3.0),
    ("2.5", "ratio", 2.5), ("7", "ratio", 7), ("1e999", "ratio", "1e999"), ("NaN", "ratio", "NaN"),
    ("true", "open", True), ("False", "open", False), ("yes", "open", "yes"),
    ("null", "nothing", None), ("None", "nothing", None),
    ('["Rome", "Oslo"]', "stops", ["Rome", "Oslo"]), ("[1, 2", "stops", "[1, 2"),
    ('{"max": 900}', "budget", {"max": 900}), ("{'max': 900}", "budget", "{'max': 900}"),
    ("null", "note", None), ("a note", "note", "a note"), ('"quoted"', "note", "quoted"), ("42", "note", "42"),
    ("c", "unit", "c"), ("2", "level", 2), ("12", "mode", "12"),
    ("7", "either", 7), ("true", "either", True), ("maybe", "either", "maybe"),
    ("42", "extra", 42), ("[1]", "extra", [1]), ("hello", "extra", "hello"), ("", "extra", ""),
]


@pytest.mark.parametrize("raw, key, value", CONVERSIONS, ids=[f"{k}={r!r}" for r, k, _ in CONVERSIONS])
def test_xml_values_follow_the_schema(raw, key, value):
    text = xml_call("plan", (key, raw))
    content, calls = parse_tool_calls(text, QWEN3_CODER, {"plan": PLAN})
    assert content is None and json.loads(calls[0].arguments) == {key: value}
    assert type(json.loads(calls[0].arguments)[key]) is type(value)  # 3.0 stays a float, "3" a string
    direct = xml_value(raw, PLAN["properties"][key], PLAN) if key in PLAN["properties"] else xml_value(raw)
    assert direct == value and type(direct) is type(value)


def test_xml_call_streams_as_vllm_does():
    """Char by char: the header (id, type, name), `{`, each parameter whole once its value ends, `}` at
    `</function>`; in pieces of any size the deltas join to the whole answer's parse, values converted."""
    text = ("Let me look.\n" + xml_call("plan", ("city", "Paris"), ("days", "3"), ("stops", '["Rome"]'), ("x", "y"))
            + "\n" + xml_call("get_time"))
    names = {"plan": PLAN, "get_time": None}
    deltas, called = _stream(QWEN3_CODER, list(text), names)
    assert called and deltas[0] == {"content": "L"} and "".join(d.get("content", "") for d in deltas) == "Let me look."
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert pieces[0] == {"index": 0, "id": "chatcmpl-tool-" + "0" * 32, "type": "function",
                         "function": {"name": "plan", "arguments": ""}}
    assert [p["function"]["arguments"] for p in pieces[1:6]] == [
        "{", '"city": "Paris"', ', "days": 3', ', "stops": ["Rome"]', ', "x": "y"']
    assert [p["function"]["arguments"] for p in pieces[6:]] == ["}", "", "{", "}"]
    whole = parse_tool_calls(text, QWEN3_CODER, names, make_id=_ids())
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [
        ("plan", {"city": "Paris", "days": 3, "stops": ["Rome"], "x": "y"}), ("get_time", {})]
    assert join_deltas(deltas) == whole
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(2, 16)))
        deltas, _ = _stream(QWEN3_CODER, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], names)
        assert join_deltas(deltas) == whole


def test_xml_markers_are_held_back_from_content():
    stream = ToolCallStream(QWEN3_CODER)
    shown = ""
    for piece, now in [("a <", "a"), ("func", "a"), ("tion", "a"), (" b", "a <function b"),
                       (" <tool_", "a <function b"), ("call>\n<function=get_time>", "a <function b")]:
        shown += "".join(d.get("content", "") for d in stream.feed(piece))
        assert shown == now, piece
    deltas, called = stream.finish()
    assert called and [d["tool_calls"][0]["function"]["arguments"] for d in deltas] == ["}"]
    assert stream.ended == 1


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=["hermes", "llama3"])
def test_grammar_pieces_parse_back(fmt):
    """The prefix / key / suffix the grammar layer builds a forced call from give that call back."""
    one = [json.dumps({"name": n, fmt.arguments_key: a}) for n, a in [("get_weather", PARIS), ("get_time", {})]]
    text = fmt.separator.join(fmt.prefix + j + fmt.suffix for j in one)
    content, calls = parse_tool_calls(text, fmt)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", PARIS), ("get_time", {})]


# -- the prompt -------------------------------------------------------------------------------------------

QWEN_LIKE = (  # a template that takes tools and writes calls the Hermes way (written for this test)
    "{% if tools %}<|sys|>Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QWEN3_CODER_LIKE = (  # a template that takes tools and asks for Qwen3-Coder's XML calls (written for these tests)
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for tool in tools %}{% set f = tool.function %}<function>\n<name>{{ f.name }}</name>\n"
    "{% for key, p in f.parameters.properties|items %}<parameter>{{ key }}: {{ p | tojson }}</parameter>\n"
    "{% endfor %}</function>\n{% endfor %}</tools>\n"
    "To call one, answer with:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\n"
    "value\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for key, value in c.function.arguments|items %}<parameter={{ key }}>\n"
    "{{ value | tojson if value is mapping or (value is sequence and value is not string) else value }}\n"
    "</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_LIKE = (
    "{% for m in messages %}{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>{{ m.content }}"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}{% endif %}{% endfor %}"
    "{% if tools is not none %}{{ tools | length }} tools{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, light rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]


def test_formats_from_templates():
    from strata.model.loader import ModelFiles

    default = ModelFiles.open("default")
    assert not template_takes_tools(default.tokenizer.chat_template)
    assert tool_format(default.tokenizer.chat_template, default.family.name) is HERMES
    assert template_takes_tools(QWEN_LIKE) and tool_format(QWEN_LIKE, "qwen3") is HERMES
    assert template_takes_tools(LLAMA_LIKE) and tool_format(LLAMA_LIKE, "llama") is LLAMA3_JSON
    assert tool_format("{{ tools }} <|python_tag|>", "qwen3") is LLAMA3_JSON
    assert tool_format("{{ tools }}", "llama") is LLAMA3_JSON and tool_format("{{ tools }}", "qwen3") is HERMES
    assert tool_format("{{ tools }}{{ '<tool_call>\\n<function=' + name }}", "qwen3_5_moe") is QWEN3_CODER
    assert template_takes_tools(QWEN3_CODER_LIKE) and tool_format(QWEN3_CODER_LIKE, "llama") is QWEN3_CODER
    assert tool_format("no tools here: <|python_tag|>", "llama") is HERMES  # Strata's own prompt is Hermes
    assert not template_takes_tools("{% for tool in tool_list %}{% endfor %}")


@pytest.fixture(scope="module")
def default_tokenizer():
    from strata.model.loader import ModelFiles

    return ModelFiles.open("default").tokenizer


def test_hermes_prompt_on_the_default_template(default_tokenizer):
    messages, extra = template_messages(HISTORY, [WEATHER, TIME], default_tokenizer.chat_template)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    prompt = default_tokenizer.apply_chat_template(messages, **extra)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    system = prompt.split("<|im_end|>")[0]
    assert "get_weather" in system and "<tool_call>" in system.split("</tools>")[-1]  # and how to call one
    # the past call as the model would write it, and both results in one user turn
    assistant = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(assistant, HERMES)[1][0].name == "get_weather"
    assert json.loads(parse_tool_calls(assistant, HERMES)[1][0].arguments) == PARIS
    results = "<tool_response>\n18 C, light rain\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_hermes_prompt_keeps_the_system_message(default_tokenizer):
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    messages, _ = template_messages(system, [TIME], default_tokenizer.chat_template)
    assert messages[0]["content"].startswith("Be brief.\n\n") and "get_time" in messages[0]["content"]
    assert len(messages) == 2


def test_tool_choice_none_offers_no_tools(default_tokenizer):
    for template in (default_tokenizer.chat_template, QWEN_LIKE):
        messages, extra = template_messages(HISTORY, [WEATHER], template, tool_choice="none")
        assert extra == {} and not any("<tools>" in m["content"] for m in messages)
    messages, _ = template_messages(HISTORY, [WEATHER], default_tokenizer.chat_template, tool_choice="none")
    prompt = default_tokenizer.apply_chat_template(messages)
    assert "get_weather" in prompt and "18 C, light rain" in prompt  # the history is still there


def test_native_template_gets_tools_and_results(default_tokenizer):
    messages, extra = template_messages(HISTORY, [WEATHER, TIME], QWEN_LIKE)
    assert extra == {"tools": [WEATHER, TIME]}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == PARIS  # an object, as templates expect
    assert messages[2] == {"role": "tool", "content": "18 C, light rain", "tool_call_id": "call_1"}
    assert messages[3]["content"] == "14:05"
    prompt = Tokenizer(default_tokenizer.backend, chat_template=QWEN_LIKE).apply_chat_template(messages, **extra)
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt and '"name": "get_time"' in prompt
    assert "<|tool|>18 C, light rain [call_1]<|end|>" in prompt
    assistant = prompt.split("<|assistant|>")[1].split("<|end|>")[0]
    calls = parse_tool_calls(assistant, HERMES)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", PARIS)]


def test_qwen3_coder_template_round_trip(default_tokenizer):
    """A template walking `arguments|items` gets each past call's arguments as an object; the call it writes
    parses back into the same call (Python's True as Qwen's template prints it included)."""
    arguments = {"city": "Paris", "days": 3, "open": True, "stops": ["Rome", "Oslo"], "budget": {"max": 900}}
    history = [HISTORY[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "plan", "arguments": json.dumps(arguments)}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}, HISTORY[2]]
    tools = [{"type": "function", "function": {"name": "plan", "parameters": PLAN}}, TIME]
    messages, extra = template_messages(history, tools, QWEN3_CODER_LIKE)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == {}  # no arguments: an empty object
    prompt = Tokenizer(default_tokenizer.backend, chat_template=QWEN3_CODER_LIKE).apply_chat_template(messages, **extra)
    assert '<parameter>city: {"type": "string"}</parameter>' in prompt and "<function=example_function_name>" in prompt
    assert "<parameter=days>\n3\n</parameter>\n<parameter=open>\nTrue\n</parameter>" in prompt
    assert "<tool_response>\n18 C, light rain\n</tool_response>" in prompt
    assistant = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(assistant, QWEN3_CODER, {"plan": PLAN, "get_time": None})
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("plan", arguments), ("get_time", {})]


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"Paris"'])
def test_arguments_a_template_walks_must_be_an_object(arguments):
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]
    with pytest.raises(APIError) as e:
        template_messages(history, [WEATHER], QWEN3_CODER_LIKE)
    assert e.value.status == 400 and e.value.param == "messages.1.tool_calls.0.function.arguments"
    assert "JSON object" in e.value.message
    template_messages(history, [WEATHER], QWEN_LIKE)  # a template printing them whole takes any text


def test_native_messages_without_calls_have_no_tool_calls_key():
    messages, extra = template_messages([{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}],
                                        None, LLAMA_LIKE)
    assert messages == [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}] and extra == {}
