"""The constraint behind `tool_choice: "required"` and a named function: the answer is a call of one of the tools
(or of the named one) whose arguments follow that function's parameters schema."""

from __future__ import annotations

import json

from strata.errors import StrataError
from strata.grammar.constraint import JSON_STYLE, Constraint

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


def tool_call_schema(tools: list[dict], name: str | None = None, *, arguments_key: str = "arguments") -> dict:
    """A JSON schema for one call, `{"name": <const>, <arguments_key>: <the function's parameters>}`: of the
    function `name`, or of any of `tools` (an anyOf, one branch a function, so the arguments are checked against
    the function the name says). `tools` in OpenAI's form: [{"type": "function", "function": {"name",
    "parameters"}}]. `arguments_key`: "arguments" (Hermes, Qwen, Mistral), "parameters" (Llama 3's JSON calls)."""
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
    calls = [{
        "type": "object",
        "properties": {"name": {"const": n}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for n, parameters in functions.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_call_constraint(tools: list[dict], name: str | None = None, *, wrap: str | None = None,
                         parallel: bool = False, arguments_key: str = "arguments") -> Constraint:
    """The constraint for a forced tool call. `wrap` None: the answer is the call's JSON alone. `wrap="hermes"`: the
    Hermes / Qwen text form, `<tool_call>\\n{json}\\n</tool_call>`, as a Lark grammar with the schema inline (llguidance
    compiles the JSON part from the schema inside the grammar, no regex approximation), and with `parallel` one
    or more such blocks, a newline apart."""
    schema = tool_call_schema(tools, name, arguments_key=arguments_key)
    if wrap is None:
        if parallel:
            raise StrataError("parallel calls need a wrapper that separates them (wrap='hermes')")
        return Constraint.json_schema(schema)
    if wrap != "hermes":
        raise StrataError(f"unknown tool-call wrapper {wrap!r} (known: hermes)")
    inline = json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)  # the JSON style inside Lark too
    call = f'"<tool_call>\\n" %json {inline} "\\n</tool_call>"'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Constraint.grammar(f"{start}\ncall: {call}\n")
