"""Tool calls and structured output through a real `strata serve` on the embedded default (the shared `server`
fixture), with the official `openai` SDK: forced calls (a named function, "required") whose arguments validate
against the function's schema, streamed and not; a tool result going back through the prompt; json_schema answers
that validate, in windows beside unconstrained greedy answers that stay what they are alone; guided choice and
regex; bad constraints refused by name; an answer closed by its first call leaving the next answer intact. Then
the same forced calls in Qwen3-Coder's XML format, on a tiny random model whose chat template asks for it (the
`coder` fixture, one server for those tests).

SmolLM2-135M does not call tools by itself: every call here comes from constrained decoding (docs/SERVING.md)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                            "parameters": WEATHER_PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone",
                                          "parameters": TIME_PARAMETERS}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TRIP = {"type": "object", "properties": WEATHER_PARAMETERS["properties"], "required": ["city", "days"],
        "additionalProperties": False}
TRIP_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}}
PLAIN_PROMPTS = ["Name three colours.", "Count from one to five.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, **kw})


def streamed_chat(client, **kw) -> tuple[list[dict], str | None, int]:
    """A streamed chat answer: its deltas (as sent), the finish reason of the last chunk, completion tokens."""
    deltas, finish, tokens = [], None, 0
    for chunk in chat(client, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            deltas.append(c.delta.model_dump(exclude_none=True))
            finish = c.finish_reason or finish
    return deltas, finish, tokens


def joined_calls(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Streamed deltas joined as a client joins them: the content, and per call index its id, name, arguments."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for piece in d.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"ids": [], "name": "", "arguments": ""})
            if piece.get("id"):
                call["ids"].append(piece["id"])
            call["name"] += piece.get("function", {}).get("name") or ""
            call["arguments"] += piece.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def plain_answer(client, prompt: str) -> str:
    return chat(client, messages=[{"role": "user", "content": prompt}], max_tokens=12).choices[0].message.content


@pytest.fixture(scope="module")
def solo(client):
    """The unconstrained greedy answers of PLAIN_PROMPTS, each alone."""
    return {p: plain_answer(client, p) for p in PLAIN_PROMPTS}


def assert_valid_call(name: str, arguments: str, expected_name: str | None = None):
    assert name in SCHEMAS and (expected_name is None or name == expected_name)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- forced tool calls ------------------------------------------------------------------------------------

FORCED = {"named": dict(tool_choice=NAMED), "required": dict(tool_choice="required", parallel_tool_calls=False)}


@pytest.fixture(scope="module")
def forced_whole(client):
    return {k: chat(client, messages=ASK, tools=TOOLS, max_tokens=48, **kw) for k, kw in FORCED.items()}


def assert_one_forced_call(r, choice: str):
    """A choice that is one tool call (named: get_weather) whose arguments validate, and nothing else; the call."""
    assert r.finish_reason == "tool_calls"
    assert r.message.content is None and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert_valid_call(call.function.name, call.function.arguments, "get_weather" if choice == "named" else None)
    return call


@pytest.mark.parametrize("choice", FORCED)
def test_forced_call_validates_against_the_function_schema(forced_whole, choice):
    r = forced_whole[choice].choices[0]
    assert_one_forced_call(r, choice)


@pytest.mark.parametrize("choice", FORCED)
def test_forced_call_streamed_joins_to_the_same_call(client, forced_whole, choice):
    deltas, finish, _ = streamed_chat(client, messages=ASK, tools=TOOLS, max_tokens=48, **FORCED[choice])
    assert finish == "tool_calls"
    content, calls = joined_calls(deltas)
    assert content == "" and len(calls) == 1
    whole = forced_whole[choice].choices[0].message.tool_calls[0]
    assert len(calls[0]["ids"]) == 1 and calls[0]["ids"][0].startswith("chatcmpl-tool-")
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert_valid_call(calls[0]["name"], calls[0]["arguments"])
    # vLLM's shapes: the call's header (id, type, name, empty arguments) first, then argument pieces only
    pieces = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert pieces[0]["function"] == {"name": calls[0]["name"], "arguments": ""} and pieces[0]["type"] == "function"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])


def test_a_call_closing_the_answer_leaves_the_next_answer_intact(client, solo, forced_whole):
    """With parallel_tool_calls false the answer ends once its first call is read: before the grammar's
    `</tool_call>` line, the job aborted and its slot freed; the next answer is what it is alone."""
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=48)
    closed = chat(client, parallel_tool_calls=False, **kw)
    full = forced_whole["named"]  # the same call, run to the grammar's end
    assert closed.choices[0].finish_reason == "tool_calls"
    assert closed.choices[0].message.tool_calls[0].function.arguments == \
        full.choices[0].message.tool_calls[0].function.arguments
    assert closed.usage.completion_tokens < full.usage.completion_tokens
    prompt = PLAIN_PROMPTS[0]
    assert plain_answer(client, prompt) == solo[prompt]

    deltas, finish, _ = streamed_chat(client, parallel_tool_calls=False, **kw)
    assert finish == "tool_calls" and joined_calls(deltas)[0] == ""
    assert plain_answer(client, prompt) == solo[prompt]


def test_a_tool_result_goes_back_through_the_prompt(client, server):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"forecast": "sunny, 24 C"}'}]
    r = chat(client, messages=messages, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["count"] == r.usage.prompt_tokens  # the chat request read this prompt
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    # SmolLM2's template takes no tools: Strata's Hermes prompt (docs/SERVING.md, "Tool calls")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"forecast": "sunny, 24 C"}\n</tool_response>' in prompt
    assert '"name": "get_time"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    # tool_choice "none": the tools are not offered, the past call and its result still are in the prompt
    none = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    text = httpx.post(server.url + "/detokenize", json={"tokens": none.json()["tokens"]}).json()["prompt"]
    assert "<tools>" not in text and "<tool_response>" in text


# -- structured output ------------------------------------------------------------------------------------


def test_json_schema_answers_validate_beside_unchanged_greedy_answers(client, solo):
    """Three json_schema requests and three unconstrained greedy ones at once (--batch 4: shared windows, and some
    wait for a slot): each constrained answer validates, each greedy answer is what it is alone."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    trips = ["Plan a trip to Rome.", "Plan a week in Oslo.", "Where should I travel?"]
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, client, messages=[{"role": "user", "content": t}], response_format=fmt,
                                   max_tokens=24, temperature=0.8, seed=i) for i, t in enumerate(trips)]
        plain = {p: pool.submit(plain_answer, client, p) for p in PLAIN_PROMPTS}
        answers = [f.result().choices[0] for f in constrained]
        assert {p: f.result() for p, f in plain.items()} == solo
    for a in answers:
        assert a.finish_reason == "stop", a.message.content
        jsonschema.validate(json.loads(a.message.content), TRIP)


def test_json_object_and_structured_outputs_json(client):
    r = chat(client, messages=[{"role": "user", "content": "Describe Paris."}], max_tokens=40,
             response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an open object may run past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="A trip:", max_tokens=24, temperature=0,
                                  extra_body={"structured_outputs": {"json": TRIP}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), TRIP)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_guided_choice_and_regex(client, endpoint):
    choices = ["sunny", "rainy", "snowy"]
    pattern = r"[0-9]{2}-[A-Z]{3}"

    def ask(**extra):
        if endpoint == "chat":
            r = chat(client, messages=[{"role": "user", "content": "The weather tomorrow?"}], max_tokens=8,
                     extra_body=extra)
            return r.choices[0].message.content, r.choices[0].finish_reason
        r = client.completions.create(model=MODEL, prompt="The weather tomorrow will be", max_tokens=8,
                                      temperature=0, extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason

    assert ask(guided_choice=choices)[0] in choices
    text, finish = ask(guided_regex=pattern)
    assert re.fullmatch(pattern, text) and finish == "stop"
    assert ask(structured_outputs={"choice": choices})[0] in choices


# -- the pure functions: constraints and the parser agree ---------------------------------------------------


@pytest.fixture(scope="module")
def grammars():
    from strata.grammar import GrammarVocab, Grammars
    from strata.model.loader import ModelFiles

    files = ModelFiles.open("default")
    return files.tokenizer, Grammars(GrammarVocab.build(files.tokenizer, width=files.spec.vocab_size))


def accepts(grammars, constraint, text: str) -> bool:
    """Whether the compiled constraint takes `text` (as the tokenizer spells it) as a whole answer."""
    from strata.grammar import GrammarMatcher

    tokenizer, cache = grammars
    matcher = GrammarMatcher(cache.compile(constraint))
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.can_end()


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_written_as_the_parser_reads_it(grammars, fmt_name, choice):
    """For each format the server forces calls in, a call as the model writes it is a whole answer of the forced
    grammar and parses back into the same call; the other format's argument key is refused."""
    from serve.requests import ToolPlan, forced_call_constraint
    from serve.schemas import ChatCompletionRequest
    from serve.tools import HERMES, LLAMA3_JSON, parse_tool_calls
    from strata.grammar.tools import MAX_PARALLEL_CALLS

    fmt = {"hermes": HERMES, "llama3_json": LLAMA3_JSON}[fmt_name]
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **FORCED[choice]})
    constraint = forced_call_constraint(body, ToolPlan(fmt, frozenset(SCHEMAS), body.parallel_tool_calls, True))
    arguments = {"city": "Oslo", "days": 4}

    def written(key: str) -> str:
        return fmt.prefix + json.dumps({"name": "get_weather", key: arguments}) + fmt.suffix

    assert accepts(grammars, constraint, written(fmt.arguments_key))
    other = "parameters" if fmt.arguments_key == "arguments" else "arguments"
    assert not accepts(grammars, constraint, written(other))
    assert not accepts(grammars, constraint, written(fmt.arguments_key).replace("4}", '"4"}'))  # not the schema
    content, calls = parse_tool_calls(written(fmt.arguments_key), fmt, SCHEMAS)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", arguments)]
    two = written(fmt.arguments_key) + fmt.separator + fmt.prefix + json.dumps(
        {"name": "get_time", fmt.arguments_key: {"zone": "UTC"}}) + fmt.suffix
    assert not accepts(grammars, constraint, two)  # one call: named, or parallel_tool_calls false
    if fmt is HERMES and choice == "required":  # parallel calls: blocks a separator apart
        body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
        parallel = forced_call_constraint(body, ToolPlan(fmt, frozenset(SCHEMAS), True, True))
        assert accepts(grammars, parallel, two) and accepts(grammars, parallel, written("arguments"))
        most = fmt.separator.join([written("arguments")] * MAX_PARALLEL_CALLS)  # a small model's loop ends there
        assert accepts(grammars, parallel, most)
        assert not accepts(grammars, parallel, most + fmt.separator + written("arguments"))
        assert [c.name for c in parse_tool_calls(two, fmt, SCHEMAS)[1]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_xml_call_is_written_as_the_parser_reads_it(grammars, choice):
    """A template asking for `<function=...>` calls: the plan reads Qwen3-Coder's XML with the tools' schemas, and
    its forced grammar takes a call as that template writes one, which parses back into the same call."""
    from serve.requests import forced_call_constraint, tool_plan
    from serve.schemas import ChatCompletionRequest
    from serve.tools import QWEN3_CODER, parse_tool_calls
    from strata.model.tokenizer import Tokenizer
    from tests.test_tools import QWEN3_CODER_LIKE

    tokenizer = Tokenizer(grammars[0].backend, chat_template=QWEN3_CODER_LIKE)
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **FORCED[choice]})
    plan = tool_plan(body, tokenizer, "llama")
    assert plan.fmt is QWEN3_CODER and plan.names == SCHEMAS and plan.forced
    constraint = forced_call_constraint(body, plan)
    weather = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n4\n"
               "</parameter>\n</function>\n</tool_call>")
    clock = "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
    assert accepts(grammars, constraint, weather) and not accepts(grammars, constraint, weather + "\n" + clock)
    assert not accepts(grammars, constraint, weather.replace("4", '"4"'))  # an integer, as its schema says
    assert not accepts(grammars, constraint, weather.replace("Oslo", "Bergen"))  # one of the enum's cities
    assert accepts(grammars, constraint, clock) == (choice == "required")
    content, calls = parse_tool_calls(weather, QWEN3_CODER, plan.names)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 4})]
    if choice == "required":  # parallel calls: blocks a newline apart
        body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
        parallel = forced_call_constraint(body, tool_plan(body, tokenizer, "llama"))
        assert accepts(grammars, parallel, weather + "\n" + clock)
        assert [c.name for c in parse_tool_calls(weather + "\n" + clock, QWEN3_CODER, SCHEMAS)[1]] == [
            "get_weather", "get_time"]


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": TRIP_FORMAT}, "json_schema", "response_format"),
    ({"structured_outputs": {"json": json.dumps(TRIP)}}, "json_schema", "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, "grammar", "structured_outputs.grammar"),
    ({"guided_json": TRIP}, "json_schema", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "yes" | "no"'}, "grammar", "guided_grammar"),
    ({"tools": TOOLS}, None, None),
    ({"tools": TOOLS, "tool_choice": "none"}, None, None),
    ({"tools": TOOLS, "tool_choice": "required"}, "grammar", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED}, "grammar", "tool_choice"),
])
def test_which_field_constrains_the_answer(grammars, fields, kind, param):
    from serve.requests import request_constraint, tool_plan
    from serve.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": ASK, **fields})
    constraint, field = request_constraint(body, tool_plan(body, grammars[0], "llama"))
    assert (constraint.kind if constraint else None, field) == (kind, param)
    if constraint is not None:
        grammars[1].compile(constraint)


# -- bad input --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "'get_news', which is not among the tools (get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice"),
    ({"response_format": TRIP_FORMAT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice",
     "response_format and tool_choice"),
    ({"structured_outputs": {"json": TRIP, "regex": "a"}}, "structured_outputs.regex",
     "structured_outputs.json and structured_outputs.regex"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "extra": 1}}]},
     "tools.0.function.extra", "Strata does not support this field"),
])
def test_bad_constraints_and_tools_are_refused_by_name(server, extra, param, words):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text


# -- Qwen3-Coder's XML calls: a model whose template asks for them ----------------------------------------------


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """`strata serve` on a tiny random Llama with the default's tokenizer and a Qwen3-Coder-style chat template
    (tests/test_tools.py's, which asks for `<function=...>` calls): (server, client, model name)."""
    from strata.model.loader import ModelFiles
    from tests.server_process import Server
    from tests.test_tools import QWEN3_CODER_LIKE
    from tests.tiny_models import build

    folder = tmp_path_factory.mktemp("qwen3-coder-like")
    tokenizer = ModelFiles.open("default").tokenizer
    build("llama-gqa-tied", folder, vocab_size=tokenizer.vocab_size)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(QWEN3_CODER_LIKE)
    srv = Server("--model", str(folder), "--batch", "2", "--max-cells", "1024", "--cpu-threads", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        yield srv, client, client.models.list().data[0].id
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def coder_forced(coder):
    _, client, model = coder
    return {k: chat(client, model=model, messages=ASK, tools=TOOLS, max_tokens=256, **kw) for k, kw in FORCED.items()}


@pytest.mark.parametrize("choice", FORCED)
def test_xml_forced_call_validates_whole_and_streamed(coder, coder_forced, choice):
    """The grammar writes the call as the template's model would (`<tool_call>\\n<function=...>`, one element per
    parameter); the XML parser reads it into `tool_calls` whose arguments validate; streamed, the same call."""
    _, client, model = coder
    call = assert_one_forced_call(coder_forced[choice].choices[0], choice)

    deltas, finish, _ = streamed_chat(client, model=model, messages=ASK, tools=TOOLS, max_tokens=256,
                                      **FORCED[choice])
    assert finish == "tool_calls"
    content, calls = joined_calls(deltas)
    assert content == "" and len(calls) == 1 and len(calls[0]["ids"]) == 1
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
    pieces = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert pieces[0]["function"] == {"name": call.function.name, "arguments": ""} and pieces[0]["type"] == "function"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])


def test_xml_past_calls_and_results_through_the_template(coder):
    """A past call is written by the model's own template from its arguments as an object (`arguments|items`),
    its result as the template writes tool messages; arguments that are no JSON object are refused by name."""
    server, _, model = coder
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"forecast": "sunny, 24 C"}'}]
    tokenized = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages, "tools": TOOLS})
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokenized.json()["tokens"]}).json()["prompt"]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>") in prompt
    assert "<tool_response>\n{\"forecast\": \"sunny, 24 C\"}\n</tool_response>" in prompt
    assert "<name>get_time</name>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    broken = [*messages[:1], {**messages[1], "tool_calls": [{**call, "function": {**call["function"],
                                                                                   "arguments": "[1, 2]"}}]}]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": model, "messages": broken, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
