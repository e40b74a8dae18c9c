"""Tokenizer-worker request preparation: template, ids, validation, seeds, max_tokens."""

from __future__ import annotations

import random

import msgspec
import pytest
from tpserve.message.frontend import TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer


@pytest.fixture()
def preparer(tiny_tokenizer):
    return PromptPreparer(tiny_tokenizer, PromptLimits(context_len=64, vocab_size=700), rng=random.Random(1))


def req(**kw):
    params = kw.pop("params", SamplingParams(max_tokens=None))
    return TokenizeRequest(rid=kw.pop("rid", 1), params=params, **kw)


def test_chat_template_and_enable_thinking(preparer, tiny_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    plain = preparer.prepare(req(messages=msgs)).generate.input_ids
    no_think = preparer.prepare(req(messages=msgs, chat_template_kwargs={"enable_thinking": False})).generate.input_ids
    assert tiny_tokenizer.decode(plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(no_think).endswith("<think>\n\n</think>\n\n")


def test_continue_final_message_leaves_the_assistant_turn_open(preparer, tiny_tokenizer):
    """vLLM's continue_final_message: the model continues a partial answer (was silently ignored:
    the template closed the turn and opened a new one)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: {"}]
    ids = preparer.prepare(req(messages=msgs, add_generation_prompt=False, continue_final_message=True)).generate.input_ids
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\nSure: {")
    closed = preparer.prepare(req(messages=msgs, add_generation_prompt=False)).generate.input_ids
    assert tiny_tokenizer.decode(closed).endswith("Sure: {<|im_end|>\n")


def test_text_and_ids(preparer, tiny_tokenizer):
    p = preparer.prepare(req(text="Hello world"))
    assert p.generate.input_ids == tiny_tokenizer.encode("Hello world")
    assert preparer.prepare(req(input_ids=[1, 2, 3])).generate.input_ids == [1, 2, 3]


def test_max_tokens_and_seed_made_final(preparer):
    p = preparer.prepare(req(input_ids=[1, 2, 3]))
    assert p.generate.params.max_tokens == 64 - 3
    assert p.generate.params.seed is not None
    assert p.register.prompt_tokens == 3
    fixed = preparer.prepare(req(input_ids=[1], params=SamplingParams(max_tokens=5, seed=42, stop=["x"])))
    assert fixed.generate.params.max_tokens == 5 and fixed.generate.params.seed == 42
    assert fixed.register.stop == ["x"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(preparer):
    """vLLM's truncate_prompt_tokens: the last k tokens (a prompt as long as the context was a 400); -1: as many as
    the context holds with max_tokens after them; the counts are the kept prompt's."""
    long = list(range(1, 101))  # 100 tokens, context 64
    p = preparer.prepare(req(input_ids=long, params=SamplingParams(max_tokens=None, truncate_prompt_tokens=10)))
    assert p.generate.input_ids == long[-10:] and p.register.prompt_tokens == 10 and p.generate.params.max_tokens == 54
    p = preparer.prepare(req(input_ids=long, params=SamplingParams(max_tokens=8, truncate_prompt_tokens=-1)))
    assert p.generate.input_ids == long[-56:]
    # without max_tokens, room for min_tokens is left (a 63-token prompt left 1: a 400)
    p = preparer.prepare(req(input_ids=long, params=SamplingParams(max_tokens=None, min_tokens=8, truncate_prompt_tokens=-1)))
    assert p.generate.input_ids == long[-56:] and p.generate.params.max_tokens == 8
    short = preparer.prepare(req(input_ids=[1, 2, 3], params=SamplingParams(truncate_prompt_tokens=10)))
    assert short.generate.input_ids == [1, 2, 3]
    with pytest.raises(InvalidRequest, match="context length is 64"):
        preparer.prepare(req(input_ids=long, params=SamplingParams(max_tokens=None)))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1 or -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_a_pooled_input_may_fill_the_context(preparer):
    """vLLM's bound for embeddings, classify and score: the whole context (no token follows), also under
    truncate_prompt_tokens=-1; a generation prompt leaves a place for one token."""
    pooled = SamplingParams(pooling="embed", max_tokens=1)
    assert len(preparer.prepare(req(input_ids=list(range(1, 65)), params=pooled)).generate.input_ids) == 64
    with pytest.raises(InvalidRequest, match="the input has 65 tokens, but this model's context length is 64 tokens$"):
        preparer.prepare(req(input_ids=list(range(1, 66)), params=pooled))
    cut = SamplingParams(pooling="embed", max_tokens=1, truncate_prompt_tokens=-1)
    assert preparer.prepare(req(input_ids=list(range(1, 101)), params=cut)).generate.input_ids == list(range(37, 101))


def test_seeds_differ_between_requests(preparer):
    seeds = {preparer.prepare(req(rid=i, input_ids=[1])).generate.params.seed for i in range(5)}
    assert len(seeds) == 5


def test_a_prompts_choices_are_rendered_once(preparer, tiny_tokenizer, monkeypatch):
    """n > 1: the other choices (rid, seed) share the first one's tokens and final params but their own seed (a
    given one, else a new one each); the chat template renders once, not once per choice."""
    renders = []
    render = preparer.render_chat
    monkeypatch.setattr(preparer, "render_chat", lambda r: renders.append(r) or render(r))
    params = SamplingParams(max_tokens=None, seed=7, stop=["x"])
    choices = preparer.prepare_choices(req(messages=[{"role": "user", "content": "hi"}], params=params,
                                           more_choices=[(2, 8), (3, None), (4, None)]))
    assert len(renders) == 1 and [c.generate.rid for c in choices] == [c.register.rid for c in choices] == [1, 2, 3, 4]
    assert all(c.generate.input_ids == choices[0].generate.input_ids for c in choices)
    assert all(c.register == msgspec.structs.replace(choices[0].register, rid=c.generate.rid) for c in choices)
    seeds = [c.generate.params.seed for c in choices]
    assert seeds[:2] == [7, 8] and len(set(seeds)) == 4
    assert all(c.generate.params == msgspec.structs.replace(choices[0].generate.params, seed=s)
               for c, s in zip(choices, seeds))


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        ({"input_ids": list(range(64))}, "prompt", "context length is 64"),
        ({"input_ids": []}, "prompt", "empty"),
        ({"text": ""}, "prompt", "empty"),
        ({"input_ids": [1, 700]}, "prompt", "out of range"),
        ({"input_ids": [-1]}, "prompt", "out of range"),
        ({"input_ids": [1] * 10, "params": SamplingParams(max_tokens=60)}, "max_tokens", "70 were requested"),
        # no max_tokens: the context left over caps it, and min_tokens must fit too (was a 500)
        ({"input_ids": [1] * 10, "params": SamplingParams(max_tokens=None, min_tokens=60)}, "min_tokens",
         "min_tokens (60) is more than the 54 tokens"),
        ({"input_ids": [1], "params": SamplingParams(stop_token_ids=[9999])}, "stop_token_ids", "out of range"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs", "tokenize"),
        ({"messages": [{"role": "user", "content": "word " * 80}]}, "messages", "context length"),
        ({}, "prompt", "no prompt"),
    ],
)
def test_invalid_requests(preparer, kwargs, param, fragment):
    with pytest.raises(InvalidRequest) as e:
        preparer.prepare(req(**kwargs))
    assert e.value.param == param
    assert fragment in e.value.message


def test_prompt_ids_are_the_tokenizers_and_biased_ids_the_models(preparer, tiny_tokenizer):
    """Past the tokenizer's ids (642 here) and below the model's vocabulary (700: padding rows of the embedding),
    an id is no prompt token (echo and /detokenize could not render it), but sampling may still name it."""
    past = len(tiny_tokenizer)
    assert past < 700
    with pytest.raises(InvalidRequest, match=f"token id {past} is out of range \\[0, {past}\\)"):
        preparer.prepare(req(input_ids=[1, past]))
    prepared = preparer.prepare(req(input_ids=[1], params=SamplingParams(logit_bias={past: 5.0}, stop_token_ids=[699])))
    assert prepared.generate.params.logit_bias == {past: 5.0}
    # a beam search's steps: the tokens the model generated, which may be padding ids, are taken up to its vocabulary
    assert preparer.prepare(req(input_ids=[1, past, 699], model_ids=True)).generate.input_ids == [1, past, 699]
    with pytest.raises(InvalidRequest, match="token id 700 is out of range \\[0, 700\\)"):
        preparer.prepare(req(input_ids=[1, 700], model_ids=True))


def test_template_errors_become_invalid_requests(tiny_tokenizer):
    class Broken:
        chat_template = "{{ raise_exception('bad role') }}"

        def apply_chat_template(self, *a, **k):
            raise ValueError("bad role")

    p = PromptPreparer(Broken(), PromptLimits(64, 700))
    with pytest.raises(InvalidRequest, match="bad role"):
        p.prepare(req(messages=[{"role": "user", "content": "x"}]))


def test_no_chat_template():
    class NoTemplate:
        chat_template = None

    p = PromptPreparer(NoTemplate(), PromptLimits(64, 700))
    with pytest.raises(InvalidRequest, match="no chat template"):
        p.prepare(req(messages=[{"role": "user", "content": "x"}]))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.mark.parametrize("tokenizer_name", ["tiny_tokenizer", "qwen3_tokenizer"])
def test_tools_and_tool_turns_go_through_the_template(request, tokenizer_name):
    tokenizer = request.getfixturevalue(tokenizer_name)
    preparer = PromptPreparer(tokenizer, PromptLimits(context_len=4096, vocab_size=200_000))
    text = tokenizer.decode(preparer.prepare(req(messages=TOOL_TURNS, tools=TOOLS)).generate.input_ids)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_prompt_reasoning_state_with_the_real_qwen3_template(qwen3_tokenizer):
    preparer = PromptPreparer(qwen3_tokenizer, PromptLimits(context_len=4096, vocab_size=200_000))
    def state(messages, **kw):
        return preparer.prepare(req(messages=messages, **kw)).register.prompt_in_reasoning

    msgs = [{"role": "user", "content": "hi"}]
    assert state(msgs) is None  # no block of its own: the model may open one
    assert state(msgs, chat_template_kwargs={"enable_thinking": False}) is False  # closed: all content
    # a tag quoted in a message, or an earlier turn's closed block, is not the new turn's
    assert state([{"role": "system", "content": "Never write <think>."},
                  {"role": "user", "content": "What does the <think> tag do?"}]) is None
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
               {"role": "tool", "content": "c"}]
    assert "</think>" in preparer.render_chat(req(messages=history)) and state(history) is None
    # a continued final message counts: its own open block, or the closed one the template writes before it
    prefill = {"role": "assistant", "content": "<think>\nFirst"}
    assert state([msgs[0], prefill], add_generation_prompt=False, continue_final_message=True) is True
    answer = {"role": "assistant", "content": "The answer", "reasoning_content": "done"}
    assert state([msgs[0], answer], add_generation_prompt=False, continue_final_message=True) is False


def test_template_that_opens_the_think_block(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template + "{%- if add_generation_prompt %}{{- '<think>\\n' }}{%- endif %}"
    preparer = PromptPreparer(tokenizer, PromptLimits(context_len=64, vocab_size=700))
    assert preparer.prepare(req(messages=[{"role": "user", "content": "hi"}])).register.prompt_in_reasoning


def test_sampling_controls_checked(preparer):
    from tpserve.sampling_params import StructuredOutput

    with pytest.raises(InvalidRequest, match="out of range") as e:
        preparer.prepare(req(input_ids=[1], params=SamplingParams(logit_bias={10_000: 1.0})))
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match="invalid regex") as e:
        preparer.prepare(req(input_ids=[1], params=SamplingParams(structured=StructuredOutput("regex", "(a"))))
    assert e.value.param == "response_format"  # the default field
    # the field the request gave it in is named, and the message is xgrammar's without its source location
    with pytest.raises(InvalidRequest, match=r"^invalid regex: Regex parsing error") as e:
        preparer.prepare(req(input_ids=[1], params=SamplingParams(structured=StructuredOutput("regex", "(a")),
                             structured_param="regex"))
    assert e.value.param == "regex"
    for field, params in (("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 700])),
                          ("bad_words_token_ids", SamplingParams(bad_words_token_ids=[[1, 700]]))):
        with pytest.raises(InvalidRequest, match="token id 700 is out of range") as e:
            preparer.prepare(req(input_ids=[1], params=params))
        assert e.value.param == field
    p = preparer.prepare(req(input_ids=[1], params=SamplingParams(stop=["x"], include_stop_str_in_output=True,
                                                                  min_tokens=3)))
    assert p.register.include_stop and p.register.min_tokens == 3


def test_prompt_chars_counts_everything_the_template_renders():
    """The size checks and the worker's long-prompt thread count every string the template can
    render, not only the message contents: an 8 MB tools list held the worker for seconds."""
    from tpserve.tokenizer.prepare import prompt_chars

    assert prompt_chars(req(text="abc")) == 3
    assert prompt_chars(req(input_ids=[1, 2])) == 0
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "xyz"}'}}
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    tools = [{"type": "function", "function": {"name": "g", "description": "d" * 100}}]
    plain = prompt_chars(req(messages=messages))
    assert plain >= len("hello") + len('{"a": "xyz"}')
    assert prompt_chars(req(messages=messages, tools=tools)) >= plain + 100
    assert prompt_chars(req(messages=messages, chat_template_kwargs={"system": "s" * 50})) >= plain + 50


def test_bad_words_are_tokenized_at_the_start_and_after_a_space(preparer, tiny_tokenizer):
    """vLLM's rule: the word as it starts the text, and as it follows a space where that spelling has
    its own first token and as many tokens."""
    params = SamplingParams(bad_words=["hello", " world"], bad_words_token_ids=[[3]])
    ids = preparer.prepare(req(input_ids=[1], params=params)).generate.params.bad_words_token_ids
    expected = [[3]]
    for word in ("hello", "world"):
        bare = tiny_tokenizer.encode(word, add_special_tokens=False)
        spaced = tiny_tokenizer.encode(" " + word, add_special_tokens=False)
        expected.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            expected.append(spaced)
    assert ids == expected and len(ids) >= 4  # the byte-level tokenizer spells " hello" apart from "hello"


def test_a_bad_word_without_tokens_is_an_invalid_request(tiny_tokenizer):
    class Dropping:  # a tokenizer whose normaliser drops the word's characters
        def encode(self, text, add_special_tokens=True):
            return []

        def __len__(self):
            return 700

    preparer = PromptPreparer(tiny_tokenizer, PromptLimits(context_len=64, vocab_size=700))
    preparer._tokenizer = Dropping()
    with pytest.raises(InvalidRequest, match=r"bad_words\[0\] \('\\u200b'\) is no token at all") as e:
        preparer.prepare(req(input_ids=[1], params=SamplingParams(bad_words=["\u200b"])))
    assert e.value.param == "bad_words"


def test_documents_reach_the_chat_template(qwen3_tokenizer):
    """vLLM's ``documents`` (RAG) are the template's ``documents`` (chat ignored them)."""
    preparer = PromptPreparer(qwen3_tokenizer, PromptLimits(context_len=4096, vocab_size=200_000))
    template = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}{{ messages[0].content }}"
    docs = [{"title": "Paris", "text": "Sunny."}]
    text = preparer.render_chat(req(messages=[{"role": "user", "content": "hi"}], documents=docs, chat_template=template))
    assert text == "[Paris] Sunny.\nhi"


def test_default_template_kwargs_sit_under_the_requests(tiny_tokenizer):
    """--default-chat-template-kwargs (vLLM's and SGLang's): every chat gets them unless its request sets them."""
    limits = PromptLimits(context_len=64, vocab_size=700)
    preparer = PromptPreparer(tiny_tokenizer, limits, default_template_kwargs={"enable_thinking": False})
    msgs = [{"role": "user", "content": "hi"}]
    by_default = tiny_tokenizer.decode(preparer.prepare(req(messages=msgs)).generate.input_ids)
    assert by_default.endswith("<think>\n\n</think>\n\n")
    asked = preparer.prepare(req(messages=msgs, chat_template_kwargs={"enable_thinking": True})).generate.input_ids
    assert tiny_tokenizer.decode(asked) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
