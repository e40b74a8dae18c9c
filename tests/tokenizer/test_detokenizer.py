"""The detokenizer's bookkeeping: registration races, stop strings, finish, stats."""

from __future__ import annotations

from tpserve.message import AbortRequest, BatchTokenOutput, SchedulerStats, TokenOutput
from tpserve.message.frontend import DetokenizeRegister
from tpserve.tokenizer.detokenizer import ORPHAN_TIMEOUT_S, DetokenizerManager


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def batch(*outputs, stats=None):
    return BatchTokenOutput(outputs=list(outputs), stats=stats)


def feed_tokens(manager, rid, ids, finish="length"):
    """One token per batch; returns (texts, last ApiOutput, aborts)."""
    texts, aborts, last = [], [], None
    for i, t in enumerate(ids):
        done = finish if i == len(ids) - 1 else None
        out = TokenOutput(rid=rid, token_ids=[t], finish_reason=done, prompt_tokens=7 if i == 0 else 0)
        res = manager.on_batch(batch(out))
        aborts += res.aborts
        if res.api is not None and res.api.outputs:
            last = res.api.outputs[-1]
            texts.append(last.text)
            if last.finish_reason is not None:
                break
    return texts, last, aborts


def test_streams_text_and_counts(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=1, prompt_tokens=7))
    ids = ids_of(tiny_tokenizer, "Hello 你好 🙂!")
    texts, last, aborts = feed_tokens(m, 1, ids)
    assert "".join(texts) == "Hello 你好 🙂!"
    assert "\ufffd" not in "".join(texts)
    assert last.finish_reason == "length"
    assert last.completion_tokens == len(ids) and last.prompt_tokens == 7
    assert aborts == [] and m.num_active == 0


def test_tokens_before_registration_are_buffered(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    ids = ids_of(tiny_tokenizer, "early bird")
    res = m.on_batch(batch(TokenOutput(rid=5, token_ids=ids[:2], prompt_tokens=3)))
    assert res.api is None or res.api.outputs == []
    res = m.register(DetokenizeRegister(rid=5, prompt_tokens=3))
    assert res.api.outputs[0].text == tiny_tokenizer.decode(ids[:2])
    res = m.on_batch(batch(TokenOutput(rid=5, token_ids=ids[2:], finish_reason="stop")))
    out = res.api.outputs[0]
    assert out.finish_reason == "stop" and out.completion_tokens == len(ids)


def test_stop_string_spanning_outputs_finishes_and_aborts(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=2, stop=["STOP here"]))
    ids = ids_of(tiny_tokenizer, "keep this STOP here and not this")
    texts, last, aborts = feed_tokens(m, 2, ids)
    assert "".join(texts) == "keep this "
    assert last.finish_reason == "stop"
    assert aborts == [AbortRequest(rid=2)]
    # tokens still in flight for the request are dropped
    late = [TokenOutput(rid=2, token_ids=ids[:1]), TokenOutput(rid=2, token_ids=[], finish_reason="abort")]
    res = m.on_batch(batch(*late))
    assert res.api is None or res.api.outputs == []


def test_stop_string_in_last_output_needs_no_abort(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=3, stop=["!"]))
    ids = ids_of(tiny_tokenizer, "hi!")
    res = m.on_batch(batch(TokenOutput(rid=3, token_ids=ids, finish_reason="length")))
    assert res.aborts == []
    assert res.api.outputs[0].text == "hi" and res.api.outputs[0].finish_reason == "stop"


def test_no_stop_string_ends_in_the_first_min_tokens(tiny_tokenizer):
    """vLLM's rule: a stop string counts once more than min_tokens tokens are out (the probe's request stopped at
    5 tokens with min_tokens 20); one that starts before that point and ends after it does."""
    text = "ab STOP cd STOP ef"
    ids = ids_of(tiny_tokenizer, text)
    first_end = next(k for k in range(len(ids)) if "STOP" in tiny_tokenizer.decode(ids[: k + 1]))
    for min_tokens, expected in ((0, "ab "), (first_end, "ab "), (first_end + 1, "ab STOP cd ")):
        m = DetokenizerManager(tiny_tokenizer)
        m.register(DetokenizeRegister(rid=1, stop=["STOP"], min_tokens=min_tokens))
        texts, last, _ = feed_tokens(m, 1, ids)
        assert ("".join(texts), last.finish_reason) == (expected, "stop"), min_tokens
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=1, stop=["STOP"], min_tokens=len(ids)))
    texts, last, _ = feed_tokens(m, 1, ids)
    assert ("".join(texts), last.finish_reason) == (text, "length")


def test_chinese_stop_string(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=4, stop=["公园"]))
    ids = ids_of(tiny_tokenizer, "我们去公园散步吧")
    texts, last, aborts = feed_tokens(m, 4, ids)
    assert "".join(texts) == "我们去" and last.finish_reason == "stop"
    assert all("\ufffd" not in t for t in texts)


def test_error_finish_passes_message(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=9))
    res = m.on_batch(batch(TokenOutput(rid=9, token_ids=[], finish_reason="error", error="too big")))
    out = res.api.outputs[0]
    assert out.finish_reason == "error" and out.error == "too big"


def test_stats_forwarded_even_without_outputs(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    stats = SchedulerStats(running=1, waiting=2, kv_pages_used=3, kv_pages_total=4)
    res = m.on_batch(batch(stats=stats))
    assert res.api is not None and res.api.stats == stats and res.api.outputs == []


def test_interleaved_requests(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    a, b = ids_of(tiny_tokenizer, "alpha 你好"), ids_of(tiny_tokenizer, "beta 🙂 x")
    m.register(DetokenizeRegister(rid=1))
    m.register(DetokenizeRegister(rid=2))
    texts = {1: "", 2: ""}
    for i in range(max(len(a), len(b))):
        outs = []
        for rid, ids in ((1, a), (2, b)):
            if i < len(ids):
                finish = "length" if i == len(ids) - 1 else None
                outs.append(TokenOutput(rid=rid, token_ids=[ids[i]], finish_reason=finish))
        for o in m.on_batch(batch(*outs)).api.outputs:
            texts[o.rid] += o.text
    assert texts == {1: "alpha 你好", 2: "beta 🙂 x"}


def test_never_registered_tokens_are_dropped_after_timeout(tiny_tokenizer):
    clock = Clock()
    m = DetokenizerManager(tiny_tokenizer, clock=clock)
    m.on_batch(batch(TokenOutput(rid=77, token_ids=[1])))
    clock.now = ORPHAN_TIMEOUT_S + 1
    m.on_batch(batch())
    assert m.register(DetokenizeRegister(rid=77)).api is None


def test_include_stop_string_matched_stop_and_reasoning_flag(tiny_tokenizer):
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=6, stop=["STOP"], include_stop=True, prompt_in_reasoning=True))
    texts, last, _ = feed_tokens(m, 6, ids_of(tiny_tokenizer, "keep STOP drop"))
    assert "".join(texts) == "keep STOP" and last.matched_stop == "STOP" and last.prompt_in_reasoning
    m.register(DetokenizeRegister(rid=7))
    res = m.on_batch(batch(TokenOutput(rid=7, token_ids=[5], finish_reason="stop", matched_stop=5)))
    assert res.api.outputs[0].matched_stop == 5


def test_logprob_bytes_of_partial_characters(qwen3_tokenizer):
    """A byte-level token holding part of a multi-byte character decodes to U+FFFD; its logprob
    entries (chat's ``bytes``, top_logprobs' too, and an echoed prompt's) carry its real bytes, so
    the tokens' bytes join to the text's UTF-8."""
    from tpserve.server.formats import ChatFormat, CompletionFormat, legacy_token

    text = "🦜 𝄞 Ѯ"
    ids = ids_of(qwen3_tokenizer, text)
    assert any(qwen3_tokenizer.decode([t]) == "\ufffd" for t in ids), "the text must hold partial tokens"
    m = DetokenizerManager(qwen3_tokenizer)
    m.register(DetokenizeRegister(rid=1, prompt_tokens=len(ids)))
    out = TokenOutput(rid=1, token_ids=ids, finish_reason="length", logprobs=[-0.5] * len(ids),
                      top_logprobs=[[(t, -0.5), (ids[0], -1.0)] for t in ids], prompt_token_ids=ids,
                      prompt_logprobs=[-0.25] * (len(ids) - 1), prompt_top_logprobs=[[(t, -0.25)] for t in ids[1:]])
    api = m.on_batch(batch(out)).api.outputs[0]
    assert b"".join(e.raw for e in api.logprobs) == text.encode()
    assert b"".join(e.raw for e in api.prompt_logprobs) == text.encode()

    chat = ChatFormat("m", logprobs=True)._logprobs(api.logprobs)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == text.encode()
    assert b"".join(bytes(e["top_logprobs"][0]["bytes"]) for e in chat) == text.encode()
    assert all(e["top_logprobs"][1]["bytes"] == chat[0]["bytes"] for e in chat)
    assert chat[0]["token"] == "\ufffd" and chat[0]["bytes"] == list("🦜".encode()[:3])

    legacy = CompletionFormat("m", logprobs=True)._logprobs(0, api.prompt_logprobs + api.logprobs)
    assert legacy["tokens"] == [legacy_token(e.token, e.raw) for e in api.prompt_logprobs + api.logprobs]
    assert legacy["top_logprobs"][1] == {legacy["tokens"][1]: -0.25}


def test_completions_logprobs_keep_partial_tokens_apart(qwen3_tokenizer):
    """Tokens holding different parts of multi-byte characters all decode to U+FFFD: as keys of the
    legacy top_logprobs they overwrote each other. They show as OpenAI's legacy completions show
    them, "bytes:" and each byte as \\xNN (in ``tokens`` too); whole tokens keep their text, and chat
    logprobs (which carry ``bytes``) are unchanged."""
    from tpserve.server.formats import ChatFormat, CompletionFormat

    text = "🦜 𝄞"  # f0 9f a6 | 9c | 20 f0 9d | 84 | 9e: every Qwen3 token of it is partial
    ids = ids_of(qwen3_tokenizer, text)
    whole = ids_of(qwen3_tokenizer, "你好")
    assert len(ids) == 5 and all("\ufffd" in qwen3_tokenizer.decode([t]) for t in ids) and len(whole) == 1
    top = [(t, -1.0 - i) for i, t in enumerate(ids + whole)]
    m = DetokenizerManager(qwen3_tokenizer)
    m.register(DetokenizeRegister(rid=1))
    out = TokenOutput(rid=1, token_ids=ids, finish_reason="length", logprobs=[-0.5] * len(ids),
                      top_logprobs=[top] * len(ids))
    api = m.on_batch(batch(out)).api.outputs[0]

    legacy = CompletionFormat("m", logprobs=True)._logprobs(0, api.logprobs)
    shown = ["bytes:\\xf0\\x9f\\xa6", "bytes:\\x9c", "bytes:\\x20\\xf0\\x9d", "bytes:\\x84", "bytes:\\x9e"]
    assert legacy["top_logprobs"] == [{**{s: -1.0 - i for i, s in enumerate(shown)}, "你好": -6.0}] * len(ids)
    assert legacy["tokens"] == shown
    assert b"".join(bytes.fromhex(s[len("bytes:"):].replace("\\x", "")) for s in shown) == text.encode()
    assert legacy["text_offset"] == [0, 1, 2, 4, 5]  # each token's text as decoded: U+FFFD, " U+FFFD"
    chat = ChatFormat("m", logprobs=True)._logprobs(api.logprobs)["content"]
    assert [e["token"] for e in chat] == [qwen3_tokenizer.decode([t]) for t in ids]
    assert len({e["token"] for e in chat[0]["top_logprobs"]}) == 3  # "\ufffd", " \ufffd", "你好"; bytes tell apart


def test_a_stop_tokens_text_is_left_out_unless_asked(tiny_tokenizer):
    """EOS or a stop_token_ids token ends the text without its own (shown with skip_special_tokens false), as vLLM;
    include_stop_str_in_output keeps it."""
    ids = ids_of(tiny_tokenizer, "Hi there")
    head = tiny_tokenizer.decode(ids[:-1])
    for include, expected in ((False, head), (True, "Hi there")):
        m = DetokenizerManager(tiny_tokenizer)
        m.register(DetokenizeRegister(rid=1, include_stop=include, skip_special_tokens=False))
        outs = [TokenOutput(rid=1, token_ids=ids[:-1]),
                TokenOutput(rid=1, token_ids=ids[-1:], finish_reason="stop", matched_stop=ids[-1])]
        texts = [o.text for o in m.on_batch(batch(*outs)).api.outputs]
        assert head != "Hi there" and "".join(texts) == expected


def test_lora_answers_pass_through(tiny_tokenizer):
    """A scheduler's answer to a LoRA load or unload reaches the API server as it is (its rid is no request's)."""
    from tpserve.message import BatchTokenOutput, LoRAAnswer

    m = DetokenizerManager(tiny_tokenizer)
    result = m.on_batch(BatchTokenOutput([], answers="load_lora", lora=LoRAAnswer(5, "no free LoRA slot")))
    assert result.api is not None and result.api.lora == LoRAAnswer(5, "no free LoRA slot") and result.api.outputs == []


def test_a_stop_string_inside_several_tokens_of_one_output_ends_the_count_there(tiny_tokenizer):
    """Several tokens in one output (speculative decoding's accepted drafts): a stop string completed by one of them
    ends the output at that token; those after it are not counted, nor their log-probabilities sent."""
    ids = ids_of(tiny_tokenizer, "keep this STOP here and not this")
    end = next(k for k in range(len(ids)) if "STOP" in tiny_tokenizer.decode(ids[: k + 1])) + 1
    m = DetokenizerManager(tiny_tokenizer)
    m.register(DetokenizeRegister(rid=2, stop=["STOP"]))
    out = TokenOutput(rid=2, token_ids=ids, prompt_tokens=3, logprobs=[-1.0] * len(ids),
                      top_logprobs=[[]] * len(ids), ranks=[1] * len(ids))
    res = m.on_batch(batch(out))
    api = res.api.outputs[0]
    assert (api.text, api.finish_reason, api.matched_stop) == ("keep this ", "stop", "STOP")
    assert api.completion_tokens == api.new_tokens == end < len(ids)
    assert len(api.logprobs) == end and res.aborts == [AbortRequest(rid=2)]
