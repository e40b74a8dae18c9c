"""Grammars for structured output (xgrammar): checking a spec, compiling it off the decode path,
and one matcher per request.

Compiling a grammar against the vocabulary takes tens of milliseconds (a large JSON schema
more), so it never runs on the decode loop: ``GrammarCompiler.submit`` compiles on a worker
thread (xgrammar releases the GIL while it works) and caches the result by spec, so a repeated
schema is ready at once. The tokenizer and xgrammar's vocabulary tables are built on that thread
too, on first use.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tpserve.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, by spec


class InvalidGrammar(ValueError):
    """The spec does not parse (bad JSON schema, regex or EBNF)."""


def _grammar(spec: StructuredOutput):
    import xgrammar as xgr

    if spec.kind == "json_object":  # any object (OpenAI's JSON mode), not any JSON value
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        # strict: no properties beyond the schema's, as OpenAI's strict mode
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.spec)
    return xgr.Grammar.from_ebnf(spec.spec)


def check_spec(spec: StructuredOutput) -> None:
    """Parse the spec without compiling it against a vocabulary (cheap); InvalidGrammar if bad."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidGrammar("the JSON schema must be an object")
    try:
        _grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise InvalidGrammar(f"invalid {spec.kind}: {str(e).strip().splitlines()[0] if str(e).strip() else e}") from e


class GrammarCompiler:
    """Compiles specs on one worker thread; ``submit`` returns a future of the compiled grammar."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpserve-grammar")
        self._compiler: Any = None  # built on the worker thread
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

    def _compile(self, spec: StructuredOutput):
        if self._compiler is None:
            import xgrammar as xgr

            from tpserve.tokenizer.loader import load_tokenizer

            info = xgr.TokenizerInfo.from_huggingface(
                load_tokenizer(self._model_dir), vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            return self._compiler.compile_grammar(_grammar(spec))
        except Exception as e:
            raise InvalidGrammar(f"invalid {spec.kind}: {e}") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def allocate_bitmask(rows: int, vocab_size: int):
    """[rows, ceil(V / 32)] int32, every bit set (every token allowed)."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)
