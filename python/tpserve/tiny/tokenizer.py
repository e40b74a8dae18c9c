"""The tiny models' tokenizer: byte-level BPE trained offline on a small built-in corpus
(corpus.txt), with Qwen's special tokens and a ChatML chat template (chat_template.jinja)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", IM_END)
EXTRA_TOKENS = ("<think>", "</think>")  # added, but not special: they are printed in outputs

BPE_TARGET_VOCAB = 1024  # cap before added tokens; this corpus yields fewer (~640)

# Qwen2's pre-tokenizer split (single digits, words with one leading non-letter, ...).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Read as bytes, so that no newline translation changes them: both are part of the demo model's cache key.
CORPUS = (Path(__file__).parent / "corpus.txt").read_bytes().decode("utf-8")
# Qwen3's template, trimmed: tools in the system turn, assistant tool calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn, and the enable_thinking switch. It is one line;
# the file breaks it into lines for reading.
CHAT_TEMPLATE = "".join((Path(__file__).parent / "chat_template.jinja").read_bytes().decode("utf-8").splitlines())


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


def tokenizer_config(max_position_embeddings: int) -> dict:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beside tokenizer.json."""
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
