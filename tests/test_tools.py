"""serve/tools.py: tool calls parsed from answers in each family's format, whole and streamed at every split,
and tools, past calls and tool results rendered into the chat template's input."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from serve.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolCallStream,
    join_deltas,
    parse_tool_calls,
    template_messages,
    template_takes_tools,
    tool_format,
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
CASES = [(f"hermes: {c[0]}", HERMES, *c[1:]) for c in HERMES_CASES]
CASES += [(f"llama3: {c[0]}", LLAMA3_JSON, *c[1:]) for c in LLAMA_CASES]
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
    assert tool_format("{{ tools }}{{ '<tool_call>\\n<function=' + name }}", "qwen3_5_moe") is None
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


def test_native_messages_without_calls_have_no_tool_calls_key():
    messages, extra = template_messages([{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}],
                                        None, LLAMA_LIKE)
    assert messages == [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}] and extra == {}
