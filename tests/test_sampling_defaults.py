"""--generation-config: the model's recommended sampling parameters as the defaults of requests that leave them unset
(vLLM's and SGLang's default), from the real Qwen3-8B generation_config.json."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tpserve.sampling_defaults import load_sampling_defaults

QWEN3_8B = os.path.join(os.path.dirname(__file__), "data", "configs", "Qwen3-8B")


def test_auto_reads_the_models_sampling_fields_only():
    # its bos/eos/pad ids and do_sample are not sampling defaults
    assert load_sampling_defaults(QWEN3_8B) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_vllm_a_directory_and_overrides(tmp_path):
    assert load_sampling_defaults(QWEN3_8B, "vllm") == {}
    assert load_sampling_defaults(str(tmp_path), "auto") == {}  # a model without the file: none
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.05,
                                                              "min_p": None, "max_new_tokens": 99}))
    # max_new_tokens is vLLM's max_tokens (was not read)
    assert load_sampling_defaults(QWEN3_8B, str(other)) == {"temperature": 0.7, "repetition_penalty": 1.05,
                                                            "max_tokens": 99}
    assert load_sampling_defaults(QWEN3_8B, str(other), {"max_new_tokens": None, "temperature": None}) == {
        "repetition_penalty": 1.05}  # a null override drops the file's value, as vLLM's
    assert load_sampling_defaults(QWEN3_8B, "auto", {"temperature": 0.2, "min_p": 0.05}) == {
        "temperature": 0.2, "top_k": 20, "top_p": 0.95, "min_p": 0.05}
    assert load_sampling_defaults(QWEN3_8B, "vllm", {"top_k": 5}) == {"top_k": 5}


@pytest.mark.parametrize("source, overrides, fragment", [
    ("nowhere", None, "--generation-config 'nowhere': no generation_config.json there"),
    ("auto", {"max_tokens": 5}, "--override-generation-config: 'max_tokens' is not one of temperature"),
    ("auto", {"max_new_tokens": 0}, "max_tokens must be >= 1"),
    ("auto", {"temperature": -1.0}, "--generation-config 'auto' with --override-generation-config: temperature must be"),
    ("auto", {"top_k": "20"}, "top_k"),
])
def test_bad_sources_and_values_name_the_setting(source, overrides, fragment):
    with pytest.raises(ValueError) as e:
        load_sampling_defaults(QWEN3_8B, source, overrides)
    assert fragment in str(e.value)


def test_a_bad_value_in_the_file_names_it(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(QWEN3_8B, model)
    (model / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"--generation-config 'auto': top_p must be"):
        load_sampling_defaults(str(model))


def test_max_new_tokens_caps_every_requests_max_tokens_on_the_server():
    """vLLM's get_max_tokens: the least of the request's max_tokens and generation_config's max_new_tokens; a request
    that sets none gets the cap (was: the rest of the context, the file's max_new_tokens never read)."""
    from tpserve.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    defaults = {"temperature": 0.6, "max_tokens": 64}
    assert body.sampling_params(None, defaults=defaults).max_tokens == 64
    assert body.sampling_params(1000, defaults=defaults).max_tokens == 64
    assert body.sampling_params(8, defaults=defaults).max_tokens == 8
    assert body.sampling_params(None, defaults={"temperature": 0.6}).max_tokens is None
