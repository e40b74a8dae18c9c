"""Speculative decoding with n-gram drafts (``--speculative-config '{"method": "ngram", ...}'``): the config as vLLM
reads it, the drafts, and engines with drafts against the same engines without (float32, CPU): the same tokens and
log-probabilities, greedy and seeded random, at TP 1 and 2, with stops, limits and logit edits beside, while drafts
are both accepted and rejected; and through the server, streamed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tpserve import LLM, SamplingParams
from tpserve.scheduler.ngram import NgramConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[i, i + 1, i + 2] for i in range(1, 200, 23)]


def test_config_as_vllm_reads_it():
    assert NgramConfig.from_json(None) is None
    assert NgramConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}') == NgramConfig(3, 5, 5)
    assert NgramConfig.from_json('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}') \
        == NgramConfig(3, 4, 4)
    assert NgramConfig.from_json(json.dumps({**SPEC, "disable_by_batch_size": 8})) == NgramConfig(4, 1, 3, 8)
    for config, message in (
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "method 'eagle': drafts from a second model"),
        ({"num_speculative_tokens": 2}, 'serves method "ngram" only'),
        ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
        ({**SPEC, "prompt_lookup_min": 4}, "prompt_lookup_min 4 is above prompt_lookup_max 3"),
        ({**SPEC, "prompt_lookup_max": "3"}, "prompt_lookup_max must be a positive integer, got '3'"),
        ({**SPEC, "disable_by_batch_size": 1}, "disable_by_batch_size must be an integer >= 2"),
        ({**SPEC, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size is not served"),
    ):
        with pytest.raises(ValueError, match=message):
            NgramConfig.from_json(json.dumps(config))
    with pytest.raises(ValueError, match="must be a JSON object"):
        NgramConfig.from_json("[1]")


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    config = NgramConfig(3, 1, 3)
    tokens = np.array([1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3])
    assert config.propose(tokens, 5) == [9, 8, 2], "the 3-token suffix's match, over the later 2-token one"
    assert config.propose(np.array([5, 2, 3, 7, 4, 2, 3]), 5) == [7, 4, 2], "no 3-token match: the 2-token one"
    assert config.propose(np.array([1, 2, 1, 2, 3, 1, 2]), 5) == [3, 1, 2], "the latest of two"
    assert config.propose(np.array([1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]), 2) == [9, 8], "at most the room"
    assert config.propose(np.array([4, 5, 6]), 3) == [] and config.propose(np.array([4]), 3) == []
    assert NgramConfig(3, 2, 3).propose(np.array([1, 2, 9, 3, 2]), 3) == [], "one token matching is below the min"
    run = np.array([4, 6, 6, 6, 6, 6, 6])
    assert config.propose(run, 3) == [6, 6, 6], "in a run of one token, an occurrence followed by enough of it"
    assert config.propose(tokens, 5, skip=1) == [8, 2, 3], "the guess of a token not yet known left out"
    assert config.propose(np.array([5, 8, 8]), 3, skip=1) == [], "nothing after the guess"


def drafts_by_definition(tokens: list[int], config: NgramConfig, most: int, skip: int) -> list[int]:
    """``NgramConfig.propose`` as its docstring says it, one window at a time."""
    most, length = min(most, config.num_speculative_tokens), len(tokens)
    for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
        starts = [i + n + skip for i in range(length - n) if tokens[i: i + n] == tokens[length - n:]]
        if starts:
            enough = [start for start in starts if start + most <= length]
            start = enough[-1] if enough else starts[0]
            if start < length:
                return tokens[start: start + most]
    return []


def test_drafts_equal_their_definition_on_random_histories():
    rng = np.random.default_rng(0)
    proposed = 0
    for _ in range(3000):
        low = int(rng.integers(1, 4))
        config = NgramConfig(int(rng.integers(1, 6)), low, low + int(rng.integers(0, 3)))
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 40))).tolist()
        most, skip = int(rng.integers(1, 7)), int(rng.integers(0, 3))
        drafts = config.propose(np.array(tokens), most, skip)
        assert drafts == drafts_by_definition(tokens, config, most, skip), (tokens, config, most, skip)
        proposed += bool(drafts)
    assert proposed > 1000


@pytest.fixture(scope="module")
def loopy_dir(tiny_model_factory, tmp_path_factory) -> str:
    from loopy_model import loopy_model

    return loopy_model(tiny_model_factory("qwen3", vocab_size=700), tmp_path_factory.mktemp("loopy") / "model")


def run(model_dir: str, params: list[SamplingParams], spec: dict | None, tp: int = 1, prompts=PROMPTS):
    kwargs = {} if spec is None else {"speculative_config": spec}
    with LLM(model_dir, device="cpu", tensor_parallel_size=tp, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.replica_stats()[0]
    return outs, (stats.draft_tokens_total, stats.accepted_tokens_total)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_drafts_give_the_same_tokens_and_logprobs(loopy_dir, tp):
    from reference import hf_greedy

    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=2)] * len(PROMPTS)
    plain, _ = run(loopy_dir, params, None, tp)
    drafted, (drafts, accepted) = run(loopy_dir, params, SPEC, tp)
    print(f"tp {tp}: {accepted} of {drafts} drafts accepted")
    assert 30 < accepted < drafts, (drafts, accepted)
    worst = 0.0
    for p, d, prompt in zip(plain, drafted, PROMPTS):
        assert d.outputs[0].token_ids == p.outputs[0].token_ids == hf_greedy(loopy_dir, prompt, 80)
        worst = max(worst, max(abs(a - b) for a, b in zip(d.token_logprobs, p.token_logprobs)))
        assert [len(top) for top in d.outputs[0].logprobs] == [len(top) for top in p.outputs[0].logprobs]
    print(f"max log-probability difference {worst:.2e}")
    assert worst < 1e-5, worst


def test_seeded_sampling_stops_and_edits_beside_drafts(loopy_dir):
    """Each position is sampled at its own step's seed, as without drafts; a stop token or max_tokens inside an
    accepted run ends the request there; a request that edits logits (its row's penalties) keeps the batch from
    drafting that step, and is served as without drafts."""
    greedy_run = run(loopy_dir, [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * 2, None,
                     prompts=PROMPTS[:2])[0]
    repeated = greedy_run[0].outputs[0].token_ids[40]  # a token of the part that loops
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, ignore_eos=True, seed=11),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[repeated]),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0.5, max_tokens=60, ignore_eos=True, seed=5, top_k=3),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.05),  # drafts wait for it
    ]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4]]
    plain, _ = run(loopy_dir, params, None, prompts=prompts)
    drafted, (drafts, accepted) = run(loopy_dir, params, SPEC, prompts=prompts)
    assert accepted > 0
    for p, d in zip(plain, drafted):
        assert d.outputs[0].token_ids == p.outputs[0].token_ids
        assert d.outputs[0].finish_reason == p.outputs[0].finish_reason
    assert drafted[1].outputs[0].finish_reason == "stop" and drafted[1].outputs[0].token_ids[-1] == repeated
    assert len(drafted[2].outputs[0].token_ids) == 37


def test_a_server_with_drafts_streams_the_same_tokens(loopy_dir):
    """Several tokens a step reach the client as decoding's would: the same ids and log-probabilities, streamed or
    not, and the usage counts every token."""
    import httpx
    from server_process import running_server

    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=0)
    plain, _ = run(loopy_dir, [params] * 2, None, prompts=PROMPTS[:2])
    body = {"model": "loopy", "max_tokens": 50, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    for server in running_server(["--model", loopy_dir, "--device", "cpu", "--served-model-name", "loopy",
                                   "--speculative-config", json.dumps(SPEC)]):
        for prompt, expected in zip(PROMPTS[:2], plain):
            whole = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()
            tokens = whole["choices"][0]["logprobs"]["tokens"]
            assert [int(t.removeprefix("token_id:")) for t in tokens] == expected.outputs[0].token_ids
            assert whole["usage"]["completion_tokens"] == 50
            lines = []
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                              json={**body, "prompt": prompt, "stream": True,
                                    "stream_options": {"include_usage": True}}) as stream:
                lines = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
            pieces = [chunk["choices"][0]["logprobs"] or {} for chunk in lines if chunk["choices"]]
            streamed = [t for piece in pieces for t in piece.get("tokens", [])]
            assert streamed == tokens and lines[-1]["usage"]["completion_tokens"] == 50
            values = [v for piece in pieces for v in piece.get("token_logprobs", [])]
            assert max(abs(a - b) for a, b in zip(values, expected.token_logprobs)) < 1e-5
        text = httpx.get(f"{server.url}/metrics").text
        accepted = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].rsplit(" ", 1)[1]) > 0, accepted


def test_a_stop_string_inside_an_accepted_run_ends_the_output_at_its_token(loopy_dir):
    """A stop string completed by a token of an accepted run: the output ends at that token, as decoding's (the
    tokens after it are neither returned nor counted, nor their log-probabilities)."""
    prompts = [[i, i + 1, i + 2] for i in range(1, 600, 7)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(loopy_dir, device="cpu") as llm:
        plain = llm.generate(prompts, greedy, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    stops = []
    for prompt, out in zip(prompts, plain):  # five tokens' text from the output: met again, or where it is drafted
        ids = out.outputs[0].token_ids
        text = next((t for j in range(5, 30) if len((t := tokenizer.decode(ids[j: j + 5])).strip()) > 3
                     and "\ufffd" not in t), None)
        if text is not None:
            stops.append((prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text], logprobs=1)))
    prompts, params = [p for p, _ in stops], [s for _, s in stops]
    plain, _ = run(loopy_dir, params, None, prompts=prompts)
    drafted, (_, accepted) = run(loopy_dir, params, SPEC, prompts=prompts)
    assert accepted > 0
    for p, d in zip(plain, drafted):
        p, d = p.outputs[0], d.outputs[0]
        assert (d.token_ids, d.text, d.finish_reason, d.stop_reason) == (p.token_ids, p.text, "stop", p.stop_reason)
        assert len(d.logprobs) == len(p.logprobs) == len(p.token_ids)


def test_the_ngram_method_named_by_model_as_vllm_reads_it():
    """vLLM takes {"model": "[ngram]"} (or "ngram") without a method as the ngram method, the older spelling of it."""
    assert NgramConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}') \
        == NgramConfig(3, 4, 4)
    assert NgramConfig.from_json('{"model": "ngram", "method": "ngram", "num_speculative_tokens": 2}') \
        == NgramConfig(2, 5, 5)
    with pytest.raises(ValueError, match="drafts from a second model are not served"):
        NgramConfig.from_json('{"model": "some/draft", "num_speculative_tokens": 3}')
    with pytest.raises(ValueError, match="drafts from a second model are not served"):
        NgramConfig.from_json('{"model": "some/draft", "method": "ngram", "num_speculative_tokens": 3}')
