"""Offline sampling controls end to end: penalties, logit bias and min_tokens against
transformers' generate, stop strings, and neighbours in the batch left alone."""

from __future__ import annotations

import pytest
import torch

from tpserve import LLM, SamplingParams
from tests.reference import hf_logits, hf_model
from tpserve.tokenizer.prepare import with_bad_words_encoded

PROMPTS = [[20, 21, 22, 20, 21], [30, 31, 32, 33], [40, 41]]


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, device="cpu") as llm:
        yield llm


@torch.inference_mode()
def hf_generate(model_dir: str, prompt: list[int], new: int, **kwargs) -> list[int]:
    model = hf_model(model_dir)
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=kwargs.pop("min_new_tokens", 0),
        pad_token_id=0, **kwargs,
    )
    return out[0, len(prompt):].tolist()


def test_greedy_with_edits_matches_transformers_generate(llm, qwen3_dir):
    eos = list(llm.model_config.eos_token_ids)
    bias = {5: 3.0, 6: -2.5}
    seen_bias = {21: 6.0, 32: 6.0, 41: 6.0}
    cases = [
        (SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5),
         dict(repetition_penalty=1.5, eos_token_id=eos)),
        (SamplingParams(temperature=0, max_tokens=12, logit_bias=bias),
         dict(sequence_bias={(t,): v for t, v in bias.items()}, eos_token_id=eos)),
        (SamplingParams(temperature=0, max_tokens=12, min_tokens=12, repetition_penalty=0.8),
         dict(min_new_tokens=12, repetition_penalty=0.8, eos_token_id=eos)),
        # the bias comes first, as generate's sequence_bias (and vLLM's logit_bias): a seen token's biased logit
        # is what the repetition penalty divides (the prompts' own tokens are biased here)
        (SamplingParams(temperature=0, max_tokens=12, repetition_penalty=2.0, logit_bias=seen_bias),
         dict(repetition_penalty=2.0, sequence_bias={(t,): v for t, v in seen_bias.items()}, eos_token_id=eos)),
    ]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], plain, use_tqdm=False)[0].token_ids
    for params, hf_kwargs in cases:
        # the same prompts, each with the edit, plus an unedited neighbour in the same batch
        outs = llm.generate(PROMPTS + [PROMPTS[0]], [params] * 3 + [plain], use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            expected = hf_generate(qwen3_dir, prompt, 12, **dict(hf_kwargs))
            assert out.token_ids == expected[: len(out.token_ids)] and len(out.token_ids) >= 1, (params, prompt)
        assert outs[-1].token_ids == alone


def test_frequency_and_presence_match_a_reference_greedy_loop(llm, qwen3_dir):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    prompt = PROMPTS[0]  # greedy repeats a token within 10 steps from this one
    ids, expected = list(prompt), []
    for _ in range(10):  # OpenAI's rule on transformers' logits: output tokens only, not the prompt
        logits = hf_logits(qwen3_dir, ids)[-1].double()
        counts = torch.bincount(torch.tensor(expected or [0]), minlength=logits.numel()).double()
        if not expected:
            counts.zero_()
        logits -= 1.5 * counts + 0.5 * (counts > 0).double()
        expected.append(int(logits.argmax()))
        ids.append(expected[-1])
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out, again, unedited = llm.generate([prompt] * 3, [params, params, plain], use_tqdm=False)
    assert out.token_ids == expected == again.token_ids
    assert unedited.token_ids != expected  # the penalties did change the output


def reference_greedy(model_dir: str, prompt: list[int], new: int, allowed=None, bad_words=()) -> list[int]:
    """Greedy on transformers' logits with vLLM's bans: only ``allowed`` tokens, and a bad word's last token
    wherever the output (not the prompt) ends with the tokens before it."""
    ids, out = list(prompt), []
    for _ in range(new):
        logits = hf_logits(model_dir, ids)[-1].double()
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[allowed] = 0
            logits += keep
        for word in bad_words:
            if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def test_allowed_token_ids_and_bad_words_match_a_reference_greedy_loop(llm, qwen3_dir):
    """Under overlap scheduling too: a bad word of two tokens is banned right after its first token, which
    the step planned next must already know (such a request's steps drain)."""
    prompt, new = PROMPTS[1], 10
    plain = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    free = llm.generate([prompt], plain, use_tqdm=False)[0].token_ids
    allowed = sorted({free[1], free[4], 7, 8, 9, 100, 101})
    bad = [[free[2], free[3]], [free[6]]]  # two tokens greedy takes in a row, and one it takes later
    cases = [(dict(allowed_token_ids=allowed), dict(allowed=allowed)),
             (dict(bad_words_token_ids=bad), dict(bad_words=bad))]
    for extra, reference in cases:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, **extra)
        outs = llm.generate([prompt, prompt, PROMPTS[0]], [params, plain, params], use_tqdm=False)
        assert outs[0].token_ids == reference_greedy(qwen3_dir, prompt, new, **reference) != free, extra
        assert outs[1].token_ids == free  # the neighbour without them is left alone
        assert outs[2].token_ids == reference_greedy(qwen3_dir, PROMPTS[0], new, **reference), extra
    assert free[6] not in outs[0].token_ids


def test_allowed_tokens_all_banned_is_an_error_not_a_token_they_forbid(llm):
    """allowed_token_ids holding only tokens min_tokens or bad_words ban leaves nothing to sample (every logit was
    -inf and token 0 came out): the request fails saying so, at any position (a page's last too), and the LLM goes
    on."""
    eos = llm.model_config.eos_token_ids[0]
    for prompt, allowed in (([1], [eos]), (list(range(1, 16)), [eos, eos])):  # a repeated id is one token
        with pytest.raises(ValueError, match="every token in allowed_token_ids is banned after 0 generated tokens"):
            llm.generate([prompt], SamplingParams(temperature=0, allowed_token_ids=allowed, min_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[7, 8], bad_words_token_ids=[[8], [7, 7]])
    with pytest.raises(ValueError, match="every token in allowed_token_ids is banned after 1 generated tokens"):
        llm.generate([[1]], params, use_tqdm=False)  # 8 is banned: 7; then 7 would complete [7, 7]
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[7, 8],
                                             bad_words_token_ids=[[7, 7]]), use_tqdm=False)[0]
    assert out.token_ids[0] in (7, 8) and all(t in (7, 8) for t in out.token_ids) and [7, 7] != out.token_ids[:2]


def test_bad_words_as_text_never_appear(llm):
    free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    word = llm.tokenizer.decode(free.token_ids[3:5])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.token_ids[:3] == free.token_ids[:3] and out.token_ids != free.token_ids
    forms = with_bad_words_encoded(params, llm.tokenizer).bad_words_token_ids
    def occurs(ids, within):
        return any(within[i:i + len(ids)] == ids for i in range(len(within)))

    assert any(occurs(ids, free.token_ids) for ids in forms)  # greedy took a banned spelling
    assert not any(occurs(ids, out.token_ids) for ids in forms)


def test_stop_strings_offline(llm):
    free = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.find(stop)]
    assert len(out.token_ids) < 20
    kept = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == free.text[: free.text.find(stop) + len(stop)]


def test_bad_sampling_controls(llm):
    with pytest.raises(ValueError, match="logit_bias: token id"):
        llm.generate([[1]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3.0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match=r"allowed_token_ids: token id 1000000 is out of range \[0, "):
        llm.generate([[1]], SamplingParams(allowed_token_ids=[1, 10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words_token_ids: token id 1000000 is out of range"):
        llm.generate([[1]], SamplingParams(bad_words_token_ids=[[10**6]]), use_tqdm=False)


GREEDY = dict(temperature=0, ignore_eos=True)


def test_a_stop_tokens_text_is_left_out_and_named_as_the_stop_reason(llm):
    """As the server's detokenizer does: the stop token's text is not in ``text`` (it was), unless
    include_stop_str_in_output; with stop strings too (their text streams through another path)."""
    ids = llm.generate(["Hello"], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token greedy reaches first at step k
    decode = llm.tokenizer.decode
    for stop in ([], ["\x00never"]):
        out = llm.generate(["Hello"], SamplingParams(max_tokens=12, stop_token_ids=[ids[k]], stop=stop, **GREEDY),
                           use_tqdm=False)[0]
        assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason == ids[k]
        assert out.text == decode(ids[:k], skip_special_tokens=True), stop
        kept = llm.generate(["Hello"], SamplingParams(max_tokens=12, stop_token_ids=[ids[k]], stop=stop,
                                                      include_stop_str_in_output=True, **GREEDY), use_tqdm=False)[0]
        assert kept.text == decode(ids[: k + 1], skip_special_tokens=True), stop
    assert out.outputs[0].cumulative_logprob is None  # no logprobs asked
    scored = llm.generate(["Hello"], SamplingParams(max_tokens=3, logprobs=0, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert scored.cumulative_logprob == pytest.approx(sum(scored.token_logprobs)) and scored.stop_reason is None
    eos = llm.model_config.eos_token_ids[0]  # an EOS that ends it is no stop_reason (vLLM's)
    at_eos = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, logit_bias={eos: 100.0}),
                          use_tqdm=False)[0]
    assert (at_eos.token_ids, at_eos.finish_reason, at_eos.outputs[0].stop_reason) == ([eos], "stop", None)


def test_a_stop_string_its_last_allowed_token_completes_is_a_stop(llm):
    free = llm.generate(["Hello"], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    before = llm.tokenizer.decode(free.token_ids[:7], skip_special_tokens=True)
    stop = free.text[len(before) - 1:]  # the 8th token's text and the character before it
    assert len(stop) >= 2 and free.text.find(stop) == len(before) - 1, "the model's output changed: pick another stop"
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert (out.text, out.finish_reason, out.outputs[0].stop_reason) == (free.text[: len(before) - 1], "stop", stop)


def test_min_tokens_holds_back_stop_strings(llm):
    """vLLM's rule (its detokenizer): a stop string counts once more than min_tokens tokens are out."""
    free = llm.generate(["Hello"], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0]
    stop = free.text[2:4]
    early = llm.generate(["Hello"], SamplingParams(max_tokens=20, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert len(early.token_ids) < 10
    held = llm.generate(["Hello"], SamplingParams(max_tokens=20, min_tokens=10, stop=[stop], **GREEDY),
                        use_tqdm=False)[0]
    boundary = len(llm.tokenizer.decode(free.token_ids[:10], skip_special_tokens=True))
    later = [i for i in range(len(free.text)) if free.text.startswith(stop, i) and i + len(stop) > boundary]
    assert held.text == (free.text[: later[0]] if later else free.text)
    assert len(held.token_ids) > 10


def test_skip_special_tokens_false_shows_them(llm):
    start = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token that ends nothing
    forced = dict(max_tokens=3, logit_bias={start: 100.0}, **GREEDY)
    shown = llm.generate(["Hello"], SamplingParams(skip_special_tokens=False, **forced), use_tqdm=False)[0]
    assert shown.token_ids == [start] * 3 and shown.text == "<|im_start|>" * 3
    assert llm.generate(["Hello"], SamplingParams(**forced), use_tqdm=False)[0].text == ""
    cut = llm.generate(["Hello"], SamplingParams(skip_special_tokens=False, stop=["|><"], **forced), use_tqdm=False)[0]
    assert cut.text == "<|im_start" and cut.finish_reason == "stop"  # through the stop-string path too


def test_tp2_takes_the_same_bans_on_every_rank(llm, qwen3_dir):
    """At TP 2 each rank builds the bans from its own copy of the requests and drains the same steps: the outputs
    equal TP 1's (a rank that banned otherwise would sample otherwise, or wait at a collective forever)."""
    prompt, new = PROMPTS[1], 8
    plain = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    free = llm.generate([prompt], plain, use_tqdm=False)[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, bad_words_token_ids=[free[1:3]]),
              SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, allowed_token_ids=sorted(set(free[2:6]))),
              plain]
    want = [o.token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    with LLM(qwen3_dir, tp_size=2, device="cpu") as tp2:
        assert [o.token_ids for o in tp2.generate([prompt] * 3, params, use_tqdm=False)] == want
    assert want[0] != free and want[2] == free
