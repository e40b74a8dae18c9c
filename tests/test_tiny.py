"""Tests for the tiny random model maker (tpserve.tiny)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from tpserve import tiny
from tpserve.config import ModelConfig

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

ARCHS = ["qwen3", "qwen2", "llama", "mistral", "qwen3_moe"]
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "今天天气", "1 2 3 4"]
SAME_LAST_TOKEN = ["The capital of France is", "My favourite colour is", "What time is", "1 2 3 is"]
ROUND_TRIP = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\n\ttabs\r\n",
    "今天天气很好，我们去公园散步吧。龘 (rare: not in the corpus)",
    "def f(x: int) -> int:\n    return x ** 2  # squared\n",
    "Émoji 🙂🚀, naïve café, ∑ x² ≤ ∞, こんにちは",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls run faster on one thread, and far faster when other processes share the CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_model(model_dir: str | Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not any(info.values()), f"weights do not match the model: {info}"
    return model.eval()


def safetensors_contents(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (ignoring EOS) and the top-1 minus top-2 logit margin of each step."""
    ids = list(ids)
    out, margins = [], []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top = logits.topk(2)
        margins.append((top.values[0] - top.values[1]).item())
        ids.append(int(top.indices[0]))
        out.append(ids[-1])
    return out, margins


def hf_parameter(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A checkpoint tensor's value in the transformers model; per-expert tensors are pieces of
    transformers' stacked experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    expert = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
    if expert is None:
        return params[name]
    prefix, e, proj = expert[1], int(expert[2]), expert[3]
    if proj == "down_proj":
        return params[f"{prefix}.down_proj"][e]
    return params[f"{prefix}.gate_up_proj"][e].chunk(2)[proj == "up_proj"]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers(tmp_path: Path, arch: str, tie: bool) -> None:
    out = tiny.make_tiny_model(str(tmp_path), arch, tie_word_embeddings=tie)
    assert out == str(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [tiny.ARCHITECTURES[arch]]
    assert cfg["dtype"] == "float32"
    assert "rope_parameters" in cfg and "rope_theta" not in cfg  # what transformers 5 writes
    assert cfg["tie_word_embeddings"] is tie

    model = load_model(tmp_path)
    assert type(model).__name__ == tiny.ARCHITECTURES[arch]
    saved = safetensors_contents(tmp_path)
    assert ("lm_head.weight" in saved) is not tie
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # Every saved tensor arrived in the model unchanged.
    params = dict(model.named_parameters())
    for name, tensor in saved.items():
        assert torch.equal(hf_parameter(params, name), tensor), name
    assert any(name.endswith("q_proj.bias") for name in saved) is (arch == "qwen2")
    assert any(name.endswith("q_norm.weight") for name in saved) is (arch in ("qwen3", "qwen3_moe"))
    assert any(".mlp.experts.7." in name for name in saved) is (arch == "qwen3_moe")

    hf_cfg = AutoConfig.from_pretrained(str(tmp_path))
    expected_rope = "llama3" if arch == "llama" else "default"
    assert hf_cfg.rope_parameters["rope_type"] == expected_rope
    ours = ModelConfig.from_pretrained(str(tmp_path))
    assert ours.architecture == tiny.ARCHITECTURES[arch]
    assert ours.rope_parameters == hf_cfg.rope_parameters
    assert ours.head_dim == 16 and ours.vocab_size == cfg["vocab_size"]


def test_llama3_rope_scaling_changes_the_model(tmp_path: Path) -> None:
    """The llama3 frequencies must differ from plain rope at the default tiny shapes."""
    tiny.make_tiny_model(str(tmp_path), "llama")
    model = load_model(tmp_path)
    scaled = model.model.rotary_emb.inv_freq.clone()
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(scaled[:2], plain[:2])  # high frequencies are kept
    assert not torch.allclose(scaled, plain)  # low ones are scaled


def test_shards(tmp_path: Path) -> None:
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    tiny.make_tiny_model(str(single), "qwen2")
    tiny.make_tiny_model(str(sharded), "qwen2", num_shards=3)

    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    weights = safetensors_contents(sharded)
    assert set(index["weight_map"]) == set(weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert name in index["weight_map"]
    for filename in files:
        with safe_open(str(sharded / filename), "pt") as f:
            assert {index["weight_map"][k] for k in f.keys()} == {filename}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())

    # Sharding changes only the layout: same tensors as the single-file model with the same seed.
    reference = safetensors_contents(single)
    assert set(reference) == set(weights)
    assert all(torch.equal(reference[k], weights[k]) for k in reference)
    load_model(sharded)

    # Rewriting the directory as one file removes the shards and the index.
    tiny.make_tiny_model(str(sharded), "qwen2")
    assert sorted(p.name for p in sharded.iterdir() if p.name.startswith("model")) == ["model.safetensors"]


def test_tokenizer(tmp_path: Path) -> None:
    tiny.make_tiny_model(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    gen = json.loads((tmp_path / "generation_config.json").read_text())

    assert 300 <= len(tok) <= 1000
    assert cfg["vocab_size"] >= len(tok) and cfg["vocab_size"] % 64 == 0
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    special = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert gen["eos_token_id"] == [special["<|im_end|>"], special["<|endoftext|>"]]
    for token in ("<think>", "</think>", *special):
        assert tok.convert_ids_to_tokens(tok.encode(token)) == [token]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_utf8_round_trip(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    model_dir = tmp_path_factory.getbasetemp() / "round_trip_model"
    if not model_dir.exists():
        tiny.make_tiny_model(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tiny.build_tokenizer().decode(ids, skip_special_tokens=False) == text


def test_multibyte_characters_split_across_tokens() -> None:
    """Detokenizers must cope with tokens that are not valid UTF-8 alone; make sure they occur."""
    tok = tiny.build_tokenizer()
    ids = tok.encode("龘 今天天气很好").ids
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "expected some Chinese character to span several tokens"


def test_chat_template(tmp_path: Path) -> None:
    tiny.make_tiny_model(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    convo = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"

    assert tok.apply_chat_template(msgs, tokenize=False) == convo
    prompt = convo + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == prompt
    def render(enable_thinking: bool) -> str:
        return tok.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )

    assert render(enable_thinking=True) == prompt
    assert render(enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == prompt


@pytest.mark.parametrize("arch,tie", [(a, False) for a in ARCHS] + [("qwen3", True)])
def test_greedy_generation_is_diverse(tmp_path: Path, arch: str, tie: bool) -> None:
    tiny.make_tiny_model(str(tmp_path), arch, tie_word_embeddings=tie)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    model = load_model(tmp_path)
    continuations, margins = [], []
    for prompt in PROMPTS:
        out, step_margins = greedy(model, tok.encode(prompt), steps=20)
        assert len(set(out)) >= 3, f"{prompt!r} -> {tok.decode(out)!r} is nearly one repeated token"
        continuations.append(tuple(out))
        margins += step_margins
    assert len(set(continuations)) == len(PROMPTS), "different prompts gave the same continuation"
    assert len({t for c in continuations for t in c}) >= 30
    near_ties = sum(m <= 1e-3 for m in margins)
    assert near_ties <= len(margins) // 20, f"{near_ties}/{len(margins)} steps have top-2 margins <= 1e-3"

    # The context, not just the last token, decides the next token.
    prompts = [tok.encode(p) for p in SAME_LAST_TOKEN]
    assert len({p[-1] for p in prompts}) == 1
    next_tokens = {greedy(model, p, steps=1)[0][0] for p in prompts}
    assert len(next_tokens) >= 3, "the next token barely depends on the context"


def test_deterministic(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    tiny.make_tiny_model(str(a), "llama", seed=7, num_shards=2)
    tiny.make_tiny_model(str(b), "llama", seed=7, num_shards=2)
    tiny.make_tiny_model(str(c), "llama", seed=8, num_shards=2)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    weights = [n for n in names if n.endswith(".safetensors")]
    assert all((a / n).read_bytes() != (c / n).read_bytes() for n in weights)


def test_cli_matches_api(tmp_path: Path) -> None:
    """The CLI (a fresh process: tokenizer training and init must not depend on the process)."""
    cli_dir, api_dir = tmp_path / "cli", tmp_path / "api"
    cmd = [
        sys.executable, "-m", "tpserve.tiny", str(cli_dir), "--arch", "mistral", "--layers", "1",
        "--hidden", "48", "--heads", "4", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "96", "--vocab", "1000", "--tie", "--shards", "2", "--seed", "3",
        "--max-position-embeddings", "512",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(cli_dir)
    tiny.make_tiny_model(
        str(api_dir), "mistral", num_layers=1, hidden_size=48, num_heads=4, num_kv_heads=1,
        head_dim=16, intermediate_size=96, vocab_size=1000, tie_word_embeddings=True,
        num_shards=2, seed=3, max_position_embeddings=512,
    )
    names = sorted(p.name for p in cli_dir.iterdir())
    assert names == sorted(p.name for p in api_dir.iterdir())
    for name in names:
        assert (cli_dir / name).read_bytes() == (api_dir / name).read_bytes(), name
    cfg = json.loads((cli_dir / "config.json").read_text())
    expected = {
        "num_hidden_layers": 1, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 1000, "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    }
    assert {k: cfg[k] for k in expected} == expected
    load_model(cli_dir)


def test_cli_help_mentions_every_flag() -> None:
    help_text = tiny.build_parser().format_help()
    for flag in ("OUT_DIR", "--arch", "--layers", "--hidden", "--heads", "--kv-heads", "--head-dim",
                 "--intermediate", "--vocab", "--tie", "--shards", "--seed", "--max-position-embeddings",
                 "--rope-type", "--legacy-config"):
        assert flag in help_text
    actions = [a for a in tiny.build_parser()._actions if a.dest != "help"]
    assert all(a.help for a in actions)


def test_cli_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tiny.main([str(tmp_path / "m"), "--heads", "4", "--kv-heads", "3"])
    assert exc.value.code == 2
    assert "num_heads (4)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "num_heads (4) must be a multiple of num_kv_heads (3)"),
        ({"hidden_size": 66}, "hidden_size (66) is not divisible by num_heads (4)"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim (32) must equal hidden_size (64) / num_heads (4)"),
        ({"arch": "llama", "hidden_size": 66, "head_dim": 16}, "hidden_size (66) divisible by num_heads (4)"),
        ({"head_dim": 15, "hidden_size": 60}, "head_dim must be even"),
        ({"vocab_size": 100}, "vocab_size (100) must be >= the tokenizer's size"),
        ({"num_shards": 10_000}, "num_shards (10000) exceeds the number of tensors"),
        ({"num_layers": 0}, "num_layers must be >= 1, got 0"),
        ({"arch": "gpt2"}, "unknown arch 'gpt2'"),
    ],
)
def test_bad_values(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        tiny.make_tiny_model(str(tmp_path / "m"), **kwargs)
    assert message in str(exc.value)
    assert not (tmp_path / "m").exists()


def test_head_dim_not_hidden_over_heads(tmp_path: Path) -> None:
    """Qwen3 and Mistral may have heads * head_dim != hidden_size (as real Qwen3 checkpoints do)."""
    for arch in ("qwen3", "mistral"):
        model_dir = tmp_path / arch
        tiny.make_tiny_model(str(model_dir), arch, hidden_size=48, num_heads=4, head_dim=32)
        model = load_model(model_dir)
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 48)


def test_default_tiny_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))
    path = tiny.default_tiny_model_dir()
    assert Path(path).parent == tmp_path
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (4, 128)
    model = load_model(path)
    assert len(model.model.layers) == 4

    # Cached: a second call does not rebuild.
    def fail(*args: object, **kwargs: object) -> str:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "make_tiny_model", fail)
    assert tiny.default_tiny_model_dir() == path
    monkeypatch.undo()
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))

    # A new format version is a new directory.
    monkeypatch.setattr(tiny, "FORMAT_VERSION", tiny.FORMAT_VERSION + 1)
    other = tiny.default_tiny_model_dir()
    assert other != path and os.path.isdir(other)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(path).name, Path(other).name])


def test_default_tiny_model_dir_lost_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishing first: its copy is used and our temporary directory is removed."""
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))
    real_make = tiny.make_tiny_model
    built: list[str] = []

    def racing_make(out_dir: str, *args: object, **kwargs: object) -> str:
        real_make(out_dir, *args, **kwargs)
        built.append(out_dir)
        if len(built) == 1:
            tiny.default_tiny_model_dir()  # the other process, which renames first
        return out_dir

    monkeypatch.setattr(tiny, "make_tiny_model", racing_make)
    path = tiny.default_tiny_model_dir()
    assert len(built) == 2
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    assert not os.path.exists(built[0])
    load_model(path)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_all_sparse_experts_take_the_intermediate_size(arch):
    """Mixtral's and OLMoE's experts are config.json's intermediate_size wide: --intermediate sets them (unless
    --moe-intermediate does); they have no dense layers."""
    from tpserve.tiny.config import model_config

    def size(**kwargs) -> int:
        return model_config(arch, tokenizer_size=100, bos_token_id=0, eos_token_id=1, **kwargs).intermediate_size

    assert (size(intermediate_size=96), size(intermediate_size=96, moe_intermediate_size=48), size()) == (96, 48, 32)
    with pytest.raises(ValueError, match=f"{arch} has no dense layers"):
        size(mlp_only_layers=(0,))
    if arch == "olmoe":  # its q/k norms span hidden_size (transformers): the heads must fill it; top k as published
        with pytest.raises(ValueError, match="olmoe has no head_dim setting"):
            size(head_dim=32)
        assert not model_config(arch, tokenizer_size=100, bos_token_id=0, eos_token_id=1).norm_topk_prob
