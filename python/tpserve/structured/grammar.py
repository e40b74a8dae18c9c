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

import json
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.sampling_params import StructuredOutput
from tpserve.structured.json_schema import unenforced_keyword, unescaped_pattern, xgrammar_schema

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
        schema = xgrammar_schema(document)
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
