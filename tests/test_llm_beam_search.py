"""Beam search (``tpserve.beam_search``): the search itself on scripted candidates, and ``LLM.beam_search`` against
transformers' beam search."""

from __future__ import annotations

import pytest

from tpserve import LLM, BeamSearchParams, SamplingParams
from tpserve.beam_search import BeamSearch

EOS = 0


def test_beams_keep_the_best_extensions_and_set_aside_those_at_eos():
    """Each step keeps the beam_width best non-EOS extensions by cumulative log-probability; an EOS extension is
    finished (without its token unless include_stop_str_in_output); the answer ranks finished and live beams by
    cum_logprob / len ** length_penalty, the prompt counted in the length (vLLM's score)."""
    search = BeamSearch([9, 9], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    search.advance([({1: -0.1, 2: -0.5, EOS: -3.0}, "s1")])
    assert [(b.tokens, b.cum_logprob) for b in search.live] == [([9, 9, 1], -0.1), ([9, 9, 2], -0.5)]
    assert [(b.tokens, b.cum_logprob, b.finish_reason, b.logprobs) for b in search.finished] == [([9, 9], -3.0, "stop",
                                                                                                  ["s1"])]
    search.advance([({3: -2.0, EOS: -0.2}, "a"), ({4: -0.1, 5: -0.2}, "b")])
    assert [(b.tokens, b.cum_logprob) for b in search.live] == [([9, 9, 2, 4], -0.6), ([9, 9, 2, 5], -0.7)]
    assert search.finished[-1].tokens == [9, 9, 1] and search.finished[-1].cum_logprob == pytest.approx(-0.3)
    assert not search.done
    search.advance([({6: -1.0}, "c"), ({7: -1.5}, "d")])
    assert search.done and search.steps == 3
    best = search.best()  # scores: [9,9,1] -0.3/3; [9,9,2,4,6] -1.6/5; [9,9,2,5,7] -2.2/5; [9,9] -3/2
    assert [(b.tokens, b.finish_reason) for b in best] == [([9, 9, 1], "stop"), ([9, 9, 2, 4, 6], "length")]
    assert best[0].stop_reason == EOS and search.generated(best[0]) == [1] and search.generated(best[1]) == [2, 4, 6]

    # length_penalty 0: the summed log-probabilities alone; the EOS kept with include_stop_str_in_output
    search = BeamSearch([9], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0,
                                              include_stop_str_in_output=True), EOS)
    search.advance([({EOS: -0.5, 1: -0.4}, None)])
    search.advance([({2: -0.3}, None)])
    best = search.best()
    assert [(b.tokens, b.finish_reason) for b in best] == [([9, EOS], "stop")] and search.generated(best[0]) == []
    # ignore_eos: EOS is a token as any other
    search = BeamSearch([9], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), EOS)
    search.advance([({EOS: -0.1, 1: -0.4}, None)])
    assert [b.tokens for b in search.best()] == [[9, EOS]] and not search.finished


@pytest.mark.parametrize("length_penalty, best", [(1e308, [[1, 3], [2, 4]]), (400.0, [[1, 3], [2, 4]]),
                                                   (-1e308, [[], [1, 3]]), (-400.0, [[], [1, 3]])])
def test_extreme_length_penalties_rank_beams_without_an_arithmetic_error(length_penalty, best):
    """length ** length_penalty past a float's range was an OverflowError or ZeroDivisionError in best() (a 500 on
    the server); they rank as the score would (a large one favours the longest beams, a negative one the shortest)."""
    search = BeamSearch([9] * 8, BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty), EOS)
    search.advance([({1: -0.1, 2: -0.5, EOS: -3.0}, None)])
    search.advance([({3: -0.2}, None), ({4: -0.3}, None)])
    assert [b.tokens[8:] for b in search.best()] == best


def test_a_prompt_of_eos_alone_is_scored():
    """A beam finished at EOS right after a prompt of EOS alone was 0 tokens long (a ZeroDivisionError)."""
    search = BeamSearch([EOS], BeamSearchParams(beam_width=2, max_tokens=1), EOS)
    search.advance([({EOS: -0.1, 1: -0.5}, None)])
    assert [(b.tokens, b.finish_reason) for b in search.best()] == [([EOS], "stop"), ([EOS, 1], "length")]


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0}, "beam_width must be in [1, 10]"),
    ({"beam_width": 11}, "beam_width must be in [1, 10]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"temperature": -1.0}, "temperature must be"),
    ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
])
def test_bad_params_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, device="cpu") as llm:
        yield llm


def test_beam_search_matches_transformers(llm, qwen3_dir):
    """Every beam running max_tokens (ignore_eos; transformers' min_new_tokens): the same beams as transformers'
    num_beams search, in the same order, with the same summed log-probabilities (float32: within 1e-4); each
    prompt of a call is searched on its own."""
    from reference import hf_beam_search

    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.0))
    for prompt, output in zip(prompts, outputs):
        expected = hf_beam_search(qwen3_dir, prompt, beams=3, max_new_tokens=6)
        got = [(beam.tokens[len(prompt):], beam.cum_logprob) for beam in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4)
        for beam in output.sequences:
            assert beam.tokens[: len(prompt)] == prompt and beam.finish_reason == "length"
            assert beam.text == llm.tokenizer.decode(beam.tokens)  # vLLM's: the prompt's text too
            assert len(beam.logprobs) == 6 and all(len(step) >= 6 for step in beam.logprobs)  # 2 x beam_width each
    # a text prompt is tokenized as generate's; beam_width 1 is greedy
    text = llm.tokenizer.decode(prompts[0])
    greedy = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    one = llm.beam_search(text, BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))[0].sequences
    assert len(one) == 1 and one[0].tokens[-5:] == greedy.token_ids
    with pytest.raises(ValueError, match="more than the context length"):
        llm.beam_search([{"prompt_token_ids": [1] * 10}], BeamSearchParams(beam_width=2, max_tokens=10**6))


def test_offline_beams_keep_their_eos_as_vllms(llm, monkeypatch):
    """vLLM's LLM.beam_search: a beam ended by EOS keeps the EOS token (include_stop_str_in_output or not), and every
    beam's text is its whole sequence's, the prompt's included."""
    prompt = [5, 6, 7, 8]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids[0]

    class EosAt:  # the model's tokenizer, its EOS the greedy first token (a beam ends there at once)
        eos_token_id = first

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    tokenizer = llm.tokenizer
    monkeypatch.setattr(llm, "tokenizer", EosAt())
    beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
    ended = [beam for beam in beams if beam.finish_reason == "stop"]
    assert [beam.tokens for beam in ended] == [prompt + [first]] and ended[0].stop_reason == first, beams
    assert all(beam.text == tokenizer.decode(beam.tokens) for beam in beams)
