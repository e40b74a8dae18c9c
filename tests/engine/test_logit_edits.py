"""Logit edits (penalties, logit bias, min-tokens bans) against transformers' logits processors
and OpenAI's formula, and their device-side token history."""

from __future__ import annotations

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tpserve.engine.logit_edits import LogitEdits, PenaltyState
from tpserve.sampling_params import SamplingParams as SP

V = 50
EOS = [3, 7]


def run_edits(logits, params, prompts, outputs, steps=None):
    """Edited logits after the prompts are registered and ``outputs`` recorded step by step."""
    state = PenaltyState(V, torch.device("cpu"))
    slots = list(range(len(params)))
    new = [(s, p) for s, p in zip(slots, prompts)]
    longest = max(len(o) for o in outputs)
    for step in range(longest):
        sampled = [step < len(o) for o in outputs]
        edits = LogitEdits.build(params, slots, [step] * len(params), sampled, new, EOS, V, "cpu")
        new = []
        state.apply(torch.zeros(len(params), V), edits)
        tokens = torch.tensor([o[step] if step < len(o) else 0 for o in outputs])
        state.record(tokens, edits)
    steps = steps or [len(o) for o in outputs]
    edits = LogitEdits.build(params, slots, steps, [True] * len(params), new, EOS, V, "cpu")
    return state.apply(logits, edits)


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 5, 5], [9, 10], [11]]
    outputs = [[4, 2, 4], [10, 12], []]
    params = [SP(repetition_penalty=1.3), SP(repetition_penalty=0.7), SP(repetition_penalty=2.0)]
    ours = run_edits(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], ref[0])


def test_extreme_repetition_penalties_keep_the_logits_finite():
    """1e300 and 1e-300 are inf and 0 in float32: a seen negative logit became -inf (as if masked: a
    grammar whose allowed tokens were all seen then let argmax pick a masked token) and 0 / 0 NaN."""
    logits = torch.tensor([[-2.0, 0.0, 3.0, -1.0, 1.0] + [0.5] * (V - 5)] * 2)
    params = [SP(repetition_penalty=1e300), SP(repetition_penalty=1e-300)]
    ours = run_edits(logits, params, [[0, 1, 2], [0, 1, 2]], [[], []])
    assert torch.isfinite(ours).all(), ours[:, :5]
    assert ours[0, 0] < -1e20 and ours[0, 2] < 1e-20  # harsh: seen tokens fall far below the rest
    assert ours[1, 2] > 1e20 and ours[1, 0] > -1e-20  # lenient: seen tokens rise far above them
    assert ours[0, 0] < ours[0, 3] and ours[1, 2] > ours[1, 4]


def test_frequency_and_presence_follow_openai():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    prompts = [[1, 2], [3]]
    outputs = [[4, 4, 4, 6], [1, 1]]
    params = [SP(frequency_penalty=0.5, presence_penalty=0.25), SP(frequency_penalty=-1.0, presence_penalty=1.5)]
    ours = run_edits(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=V).float()  # prompt tokens do not count
        ref = logits[i] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(ours[i], ref)


def test_logit_bias_and_min_tokens_match_transformers():
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    params = [SP(logit_bias={5: 4.0, 6: -100.0}, min_tokens=3, stop_token_ids=[9]), SP(min_tokens=1)]
    ours = run_edits(logits, params, [[1], [2]], [[0], [0]])  # both have 1 output token
    bias = SequenceBiasLogitsProcessor({(5,): 4.0, (6,): -100.0})
    ref0 = bias(torch.tensor([[1]]), logits[:1].clone())
    ref0 = MinNewTokensLengthLogitsProcessor(1, 3, EOS + [9])(torch.tensor([[1, 0]]), ref0)
    torch.testing.assert_close(ours[0], ref0[0])
    torch.testing.assert_close(ours[1], logits[1])  # its 1 token reached min_tokens: nothing banned


def test_logit_bias_comes_before_the_repetition_penalty():
    """As transformers' generate (SequenceBiasLogitsProcessor, then RepetitionPenaltyLogitsProcessor) and vLLM
    (logit_bias, then the penalties): a biased token already seen gets (x + b) / r, not x / r + b."""
    logits = torch.full((1, V), 0.5)
    logits[0, 1] = 2.0
    params = [SP(repetition_penalty=2.0, logit_bias={1: 4.0, 2: -1.0, 20: 3.0})]
    ours = run_edits(logits, params, [[1, 2, 3]], [[]])
    ids = torch.tensor([[1, 2, 3]])
    ref = SequenceBiasLogitsProcessor({(1,): 4.0, (2,): -1.0, (20,): 3.0})(ids, logits.clone())
    ref = RepetitionPenaltyLogitsProcessor(2.0)(ids, ref)
    torch.testing.assert_close(ours[0], ref[0])
    assert ours[0, 1] == 3.0  # (2 + 4) / 2, not 2 / 2 + 4 = 5


def test_rows_without_edits_are_untouched_and_raw_logits_kept():
    logits = torch.randn(2, V)
    raw = logits.clone()
    ours = run_edits(logits, [SP(), SP(presence_penalty=1.0)], [[1], [2]], [[4], [4]])
    torch.testing.assert_close(ours[0], raw[0])
    assert not torch.equal(ours[1], raw[1])
    torch.testing.assert_close(logits, raw)  # a copy was edited


def test_nothing_to_edit_builds_nothing():
    assert LogitEdits.build([SP(), SP(temperature=0)], [-1, -1], [0, 0], [True, True], [], EOS, V, "cpu") is None


def test_mid_prompt_rows_are_not_counted():
    state = PenaltyState(V, torch.device("cpu"))
    params = [SP(frequency_penalty=1.0)]
    edits = LogitEdits.build(params, [0], [0], [False], [(0, [1, 2])], EOS, V, "cpu")
    state.apply(torch.zeros(1, V), edits)
    state.record(torch.tensor([5]), edits)
    assert int(state.counts.sum()) == 0
    edits = LogitEdits.build(params, [0], [0], [True], [], EOS, V, "cpu")
    state.record(torch.tensor([5]), edits)
    assert state.counts[0, 5] == 1 and state.prompt_mask[0, [1, 2]].all()


def test_reused_slot_starts_clean():
    state = PenaltyState(V, torch.device("cpu"))
    p = [SP(presence_penalty=1.0)]
    e = LogitEdits.build(p, [0], [0], [True], [(0, [1])], EOS, V, "cpu")
    state.apply(torch.zeros(1, V), e)
    state.record(torch.tensor([8]), e)
    e = LogitEdits.build(p, [0], [0], [True], [(0, [2])], EOS, V, "cpu")  # slot 0 given to a new request
    out = state.apply(torch.zeros(1, V), e)
    assert out.sum() == 0 and state.prompt_mask[0].nonzero().flatten().tolist() == [2]


def test_allowed_token_ids_and_bad_words():
    """Only the allowed tokens stay finite in their row; a bad word's last token is banned after its prefix;
    the rows beside them are untouched."""
    state = PenaltyState(V, torch.device("cpu"))
    params = [SP(allowed_token_ids=[3, 5, V + 4]), SP(), SP(bad_words_token_ids=[[2], [6, 8]])]
    edits = LogitEdits.build(params, [-1] * 3, [2] * 3, [True] * 3, [], EOS, V, "cpu", outputs=[[1], [6], [4, 6]])
    logits = torch.randn(3, V)
    out = state.apply(logits, edits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 5]
    assert torch.equal(out[0, [3, 5]], logits[0, [3, 5]])
    assert torch.equal(out[1], logits[1])
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [2, 8]
    later = LogitEdits.build(params[2:], [-1], [3], [True], [], EOS, V, "cpu", outputs=[[4, 6, 1]])
    assert torch.isinf(state.apply(logits[2:], later)).nonzero().tolist() == [[0, 2]]
