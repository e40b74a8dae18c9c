"""Grammars for structured output (xgrammar): checking a spec, compiling it off the decode path,
and one matcher per request.

Compiling a grammar against the vocabulary takes tens of milliseconds (a large JSON schema
more), so it never runs on the decode loop: ``GrammarCompiler.submit`` compiles on worker
threads (xgrammar releases the GIL while it works) and caches the result by spec, so a repeated
schema is ready at once. The tokenizer and xgrammar's vocabulary tables are built on a worker
thread too, on first use. A costly spec holds up only its own requests: a few compile at once,
the scheduler gives up on one that takes too long, and an abort drops a compile not yet started.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, by spec
COMPILE_THREADS = 4  # grammars compiled at once, so that one slow spec does not hold back the others
# xgrammar's parse of a JSON schema grows with about the cube of its nesting (Qwen3's vocabulary, 2026-12-05: 64 /
# 128 levels of arrays 0.02 / 0.17 s, of objects, two JSON levels each, 0.05 / 0.34 s; ~10 s at 400 levels), in the
# tokenizer's check and again in the compile: a schema document nested deeper than this is refused before either.
MAX_SCHEMA_DEPTH = 128


class InvalidGrammar(ValueError):
    """The spec does not parse (bad JSON schema, regex or EBNF)."""


def _grammar(spec: StructuredOutput):
    import xgrammar as xgr

    if spec.kind == "json_object":  # any object (OpenAI's JSON mode), not any JSON value
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        # strict: no properties beyond the schema's, as OpenAI's strict mode (a required name is one of them)
        document = json.loads(spec.spec)
        schema = with_xgrammar_formats(with_escaped_patterns(with_required_properties(document)))
        text = spec.spec if schema is document else json.dumps(schema)  # the schema as sent where nothing changed
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == "structural_tag":
        tag = json.loads(spec.spec)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's first layout: tags, each begin, schema and end
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
        return xgr.Grammar.from_structural_tag(tag)
    return xgr.Grammar.from_ebnf(spec.spec)


def check_spec(spec: StructuredOutput) -> None:
    """Parse the spec without compiling it against a vocabulary (cheap); InvalidGrammar if bad."""
    if spec.kind in ("json_schema", "structural_tag"):
        what = "JSON schema" if spec.kind == "json_schema" else "structural tag"
        try:
            document = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"the {what} is not valid JSON: {e}") from e
        if not isinstance(document, (dict, bool) if spec.kind == "json_schema" else dict):
            raise InvalidGrammar(f"the {what} must be an object")
        if (depth := nesting_depth(document)) > MAX_SCHEMA_DEPTH:
            raise InvalidGrammar(f"the {what} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
        if (big := _past_int64(document)) is not None:  # xgrammar takes its integers as doubles: a const of 2**64 - 1
            raise InvalidGrammar(f"the {what} holds the integer {big}, past the 64-bit signed range that "
                                 "structured output can hold exactly")  # came out 1.8446744073709552e+19
        if spec.kind == "json_schema" and (unenforced := unenforced_keyword(document)) is not None:
            raise InvalidGrammar(f"the JSON schema uses {unenforced}, which structured output (xgrammar) does not "
                                 "enforce: the output could break it")
        if spec.kind == "json_schema" and (pattern := unescaped_pattern(document)) is not None:
            raise InvalidGrammar(f"the JSON schema's pattern {pattern!r} needs a character that a JSON string must "
                                 "escape (a quote, a backslash or a control character), which structured output "
                                 "(xgrammar) writes unescaped: its output would not be JSON")
        if spec.kind == "structural_tag" and "structures" in document:
            _check_structures(document)
    try:
        _grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise InvalidGrammar(f"invalid {spec.kind}: {_parser_message(e)}") from e


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


def with_required_properties(schema: Any) -> Any:
    """``schema`` with every object's required names that its ``properties`` leave out added to them (as its
    ``additionalProperties`` schema, else any value): in strict mode xgrammar would otherwise leave them out, and its
    output would lack a required property. A schema that needs no change is returned as it is (not copied)."""
    if not any(_missing_required(node) for node in _schema_nodes(schema)):
        return schema
    fixed = copy.deepcopy(schema)
    for node in _schema_nodes(fixed):
        if missing := _missing_required(node):
            extra = node.get("additionalProperties")
            value_schema = extra if isinstance(extra, dict) else {}
            node["properties"] = {**node.get("properties", {}), **dict.fromkeys(missing, value_schema)}
    return fixed


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


def with_escaped_patterns(schema: Any) -> Any:
    """``schema`` with every string ``pattern`` (and ``patternProperties`` name) through ``_escaped_pattern``; one
    that needs no change is returned as it is (not copied)."""
    def changes(node: dict[str, Any]) -> bool:
        names = node.get("patternProperties")
        return ((isinstance(node.get("pattern"), str) and _escaped_pattern(node["pattern"]) != node["pattern"])
                or (isinstance(names, dict) and any(_escaped_pattern(name) != name for name in names)))

    if not any(changes(node) for node in _schema_nodes(schema)):
        return schema
    fixed = copy.deepcopy(schema)
    for node in _schema_nodes(fixed):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = _escaped_pattern(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {_escaped_pattern(k): v for k, v in node["patternProperties"].items()}
    return fixed


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


def with_xgrammar_formats(schema: Any) -> Any:
    """``schema`` with the string formats of ``_FORMAT_PATTERNS`` as their patterns (a copy only if any)."""
    if not any(node.get("format") in _FORMAT_PATTERNS and "pattern" not in node for node in _schema_nodes(schema)):
        return schema
    fixed = copy.deepcopy(schema)
    for node in _schema_nodes(fixed):
        if (pattern := _FORMAT_PATTERNS.get(node.get("format"))) is not None and "pattern" not in node:  # type: ignore[arg-type]
            del node["format"]
            node["pattern"] = pattern
    return fixed


def _check_structures(tag: dict[str, Any]) -> None:
    """vLLM's older structural tag: ``structures`` of {"begin", "schema", "end"} and ``triggers``, strings."""
    structures, triggers = tag["structures"], tag.get("triggers", [])
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise InvalidGrammar("the structural tag's structures must be a list of objects")
    for i, item in enumerate(structures):
        for key in ("begin", "end"):
            if not isinstance(item.get(key), str):
                raise InvalidGrammar(f"the structural tag's structures[{i}].{key} must be a string")
        if not isinstance(item.get("schema"), (dict, bool)):
            raise InvalidGrammar(f"the structural tag's structures[{i}].schema must be a JSON schema")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidGrammar("the structural tag's triggers must be a list of non-empty strings")


def nesting_depth(document: Any) -> int:
    """How deep objects and arrays nest in a parsed JSON document (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(document, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _past_int64(document: Any) -> int | None:
    """An integer of a parsed JSON document outside [-2**63, 2**63), or None."""
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**63:
            return item
    return None


def _parser_message(error: Exception) -> str:
    """xgrammar's message without its "[12:00:00] /project/cpp/file.cc:94: " source location."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else repr(error)
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)


JSON_KINDS = ("json_object", "json_schema")


def json_tokenizer_info(info: Any) -> Any:
    """``info``'s vocabulary for JSON grammars: tokens whose text has a control character become
    special tokens, which no grammar allows. xgrammar's length-limited JSON strings take raw
    control characters, which JSON (and so every client's parser) rejects; leaving those tokens
    out of the vocabulary keeps them out of every mask at no cost per step."""
    import xgrammar as xgr

    special = set(info.special_token_ids)
    vocab = [
        b"" if i in special or any(b < 0x20 for b in text) else text for i, text in enumerate(info.decoded_vocab)
    ]
    # The decoded bytes are the tokens' text as it is: RAW needs no byte-level decoding.
    return xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size, stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


class GrammarCompiler:
    """Compiles specs on ``COMPILE_THREADS`` worker threads; ``submit`` returns a future of an
    xgrammar CompiledGrammar."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="tpserve-grammar")
        self._info: Any = None  # built on a worker thread, on first use
        self._compilers: dict[bool, Any] = {}  # by "is a JSON kind"
        self._compilers_lock = threading.Lock()  # the first two compiles may come at once
        self._cache: dict[tuple[str, str], Future] = {}

    def submit(self, spec: StructuredOutput) -> Future:
        future = self._cache.get(spec.key)
        if future is None:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            future = self._cache[spec.key] = self._pool.submit(self._compile, spec)
        else:  # most recently used last
            self._cache[spec.key] = self._cache.pop(spec.key)
        return future

    def forget(self, spec: StructuredOutput, future: Future) -> None:
        """No request waits for ``future`` any more: stop its compile if it has not started, and drop it from the
        cache either way. So every rank's cache holds the same specs whatever each one's timing: a rank that kept a
        started compile would find a retry ready at once while another compiled it anew, stalling the others."""
        future.cancel()
        if self._cache.get(spec.key) is future:
            del self._cache[spec.key]

    def _compiler(self, json_kind: bool) -> Any:
        import xgrammar as xgr

        with self._compilers_lock:
            if self._info is None:
                from tpserve.tokenizer.loader import load_tokenizer

                self._info = xgr.TokenizerInfo.from_huggingface(
                    load_tokenizer(self._model_dir), vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
            if json_kind not in self._compilers:
                info = json_tokenizer_info(self._info) if json_kind else self._info
                # cache_enabled=False: xgrammar's own cache (on by default) has no size limit and kept every spec
                # ever compiled (a small JSON schema ~190 KB at a 150k-token vocabulary, on every rank); ``_cache``
                # above is the one cache, bounded, and the same on every rank (``forget``)
                self._compilers[json_kind] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compilers[json_kind]

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._compiler(spec.kind in JSON_KINDS)
        try:
            return compiler.compile_grammar(_grammar(spec))
        except Exception as e:
            raise InvalidGrammar(f"invalid {spec.kind}: {_parser_message(e)}") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


@dataclass(eq=False)
class RequestGrammar:
    """A request's matcher and whether it has terminated (accepted a stop token; it then takes
    no more tokens and has no mask). Tracked here rather than asked of xgrammar: that would be a
    call per request per step. Only the mask worker touches either once the request runs."""

    matcher: Any  # xgrammar GrammarMatcher
    # the request's min_tokens and the stop tokens banned until then: a mask that allows only those is a dead end
    min_tokens: int = 0
    early_stops: list[int] = field(default_factory=list)
    accepted: int = 0  # tokens the matcher took
    terminated: bool = False
    dead_end: bool = False  # its mask allowed no token (a grammar that accepts no output, or none from here)
    only_stops: bool = False  # ... but a stop token, before min_tokens

    @property
    def bans_stops(self) -> bool:
        return self.accepted < self.min_tokens and bool(self.early_stops)


class MaskFiller:
    """The matchers' side of a constrained step, each batched into one call into xgrammar (which
    releases the GIL while it works): the sampled tokens in, the next-token bitmasks out. Masks
    are filled into two host buffers in turn (pinned when the logits live on a GPU, so their
    upload does not block): one is filled while the other's upload may still be in flight.

    xgrammar starts its threads afresh on every call, which costs more than filling a cheap
    grammar's row (a few microseconds), so a fill uses one thread per ``ROWS_PER_THREAD`` rows,
    up to ``max_threads``."""

    ROWS_PER_THREAD = 64

    def __init__(self, vocab_size: int, pin_memory: bool = False, max_threads: int = 0) -> None:
        self._vocab_size = vocab_size
        self._pin = pin_memory
        # by default half this process's CPUs, at most 8
        self.max_threads = max_threads if max_threads > 0 else max(1, min(8, len(os.sched_getaffinity(0)) // 2))
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._batches: dict[int, Any] = {}  # xgrammar BatchGrammarMatcher by thread count
        self._get_item: Any = None

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Each matcher takes its token; whether each accepted it.

        xgrammar's ``batch_accept_token`` reads its result back row by row through calls that
        each release and retake the GIL; on the mask worker's thread every retake waits for the
        busy main thread. So this makes the same call into xgrammar's core and reads the result
        through tvm_ffi's item getter set to keep the GIL (a private copy of the function)."""
        from xgrammar.base import _core

        if self._get_item is None:
            import tvm_ffi

            self._get_item = tvm_ffi.get_global_func("ffi.ArrayGetItem")
            self._get_item.release_gil = False
        result = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
        return [bool(self._get_item(result, i)) for i in range(len(matchers))]

    def fill(self, matchers: list[Any], rows: list[int], batch_size: int) -> torch.Tensor:
        """The [batch_size, ceil(V / 32)] host bitmask with ``matchers[i]``'s mask in row
        ``rows[i]``; other rows allow every token. Its buffer is filled again two calls later:
        the caller must have consumed this one (its upload done) by then."""
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < batch_size:
            rows_needed = max(batch_size, 2 * (buffer.shape[0] if buffer is not None else 32))
            buffer = torch.empty((rows_needed, -(-self._vocab_size // 32)), dtype=torch.int32, pin_memory=self._pin)
            self._buffers[self._turn] = buffer
        self._turn ^= 1
        bitmask = buffer[:batch_size]
        threads = min(self.max_threads, max(1, len(matchers) // self.ROWS_PER_THREAD))
        batch = self._batches.get(threads)
        if batch is None:
            import xgrammar as xgr

            batch = self._batches[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        if len(rows) < batch_size:
            unconstrained = sorted(set(range(batch_size)).difference(rows))
            bitmask[unconstrained] = -1
        return bitmask
