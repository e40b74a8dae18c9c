"""A JSON schema as structured output (xgrammar) can hold it: the keywords xgrammar parses but does not enforce
(refused, as vLLM's xgrammar backend refuses them, since a "stop" answer could break them), and the schema as given to
xgrammar (required names it would drop, patterns it would write unescaped, formats it takes loosely)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any


# Keywords whose values are schemas (one, a list, or a map of names to schemas), as far as a walk of a schema needs
_SCHEMA_VALUED = frozenset(("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
                            "additionalItems", "unevaluatedItems", "unevaluatedProperties"))
_SCHEMA_LISTS = frozenset(("anyOf", "oneOf", "allOf", "prefixItems"))
_SCHEMA_MAPS = frozenset(("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"))
# Keywords xgrammar (0.2.9) parses but does not hold the output to (checked against jsonschema): a grammar that ignores
# them would let a "stop" answer break the schema. vLLM's xgrammar backend refuses such schemas too.
_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
# Keywords of one type that xgrammar ignores in a schema without "type" ({"minimum": 5} took 3), and where a subschema
# leaves its type to its parent ({"type": "integer", "anyOf": [{"minimum": 5}]} took 0). ("properties" or "items" make
# it an object or an array, and are held.)
_TYPED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format",
          "minItems", "maxItems", "minProperties", "maxProperties", "propertyNames", "patternProperties")
# The string formats xgrammar 0.2.9 writes; it takes any string for another ("idn-email" took "")
_FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                      "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"))


def _subschemas(node: dict[str, Any]) -> list[Any]:
    """The schemas directly inside schema ``node``."""
    found: list[Any] = []
    for key, value in node.items():
        if key in _SCHEMA_VALUED:
            found.extend(value if isinstance(value, list) else [value])  # items as a list: draft 4's tuples
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            found.extend(value)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            found.extend(value.values())
    return [child for child in found if isinstance(child, dict)]


def _schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every (sub)schema object of ``schema``, without recursion; a node's subschemas are read after it is yielded."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(_subschemas(node))


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` (and its subschemas) the grammar would silently not enforce, described, or
    None: those of ``_UNENFORCED`` (``uniqueItems`` only when true), ``multipleOf`` but an integer's by an integer,
    ``allOf`` of more than one schema, and a string's ``minLength``/``maxLength`` beside a ``pattern`` or ``format``
    (xgrammar keeps only the latter)."""
    names_schemas: set[int] = set()  # propertyNames' schemas, of strings without saying so (a parent comes first)
    for node in _schema_nodes(schema):
        for key in _UNENFORCED:
            if key in node and not (key == "uniqueItems" and node[key] is not True):
                return f"'{key}'"
        if isinstance(node.get("propertyNames"), dict):
            names_schemas.add(id(node["propertyNames"]))
        typed = next((key for key in _TYPED if key in node), None)
        if typed is not None and "type" not in node and id(node) not in names_schemas:
            return f"'{typed}' in a schema without a 'type' (xgrammar holds it only beside its type)"
        if "propertyNames" in node and (beside := _beside_names(node)) is not None:
            return f"'propertyNames' beside {beside}"
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and (len(patterns) > 1 or _beside_names(node) not in (None, "'patternProperties'")):
            return "'patternProperties' of more than one pattern, or beside 'properties' or an 'additionalProperties' schema"
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "string" in types and isinstance(node.get("format"), str) and node["format"] not in _FORMATS:
            return f"the string format {node['format']!r}"
        step = node.get("multipleOf")
        integer_step = isinstance(step, int) and not isinstance(step, bool)
        if step is not None and not (node.get("type") == "integer" and integer_step):
            return "'multipleOf' (enforced only for an integer type and an integer step)"
        bounds = [any(key in node for key in side) for side in (("minimum", "exclusiveMinimum"),
                                                                   ("maximum", "exclusiveMaximum"))]
        if step is not None and bounds[0] != bounds[1]:  # xgrammar drops it there: exclusiveMaximum 3 took -24 for 5
            return "'multipleOf' with a bound on one side only"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "'allOf' of more than one schema"
        lengths = [key for key in ("minLength", "maxLength") if key in node]
        if lengths and ("pattern" in node or "format" in node):
            return f"'{lengths[0]}' beside '{'pattern' if 'pattern' in node else 'format'}'"
    return None


def _beside_names(node: dict[str, Any]) -> str | None:
    """What of an object schema, beside its ``propertyNames`` or ``patternProperties``, xgrammar then does not hold to
    (as vLLM's xgrammar backend refuses them), described: ``propertyNames`` "^[a-c]+$" beside ``properties`` took
    {"zz": 1}; ``patternProperties`` "^a" beside ``properties`` gave a name "an..." its ``additionalProperties``'
    boolean."""
    for key in ("properties", "patternProperties"):
        if key in node:
            return f"'{key}'"
    return "an 'additionalProperties' schema" if isinstance(node.get("additionalProperties"), dict) else None


def _missing_required(node: dict[str, Any]) -> list[str]:
    """The names an object schema requires that its ``properties`` do not list."""
    required, properties = node.get("required"), node.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return []
    return [name for name in required if isinstance(name, str) and name not in properties]


def _add_required_properties(node: dict[str, Any]) -> None:
    """The object's required names that its ``properties`` leave out, added to them (as its ``additionalProperties``
    schema, else any value): in strict mode xgrammar would otherwise leave them out, and its output would lack a
    required property."""
    if missing := _missing_required(node):
        extra = node.get("additionalProperties")
        value_schema = extra if isinstance(extra, dict) else {}
        node["properties"] = {**node.get("properties", {}), **dict.fromkeys(missing, value_schema)}


def _escaped_pattern(pattern: str) -> str:
    """``pattern`` with each character outside printable ASCII written as an escape ``\\u{...}`` (an escaped one's
    backslash dropped). xgrammar compiles a pattern of printable ASCII into a JSON string's body, escapes included; any
    other it spells out character by character, unescaped: ``^.é$`` gave the string ``""é"``, not JSON."""
    out, escaped = [], False
    for char in pattern:
        if 0x20 <= ord(char) <= 0x7E:
            out.append(char)
            escaped = char == "\\" and not escaped
            continue
        if escaped:  # "\é" is "é"
            out.pop()
        out.append(f"\\u{{{ord(char):X}}}")
        escaped = False
    return "".join(out)


def _escape_patterns(node: dict[str, Any]) -> None:
    """The node's ``pattern`` and ``patternProperties`` names through ``_escaped_pattern``."""
    if isinstance(node.get("pattern"), str):
        node["pattern"] = _escaped_pattern(node["pattern"])
    if isinstance(node.get("patternProperties"), dict):
        node["patternProperties"] = {_escaped_pattern(k): v for k, v in node["patternProperties"].items()}


def unescaped_pattern(schema: Any) -> str | None:
    """A ``pattern`` of ``schema`` that xgrammar cannot hold inside a JSON string, or None: one that matches only with
    a character a JSON string escapes (a quote, a backslash, a control character). xgrammar then spells the pattern
    out unescaped, as it does one its regex engine does not take: ``^"$`` gave the string ``\"\"\"``."""
    import xgrammar as xgr

    for node in _schema_nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            alone = json.dumps({"type": "string", "pattern": _escaped_pattern(pattern)})
            try:
                grammar = str(xgr.Grammar.from_json_schema(alone, any_whitespace=False, strict_mode=True))
            except Exception:  # the whole schema's parse names it
                continue
            if "json_string=true" not in grammar:  # xgrammar's JSON-string regex, which escapes, was not used
                return pattern
    return None


# Formats whose xgrammar regex takes strings the format refuses, as patterns that hold them: an octet "031" (RFC 2673's
# dotted quad has no leading zero), a day 31 in any month ("2021-02-31")
_IPV4_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DATE = (r"([0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|"
         r"2[0-8]))|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)")
_FORMAT_PATTERNS = {
    "ipv4": rf"^({_IPV4_OCTET}\.){{3}}{_IPV4_OCTET}$",
    "date": rf"^{_DATE}$",
}


def _format_as_pattern(node: dict[str, Any]) -> None:
    """A string format of ``_FORMAT_PATTERNS`` as its pattern."""
    if (pattern := _FORMAT_PATTERNS.get(node.get("format"))) is not None and "pattern" not in node:  # type: ignore[arg-type]
        del node["format"]
        node["pattern"] = pattern


def xgrammar_schema(schema: Any) -> Any:
    """``schema`` as xgrammar is given it: required names listed, patterns escaped, loose formats as patterns; the same
    object where nothing changes (each edit is idempotent, so a subschema shared by two places may meet it twice)."""
    fixed = copy.deepcopy(schema)
    for node in _schema_nodes(fixed):
        _add_required_properties(node)
        _escape_patterns(node)
        _format_as_pattern(node)
    return schema if fixed == schema else fixed
