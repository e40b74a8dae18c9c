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
from dataclasses import dataclass
from typing import Any

import torch

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


JSON_KINDS = ("json_object", "json_schema")


@dataclass(frozen=True)
class CompiledSpec:
    grammar: Any  # xgrammar CompiledGrammar
    # For JSON: the tokens allowed at all, as a packed bitmask row. xgrammar's JSON strings
    # accept raw control characters, which JSON (and so every client's parser) rejects.
    token_filter: torch.Tensor | None


def _printable_tokens(info: Any) -> torch.Tensor:
    """Packed [ceil(V / 32)] int32 bitmask of the tokens whose text has no control character."""
    words = -(-info.vocab_size // 32)
    bad = [i for i, text in enumerate(info.decoded_vocab) if any(b < 0x20 for b in text)]
    index = torch.tensor(bad, dtype=torch.int64)
    cleared = torch.zeros(words, dtype=torch.int64).index_add_(0, index // 32, torch.ones_like(index) << (index % 32))
    allowed = ~cleared & 0xFFFF_FFFF  # uint32 values held in int64
    return torch.where(allowed >= 2**31, allowed - 2**32, allowed).to(torch.int32)


class GrammarCompiler:
    """Compiles specs on one worker thread; ``submit`` returns a future of a CompiledSpec."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpserve-grammar")
        self._compiler: Any = None  # built on the worker thread
        self._printable: torch.Tensor | None = None
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
            self._printable = _printable_tokens(info)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            compiled = self._compiler.compile_grammar(_grammar(spec))
        except Exception as e:
            raise InvalidGrammar(f"invalid {spec.kind}: {e}") from e
        return CompiledSpec(compiled, self._printable if spec.kind in JSON_KINDS else None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def allocate_bitmask(rows: int, vocab_size: int):
    """[rows, ceil(V / 32)] int32, every bit set (every token allowed)."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


class MaskFiller:
    """Fills many matchers' next-token bitmasks at once, on xgrammar's own threads."""

    PARALLEL_FROM = 8  # fewer rows are filled one by one (no thread hand-off)

    def __init__(self) -> None:
        self._batch: Any = None

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) < self.PARALLEL_FROM:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
