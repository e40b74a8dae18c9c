"""Tiny random models in Hugging Face format, made offline, for tests and demos.

``python -m tpserve.tiny OUT_DIR --arch qwen3`` writes config.json, generation_config.json,
safetensors weights (optionally sharded, with an index) and a byte-level BPE tokenizer trained
on a small built-in corpus, with a Qwen-style ChatML chat template.

The weights are random but deliberately large (see ``_init_tensor``): Hugging Face's default
init (std 0.02) gives nearly flat logits, so greedy decoding would repeat one token and a test
comparing against transformers could not tell a broken engine from a working one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}

# Bump whenever the files written for the same parameters change (corpus, init, config keys):
# it is part of the cache key of ``default_tiny_model_dir``.
FORMAT_VERSION = 1

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EXTRA_TOKENS = (THINK_START, THINK_END)  # added, but not special: they are printed in outputs

BPE_TARGET_VOCAB = 1024  # cap before added tokens; this corpus yields fewer (~640)
VOCAB_MULTIPLE = 64

# Qwen2's pre-tokenizer split (single digits, words with one leading non-letter, ...).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine keeps many requests in flight at
once: it batches their prompts, runs one forward pass per step, and streams tokens back as soon
as they are sampled. Tensor parallelism splits every weight matrix across GPUs, so each rank holds
a slice of the attention heads and of the feed-forward columns, and the partial results are summed
with an all-reduce after the output projection.
Once upon a time, in a small town by the sea, there lived an old clockmaker who repaired watches
for sailors. Every morning he opened his shop at seven o'clock, brewed a pot of black tea, and
listened to the gulls. "Time is patient," he would say, "but people are not." The children of the
town loved to visit him, because he kept a jar of lemon sweets on the counter and told stories about
storms, lighthouses, and ships that never came home.
Weather report: Monday 21 degrees and sunny; Tuesday 18 degrees with light rain; Wednesday 25
degrees, humid, with thunderstorms in the evening. Wind from the north-west at 15 km/h.
Invoice #20931 - 3 x widgets @ $4.99 = $14.97; 12 x bolts @ $0.25 = $3.00; total $17.97 (tax 8.5%).
Phone: +1 (555) 013-2468. Date: 2024-03-15T09:26:53Z. Version 1.2.3, build 4567, 0x1F, 3.14159.
Primes: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89.
Fibonacci: 1 1 2 3 5 8 13 21 34 55 89 144 233 377 610 987 1597 2584 4181 6765 10946.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Scheduler:
    def __init__(self, max_tokens: int = 8192) -> None:
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}
        self.max_tokens = max_tokens

    def step(self) -> Batch | None:
        if not self.waiting and not self.running:
            return None
        budget = self.max_tokens - len(self.running)
        return Batch(prefill=self.waiting[:budget], decode=list(self.running.values()))

for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }
if (err != nil) { return fmt.Errorf("open %s: %w", path, err) }
SELECT name, COUNT(*) AS total FROM users WHERE age >= 18 GROUP BY name ORDER BY total DESC;
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
<html><body><h1>Hello, world!</h1><p class="note">It works &amp; it is fast.</p></body></html>
$ pip install -e . && python -m pytest tests -q --timeout 60

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
User: Can you write a haiku about autumn? Assistant: Leaves drift on cold wind, / the river
carries them south, / geese call overhead.
Why do we sleep? Nobody knows for sure, but sleep helps memory, repairs tissue, and saves energy.

今天天气很好，我们去公园散步吧。春天来了，花儿都开了，小鸟在树上唱歌。
人工智能是计算机科学的一个分支，它试图理解智能的本质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。
大型语言模型通过预测下一个词来生成文本。张量并行把每个权重矩阵切分到多个显卡上。
我爱北京天安门。学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
请问，火车站怎么走？一直往前走，然后在第二个路口左转。谢谢你！不客气。
日本語も少し：こんにちは、世界。Ça va très bien, merci! Größe, Straße, naïve café, jalapeño.
Emoji: 🙂 🚀 ✨ — math: ∑ x² ≤ ∞, π ≈ 3.14, α + β = γ.
"""


@dataclass(frozen=True)
class TinySpec:
    """The maker's parameters, resolved (no None left)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_shards: int
    seed: int
    max_position_embeddings: int


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on ``CORPUS`` (deterministic: same corpus, same merges)."""
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer: decode(encode(s)) must give s back byte for byte.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=BPE_TARGET_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    return tok


def _tokenizer_config(max_position_embeddings: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_tokenizer(tok: Tokenizer, out_dir: str, max_position_embeddings: int) -> None:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), _tokenizer_config(max_position_embeddings))


# ---------------------------------------------------------------------------------------------
# Config


def resolve_spec(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    intermediate_size: int | None,
    vocab_size: int | None,
    tie_word_embeddings: bool,
    num_shards: int,
    seed: int,
    max_position_embeddings: int,
    tokenizer_size: int,
) -> TinySpec:
    """Fill in defaults and reject shapes the target architecture cannot express."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    positive = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "num_shards": num_shards,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    divisible = hidden_size % num_heads == 0
    if head_dim is None:
        if not divisible:
            raise ValueError(
                f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); "
                "pass head_dim explicitly"
            )
        head_dim = hidden_size // num_heads
    elif arch == "qwen2" and (not divisible or head_dim != hidden_size // num_heads):
        raise ValueError(
            f"qwen2 has no head_dim setting: head_dim ({head_dim}) must equal "
            f"hidden_size ({hidden_size}) / num_heads ({num_heads})"
        )
    elif arch == "llama" and not divisible:
        # transformers' LlamaConfig rejects this even when head_dim is given.
        raise ValueError(
            f"llama requires hidden_size ({hidden_size}) divisible by num_heads ({num_heads})"
        )
    if head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even and >= 2 (rotary embedding), got {head_dim}")
    if intermediate_size is None:
        intermediate_size = 2 * hidden_size
    if intermediate_size < 1:
        raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
    if vocab_size is None:
        vocab_size = -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < tokenizer_size:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be >= the tokenizer's size ({tokenizer_size})"
        )
    return TinySpec(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        num_shards=num_shards,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
    )


def model_config(spec: TinySpec, bos_id: int, eos_id: int) -> dict:
    """config.json in the (pre-v5) layout that both old and new transformers read."""
    cfg: dict = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if spec.arch != "qwen2":
        cfg["head_dim"] = spec.head_dim
    if spec.arch in ("qwen3", "llama"):
        cfg["attention_bias"] = False
    if spec.arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = spec.num_layers
    if spec.arch == "mistral":
        cfg["sliding_window"] = None
    if spec.arch == "llama":
        cfg["mlp_bias"] = False
        cfg["rope_theta"] = 500000.0
        # Small enough original context that, at tiny head dims, some rotary frequencies fall in
        # each llama3 band (kept, smoothed, divided by factor).
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(16, spec.max_position_embeddings // 8),
        }
    return cfg


def generation_config(endoftext_id: int, im_end_id: int) -> dict:
    return {
        "bos_token_id": endoftext_id,
        "eos_token_id": [im_end_id, endoftext_id],
        "pad_token_id": endoftext_id,
    }


# ---------------------------------------------------------------------------------------------
# Weights


def weight_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes, in checkpoint order."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if spec.arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if spec.arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


_AMPLIFIED = ("q_proj.weight", "k_proj.weight", "o_proj.weight", "down_proj.weight")


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, hidden_size: int) -> torch.Tensor:
    """Random tensor for one parameter, seeded by (seed, name) so it does not depend on order.

    Scales, chosen empirically so that greedy continuations vary with the prompt and rarely
    settle into repeating one token (with or without tied embeddings):
    - projections N(0, 1/fan_in) keep activations O(1); q/k get 3x and Qwen3's q/k norms weigh
      ~3, so attention is sharp and the context matters; o/down get 3x so the layers' outputs
      dominate the residual stream (otherwise a tied LM head mostly echoes the input token);
    - embeddings (also the tied LM head) N(0, 4/hidden): logits with std ~2;
    - other RMSNorm weights ~1 (+-10%); biases N(0, 0.5^2) so a missing bias shows.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 3.0 * (1.0 + 0.1 * noise)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.5 * noise
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return noise * (2.0 / hidden_size**0.5)
    gain = 3.0 if name.endswith(_AMPLIFIED) else 1.0
    return noise * (gain / shape[1] ** 0.5)


def random_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    return {
        name: _init_tensor(name, shape, spec.seed, spec.hidden_size)
        for name, shape in weight_shapes(spec).items()
    }


def _split_evenly(names: list[str], sizes: dict[str, int], num_shards: int) -> list[list[str]]:
    """Split ``names`` (kept in order) into exactly ``num_shards`` non-empty runs of ~equal bytes."""
    total = sum(sizes.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done, prev = 0, -1
    for i, name in enumerate(names):
        by_bytes = done * num_shards // total
        # Never skip a shard, and leave at least one tensor for each later shard.
        k = min(max(by_bytes, prev, num_shards - (len(names) - i)), prev + 1)
        shards[k].append(name)
        done, prev = done + sizes[name], k
    return shards


def _remove_old_weights(out_dir: str) -> None:
    """Rewriting a directory with another shard count must not leave the old files to be loaded."""
    for name in os.listdir(out_dir):
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out_dir, name))


def write_weights(weights: dict[str, torch.Tensor], out_dir: str, num_shards: int) -> None:
    _remove_old_weights(out_dir)
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    sizes = {name: t.numel() * t.element_size() for name, t in weights.items()}
    weight_map: dict[str, str] = {}
    for k, names in enumerate(_split_evenly(list(weights), sizes, num_shards)):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, os.path.join(out_dir, filename), metadata=metadata)
        weight_map.update({n: filename for n in names})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


# ---------------------------------------------------------------------------------------------
# Public API


def make_tiny_model(
    out_dir: str,
    arch: str = "qwen3",
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    num_shards: int = 1,
    seed: int = 0,
    max_position_embeddings: int = 4096,
) -> str:
    """Write a random Hugging Face-format model with a tokenizer to ``out_dir``; return it."""
    tok = build_tokenizer()
    spec = resolve_spec(
        arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        num_shards=num_shards,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
        tokenizer_size=tok.get_vocab_size(with_added_tokens=True),
    )
    weights = random_weights(spec)
    if num_shards > len(weights):
        raise ValueError(f"num_shards ({num_shards}) exceeds the number of tensors ({len(weights)})")
    endoftext, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), model_config(spec, endoftext, im_end))
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config(endoftext, im_end))
    _write_tokenizer(tok, out_dir, spec.max_position_embeddings)
    write_weights(weights, out_dir, spec.num_shards)
    return out_dir


DEMO_MODEL_PARAMS: dict = {
    "arch": "qwen3",
    "num_layers": 4,
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "seed": 0,
}


def cache_root() -> str:
    return os.environ.get("TPSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tpserve")


def default_tiny_model_dir() -> str:
    """The built-in demo model's directory in the cache, made on first use.

    The directory name hashes the parameters, the format version and the corpus, so any change
    gives a new directory. It is built in a temporary sibling and renamed into place; if another
    process wins the race, its (identical) copy is used.
    """
    key = json.dumps(
        {"params": DEMO_MODEL_PARAMS, "format": FORMAT_VERSION, "corpus": CORPUS}, sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = cache_root()
    final = os.path.join(root, f"tiny-{DEMO_MODEL_PARAMS['arch']}-{digest}")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-tiny-", dir=root)
    try:
        params = dict(DEMO_MODEL_PARAMS)
        make_tiny_model(tmp, params.pop("arch"), **params)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):  # a real failure, not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tpserve.tiny",
        description="Write a tiny random Hugging Face-format model (config, safetensors weights, "
        "byte-level BPE tokenizer with a ChatML chat template) to OUT_DIR, offline.",
    )
    add = parser.add_argument
    add("out_dir", metavar="OUT_DIR", help="directory to write (created if missing)")
    add("--arch", choices=list(ARCHITECTURES), default="qwen3",
        help="architecture: qwen3 (q/k RMSNorm), qwen2 (q/k/v bias), llama (llama3 rope "
        "scaling), mistral (default: %(default)s)")
    add("--layers", type=int, default=2, help="number of decoder layers (default: %(default)s)")
    add("--hidden", type=int, default=64, help="hidden size (default: %(default)s)")
    add("--heads", type=int, default=4,
        help="number of attention (query) heads (default: %(default)s)")
    add("--kv-heads", type=int, default=2,
        help="number of key/value heads; must divide --heads (default: %(default)s)")
    add("--head-dim", type=int, default=None,
        help="per-head dimension, even (default: hidden / heads, the only value qwen2 allows)")
    add("--intermediate", type=int, default=None,
        help="MLP intermediate size (default: 2 * hidden)")
    add("--vocab", type=int, default=None,
        help="model vocab size, >= the tokenizer's size (default: the tokenizer's size rounded "
        f"up to a multiple of {VOCAB_MULTIPLE})")
    add("--tie", action="store_true",
        help="tie the LM head to the token embedding (then no lm_head.weight is saved)")
    add("--shards", type=int, default=1,
        help="number of safetensors files; more than 1 also writes "
        "model.safetensors.index.json (default: %(default)s)")
    add("--seed", type=int, default=0, help="random seed for the weights (default: %(default)s)")
    add("--max-position-embeddings", type=int, default=4096,
        help="context length written to config.json (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        out = make_tiny_model(
            args.out_dir,
            args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
            tie_word_embeddings=args.tie,
            num_shards=args.shards,
            seed=args.seed,
            max_position_embeddings=args.max_position_embeddings,
        )
    except ValueError as e:
        parser.error(str(e))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
