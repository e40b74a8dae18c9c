"""The compiled-grammar cache is bounded: tpserve's own by spec (``CACHE_SIZE``), and nothing in xgrammar's."""

from __future__ import annotations

import json

from tpserve.sampling_params import StructuredOutput
from tpserve.structured import grammar


def test_distinct_specs_leave_no_compiled_grammar_in_xgrammars_cache(qwen3_dir, monkeypatch):
    """A long-running server sees endless distinct schemas and regexes (one per tool set, per response format):
    only the last CACHE_SIZE stay compiled. xgrammar's GrammarCompiler caches every compile by default, without a
    size limit, which kept every spec ever compiled beside tpserve's bounded cache."""
    from tpserve.config import ModelConfig

    monkeypatch.setattr(grammar, "CACHE_SIZE", 8)
    config = ModelConfig.from_pretrained(qwen3_dir)
    compiler = grammar.GrammarCompiler(qwen3_dir, config.vocab_size, sorted(config.eos_token_ids))
    try:
        for i in range(40):
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
            compiler.submit(StructuredOutput("json_schema", json.dumps(schema))).result()
            compiler.submit(StructuredOutput("regex", f"[0-9]{{{i + 1}}}")).result()
        assert len(compiler._cache) == 8
        assert set(compiler._compilers) == {True, False}
        assert [c.get_cache_size_bytes() for c in compiler._compilers.values()] == [0, 0]
    finally:
        compiler.close()
