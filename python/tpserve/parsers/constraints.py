"""OpenAI request fields that constrain the output, turned into one grammar spec:
``response_format`` (json_object, json_schema, structural_tag), the vLLM/SGLang extras ``regex`` and ``ebnf``, vLLM's
``structured_outputs`` (and its older ``guided_*`` fields), and ``tool_choice`` "required" or a named
function (the calls' JSON, see ``ForcedToolCalls``)."""

from __future__ import annotations

import json
from typing import Any

from tpserve.sampling_params import StructuredOutput


class FieldError(ValueError):
    """A request field is invalid; ``param`` names it (for a 400 answer)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> parameters schema; FieldError if a tool is malformed."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise FieldError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise FieldError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise FieldError(f"tools[{i}].function.description must be a string", "tools")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise FieldError(f"tools[{i}].function.strict must be a boolean", "tools")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise FieldError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[name] = parameters
    return functions


def tool_parameters(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each function's parameter schemas (checked tools): its JSON schema's ``properties``, or the schema itself where
    it has none (vLLM's qwen3_coder reading of them)."""
    schemas = check_tools(tools)
    return {name: schema.get("properties", schema) for name, schema in schemas.items()}


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools (checked by ``check_tools``) as vLLM hands them to the chat template (its ``ChatCompletionToolsParam``'s
    ``model_dump()``): ``type``, then the function's ``name``, ``description`` and ``parameters`` (null where not
    given) and ``strict`` (where given), in that order; other keys are left out. Templates such as Qwen3's write each
    tool with ``tojson``, so key order and missing keys show in the prompt."""
    if not tools:
        return None
    shown = []
    for tool in tools:
        function = tool["function"]
        spec = {"name": function["name"], "description": function.get("description"),
                "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            spec["strict"] = function["strict"]
        shown.append({"type": "function", "function": spec})
    return shown


def named_tool(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names, or None for "auto"/"none"/"required"/null."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type", "function") == "function" and isinstance(function, dict):
            name = function.get("name")
            if isinstance(name, str):
                return name
    raise FieldError(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def tool_call_structure(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> StructuredOutput | None:
    """The grammar that forces tool calls, or None when the model chooses (auto/none)."""
    functions = check_tools(tools)
    name = named_tool(tool_choice)
    if tool_choice in (None, "auto", "none"):
        return None
    if not functions:
        raise FieldError("tool_choice needs tools", "tool_choice")
    if name is not None:
        if name not in functions:
            raise FieldError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return StructuredOutput("json_schema", json.dumps(functions[name]))
    defs: dict[str, Any] = {}
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": fn}, "parameters": _rooted(schema, f"tool{i}", defs)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for i, (fn, schema) in enumerate(functions.items())
            ]
        },
    }
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    if defs:
        calls["$defs"] = defs
    return StructuredOutput("json_schema", json.dumps(calls))


def _rooted(schema: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as a part of the "required" calls' schema: where it refers to itself (``$ref`` "#...", as Pydantic's
    ``$defs`` are referred to), it moves whole under the new root's ``$defs[key]`` and its references are re-pointed
    there, so they resolve against it and not against the new root."""
    repointed = _repoint(schema, f"#/$defs/{key}")
    if repointed == schema:  # no reference of its own: nested as it is
        return schema
    defs[key] = repointed
    return {"$ref": f"#/$defs/{key}"}


_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))  # values, not schemas: a "$ref" in them is data


def _is_local_ref(key: str, value: Any) -> bool:
    """A reference to the document's root or a JSON pointer in it ("#", "#/..."; an anchor "#name" is not one)."""
    return key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/"))


def _repoint(node: Any, root: str) -> Any:
    """A copy of ``node`` whose local references point under ``root``."""
    if isinstance(node, dict):
        return {k: root + v[1:] if _is_local_ref(k, v) else v if k in _DATA_KEYWORDS else _repoint(v, root)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_repoint(v, root) for v in node]
    return node


def response_format_structure(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise FieldError("response_format json_schema needs json_schema.schema (a JSON schema)", "response_format")
        return StructuredOutput("json_schema", json.dumps(schema))
    if kind == "structural_tag":  # vLLM's: xgrammar's structural tag ("format"), or its older "structures"/"triggers"
        return StructuredOutput("structural_tag", json.dumps(response_format))
    raise FieldError(
        f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
        "response_format",
    )


def _grammar(kind: str, spec: str | None, param: str | None = None) -> StructuredOutput | None:
    """A ``regex`` or ``ebnf`` field's constraint (None when not given); ``param``: the field, if not ``kind``."""
    if spec is None:
        return None
    if not spec:
        raise FieldError(f"{param + ': ' if param else ''}{kind} must not be empty", param or kind)
    return StructuredOutput(kind, spec)


# vLLM's structured outputs: one of these keys of ``structured_outputs`` (or its older field ``guided_<key>``)
VLLM_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def vllm_structure(spec: Any, param: str) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` object (``{"choice": [...]}``, ``{"json": schema}``, ...) as a grammar spec;
    ``param`` names the field it came from. A choice is a grammar of its literal strings."""
    if spec is None:
        return None
    usage = f"{param} must be an object with one of {', '.join(VLLM_STRUCTURED_KINDS)}"
    if not isinstance(spec, dict):
        raise FieldError(usage, param)
    # vLLM's other keys at their defaults (as dataclasses.asdict(StructuredOutputsParams(...)) sends them) change
    # nothing; disable_fallback neither (xgrammar compiles every grammar); set, the others ask for what is not served
    unknown = sorted(key for key, value in spec.items()
                     if key not in (*VLLM_STRUCTURED_KINDS, "disable_fallback") and value not in (None, False, ""))
    if unknown:
        raise FieldError(f"{param}.{unknown[0]} is not supported ({usage})", param)
    given = [key for key in VLLM_STRUCTURED_KINDS if spec.get(key) not in (None, False)]
    if len(given) != 1:
        raise FieldError(usage + (f", not {' and '.join(given)}" if given else ""), param)
    kind, value = given[0], spec[given[0]]
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise FieldError(f"{param}: json must be a JSON schema (an object, or its JSON text)", param) from None
        if not isinstance(value, (dict, bool)):
            raise FieldError(f"{param}: json must be a JSON schema (an object, or its JSON text)", param)
        return StructuredOutput("json_schema", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise FieldError(f"{param}: choice must be a list of non-empty strings", param)
        return StructuredOutput("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if not isinstance(value, str):
        raise FieldError(f"{param}: {kind} must be a string", param)
    if kind == "structural_tag":  # its JSON text, as vLLM's StructuredOutputsParams holds it
        return _grammar("structural_tag", value, param)
    return _grammar("regex" if kind == "regex" else "ebnf", value, param)


def output_structure(
    response_format: dict[str, Any] | None,
    regex: str | None = None,
    ebnf: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    vllm_specs: dict[str, Any] | None = None,
) -> StructuredOutput | None:
    """The one constraint a request asks for; FieldError if it asks for several. ``vllm_specs``: field name ->
    vLLM's structured_outputs object (``structured_outputs``, or a ``guided_*`` field as one)."""
    found = [
        (param, spec)
        for param, spec in (
            ("response_format", response_format_structure(response_format)),
            ("regex", _grammar("regex", regex)),
            ("ebnf", _grammar("ebnf", ebnf)),
            ("tool_choice", tool_call_structure(tools, tool_choice, parallel_tool_calls)),
            *((name, vllm_structure(spec, name)) for name, spec in (vllm_specs or {}).items()),
        )
        if spec is not None
    ]
    if len(found) > 1:
        raise FieldError(f"give only one of {', '.join(p for p, _ in found)}: each constrains the output", found[1][0])
    return found[0][1] if found else None
