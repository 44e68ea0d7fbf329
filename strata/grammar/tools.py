"""The constraint behind `tool_choice: "required"` and a named function: the answer is a call of one of the tools
(or of the named one) whose arguments follow that function's parameters schema, in the text form the model writes
calls in: the call's JSON alone (Llama 3), Hermes / Qwen `<tool_call>` blocks of JSON, or Qwen3-Coder's XML calls.

Qwen3-Coder / Qwen3.5 write a call as markup, one parameter per element, each value as raw text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

(`serve/tools.py` reads it back: one newline after `>` and one before `</parameter>` are not part of the value; a
value ends at the first of `XML_VALUE_ENDS`.)"""

from __future__ import annotations

import json
import re

from strata.errors import StrataError
from strata.grammar.constraint import JSON_STYLE, Constraint

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted

# Qwen3-Coder's markup. A value ends at the first of XML_VALUE_ENDS (as vLLM's qwen3_coder parser reads it), so a
# string the grammar writes as raw text never holds one of them.
XML_CALL_START, XML_CALL_END = "<tool_call>", "</tool_call>"
XML_FUNCTION, XML_FUNCTION_END = "<function=", "</function>"
XML_PARAMETER, XML_PARAMETER_END = "<parameter=", "</parameter>"
XML_VALUE_ENDS = (XML_PARAMETER_END, XML_PARAMETER, XML_FUNCTION_END, XML_CALL_END)
WRAPS = ("hermes", "qwen3_coder")
# a forced answer's parallel calls: at most this many. Unbounded, a small model repeats a call until max_tokens or
# the context ends it (seen with tool_choice "required" on the 135M default); real agents' turns call far fewer.
MAX_PARALLEL_CALLS = 16
PARALLEL_START = f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}'


def tool_functions(tools: list[dict], name: str | None = None) -> dict[str, dict]:
    """{function name: its parameters schema} of `tools` (OpenAI's form: [{"type": "function", "function": {"name",
    "parameters"}}]), or of the one named `name`; a function without `parameters` takes none (`NO_PARAMETERS`)."""
    functions = {}
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise StrataError(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise StrataError(f"tools[{i}].function.parameters: a JSON schema object is needed")
        functions[function["name"]] = parameters or NO_PARAMETERS
    if not functions:
        raise StrataError("tool_choice needs at least one tool in `tools`")
    if name is not None:
        if name not in functions:
            raise StrataError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})")
        functions = {name: functions[name]}
    return functions


def tool_call_schema(tools: list[dict], name: str | None = None, *, arguments_key: str = "arguments") -> dict:
    """A JSON schema for one call, `{"name": <const>, <arguments_key>: <the function's parameters>}`: of the
    function `name`, or of any of `tools` (an anyOf, one branch a function, so the arguments are checked against
    the function the name says). `tools` in OpenAI's form: [{"type": "function", "function": {"name",
    "parameters"}}]. `arguments_key`: "arguments" (Hermes, Qwen, Mistral), "parameters" (Llama 3's JSON calls)."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": n}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for n, parameters in tool_functions(tools, name).items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_constraint(tools: list[dict], name: str | None = None, *, wrap: str | None = None,
                         parallel: bool = False, arguments_key: str = "arguments") -> Constraint:
    """The constraint for a forced tool call. `wrap` None: the answer is the call's JSON alone. `wrap="hermes"`: the
    Hermes / Qwen text form, `<tool_call>\\n{json}\\n</tool_call>`, as a Lark grammar with the schema inline (llguidance
    compiles the JSON part from the schema inside the grammar, no regex approximation). `wrap="qwen3_coder"`: the
    XML form (`xml_call_grammar`). With `parallel` (a wrapper only), 1 to `MAX_PARALLEL_CALLS` blocks, a newline
    apart."""
    if wrap == "qwen3_coder":
        return Constraint.grammar(xml_call_grammar(tool_functions(tools, name), parallel=parallel))
    schema = tool_call_schema(tools, name, arguments_key=arguments_key)
    if wrap is None:
        if parallel:
            raise StrataError("parallel calls need a wrapper that separates them (wrap='hermes' or 'qwen3_coder')")
        return Constraint.json_schema(schema)
    if wrap != "hermes":
        raise StrataError(f"unknown tool-call wrapper {wrap!r} (known: {', '.join(WRAPS)})")
    inline = json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)  # the JSON style inside Lark too
    call = f'"<tool_call>\\n" %json {inline} "\\n</tool_call>"'
    start = PARALLEL_START if parallel else "start: call"
    return Constraint.grammar(f"{start}\ncall: {call}\n")


# -- Qwen3-Coder's XML calls --------------------------------------------------------------------------------

# Raw text holding none of the markers that end a value. One lexeme with the value's closing line: llguidance's
# lexemes are greedy, so the text cannot stop before "\n</parameter>" unless the closing is part of it.
_XML_TEXT = ("/(?s:.*)/ & ~/(?s:.*)(" + "|".join(m.replace("/", "\\/") for m in XML_VALUE_ENDS) + ")(?s:.*)/")
_CLOSE = "\n" + XML_PARAMETER_END


def xml_call_grammar(functions: dict[str, dict], *, parallel: bool = False) -> str:
    """The Lark grammar (llguidance's dialect) of one call of any of `functions` ({name: parameters schema}), or with
    `parallel` of 1 to `MAX_PARALLEL_CALLS`, written as Qwen3-Coder's chat template writes a past call: `<tool_call>\\n<function=
    NAME>\\n`, each parameter `<parameter=KEY>\\nVALUE\\n</parameter>\\n`, then `</function>\\n</tool_call>`; calls a
    newline apart.

    Parameters come in the schema's `properties` order (required ones always, the others optional; required names
    that `properties` lacks after them, as any JSON). A value follows its property's schema: a schema of strings
    only (`value_types`) is raw text, one of its enum or const strings, or free text that holds none of
    `XML_VALUE_ENDS` with `minLength` / `maxLength` and a `pattern` (taken as anchored at both ends) kept and a
    `format` not enforced; any other schema (integers, numbers, booleans, null, objects, arrays, unions with
    them) is that schema's JSON inline (`%json`), which `serve/tools.py` reads back as JSON. (A JSON string
    inside an object or array value is not kept from holding `</parameter>`, where the parser would end the
    value; models do not write one there.)"""
    rules: list[str] = []
    terminals: dict[str, str] = {}  # regex -> its terminal's name, one per distinct text value
    branches = []
    for i, (fname, parameters) in enumerate(functions.items()):
        _check_name(fname, "function")
        parameters = parameters if isinstance(parameters, dict) else {}
        properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
        required = [r for r in parameters.get("required") or () if isinstance(r, str)]
        parts = []
        for j, pname in enumerate([*properties, *(r for r in required if r not in properties)]):
            _check_name(pname, f"function {fname!r}: parameter")
            value = _xml_value(properties.get(pname, {}), parameters, terminals, f"{fname}.{pname}")
            opener = _lit(f"{XML_PARAMETER}{pname}>\n")
            rules.append(f"p{i}_{j}: {opener} {value}")
            parts.append(f"p{i}_{j}" if pname in required else f"p{i}_{j}?")
        body = " ".join([_lit(f"{XML_FUNCTION}{fname}>\n"), *parts, _lit(XML_FUNCTION_END + "\n")])
        rules.append(f"f{i}: {body}")
        branches.append(f"f{i}")
    start = PARALLEL_START if parallel else "start: call"
    call = f"call: {_lit(XML_CALL_START + chr(10))} ({' | '.join(branches)}) {_lit(XML_CALL_END)}"
    lexemes = [f"{name}: {regex}" for regex, name in terminals.items()]
    return "\n".join([start, call, *rules, *lexemes]) + "\n"


def _xml_value(schema, root: dict, terminals: dict[str, str], where: str) -> str:
    """A parameter's value and its closing line (`\\n</parameter>\\n`) as a Lark expression: raw text where
    `value_types` says the schema takes strings only (`serve/tools.py` keeps such a value's text as it is), else
    the schema's JSON."""
    schema = {} if schema is True else schema
    if not isinstance(schema, dict):
        raise StrataError(f"{where}: a parameter's schema is a JSON object")
    if value_types(schema, root) == {"string"}:
        return f"({' | '.join(_text_values(schema, root, terminals, where))}) {_lit(chr(10))}"
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}  # where its "$ref"s point
    inline = {**schema, **defs, "x-guidance": JSON_STYLE}
    return f"%json {json.dumps(inline, ensure_ascii=False)} {_lit(_CLOSE + chr(10))}"


def _text_values(schema: dict, root: dict, terminals: dict[str, str], where: str, depth: int = 0) -> list[str]:
    """The alternatives of a string-only schema's raw text, each with the closing `\\n</parameter>`."""
    target = _local_ref(schema, root)
    if target is not None and depth < 8:
        return _text_values(target, root, terminals, where, depth + 1)
    strings = _string_choices(schema)
    if strings is not None:
        usable = [s for s in strings if not any(m in s for m in XML_VALUE_ENDS)]
        if not usable:
            raise StrataError(f"{where}: every allowed value holds markup ({', '.join(XML_VALUE_ENDS)}) that would "
                              "end the value early")
        return [_lit(s + _CLOSE) for s in usable]
    for key in ("anyOf", "oneOf"):
        if "type" not in schema and isinstance(schema.get(key), list) and schema[key] and depth < 8:
            return [v for branch in schema[key] for v in _text_values(branch, root, terminals, where, depth + 1)]
    regex = _XML_TEXT
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        regex += " & /(?s:.){%d,%s}/" % (low if isinstance(low, int) else 0, high if isinstance(high, int) else "")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        pattern = pattern[1:] if pattern.startswith("^") else pattern
        pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        regex += " & /(?:" + re.sub(r"(?<!\\)/", r"\\/", pattern) + ")/"
    return [terminals.setdefault(f"({regex}) {_lit(_CLOSE)}", f"TEXT_VALUE{len(terminals)}")]


def value_types(schema, root: dict | None = None, depth: int = 0) -> set[str] | None:
    """The JSON types a parameter's schema allows ("string", "integer", ...; None: any, or too involved to say),
    from its "type", "const", "enum", "anyOf" / "oneOf" branches, or the local "$ref" it points to in `root` (the
    parameters schema). `{"string"}`: its value is raw text, in the grammar and in `serve/tools.py` alike."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    target = _local_ref(schema, root or {})
    if target is not None:
        return value_types(target, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return set(kind)
    if "const" in schema:
        return json_types(schema["const"])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return set().union(*(json_types(v) for v in schema["enum"]))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            branches = [value_types(b, root, depth + 1) for b in schema[key]]
            return None if None in branches else set().union(*branches)
    return None


def json_types(value) -> set[str]:
    """The JSON schema types a value is (an integer is a number too; 2.0 an integer too, as JSON schema counts)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _local_ref(schema: dict, root: dict):
    """What a schema's local "$ref" ("#/$defs/...") points to in `root` (None: it has none, or it leads nowhere)."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    target = root
    for part in ref[2:].split("/"):
        target = target.get(part) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else None


def _string_choices(schema: dict) -> list[str] | None:
    """The strings a string-only enum or const allows (None: the schema is not one)."""
    if "const" in schema:
        options = [schema["const"]]
    elif isinstance(schema.get("enum"), list) and schema["enum"]:
        options = schema["enum"]
    else:
        return None
    return options if all(isinstance(o, str) for o in options) else None


def _check_name(name: str, what: str) -> None:
    if not name or any(c in name for c in "<>\n"):
        raise StrataError(f"{what} {name!r} cannot be written in Qwen3-Coder's XML calls (a name holds no '<', '>' "
                          "or newline); rename it")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
