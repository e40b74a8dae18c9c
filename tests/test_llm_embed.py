"""``LLM.embed`` and the bare-decoder checkpoints embedding models ship as (transformers' Qwen3Model: tensors
without "model.", no LM head), against transformers' base model in float32."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from reference import hf_embedding

from tpserve import LLM
from tpserve.config import ModelConfig
from tpserve.pooling import embedding_vector


@pytest.fixture(scope="module")
def bare_dir(qwen3_dir, tmp_path_factory) -> str:
    """The tiny model's decoder saved as transformers saves a base model (architectures ["Qwen3Model"])."""
    from transformers import AutoModel

    out = tmp_path_factory.mktemp("bare")
    AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{qwen3_dir}/{name}", out)
    return str(out)


def test_embedding_vector_cuts_then_normalizes():
    raw = np.array([3, 4, 12], dtype="<f4").tobytes()
    assert np.allclose(embedding_vector(raw), [3 / 13, 4 / 13, 12 / 13])
    assert np.allclose(embedding_vector(raw, dimensions=2), [0.6, 0.8])
    assert embedding_vector(raw, normalize=False).tolist() == [3, 4, 12]
    assert embedding_vector(np.zeros(2, "<f4").tobytes()).tolist() == [0, 0]  # no division by zero
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 3\]"):
        embedding_vector(raw, dimensions=4)


@pytest.mark.parametrize("which", ["causal_lm", "bare"])
def test_llm_embed_matches_transformers(which, qwen3_dir, bare_dir):
    model_dir = bare_dir if which == "bare" else qwen3_dir
    prompts = ["a clockmaker", [5, 6, 7, 8], {"prompt_token_ids": list(range(3, 40))}]
    with LLM(model_dir, device="cpu", chunked_prefill_size=16) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
        cut = llm.embed([[5, 6, 7, 8]], use_tqdm=False, dimensions=8, normalize=False)[0]
        if which == "bare":
            with pytest.raises(ValueError, match=r"\(Qwen3Model\) has no LM head \(lm_head.weight\): it serves"):
                llm.generate(["hi"], use_tqdm=False)
    errors = [float((torch.tensor(o.outputs.embedding) - hf_embedding(qwen3_dir, o.prompt_token_ids)).abs().max())
              for o in outputs]
    print(f"{which}: embedding max abs error vs transformers: {max(errors):.2e}")
    assert max(errors) < 1e-5 and [len(o.prompt_token_ids) for o in outputs][1:] == [4, 37]
    expected = hf_embedding(qwen3_dir, [5, 6, 7, 8], normalize=False)[:8]
    assert float((torch.tensor(cut.outputs.embedding) - expected).abs().max()) < 1e-5


def test_a_bare_decoder_is_read_as_its_causal_lm_without_a_head(qwen3_dir, bare_dir, tmp_path):
    bare, full = ModelConfig.from_pretrained(bare_dir), ModelConfig.from_pretrained(qwen3_dir)
    assert bare.architecture == "Qwen3Model" and not bare.lm_head and full.lm_head
    assert bare.tie_word_embeddings  # the head is the embedding: no memory of its own
    assert bare.hidden_size == full.hidden_size and bare.num_hidden_layers == full.num_hidden_layers
    # a *ForCausalLM config (untied) over the bare decoder's weights, as embedding models may ship: no head either
    shutil.copytree(bare_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    labelled = ModelConfig.from_pretrained(str(tmp_path / "m"))
    assert labelled.architecture == "Qwen3ForCausalLM" and not labelled.lm_head and labelled.tie_word_embeddings
    with LLM(str(tmp_path / "m"), device="cpu") as llm:
        vector = llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding
        with pytest.raises(ValueError, match=r"\(Qwen3ForCausalLM\) has no LM head"):
            llm.generate([[5, 6]], use_tqdm=False)
    assert float((torch.tensor(vector) - hf_embedding(qwen3_dir, [5, 6, 7])).abs().max()) < 1e-5


def test_sentence_transformers_pooling_other_than_the_last_token_is_refused(bare_dir, tmp_path):
    """An embedding model's modules.json says how it pools: last-token (Qwen3-Embedding's) is served; mean pooling or
    a Dense projection after it would give other vectors, so such a model's embedding requests are refused."""
    from tpserve.pooling import unserved_pooling

    def model_with(modules: list[dict], pooling: dict | None) -> str:
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(bare_dir, out)
        (out / "modules.json").write_text(json.dumps(modules))
        if pooling is not None:
            (out / "1_Pooling").mkdir()
            (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return str(out)

    pooling_module = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    base = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}, pooling_module]
    last = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
            "pooling_mode_lasttoken": True}
    assert unserved_pooling(model_with(base, last)) is None
    mean = model_with(base, {**last, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True})
    assert "pooling is mean_tokens" in unserved_pooling(mean)
    dense = [*base, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    assert "(2_Dense: Dense)" in unserved_pooling(model_with(dense, last))
    with LLM(mean, device="cpu") as llm:
        with pytest.raises(ValueError, match="embeddings are not served: its sentence-transformers pooling is mean"):
            llm.embed(["hi"], use_tqdm=False)


def test_pooling_configs_as_sentence_transformers_reads_them(tmp_path):
    """(review) A missing pooling_mode_mean_tokens is sentence-transformers' default, on; a pooling_mode string sets
    the mode alone; a modules.json nested past the parser's depth is a reason, not a scheduler that dies."""
    from tpserve.pooling import unserved_pooling

    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    for config, served in (({"pooling_mode_lasttoken": True}, False),
                           ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, True),
                           ({"pooling_mode": "lasttoken"}, True), ({"pooling_mode": "mean"}, False)):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
        assert (unserved_pooling(str(tmp_path)) is None) == served, config
    (tmp_path / "modules.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "could not be read (RecursionError" in unserved_pooling(str(tmp_path))


def test_a_pooled_input_may_fill_the_context(qwen3_dir):
    """No token follows a pooled input, so it may take the whole context (vLLM's bound); one more is refused."""
    full = list(range(3, 3 + 48))
    with LLM(qwen3_dir, device="cpu", max_model_len=48, chunked_prefill_size=16) as llm:
        out = llm.embed([full], use_tqdm=False)[0]
        kept = llm.embed([full + [60, 61]], use_tqdm=False, truncate_prompt_tokens=-1)[0]
        with pytest.raises(ValueError, match="has 49 tokens; the context limit is 48$"):
            llm.embed([full + [60]], use_tqdm=False)
        with pytest.raises(ValueError, match="48 \\(prompt plus at least one generated token"):
            llm.generate([{"prompt_token_ids": full}], use_tqdm=False)
    error = float((torch.tensor(out.outputs.embedding) - hf_embedding(qwen3_dir, full)).abs().max())
    assert error < 1e-5 and kept.prompt_token_ids == full[2:] + [60, 61]
