"""Tool calls between OpenAI's shapes and the model's text: the tools and past calls into the chat template's
input, the model's answer back into `tool_calls`, whole or as streamed deltas.

Formats (`ToolFormat`), chosen from the chat template's text (`tool_format`):
- `HERMES` (Qwen3 and Hermes templates, and Strata's own prompt for templates that take no tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly several, possibly after text.
- `LLAMA3_JSON` (Llama 3.1+ templates): `{"name": ..., "parameters": {...}}` at the start of the answer or after
  `<|python_tag|>`, several separated by `;`.
Both read either key, "arguments" or "parameters".

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
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes a call. `prefix` + the call's JSON + `suffix` is one call as the model
    writes it, calls joined by `separator` (what a grammar for `tool_choice` "required" or a named function
    builds on); `arguments_key` is the JSON key of the arguments there."""

    name: str
    start: str  # the marker that opens a call anywhere in the answer
    end: str  # the marker that closes it ("" where the JSON object's end does)
    prefix: str
    suffix: str
    separator: str
    arguments_key: str


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", "", "", "", "; ", "parameters")
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


def tool_format(chat_template: str | None, family: str | None = None) -> ToolFormat | None:
    """The format a model writes calls in. A template that does not read `tools` gets Strata's Hermes prompt
    (`template_messages`), so `HERMES`; one that does names its format in its text (`<tool_call>`: Hermes;
    `<|python_tag|>` or "ipython": Llama 3); `family` (Strata's family name) decides where it names neither.
    None: the template asks for Qwen3-Coder's XML calls (`<function=...>`, Qwen3.5's template), which Strata
    does not parse yet (refuse `tools` for such a model rather than misread its calls)."""
    text = chat_template or ""
    if not template_takes_tools(text):
        return HERMES
    if "<function=" in text:
        return None
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
        return [_native_message(m) for m in messages], ({"tools": offered} if offered else {})
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
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


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


class ToolCallStream:
    """Feed the answer's text as it comes; get OpenAI chat completion `delta` dicts as vLLM streams them:
    `{"content": ...}` until a call begins (text that may be the start of a marker is held back), then per call
    `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}` once its name
    is read and `{"tool_calls": [{"index", "function": {"arguments": piece}}]}` whose pieces join into its
    arguments. `finish` flushes and says whether a call was made (finish_reason "tool_calls"). `ended` counts the
    calls read to their end, so a server can end the answer at its first call (`parallel_tool_calls` false)."""

    def __init__(self, fmt: ToolFormat, names=None, make_id=new_call_id):
        self.fmt = fmt
        self.names = set(names) if names is not None else None  # a call to another name is content
        self.make_id = make_id
        self.calls = 0
        self.ended = 0  # calls whose JSON has been read to its end (or to where it broke): no more arguments come
        self._buf = ""  # text read but not decided yet
        self._ws = ""  # whitespace held at the end of the content
        self._mode = "text"  # text, opening, call, after (to the end marker), broken (content to the end marker)
        self._json_may_open = fmt.end == ""  # Llama: a bare JSON object may open a call here
        self._call: _Call | None = None
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
                "after": self._to_end, "broken": self._to_end}
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
        at = buf.find(self.fmt.start)
        if at >= 0:
            self._content(buf[:at])
            self._buf = buf[at + len(self.fmt.start):]
            self._open(self.fmt.start)
            return True
        keep = 0 if final else _partial_marker(buf, (self.fmt.start,))
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
        start, end = self.fmt.start, self.fmt.end
        at_start, at_end = self._buf.find(start), self._buf.find(end)
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
        keep = 0 if final else _partial_marker(self._buf, (start, end))
        if keep_text:
            self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False


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
