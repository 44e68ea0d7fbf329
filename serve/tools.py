"""Tool calls between OpenAI's shapes and the model's text: the tools and past calls into the chat template's
input, the model's answer back into `tool_calls`, whole or as streamed deltas.

Formats (`ToolFormat`), chosen from the chat template's text (`tool_format`):
- `HERMES` (Qwen3 and Hermes templates, and Strata's own prompt for templates that take no tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly several, possibly after text.
- `LLAMA3_JSON` (Llama 3.1+ templates): `{"name": ..., "parameters": {...}}` at the start of the answer or after
  `<|python_tag|>`, several separated by `;`.
Both read either key, "arguments" or "parameters".
- `QWEN3_CODER` (Qwen3-Coder and Qwen3.5 templates, which ask for `<function=...>`): XML calls,
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>`, possibly
  several, possibly after text; each value is raw text converted by its parameter's schema (`xml_value`).

Parsing is one streaming parser (`ToolCallStream`); `parse_tool_calls` feeds it the whole text, so a streamed
answer and the same answer parsed whole always agree. Its rules:
- Text outside calls is content. When the answer holds a call, whitespace at the end of the content is dropped
  and a content of only whitespace is None; without a call the content is the text unchanged.
- A call's JSON is read strictly, one character at a time. Until its name is read, anything wrong (no JSON
  object after the marker, a broken object, no "name", a name not among `names`) makes the whole block plain
  content, as vLLM does. Once the name is out (streamed as soon as it is read), the call stands: arguments are
  streamed as far as they are certainly well formed, and where the model's JSON breaks or the text ends, they
  are closed there (`{"city": "Par` gives `{"city": "Par"}`), so `arguments` is always valid JSON. Raw
  control characters inside strings are escaped (`\\n`); arguments given as a JSON string are decoded.
- Qwen3-Coder's XML calls are read as vLLM's `qwen3_coder` parser reads them. A call opens at `<tool_call>` (or at
  a bare `<function=`, which some answers write without the wrapper); its name runs to `>`. Until the name is
  read, anything wrong (no `<function=` after `<tool_call>`, a name with a newline, a name not among `names`)
  makes the block plain content. Once the name is out (the call's header, then `{`), each parameter is streamed
  whole when its value ends: at `</parameter>`, or where the model forgot it, at the next `<parameter=`, at
  `</function>` or `</tool_call>`; one newline after `<parameter=KEY>` and one before the end are not part of
  the value. `</function>` closes the arguments (`}`); the rest of the block up to `</tool_call>` is dropped.
  Text between parameters is ignored, a parameter named twice keeps its first value, and an answer that ends
  inside a call has its arguments closed there (a value cut off is kept up to where a closing marker may
  begin). The arguments are the JSON object of the converted values, `{"city": "Paris", "days": 3}`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta

from serve.errors import APIError
from strata.grammar.tools import (XML_CALL_END, XML_CALL_START, XML_FUNCTION, XML_FUNCTION_END, XML_PARAMETER,
                                  XML_PARAMETER_END, XML_VALUE_ENDS, json_types, value_types)


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call. `prefix` + the call + `suffix` is one call as the model writes it,
    calls joined by `separator` (what a grammar for `tool_choice` "required" or a named function builds on).
    `markup` "json": the call is a JSON object, its arguments under `arguments_key`; "xml": Qwen3-Coder's
    `<function=NAME>` element, one `<parameter=KEY>` element per argument (`strata.grammar.tools`)."""

    name: str
    start: str  # the marker that opens a call anywhere in the answer
    end: str  # the marker that closes it ("" where the JSON object's end does)
    prefix: str
    suffix: str
    separator: str
    arguments_key: str  # "" where the arguments are no JSON object (xml)
    markup: str = "json"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", "", "", "", "; ", "parameters")
QWEN3_CODER = ToolFormat("qwen3_coder", XML_CALL_START, XML_CALL_END, XML_CALL_START + "\n", "\n" + XML_CALL_END,
                         "\n", "", markup="xml")
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text

    def openai(self) -> dict:
        """The entry of a chat completion message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's shape


# -- which format, and how tools reach the model ----------------------------------------------------------


def tool_format(chat_template: str | None, family: str | None = None) -> ToolFormat:
    """The format a model writes calls in. A template that does not read `tools` gets Strata's Hermes prompt
    (`template_messages`), so `HERMES`; one that does names its format in its text (`<tool_call>`: Hermes;
    `<|python_tag|>` or "ipython": Llama 3; `<function=`: Qwen3-Coder's XML calls, as Qwen3-Coder's and Qwen3.5's
    templates ask for them); `family` (Strata's family name) decides where it names none."""
    text = chat_template or ""
    if not template_takes_tools(text):
        return HERMES
    if XML_FUNCTION in text:
        return QWEN3_CODER
    if "<tool_call>" in text:
        return HERMES
    if "<|python_tag|>" in text or "ipython" in text or family == "llama":
        return LLAMA3_JSON
    return HERMES


@lru_cache(maxsize=8)
def template_takes_tools(chat_template: str | None) -> bool:
    """Whether the template reads the `tools` variable (then it gets the request's tools as transformers'
    `apply_chat_template` passes them; otherwise Strata describes them in the system message)."""
    if not chat_template:
        return False
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False


def template_messages(
    messages: list[dict], tools: list[dict] | None, chat_template: str | None, tool_choice="auto"
) -> tuple[list[dict], dict]:
    """OpenAI request messages and tools -> (messages, extra) for `Tokenizer.apply_chat_template(messages,
    **extra)`.

    A template that reads `tools` gets them as `extra["tools"]` (OpenAI tool dicts, unchanged), past calls as
    `tool_calls` with their arguments parsed into objects (as transformers' templates expect) and tool
    results as `role: "tool"` messages. Any other template gets Strata's Hermes prompt: the tools described
    in the system message, past calls written in the assistant's content as `<tool_call>` blocks, and tool
    results as a user message of `<tool_response>` blocks (user, not tool: a template without tools may
    refuse roles it does not know); answers are then parsed with `HERMES`.

    `tool_choice` "none": the tools are not offered at all (neither to the template nor in the prompt), so the
    model answers in plain text; past calls and results are still rendered. (vLLM by default still gives
    the template the tools and only skips parsing.) "auto", "required" and a named function all offer every
    tool; the grammar, not the prompt, forces the call.
    """
    offered = list(tools or []) if tool_choice != "none" else []
    if template_takes_tools(chat_template):
        native = [_native_message(m) for m in messages]
        if _ITEMS_OF_ARGUMENTS.search(chat_template):
            _check_argument_objects(native)
        return native, ({"tools": offered} if offered else {})
    out: list[dict] = []
    results = False  # the last message of `out` is a turn of tool results
    for m in messages:
        role, content = _role(m), _text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if role == "assistant" and m.get("tool_calls"):
            blocks = [HERMES.prefix + _call_json(c) + HERMES.suffix for c in m["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": content})
    if offered:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{hermes_tools_prompt(offered)}"
        else:
            out.insert(0, {"role": "system", "content": hermes_tools_prompt(offered)})
    return out, {}


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The system message's description of the tools for a template that takes none."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = json.dumps({"name": "<function name>", "arguments": {"<parameter>": "<value>"}})
    return (
        "You have tools you can call. Each tool's signature is one JSON object inside the <tools></tools> tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a tool, write its name and arguments as one JSON object inside <tool_call></tool_call> tags, "
        "one block per call:\n"
        f"<tool_call>\n{example}\n</tool_call>\n"
        "The result of each call comes back inside <tool_response></tool_response> tags."
    )


def _role(m: dict) -> str:
    return "system" if m.get("role") == "developer" else m.get("role", "user")


def _text(content) -> str:
    """A message's content as text: None -> "", a list of parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments_object(arguments):
    """A past call's arguments as the object they stand for: JSON text parsed, no text at all `{}`; text that is
    not JSON stays as it is."""
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


# A template that walks a past call's arguments key by key (Qwen3-Coder's and Qwen3.5's: `arguments|items`).
_ITEMS_OF_ARGUMENTS = re.compile(r"arguments\s*\|\s*items\b|arguments\.items\(\)")


def _check_argument_objects(messages: list[dict]) -> None:
    """For a template that walks each past call's arguments key by key: every call's arguments are an object."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            arguments = call["function"]["arguments"]
            if not isinstance(arguments, dict):
                field = f"messages.{i}.tool_calls.{j}.function.arguments"
                shown = json.dumps(arguments, ensure_ascii=False)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise APIError(400, f"{field}: this model's chat template writes a past call's arguments one by one, "
                                    f"so they must be the text of a JSON object (such as {{\"city\": \"Paris\"}}), "
                                    f"and they are {shown}; send the call's arguments as a JSON object", param=field)


def _call_json(call: dict) -> str:
    function = call.get("function", call)
    args = _arguments_object(function.get("arguments", {}))
    return json.dumps({"name": function.get("name", ""), HERMES.arguments_key: args}, ensure_ascii=False)


def _native_message(m: dict) -> dict:
    out = {"role": _role(m), "content": _text(m.get("content"))}
    if m.get("tool_calls"):  # only when there are some: Llama's template asks whether the key exists
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c.get("function", {}).get("name", ""),
                    "arguments": _arguments_object(c.get("function", {}).get("arguments", {})),
                },
            }
            for c in m["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


# -- strict JSON, one character at a time -----------------------------------------------------------------

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


class _Json:
    """One JSON object read a character at a time. `push` says False at the first character that no JSON text
    could continue with; `members` maps the outermost object's keys to their values' [start, end) in
    `chars` (end None while the value is read); `closers` says what would close the text so far."""

    def __init__(self):
        self.chars: list[str] = []  # one entry per character pushed (a raw control character: its escape)
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.expect = "value"  # value, value_or_end, key, key_or_end, colon, comma_or_end, done
        self.string = ""  # "key" or "value" while inside a string
        self.escape = 0  # -1 just after a backslash; n > 0 while n hex digits of a \u escape are due
        self.scalar = ""  # the number or literal being read
        self.members: dict[str, list] = {}
        self._member: list = [None, None]
        self._key_at = 0

    def text(self, start: int = 0, end: int | None = None) -> str:
        return "".join(self.chars[start:end])

    def push(self, c: str) -> bool:
        at = len(self.chars)
        if not self._step(c, at):
            return False
        self.chars.append(_CONTROL_ESCAPES.get(c, f"\\u{ord(c):04x}") if self.string and c < " " else c)
        return True

    def closers(self) -> str | None:
        """What completes the text so far inside the outermost container (None where nothing appended can)."""
        if self.escape or self.string == "key" or (self.scalar and not self._scalar_ok(final=True)):
            return None
        if not (self.string or self.scalar) and self.expect not in ("comma_or_end", "key_or_end", "value_or_end"):
            return None
        inner = "".join("}" if o == "{" else "]" for o in reversed(self.stack[1:]))
        return ('"' if self.string else "") + inner

    def _step(self, c: str, at: int) -> bool:
        if self.string:
            return self._string_char(c, at)
        if self.scalar:
            if c.isalnum() or c in "+-.":
                self.scalar += c
                return self._scalar_ok(final=False)
            if not self._scalar_ok(final=True):
                return False
            self.scalar = ""
            self._value_done(at)
        if c in _WS:
            return True
        expect = self.expect
        if expect in ("value", "value_or_end"):
            if c == "]" and expect == "value_or_end":
                return self._close(c, at)
            if len(self.stack) == 1:
                self._member[0] = at
            if c == '"':
                self.string = "value"
            elif c in "{[":
                self.stack.append(c)
                self.expect = "key_or_end" if c == "{" else "value_or_end"
            elif c in "-0123456789tfn":
                self.scalar = c
            else:
                return False
            return True
        if expect in ("key", "key_or_end"):
            if c == "}" and expect == "key_or_end":
                return self._close(c, at)
            if c != '"':
                return False
            self.string, self._key_at = "key", at
            return True
        if expect == "colon":
            self.expect = "value"
            return c == ":"
        if expect == "comma_or_end":
            if c == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
                return True
            return c in "}]" and self._close(c, at)
        return False  # done: nothing may follow the object

    def _string_char(self, c: str, at: int) -> bool:
        if self.escape == -1:
            self.escape = 4 if c == "u" else 0
            return c in '"\\/bfnrtu'
        if self.escape:
            self.escape -= 1
            return c in "0123456789abcdefABCDEF"
        if c == "\\":
            self.escape = -1
        elif c == '"':
            kind, self.string = self.string, ""
            if kind == "value":
                self._value_done(at + 1)
            else:
                self.expect = "colon"
                if len(self.stack) == 1:
                    self._member = [None, None]
                    self.members.setdefault(json.loads(self.text(self._key_at) + '"'), self._member)
        return True

    def _scalar_ok(self, final: bool) -> bool:
        s = self.scalar
        if s[0].isalpha():
            return s in _LITERALS if final else any(word.startswith(s) for word in _LITERALS)
        return bool(_NUMBER.fullmatch(s)) if final else all(ch in "0123456789+-.eE" for ch in s)

    def _close(self, c: str, at: int) -> bool:
        if self.stack[-1] != ("{" if c == "}" else "["):
            return False
        self.stack.pop()
        self._value_done(at + 1)
        return True

    def _value_done(self, end: int) -> None:
        if len(self.stack) == 1:
            self._member[1] = end
        self.expect = "comma_or_end" if self.stack else "done"


# -- the answer's text -> content and calls ---------------------------------------------------------------


class _Call:
    def __init__(self, opener: str):
        self.opener = opener  # the marker and whitespace before the JSON (content again if this is no call)
        self.json = _Json()
        self.index = -1
        self.name: str | None = None
        self.sent = 0  # characters of the arguments streamed
        self.good: tuple[int, str] | None = None  # the longest arguments prefix known to close: (end, closers)


class _XmlCall:
    def __init__(self, opener: str, wrapped: bool):
        self.opener = opener  # the text read since the block began (content again if this is no call)
        self.wrapped = wrapped  # opened by <tool_call>: after </function>, the rest up to </tool_call> is dropped
        self.index = -1
        self.name: str | None = None
        self.properties: dict = {}  # the function's parameters schema's properties (values are converted by them)
        self.root: dict = {}  # the parameters schema (what a property's "$ref" points into)
        self.param: str | None = None  # the parameter whose value is being read
        self.seen: set[str] = set()  # parameters streamed
        self.scanned = 0  # characters of the value known to hold no end marker


class ToolCallStream:
    """Feed the answer's text as it comes; get OpenAI chat completion `delta` dicts as vLLM streams them:
    `{"content": ...}` until a call begins (text that may be the start of a marker is held back), then per call
    `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}` once its name
    is read and `{"tool_calls": [{"index", "function": {"arguments": piece}}]}` whose pieces join into its
    arguments. `finish` flushes and says whether a call was made (finish_reason "tool_calls"). `ended` counts the
    calls read to their end, so a server can end the answer at its first call (`parallel_tool_calls` false).

    `names`: the functions that may be called (a call to another is content; None: any), either names or a
    mapping of each name to its parameters schema, which the XML format converts values by (a name without a
    schema: every value is JSON if it reads as JSON, else a string)."""

    def __init__(self, fmt: ToolFormat, names=None, make_id=new_call_id):
        self.fmt = fmt
        self.names = set(names) if names is not None else None  # a call to another name is content
        self.schemas = dict(names) if isinstance(names, Mapping) else {}
        self.make_id = make_id
        self.calls = 0
        self.ended = 0  # calls whose JSON has been read to its end (or to where it broke): no more arguments come
        self._buf = ""  # text read but not decided yet
        self._ws = ""  # whitespace held at the end of the content
        # text, opening, call, after (to the end marker), broken (content to the end marker); xml: xml_open (after
        # <tool_call>), xml_name, xml_body (between parameters), xml_param (a parameter's name), xml_value
        self._mode = "text"
        self._xml = fmt.markup == "xml"
        self._openers = (fmt.start, XML_FUNCTION) if self._xml else (fmt.start,)
        self._json_may_open = fmt.end == ""  # Llama: a bare JSON object may open a call here
        self._call: _Call | _XmlCall | None = None
        self._out: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[list[dict], bool]:
        self._run(final=True)
        if self._call is not None:  # the answer ended inside a call
            self._end_call()
        if not self.calls and self._ws:
            self._emit({"content": self._ws})
        self._ws = ""
        return self._take(), self.calls > 0

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        step = {"text": self._text, "opening": self._opening, "call": self._read_call,
                "after": self._to_end, "broken": self._to_end, "xml_open": self._xml_open,
                "xml_name": self._xml_name, "xml_body": self._xml_body, "xml_param": self._xml_param,
                "xml_value": self._xml_value}
        while step[self._mode](final):
            pass

    def _emit(self, delta: dict) -> None:
        add_delta(self._out, delta)

    def _content(self, text: str) -> None:
        full = self._ws + text
        kept = full.rstrip()
        if kept:
            self._emit({"content": kept})
        self._ws = full[len(kept):]

    def _open(self, opener: str) -> None:
        if self._xml:  # a `<function=` inside a block (after a call, or in a broken one) belongs to the block
            block = opener == self.fmt.start
            self._call = _XmlCall(opener, wrapped=block or self._mode in ("after", "broken"))
            self._mode = "xml_open" if block else "xml_name"
            return
        self._call = _Call(opener)
        self._mode = "opening"

    def _text(self, final: bool) -> bool:
        buf = self._buf
        if self._json_may_open:
            rest = buf.lstrip()
            self._content(buf[: len(buf) - len(rest)])
            self._buf = buf = rest
            if not buf:
                return False
            if buf[0] == ";" and self.calls:
                self._buf = buf[1:]
                return True
            self._json_may_open = False
            if buf[0] == "{":
                self._open("")
                return True
        at, marker = _first(buf, self._openers)
        if at >= 0:
            self._content(buf[:at])
            self._buf = buf[at + len(marker):]
            self._open(marker)
            return True
        keep = _partial_marker(buf, self._openers)
        if final:  # after a call, the start of a marker at the very end is a next call cut off (max_tokens): dropped
            self._content(buf[: len(buf) - keep] if self.calls else buf)
            self._buf = ""
            return False
        self._content(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _opening(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        self._call.opener += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        if rest[:1] == "{":
            self._mode = "call"
            return True
        if not rest and not final:
            return False
        self._content(self._call.opener)  # no JSON object after the marker: plain text
        self._call = None
        self._mode = "broken" if self.fmt.end else "text"
        return True

    def _read_call(self, final: bool) -> bool:
        call = self._call
        for i, c in enumerate(self._buf):
            if not call.json.push(c):
                self._buf = self._buf[i:]
                self._end_call()
                return True
            if not self._progress(call):  # a name that makes this no call
                self._buf = self._buf[i + 1:]
                self._end_call()
                return True
            if call.json.expect == "done":
                self._buf = self._buf[i + 1:]
                self._end_call(complete=True)
                return True
        self._buf = ""
        self._send_arguments(call)
        return False

    def _progress(self, call: _Call) -> bool:
        json_ = call.json
        if call.name is None:
            span = json_.members.get("name")
            if span and span[1] is not None:
                name = json.loads(json_.text(*span))
                if not isinstance(name, str) or not name or (self.names is not None and name not in self.names):
                    return False
                call.name, call.index = name, self.calls
                self.calls += 1
                self._ws = ""  # the whitespace before a call separates it: no content after all
                self._emit({"tool_calls": [{"index": call.index, "id": self.make_id(), "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
        span = _arguments_span(json_)
        if span and span[0] is not None and json_.chars[span[0]] in "{[":
            if span[1] is not None:
                call.good = (span[1], "")
            else:
                closers = json_.closers()
                if closers is not None:
                    call.good = (len(json_.chars), closers)
        return True

    def _send_arguments(self, call: _Call, final: bool = False) -> None:
        if call.name is None:
            return
        json_, span = call.json, _arguments_span(call.json)
        if span and span[0] is not None and json_.chars[span[0]] in "{[":
            end, closers = call.good
            piece = json_.text(span[0] + call.sent, end) + (closers if final else "")
            call.sent = end - span[0]
        elif final and call.sent == 0:  # arguments as a string or scalar are sent whole
            complete = span is not None and span[1] is not None
            value = json.loads(json_.text(*span)) if complete else None
            value = {} if value in ("", None) else value
            piece = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            call.sent = len(piece)
        else:
            return
        if piece:
            self._emit({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})

    def _end_call(self, complete: bool = False) -> None:
        if self._xml:
            self._end_xml_call(after=False)
            return
        call, self._call = self._call, None
        if call.name is None:  # not a call: everything it read is content
            self._content(call.opener + call.json.text())
            self._mode = "broken" if self.fmt.end else "text"
            return
        self._send_arguments(call, final=True)
        self.ended += 1
        self._mode = "after" if self.fmt.end else "text"
        self._json_may_open = complete and not self.fmt.end

    def _to_end(self, final: bool) -> bool:
        """After a call (its rest is dropped) or a broken block (its rest is content): up to the end marker, or a
        new start marker."""
        keep_text = self._mode == "broken"
        end = self.fmt.end
        (at_start, start), at_end = _first(self._buf, self._openers), self._buf.find(end)
        if at_start >= 0 and (at_end < 0 or at_start < at_end):
            if keep_text:
                self._content(self._buf[:at_start])
            self._buf = self._buf[at_start + len(start):]
            self._open(start)
            return True
        if at_end >= 0:
            if keep_text:
                self._content(self._buf[: at_end + len(end)])
            self._buf = self._buf[at_end + len(end):]
            self._mode = "text"
            return True
        keep = 0 if final else _partial_marker(self._buf, (*self._openers, end))
        if keep_text:
            self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    # -- Qwen3-Coder's XML calls --

    def _xml_open(self, final: bool) -> bool:
        """After `<tool_call>`: whitespace, then `<function=`, or the block is content."""
        call, rest = self._call, self._buf.lstrip()
        call.opener += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        if rest.startswith(XML_FUNCTION):
            call.opener += XML_FUNCTION
            self._buf = rest[len(XML_FUNCTION):]
            self._mode = "xml_name"
            return True
        if XML_FUNCTION.startswith(rest) and not final:
            return False
        self._xml_not_a_call()
        return True

    def _xml_name(self, final: bool) -> bool:
        call, buf = self._call, self._buf
        at = buf.find(">")
        name = buf if at < 0 else buf[:at]
        if at < 0 and not final and not any(c in name for c in "<\n"):
            return False
        if at < 0 or not name or any(c in name for c in "<\n") or (self.names is not None and name not in self.names):
            self._xml_not_a_call()
            return True
        self._buf = buf[at + 1:]
        schema = self.schemas.get(name)
        call.root = schema if isinstance(schema, dict) else {}
        properties = call.root.get("properties")
        call.properties = properties if isinstance(properties, dict) else {}
        call.name, call.index = name, self.calls
        self.calls += 1
        self._ws = ""  # the whitespace before a call separates it: no content after all
        self._emit({"tool_calls": [{"index": call.index, "id": self.make_id(), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        self._emit({"tool_calls": [{"index": call.index, "function": {"arguments": "{"}}]})
        self._mode = "xml_body"
        return True

    def _xml_not_a_call(self) -> None:
        """What was read of a block that turns out to be no call is content; so is the rest of a `<tool_call>`."""
        call, self._call = self._call, None
        self._content(call.opener)
        self._mode = "broken" if call.wrapped else "text"

    def _xml_body(self, final: bool) -> bool:
        """Between parameters: the next `<parameter=`, `</function>` (the call's end), or the block's end or a new
        call where the model left `</function>` out; other text is skipped."""
        rest = self._buf = self._buf.lstrip()
        if rest.startswith(XML_PARAMETER):
            self._buf = rest[len(XML_PARAMETER):]
            self._mode = "xml_param"
            return True
        if rest.startswith(XML_FUNCTION_END):
            self._buf = rest[len(XML_FUNCTION_END):]
            self._end_xml_call(after=self._call.wrapped)
            return True
        if rest.startswith(XML_CALL_END):
            self._buf = rest[len(XML_CALL_END):]
            self._end_xml_call(after=False)
            return True
        if rest.startswith(self._openers):
            self._end_xml_call(after=self._call.wrapped)
            return True
        markers = (XML_PARAMETER, XML_FUNCTION_END, XML_CALL_END, *self._openers)
        if not rest or (not final and any(m.startswith(rest) for m in markers)):
            return False
        skip = rest.find("<", 1)
        self._buf = rest[skip:] if skip > 0 else ""
        return True

    def _xml_param(self, final: bool) -> bool:
        """A parameter's name, up to `>` (one with `<` or a newline in it is no parameter: skipped)."""
        at = self._buf.find(">")
        name = self._buf if at < 0 else self._buf[:at]
        if any(c in name for c in "<\n") or (at < 0 and final):
            self._mode = "xml_body"
            return True
        if at < 0:
            return False
        self._call.param, self._call.scanned = name, 0
        self._buf = self._buf[at + 1:]
        self._mode = "xml_value"
        return True

    def _xml_value(self, final: bool) -> bool:
        """A value, up to the first of `XML_VALUE_ENDS` (only `</parameter>` is its own; the others are read next)."""
        call, buf = self._call, self._buf
        at, marker = _first(buf, XML_VALUE_ENDS, call.scanned)
        if at >= 0:
            self._buf = buf[at + len(marker):] if marker == XML_PARAMETER_END else buf[at:]
            self._xml_parameter(buf[:at])
            return True
        if not final:
            call.scanned = max(0, len(buf) - max(len(m) for m in XML_VALUE_ENDS) + 1)
            return False
        self._buf = ""
        self._xml_parameter(buf[: len(buf) - _partial_marker(buf, XML_VALUE_ENDS)])  # cut off: kept up to a marker
        return True

    def _xml_parameter(self, raw: str) -> None:
        """One parameter read: streamed as `"key": value` (after ", " but for the first)."""
        call, name = self._call, self._call.param
        call.param = None
        self._mode = "xml_body"
        if name in call.seen:  # named twice: the first value stands (it is already out)
            return
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = xml_value(raw, call.properties.get(name, _NO_SCHEMA), call.root)
        piece = (", " if call.seen else "") + json.dumps(name, ensure_ascii=False) + ": "
        call.seen.add(name)
        self._emit({"tool_calls": [{"index": call.index,
                                    "function": {"arguments": piece + json.dumps(value, ensure_ascii=False)}}]})

    def _end_xml_call(self, after: bool) -> None:
        """The call's arguments closed (`}`). `after`: the rest of its `<tool_call>` block is dropped; else text."""
        call, self._call = self._call, None
        if call.name is None:  # the answer ended before the call's name: content
            self._content(call.opener + self._buf)
            self._buf = ""
            return
        self._emit({"tool_calls": [{"index": call.index, "function": {"arguments": "}"}}]})
        self.ended += 1
        self._mode = "after" if after else "text"


_NO_SCHEMA = object()  # a parameter its function's schema does not list


def xml_value(raw: str, schema=_NO_SCHEMA, root: dict | None = None):
    """A Qwen3-Coder parameter's raw text -> its JSON value, by the parameter's schema (as vLLM's qwen3_coder parser
    converts it): a string-only schema keeps the text; any other (integer, number, boolean, null, object, array,
    unions, a schema without a type, a parameter the schema does not list) takes the text as JSON when it reads
    as JSON of a type the schema allows, else keeps the text as a string. `True` / `False` and `None` (Python's
    spelling, which Qwen's template writes for past calls) count as booleans and null where the schema takes
    them. `root`: the parameters schema, where a local `$ref` points."""
    types = None if schema is _NO_SCHEMA else value_types(schema, root or {})
    if types == {"string"}:
        return raw
    try:
        value = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except ValueError:
        word = raw.strip()
        if types and "boolean" in types and word in ("True", "False"):
            return word == "True"
        if types and "null" in types and word == "None":
            return None
        return raw
    return value if types is None or json_types(value) & types else raw


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _no_constant(text: str):
    raise ValueError(f"{text} is not JSON")


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the first of `markers` begins in `text` (from `start`), and which one: (-1, "") if none does."""
    best, which = -1, ""
    for m in markers:
        at = text.find(m, start)
        if at >= 0 and (best < 0 or at < best):
            best, which = at, m
    return best, which


def add_delta(deltas: list[dict], delta: dict) -> None:
    """Append a delta to `deltas`, joined to the last one when both are content or both arguments (of one call:
    the next call's header comes between), so a stream sends as few chunks as the parse allows."""
    last = deltas[-1] if deltas else {}
    if "content" in delta and "content" in last:
        last["content"] += delta["content"]
    elif _arguments_piece(delta) and _arguments_piece(last):
        last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
    else:
        deltas.append(delta)


def _arguments_piece(delta: dict) -> bool:
    return "tool_calls" in delta and "id" not in delta["tool_calls"][0]


def _arguments_span(json_: _Json) -> list | None:
    return next((json_.members[k] for k in _ARGUMENT_KEYS if k in json_.members), None)


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could begin one of `markers`."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def join_deltas(deltas: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """Streamed deltas -> (content, calls), as the whole answer's message has them."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = piece.get("id", call["id"])
            call["name"] += piece["function"].get("name", "")
            call["arguments"] += piece["function"].get("arguments", "")
    tool_calls = [ToolCall(**calls[i]) for i in sorted(calls)]
    return (content or None) if tool_calls else content, tool_calls


def parse_tool_calls(text: str, fmt: ToolFormat, names=None, make_id=new_call_id):
    """A whole answer -> (content or None, [ToolCall]); the same as streaming it through `ToolCallStream`."""
    stream = ToolCallStream(fmt, names, make_id)
    deltas = stream.feed(text)
    return join_deltas(deltas + stream.finish()[0])
