"""``use_beam_search`` in the API server (``server/beam_search.py``) over a scripted backend: its steps watch the
client and the call's deadline as one call does."""

from __future__ import annotations

import asyncio
import json
import itertools

import pytest

from tpserve.beam_search import BeamSearchParams
from tpserve.message.frontend import ApiOutput, TokenizeRequest, TokenLogprob
from tpserve.sampling_params import SamplingParams
from tpserve.server import generation
from tpserve.server.errors import APIError
from tpserve.server.formats import CompletionFormat
from tpserve.server.limits import RequestLimits
from tpserve.server.lora_updates import ServedAdapters
from tpserve.server.metrics import ServerMetrics
from tpserve.server.serving import Serving
from tpserve.server.tokenize_service import TokenizeService

STEP_S = 0.005  # how long each step's one token takes


class StepFrontend:
    """Answers each one-token step request after STEP_S: token 10 and the alternatives 11, 12, ..."""

    def __init__(self) -> None:
        self.submitted: list[TokenizeRequest] = []
        self.aborted: list[int] = []
        self._rids = itertools.count(1)

    def new_rid(self) -> int:
        return next(self._rids)

    async def submit(self, requests: list[TokenizeRequest], queue: asyncio.Queue) -> None:
        self.submitted += requests
        for req in requests:
            k = req.params.logprobs
            step = TokenLogprob("a", -0.5, [(f"t{i}", b"t", -1.0 - i) for i in range(k)], b"a", 10,
                                list(range(11, 11 + k)))
            out = ApiOutput(rid=req.rid, text="a", new_tokens=1, completion_tokens=1, prompt_tokens=len(req.input_ids),
                            finish_reason="length", logprobs=[step])
            asyncio.get_running_loop().call_later(STEP_S, queue.put_nowait, out)

    async def abort(self, rid: int) -> None:
        self.aborted.append(rid)


class GoneClient:
    """An HTTP request whose client has gone."""

    def __init__(self) -> None:
        self.polls = 0

    async def is_disconnected(self) -> bool:
        self.polls += 1
        return True


def beam_call(qwen3_dir, frontend: StepFrontend, client: GoneClient | None, timeout: float | None = None,
              max_tokens: int = 2000, lora: str | None = None, logprobs: int | None = None,
              beam: BeamSearchParams | None = None):
    limits = RequestLimits(context_len=4096, max_sequences=8)
    serving = Serving(frontend, ServerMetrics(), "m", limits, request_timeout=timeout,  # type: ignore[arg-type]
                      prompts=TokenizeService(qwen3_dir, None, limits),
                      lora_adapters=ServedAdapters([] if lora is None else [(lora, "/adapter")]))
    params = SamplingParams(max_tokens=max_tokens, lora=lora, logprobs=logprobs)
    req = TokenizeRequest(rid=frontend.new_rid(), params=params,
                          input_ids=[5, 6, 7], more_choices=[(frontend.new_rid(), None)])
    beam = beam or BeamSearchParams(beam_width=2, max_tokens=max_tokens, ignore_eos=True)
    fmt = CompletionFormat("m", logprobs=logprobs is not None)
    return asyncio.run(serving.run([req], fmt, False, client, 2, beam=beam))  # type: ignore[arg-type]


def test_a_client_gone_during_a_beam_search_stops_it(qwen3_dir, monkeypatch):
    """Each step is a call of its own to the backend, far shorter than the client poll: the search still looks at
    the client every DISCONNECT_POLL_S, and a client gone aborts the step in flight (a 499), not after max_tokens."""
    monkeypatch.setattr(generation, "DISCONNECT_POLL_S", 0.05)
    frontend, client = StepFrontend(), GoneClient()
    response = beam_call(qwen3_dir, frontend, client)
    assert response.status_code == 499 and client.polls == 1
    steps = len(frontend.submitted) // 2
    assert steps < 100, f"{steps} steps ran for a client that had gone"


def test_a_beam_search_past_its_deadline_names_the_request_timeout(qwen3_dir):
    """The steps share the call's deadline: the 504 names --request-timeout (not the time left to the last step),
    and the step in flight is aborted."""
    frontend = StepFrontend()
    with pytest.raises(APIError, match=r"did not finish within 0.1 s \(--request-timeout\)") as e:
        beam_call(qwen3_dir, frontend, None, timeout=0.1)
    assert e.value.status == 504
    # the step in flight's unfinished requests (one of its two may have answered before the deadline)
    assert frontend.aborted and set(frontend.aborted) <= {req.rid for req in frontend.submitted[-2:]}


def test_a_beam_search_for_a_lora_adapter_runs_its_steps_with_it(qwen3_dir):
    """A request whose model names a LoRA adapter (params.lora): every step of its beam search runs with the adapter
    (as vLLM's beam search passes its lora_request to each step), not with the base model."""
    frontend = StepFrontend()
    response = beam_call(qwen3_dir, frontend, None, max_tokens=3, lora="sql")
    assert response.status_code == 200 and len(frontend.submitted) == 1 + 2 + 2  # a beam, then two
    assert [req.params.lora for req in frontend.submitted] == ["sql"] * len(frontend.submitted)


def test_a_beam_search_shows_the_top_logprobs_asked_past_twice_its_width(qwen3_dir):
    """Each step asked 2 x beam_width log-probabilities, and the answer showed at most those (4 of logprobs 7 at
    n 2); the steps ask for as many as the answer shows, the beams still extended by the 2 x width best only."""
    frontend = StepFrontend()
    response = beam_call(qwen3_dir, frontend, None, max_tokens=3, logprobs=7)
    assert response.status_code == 200 and {req.params.logprobs for req in frontend.submitted} == {7}
    choices = json.loads(response.body)["choices"]
    assert all(len(top) >= 7 for choice in choices for top in choice["logprobs"]["top_logprobs"])
    assert [choice["logprobs"]["tokens"] for choice in choices] == [["a", "a", "a"], ["a", "a", "t0"]]


class EosFrontend(StepFrontend):
    """Answers each step with token 10, EOS the likeliest of its alternatives."""

    def __init__(self, eos: int) -> None:
        super().__init__()
        self.eos = eos

    async def submit(self, requests: list[TokenizeRequest], queue: asyncio.Queue) -> None:
        self.submitted += requests
        for req in requests:
            top = [self.eos, 11, 12, 13]
            step = TokenLogprob("a", -0.5, [(f"t{i}", b"t", -0.1 - i) for i in range(len(top))], b"a", 10, top)
            out = ApiOutput(rid=req.rid, text="a", new_tokens=1, completion_tokens=1, prompt_tokens=len(req.input_ids),
                            finish_reason="length", logprobs=[step])
            asyncio.get_running_loop().call_later(STEP_S, queue.put_nowait, out)


@pytest.mark.parametrize("keep_eos", [False, True])
def test_a_beam_ended_by_eos_counts_its_eos_only_where_it_is_kept(qwen3_dir, keep_eos):
    """vLLM's beam search returns an EOS-ended beam's tokens without its EOS (with it under
    include_stop_str_in_output), its text without it either way, and its usage counts those tokens (len(token_ids));
    the EOS was counted always, as a plain request's is."""
    eos = asyncio.run(TokenizeService(qwen3_dir, None, RequestLimits(context_len=4096, max_sequences=8)).eos_token_id())
    params = BeamSearchParams(beam_width=2, max_tokens=1, include_stop_str_in_output=keep_eos)
    response = beam_call(qwen3_dir, EosFrontend(eos), None, max_tokens=1, logprobs=1, beam=params)
    body = json.loads(response.body)
    ended, live = body["choices"]
    assert (ended["finish_reason"], ended["text"], live["finish_reason"], live["text"]) == ("stop", "", "length", "+")
    assert len(ended["logprobs"]["tokens"]) == int(keep_eos) and len(live["logprobs"]["tokens"]) == 1
    assert body["usage"]["completion_tokens"] == 1 + int(keep_eos)
