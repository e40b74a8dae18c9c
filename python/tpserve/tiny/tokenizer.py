"""The tiny models' tokenizer: byte-level BPE trained offline on a small built-in corpus, with
Qwen's special tokens and a ChatML chat template."""

from __future__ import annotations

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EXTRA_TOKENS = (THINK_START, THINK_END)  # added, but not special: they are printed in outputs

BPE_TARGET_VOCAB = 1024  # cap before added tokens; this corpus yields fewer (~640)

# Qwen2's pre-tokenizer split (single digits, words with one leading non-letter, ...).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's template, trimmed: tools in the system turn, assistant tool calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn, and the enable_thinking switch.
CHAT_TEMPLATE = (
    "{%- macro text(content) %}{%- if content is string %}{{- content }}{%- elif content %}"
    "{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}"
    "{%- endif %}{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + text(message['content']) }}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{%- if text(message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + tool_call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
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
