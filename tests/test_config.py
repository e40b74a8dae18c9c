"""Start-up checks that need the model and the machine: one clear error before any process starts."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from tpserve.attention.factory import resolve_backend_name
from tpserve.config import ModelConfig
from tpserve.engine_config import EngineConfig, check_can_start


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that reports two GPUs (the checks only ask torch.cuda how many there are)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_flashinfer_with_float32_is_an_error_naming_both(qwen3_dir, two_gpus):
    engine = EngineConfig(model=qwen3_dir, device="cuda", dtype="float32", attention_backend="flashinfer")
    model = ModelConfig.from_pretrained(qwen3_dir)
    with pytest.raises(ValueError, match="--attention-backend flashinfer runs on CUDA in bfloat16 or float16, not on cuda in float32"):
        check_can_start(engine, model, cli=True)
    with pytest.raises(ValueError, match="attention_backend='flashinfer' runs on CUDA"):
        check_can_start(engine, model)
    check_can_start(EngineConfig(model=qwen3_dir, device="cuda", dtype="float32"), model)  # auto: fine
    check_can_start(EngineConfig(model=qwen3_dir, device="cuda", dtype="bfloat16", attention_backend="flashinfer"), model)


def test_auto_attention_takes_torch_for_float32_on_cuda():
    cuda = torch.device("cuda")
    assert resolve_backend_name("auto", cuda, torch.float32) == "torch"
    assert resolve_backend_name("torch", cuda, torch.bfloat16) == "torch"


def test_more_ranks_than_gpus(qwen3_dir, two_gpus):
    model = ModelConfig.from_pretrained(qwen3_dir)
    with pytest.raises(ValueError, match="--tp-size 4 needs 4 GPUs; 2 visible"):
        check_can_start(EngineConfig(model=qwen3_dir, device="cuda", tp_size=4), model, cli=True)
    check_can_start(EngineConfig(model=qwen3_dir, device="cuda", tp_size=2), model, cli=True)


def test_python_api_names_keywords(qwen3_dir, tmp_path):
    model = ModelConfig.from_pretrained(qwen3_dir)
    with pytest.raises(ValueError, match="tp_size 3 does not divide num_attention_heads 4"):
        check_can_start(EngineConfig(model=qwen3_dir, device="cpu", tp_size=3), model)
    with pytest.raises(ValueError, match="pass load_format='dummy' for random weights"):
        check_can_start(EngineConfig(model=str(tmp_path), device="cpu"), model)
    with pytest.raises(ValueError, match="max_model_len=5000 exceeds the model's context length .4096."):
        check_can_start(EngineConfig(model=qwen3_dir, device="cpu", max_model_len=5000), model)
    check_can_start(EngineConfig(model=qwen3_dir, device="cpu", max_total_tokens=4096), model)


def test_weights_and_kv_cache_past_the_cpu_memory_are_refused_before_start(qwen3_dir, monkeypatch):
    """Was the allocator's error inside every rank: a KV cache past the memory, also one of few tokens in one huge
    page, or weights past it (Qwen3-32B in float32 on the CPU)."""
    sysconf = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 2**20 if name == "SC_PHYS_PAGES" else sysconf(name))
    memory = os.sysconf("SC_PAGE_SIZE") * 2**20 / 2**30
    model = ModelConfig.from_pretrained(qwen3_dir)
    for engine, size in [(EngineConfig(model=qwen3_dir, device="cpu", max_total_tokens=10**11), "max_total_tokens=100000000000"),
                         (EngineConfig(model=qwen3_dir, device="cpu", max_total_tokens=2, page_size=10**8),
                          "max_total_tokens=2 in pages of page_size=100000000")]:
        with pytest.raises(ValueError, match=rf"this model's weights \(0.0 GiB\) and a KV cache of {size} \([\d,.]+ GiB\) "
                                             rf"on this machine's 1 CPU rank\(s\) need more than its {memory:,.1f} GiB"):
            check_can_start(engine, model)
    big = os.path.join(os.path.dirname(__file__), "data", "configs", "Qwen3-32B")
    with pytest.raises(ValueError, match=r"this model's weights \(12[\d.]+ GiB\) and a KV cache of max_total_tokens=32768"):
        check_can_start(EngineConfig(model=big, device="cpu", load_format="dummy"), ModelConfig.from_pretrained(big))
    check_can_start(EngineConfig(model=qwen3_dir, device="cpu"), model)


def test_decode_attention_xqa_is_checked_before_start(qwen3_dir, two_gpus, monkeypatch):
    """``--decode-attention xqa`` where XQA cannot run is one clear error at start-up, not a
    failure in every rank (the machine is faked: torch.cuda and the flashinfer lookup)."""
    import importlib.util

    capability = [(9, 0)]
    installed = [True]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability[0])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: (object() if installed[0] else None) if name == "flashinfer" else real_find_spec(name, *a),
    )
    model = ModelConfig.from_pretrained(qwen3_dir)

    def start(**overrides) -> None:
        config = EngineConfig(model=qwen3_dir, device="cuda", decode_attention="xqa", **{"dtype": "bfloat16", **overrides})
        check_can_start(config, model, cli=True)

    start()  # a Hopper GPU, flashinfer installed, page size 16: fine
    for overrides, fragment in (
        ({"page_size": 8}, "XQA takes page sizes (16, 32, 64, 128), not 8"),
        ({"dtype": "float32"}, "XQA takes bfloat16 or float16 queries"),
        ({"attention_backend": "torch"}, "XQA is a kernel of the flashinfer attention backend"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            start(**overrides)
    capability[0] = (8, 0)
    with pytest.raises(ValueError, match=r"--decode-attention xqa: XQA decode runs here on Hopper \(sm90\) GPUs only"):
        start()
    capability[0], installed[0] = (9, 0), False
    with pytest.raises(ValueError, match="flashinfer package is not installed; use --decode-attention auto"):
        start()


def test_decode_attention_xqa_on_a_windowed_or_capped_model_is_checked_before_start(tiny_model_factory, two_gpus,
                                                                                  monkeypatch):
    """XQA is never built for sliding windows or an attention soft-cap: asked for, that is one clear error at start-up,
    not one from every rank once the weights are loaded (the machine is faked as above)."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a))
    for arch, kwargs, fragment in (
        ("mistral", {"sliding_window": 8}, "tpserve does not run XQA with sliding-window attention"),
        ("gemma2", {"head_dim": 32}, "tpserve does not run XQA with sliding-window attention"),
    ):
        model_dir = tiny_model_factory(arch, **kwargs)
        config = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", decode_attention="xqa")
        with pytest.raises(ValueError, match=rf"--decode-attention xqa: {fragment}; use --decode-attention auto"):
            check_can_start(config, ModelConfig.from_pretrained(model_dir), cli=True)
    gemma2 = tiny_model_factory("gemma2", head_dim=32)
    capped = dataclasses.replace(ModelConfig.from_pretrained(gemma2), window_layers=(), sliding_window=None)
    with pytest.raises(ValueError, match="tpserve does not run XQA with attention logit soft-capping"):
        check_can_start(EngineConfig(model=gemma2, device="cuda", dtype="bfloat16", decode_attention="xqa"), capped)


def test_decode_attention_triton_is_checked_before_start(qwen3_dir, two_gpus, monkeypatch):
    """``--decode-attention triton`` where the kernel cannot run: one clear error naming the flag."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    missing = [""]
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == missing[0] else object() if name == "flashinfer"
                        else real_find_spec(name, *a))
    model = ModelConfig.from_pretrained(qwen3_dir)

    def start(**overrides) -> None:
        config = EngineConfig(model=qwen3_dir, device="cuda", decode_attention="triton",
                              **{"dtype": "bfloat16", **overrides})
        check_can_start(config, model, cli=True)

    start()  # any CUDA GPU, bf16 pages, head_dim 128 (a power of two): fine, not only on Hopper
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    start()
    for overrides, fragment in (
        ({"kv_cache_dtype": "fp8_e4m3"}, "--decode-attention triton: the Triton decode kernel reads bfloat16/float16 "
                                         "pages, not FP8 (XQA does); use --decode-attention auto"),
        ({"dtype": "float32"}, "the Triton decode kernel takes bfloat16 or float16 queries"),
        ({"attention_backend": "torch"}, "the Triton decode kernel is a kernel of the flashinfer attention backend"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            start(**overrides)
    missing[0] = "triton"
    with pytest.raises(ValueError, match="the triton package is not installed"):
        start()


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        # each was a TypeError from a comparison ("'<' not supported ..."), or from torch in the engine
        ({"tp_size": "2"}, TypeError, "tp_size must be an integer, got '2'"),
        ({"tp_size": 2.0}, TypeError, "tp_size must be an integer, got 2.0"),
        ({"tp_size": True}, TypeError, "tp_size must be an integer, got True"),
        ({"dp_size": None}, TypeError, "dp_size must be an integer, got None"),
        ({"page_size": 2.5}, TypeError, "page_size must be an integer, got 2.5"),
        ({"mem_fraction": "0.5"}, TypeError, "mem_fraction must be a number, got '0.5'"),
        ({"max_model_len": "100"}, TypeError, "max_model_len must be an integer or None, got '100'"),
        ({"chunked_prefill_size": None}, TypeError, "chunked_prefill_size must be an integer, got None"),
        ({"cuda_graph_max_bs": None}, TypeError, "cuda_graph_max_bs must be an integer, got None"),
        ({"seed": "x"}, TypeError, "seed must be an integer, got 'x'"),
        ({"disable_overlap": "yes"}, TypeError, "disable_overlap must be True or False, got 'yes'"),
        ({"device": 0}, TypeError, "device must be a string or None, got 0"),
        # values the CLI refuses: max_running_requests 0 made generate() wait forever; a negative
        # max_model_len or max_total_tokens failed inside torch; a seed of 2**64 in the dummy-weight init
        ({"max_running_requests": 0}, ValueError, "max_running_requests must be >= 1, got 0"),
        ({"max_model_len": 0}, ValueError, "max_model_len must be >= 2, got 0"),
        ({"max_model_len": -5}, ValueError, "max_model_len must be >= 2, got -5"),
        ({"max_total_tokens": 1}, ValueError, "max_total_tokens must be >= 2, got 1"),  # no room to generate
        ({"max_total_tokens": -1}, ValueError, "max_total_tokens must be >= 2, got -1"),
        ({"seed": -1}, ValueError, "seed must be in [0, 2**63), got -1"),
        ({"seed": 2**64}, ValueError, f"seed must be in [0, 2**63), got {2**64}"),
    ],
)
def test_engine_settings_of_the_wrong_type_or_range_name_the_setting(qwen3_dir, kwargs, error, fragment):
    with pytest.raises(error) as e:
        EngineConfig(model=qwen3_dir, **kwargs)
    assert fragment in str(e.value)


def test_engine_settings_take_numpy_numbers_and_vllm_dtype_spellings(qwen3_dir):
    numpy = pytest.importorskip("numpy")
    config = EngineConfig(model=qwen3_dir, tp_size=numpy.int64(2), mem_fraction=numpy.float32(0.5), dist_timeout=3)
    assert type(config.tp_size) is int and type(config.mem_fraction) is float and config.dist_timeout == 3.0
    assert [EngineConfig(model=qwen3_dir, dtype=d).dtype for d in ("half", "bf16", "float", "auto", None)] == [
        "float16", "bfloat16", "float32", "auto", None]
