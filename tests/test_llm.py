"""The offline LLM API: inputs, outputs, sampling, and process lifecycle."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tpserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, device="cpu") as llm:
        yield llm


def test_text_and_token_prompts_agree(llm):
    text = "Hello world, 你好"
    ids = llm.tokenizer.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = llm.generate([text, ids], greedy, use_tqdm=False)
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids
    assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_results_in_order_with_per_prompt_params(llm):
    prompts = [[3, 4, 5], [6] * 30, [7, 8], [9, 10, 11, 12]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 1, 9, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 1, 9, 3]
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):  # each equals its own solo run
        solo = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(out.token_ids), ignore_eos=True), use_tqdm=False)
        assert solo[0].token_ids == out.token_ids


def test_seeds(llm):
    prompts = [[20, 21, 22]] * 4
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 1, 2, 3)]
    outs = llm.generate(prompts, seeded, use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids
    assert len({tuple(o.token_ids) for o in outs[1:]}) == 3
    again = llm.generate([prompts[0]], seeded[0], use_tqdm=False)
    assert again[0].token_ids == outs[0].token_ids, "same seed, same output, whatever the batch"
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_n_completions_per_prompt(llm):
    """As vLLM's: ``outputs`` holds n completions; seeded, completion i samples with seed + i (as
    the HTTP API's n); the flat fields are the first completion's."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate(["Hello", [20, 21, 22]], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        assert all(len(c.token_ids) == len(c.logprobs) == len(c.token_logprobs) == 6 and c.finish_reason == "length" for c in out.outputs)
        assert (out.token_ids, out.text, out.logprobs, out.token_logprobs) == (
            out.outputs[0].token_ids, out.outputs[0].text, out.outputs[0].logprobs, out.outputs[0].token_logprobs)
        for i, completion in enumerate(out.outputs):
            solo = llm.generate([out.prompt_token_ids], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6,
                                                                        ignore_eos=True), use_tqdm=False)[0]
            assert solo.token_ids == completion.token_ids
            assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    unseeded = llm.generate([[20, 21, 22]], SamplingParams(n=4, temperature=1.0, max_tokens=8), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        SamplingParams(n=0)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CONVERSATIONS = [
    ([{"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
     {"chat_template_kwargs": {"enable_thinking": False}}),
    ([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], {"tools": WEATHER}),
    ([{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
]


def http_chat_prompt(llm, messages, options) -> list[int]:
    """The prompt the HTTP chat endpoint makes of this request: its TokenizeRequest, prepared as the
    tokenizer worker prepares it."""
    from fastapi.testclient import TestClient

    from tpserve.engine_config import EngineConfig
    from tpserve.launch.args import ServerArgs
    from tpserve.message.frontend import RequestRejected
    from tpserve.server.api import AppState, create_app
    from tpserve.server.limits import RequestLimits
    from tpserve.server.serving import Serving
    from tpserve.tokenizer.prepare import PromptLimits, PromptPreparer

    class Capture:
        def __init__(self) -> None:
            self.submitted: list = []

        def new_rid(self) -> int:
            return 1

        async def submit(self, requests, queue) -> None:
            self.submitted.extend(requests)
            queue.put_nowait(RequestRejected(rid=1, message="captured"))

        async def abort(self, rid) -> None:
            pass

    state = AppState(ServerArgs(engine=EngineConfig(model=llm.config.model), served_model_name="m", context_len=256,
                                vocab_size=llm.model_config.vocab_size))
    frontend = Capture()
    state.serving = Serving(frontend, state.metrics, "m", RequestLimits(256, 8))  # type: ignore[arg-type]
    options = {"tool_choice": "none", **options} if "tools" in options else options
    assert TestClient(create_app(state)).post("/v1/chat/completions", json={"messages": messages, **options}).json()[
        "error"]["message"] == "captured"
    limits = PromptLimits(llm.model_config.context_length, llm.model_config.vocab_size)
    return PromptPreparer(llm.tokenizer, limits).prepare(frontend.submitted[0]).generate.input_ids


def test_chat_renders_as_the_http_chat_endpoint(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = []
    for messages, options in CONVERSATIONS:
        out = llm.chat(messages, greedy, use_tqdm=False, **options)[0]
        assert out.prompt_token_ids == http_chat_prompt(llm, messages, options)
        assert out.token_ids == llm.generate([out.prompt_token_ids], greedy, use_tqdm=False)[0].token_ids
        assert len(out.token_ids) == 4
        prompts.append(out.prompt_token_ids)
    assert llm.tokenizer.decode(prompts[2]).endswith("1, 2,")  # continued, not closed
    # a list of conversations, with one SamplingParams each
    many = llm.chat([CONVERSATIONS[0][0], CONVERSATIONS[2][0]], [greedy, SamplingParams(n=2, max_tokens=3)],
                    use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert [o.prompt_token_ids for o in many][0] == prompts[0] and [len(o.outputs) for o in many] == [1, 2]


def test_chat_template_replaces_the_models(llm):
    """LLM.chat(chat_template=...) renders with that Jinja text (as vLLM's), compiled as --chat-template is."""
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = llm.chat(messages, greedy, use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("[system] Be brief.\n[user] Hi there\n[assistant]")
    two = llm.chat([messages, messages[1:]], greedy, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert [llm.tokenizer.decode(o.prompt_token_ids) for o in two] == [
        "[system] Be brief.\n[user] Hi there\n", "[user] Hi there\n"]
    # the model's own template is left as it was
    assert llm.chat(messages, greedy, use_tqdm=False)[0].prompt_token_ids == http_chat_prompt(llm, messages, {})
    with pytest.raises(ValueError, match=r"chat_template is not a valid chat template: unexpected '}' \(line 1\)"):
        llm.chat(messages, use_tqdm=False, chat_template="{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match="chat_template is empty"):
        llm.chat(messages, use_tqdm=False, chat_template=" ")
    with pytest.raises(TypeError, match="chat_template must be the template's text"):
        llm.chat(messages, use_tqdm=False, chat_template=["{{ messages }}"])


@pytest.mark.parametrize(
    "messages, options, fragment",
    [
        ([{"role": "wizard", "content": "x"}], {}, "conversation 0: messages[0].role: Input should be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
         "image_url content is not supported"),
        ([{"role": "user", "content": "x"}], {"continue_final_message": True},
         "continue_final_message needs add_generation_prompt: false"),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tools": []}}, "may not set tools"),
        ([[{"role": "user", "content": "x"}], []], {}, "conversation 1 has no messages"),
    ],
)
def test_chat_errors_name_the_bad_value(llm, messages, options, fragment):
    with pytest.raises(ValueError) as e:
        llm.chat(messages, use_tqdm=False, **options)
    assert fragment in str(e.value)


def test_bad_inputs(llm):
    with pytest.raises(TypeError, match="got b'bytes, not text'"):
        llm.generate(b"bytes, not text")
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    vocab = llm.model_config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"stop_token_ids: token id {bad} is out of range \[0, {vocab}\)"):
            llm.generate(["hi"], SamplingParams(stop_token_ids=[1, bad]), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids may hold at most 256 token ids, got 257"):
        SamplingParams(stop_token_ids=[1] * 257)
    with pytest.raises(ValueError, match="tp_size 3 does not divide num_attention_heads 4"):
        LLM(llm.config.model, tp_size=3, device="cpu")



def test_mistyped_inputs_are_clear_errors(llm):
    with pytest.raises(TypeError, match=r"sampling_params\[0\] must be a SamplingParams, got None"):
        llm.generate(["hi"], [None], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate(["hi"], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]: token ids must be integers, got 1.7"):
        llm.generate([[1], [1.7, 2]], use_tqdm=False)  # not silently token 1
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a list of token ids, got None"):
        llm.generate([None], use_tqdm=False)
    numpy = pytest.importorskip("numpy")
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b = llm.generate([numpy.array([5, 6, 7]), (5, 6, 7)], greedy, use_tqdm=False)
    assert a.prompt_token_ids == [5, 6, 7] and type(a.prompt_token_ids[0]) is int and a.token_ids == b.token_ids



def test_prompts_of_any_sequence_type_and_clear_errors_for_the_rest(llm):
    """vLLM takes any sequence of prompts; a generator, a 2-D numpy array or None were errors from
    deep inside ("'generator' object is not subscriptable", "truth value of an array ... is ambiguous")."""
    numpy = pytest.importorskip("numpy")
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(iter([[5, 6, 7], [8, 9]]), greedy, use_tqdm=False)] == want
    assert [o.token_ids for o in llm.generate(numpy.array([[5, 6, 7]]), greedy, use_tqdm=False)] == want[:1]
    for bad in (None, 5, b"hi"):
        with pytest.raises(TypeError, match="prompts must be a list of strings, token-id lists or .* dicts, got"):
            llm.generate(bad, use_tqdm=False)
    # one prompt alone, as vLLM takes it: a list of one result
    text = [o.token_ids for o in llm.generate(["hi"], greedy, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate("hi", greedy, use_tqdm=False)] == text
    assert [o.token_ids for o in llm.generate({"prompt": "hi"}, greedy, use_tqdm=False)] == text


def test_vllm_prompt_dicts_and_keywords(llm, qwen3_dir):
    """vLLM's {"prompt": ...} / {"prompt_token_ids": ...} prompts, and its keyword names (the CLI takes the same)."""
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = llm.tokenizer.encode("hi")
    want = llm.generate([ids], greedy, use_tqdm=False)[0].token_ids
    outs = llm.generate([{"prompt": "hi"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [want, want]
    for bad, fragment in (({"text": "hi"}, "a dict prompt is"), ({"prompt": ids}, "'prompt' takes a string"),
                          (b"hi", r"prompts\[0\] is bytes: decode it to a string first")):
        with pytest.raises(TypeError, match=fragment):
            llm.generate([bad], use_tqdm=False)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict, got 'yes'"):
        llm.chat([{"role": "user", "content": "x"}], chat_template_kwargs="yes", use_tqdm=False)
    import torch

    with LLM(qwen3_dir, device="cpu", dtype=torch.float32, tensor_parallel_size=1, max_num_seqs=4,
             trust_remote_code=True) as other:
        assert (other.config.tp_size, other.config.dtype, other.config.max_running_requests) == (1, "float32", 4)
    with pytest.raises(TypeError, match="gpu_memory_utilization and mem_fraction name the same setting"):
        LLM(qwen3_dir, device="cpu", mem_fraction=0.5, gpu_memory_utilization=0.5)


def test_calls_from_two_threads_queue_and_both_complete(llm):
    """Each call reads the ranks' shared output stream: a second thread's call waits for the first (it lost the
    first's outputs and hung)."""
    from concurrent.futures import ThreadPoolExecutor

    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(llm.generate, [[5, 6, 7]] * 4, params, False) for _ in range(2)]
        results = [f.result(timeout=300) for f in futures]
    for outs in results:
        assert [len(o.token_ids) for o in outs] == [20] * 4 and {o.finish_reason for o in outs} == {"length"}
    assert [o.token_ids for o in results[0]] == [o.token_ids for o in results[1]]


def test_ctrl_c_during_a_step_leaves_the_llm_working(llm):
    """tp 1 steps in the caller's thread: a SIGINT that landed halfway through a step left the scheduler's requests
    and KV pages inconsistent (the next call failed, leaked pages or hung). It now waits for the step to end."""
    import random
    import threading

    check = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = llm.generate([[3, 4, 5]], check, use_tqdm=False)[0].token_ids
    rng, interrupted = random.Random(0), 0
    generating = threading.Event()

    def on_sigint(sig, frame) -> None:  # Python's KeyboardInterrupt, but never one outside the call (pytest's)
        if generating.is_set():
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for _ in range(40):
            timer = threading.Timer(rng.uniform(0.001, 0.05), os.kill, (os.getpid(), signal.SIGINT))
            try:  # the signal may land before the call begins (a loaded machine): still an interruption
                generating.set()
                timer.start()
                llm.generate([[rng.randrange(600) for _ in range(rng.randrange(5, 60))] for _ in range(8)],
                             SamplingParams(n=2, temperature=1, max_tokens=30, ignore_eos=True), use_tqdm=False)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                generating.clear()
                timer.cancel()
                timer.join()
            assert llm.generate([[3, 4, 5]], check, use_tqdm=False)[0].token_ids == want
    finally:
        signal.signal(signal.SIGINT, previous)
    stats = llm.stats()
    assert interrupted >= 10 and (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0), (interrupted, stats)


@pytest.mark.parametrize("handler", ["ignore", "flag"])
def test_a_sigint_that_does_not_interrupt_lets_the_call_finish(llm, handler):
    """SIG_IGN (a job started with & by a non-interactive shell) or a handler that only notes it: the call goes on
    (receive ended its steps at the signal and popped an empty outbox)."""
    import threading

    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if handler == "ignore" else lambda s, f: noted.append(s))
    timer = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        outs = llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        timer.join()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert [len(o.token_ids) for o in outs] == [40] * 8
    assert noted == ([] if handler == "ignore" else [signal.SIGINT])


def test_a_second_ctrl_c_leaves_a_step_that_does_not_end(qwen3_dir):
    """The first SIGINT waits for the step to end; a second one in the same step interrupts it (a hung step can
    still be left), and the LLM then says it failed rather than running on half-updated state."""
    import threading

    llm = LLM(qwen3_dir, device="cpu")
    stuck = threading.Event()

    def step_forever() -> bool:  # for 60 s: a test that fails must not hang
        stuck.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("the second SIGINT did not interrupt the step")

    llm._driver.loop.run_once = step_forever
    # Python's own handler: a process started in the background by a shell inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = [threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)) for delay in (0.3, 0.6)]
    try:
        for timer in timers:
            timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert stuck.is_set()
        with pytest.raises(RuntimeError, match="the engine failed in a step .*KeyboardInterrupt.*create a new LLM"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()
        signal.signal(signal.SIGINT, previous)
        llm.close()


def test_close_from_another_thread_during_generate_is_a_clear_error(qwen3_dir):
    import threading

    llm = LLM(qwen3_dir, device="cpu")
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=100_000, ignore_eos=True), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 -- what the call ended with
            errors.append(e)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(0.5)
    llm.close()
    worker.join(60)
    assert not worker.is_alive() and len(errors) == 1
    assert isinstance(errors[0], RuntimeError) and "closed during this call" in str(errors[0]), repr(errors[0])


def test_the_callers_gc_freeze_stays(llm):
    import gc

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert gc.get_freeze_count() > frozen // 2 > 0  # generate unfroze it (0 after); some frozen objects die
    finally:
        gc.unfreeze()


def test_llm_seed_and_chat_iterables_and_unknown_keywords(llm, qwen3_dir):
    sample = SamplingParams(temperature=1, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(qwen3_dir, device="cpu", seed=7) as seeded:
            runs.append([o.token_ids for o in seeded.generate([[5, 6, 7]] * 3, sample, use_tqdm=False)])
    assert runs[0] == runs[1] and len({tuple(r) for r in runs[0]}) > 1
    assert seeded.config.seed == 7  # the engine's seed too (dummy weights), as the CLI's --seed
    with pytest.raises(TypeError, match="seed must be an integer or None, got 'x'"):
        LLM(qwen3_dir, device="cpu", seed="x")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        LLM(qwen3_dir, device="cpu", max_num_seq=4)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    message = {"role": "user", "content": "hi"}
    want = llm.chat([message], greedy, use_tqdm=False)[0].token_ids
    assert llm.chat(iter([message]), greedy, use_tqdm=False)[0].token_ids == want
    assert llm.chat((c for c in [[message]]), greedy, use_tqdm=False)[0].token_ids == want


def test_vllms_switches_and_kv_cache_dtype_spelling_reach_the_engine():
    """LLM(enforce_eager=True, enable_prefix_caching=False, kv_cache_dtype="fp8"), as vLLM scripts pass them, set what
    the CLI's vLLM flags set (they were unexpected keyword arguments, and "fp8" not a choice)."""
    from tpserve.llm import _engine_kwargs

    assert _engine_kwargs({"enforce_eager": True, "enable_prefix_caching": False, "kv_cache_dtype": "fp8"}) == {
        "cuda_graph_max_bs": 0, "cache": "naive", "kv_cache_dtype": "fp8_e4m3"}
    assert _engine_kwargs({"enforce_eager": False, "enable_prefix_caching": True}) == {}  # what tpserve does anyway
    with pytest.raises(TypeError, match="enforce_eager and cuda_graph_max_bs name the same setting"):
        _engine_kwargs({"cuda_graph_max_bs": 8, "enforce_eager": True})


def test_a_rank_side_error_names_its_prompt(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: "):
        llm.generate([[5, 6], []], SamplingParams(max_tokens=2), use_tqdm=False)


def test_model_must_be_a_path(qwen3_dir, tmp_path):
    for bad in (None, 123):
        with pytest.raises(TypeError, match=f"model must be a model directory or a Hugging Face id, got {bad}"):
            LLM(bad)
    with pytest.raises(ValueError, match=f"model: {tmp_path} has no config.json"):
        LLM(str(tmp_path))
    from tpserve.launch.args import ModelNotFound

    assert issubclass(ModelNotFound, ValueError)  # a missing model is a ValueError, as every bad argument


def test_vllm_named_arguments_are_named_in_their_errors(qwen3_dir):
    with pytest.raises(ValueError, match=r"^max_num_seqs \(tpserve's max_running_requests\) must be >= 1, got 0$"):
        LLM(qwen3_dir, device="cpu", max_num_seqs=0)


def test_an_llm_used_after_its_with_block_says_so(qwen3_dir):
    with LLM(qwen3_dir, device="cpu") as closed:
        pass
    for name, call in (
        ("generate", lambda: closed.generate(["hi"], use_tqdm=False)),
        ("chat", lambda: closed.chat([{"role": "user", "content": "hi"}], use_tqdm=False)),  # said generate()
        ("flush_cache", closed.flush_cache),
        ("get_stats", closed.stats),
        ("embed", lambda: closed.embed(["hi"], use_tqdm=False)),  # these three said generate()
        ("classify", lambda: closed.classify(["hi"], use_tqdm=False)),
        ("score", lambda: closed.score("a", "b", use_tqdm=False)),
    ):
        with pytest.raises(RuntimeError, match=rf"^{name}\(\) called after close\(\)$"):
            call()
    closed.close()  # twice is fine


def test_model_without_tokenizer_takes_token_ids(qwen3_dir, tmp_path):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m", ignore=shutil.ignore_patterns("tokenizer*"))
    with LLM(str(model_dir), device="cpu") as bare:
        assert bare.tokenizer is None  # not transformers' empty stand-in, which encodes "hi" as []
        with pytest.raises(ValueError, match="this model has no tokenizer: pass prompts as token-id lists"):
            bare.generate(["hi"], use_tqdm=False)
        out = bare.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 2 and out.text == ""


def test_unreadable_tokenizer_is_named(qwen3_dir, tmp_path):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").write_text("{bad")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {model_dir}: "):
        LLM(str(model_dir), device="cpu")


SCRIPT = """
import os, sys
from tpserve import LLM, SamplingParams
llm = LLM({model!r}, tp_size=2, device="cpu")
print("CHILDREN", *[p.pid for p in llm._driver.backend.procs], flush=True)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("TOKENS", len(out[0].token_ids), flush=True)
{ending}
"""


def run_script(model_dir: str, ending: str) -> list[int]:
    code = SCRIPT.format(model=model_dir, ending=ending)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert "TOKENS 4" in proc.stdout, proc.stderr[-3000:]
    return [int(p) for p in proc.stdout.split("CHILDREN")[1].split("\n")[0].split()]


def assert_gone(pids: list[int]) -> None:
    deadline = time.time() + 15
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphan rank processes {alive}"


@pytest.mark.parametrize("ending", ["", "llm.close()", "os.kill(os.getpid(), 9)"], ids=["exit", "close", "killed"])
def test_no_orphan_rank_processes(qwen3_dir, ending):
    if ending.startswith("os.kill"):
        # A SIGKILLed parent runs no cleanup: the kernel (PR_SET_PDEATHSIG) or the ranks' parent watch ends them.
        pids = run_script_killed(qwen3_dir)
    else:
        pids = run_script(qwen3_dir, ending)
    assert len(pids) == 2
    assert_gone(pids)


def run_script_killed(model_dir: str) -> list[int]:
    code = SCRIPT.format(model=model_dir, ending="os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL
    return [int(p) for p in proc.stdout.split("CHILDREN")[1].split("\n")[0].split()]


def test_dead_rank_is_an_error_not_a_hang(qwen3_dir):
    llm = LLM(qwen3_dir, tp_size=2, device="cpu")
    procs = llm._driver.backend.procs
    try:
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tp rank 1 died"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert all(not p.is_alive() for p in procs)


def test_an_llm_built_in_a_thread_that_ends_keeps_its_ranks(qwen3_dir):
    """The kernel's parent-death signal follows the thread that started a process: the ranks were killed when the
    thread that built the LLM ended, the user's process still running."""
    import threading

    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(LLM(qwen3_dir, tp_size=2, device="cpu")))
    thread.start()
    thread.join()
    (llm,) = built
    try:
        time.sleep(1.0)
        assert all(p.is_alive() for p in llm._driver.backend.procs)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 4
    finally:
        llm.close()


def test_a_rank_that_fails_to_start_names_why(qwen3_dir, tmp_path):
    """At TP 2 the ranks are processes: their exception reaches the caller's error (it said only "tp rank 0 died")."""
    import json

    bad = tmp_path / "bad-shape"
    shutil.copytree(qwen3_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2  # the checkpoint's MLP weights no longer fit the model built from the config
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as direct:
        LLM(str(bad), device="cpu")
    with pytest.raises(RuntimeError) as ranks:
        LLM(str(bad), tp_size=2, device="cpu")
    message = str(ranks.value)
    assert "died (exit code 1)" in message and "(the first error: tpserve-scheduler-tp" in message
    assert str(direct.value).splitlines()[0][:60] in message


def test_a_script_without_the_main_guard_is_told_about_it(qwen3_dir, tmp_path):
    """Each spawned rank imports the script first: unguarded, it starts tpserve again and the rank dies before it
    can report why (Python's own message speaks of freeze_support)."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from tpserve import LLM\nLLM({str(qwen3_dir)!r}, tp_size=2, device='cpu')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and re.match(r"RuntimeError: tp rank [01] died \(exit code 1\)", last), proc.stderr
    assert f"each rank first imports {script}" in last and 'if __name__ == "__main__":' in last


def test_logprobs_match_transformers(llm, qwen3_dir):
    import torch

    from reference import hf_logits

    prompt = [30, 31, 32, 33]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                          use_tqdm=False)[0]
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                    logprobs=0), use_tqdm=False)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.logprobs is None and plain.top_logprobs is None and plain.token_logprobs is None
    for out, top_n in ((greedy, 3), (sampled, 0)):
        ref = torch.log_softmax(hf_logits(qwen3_dir, prompt + out.token_ids)[len(prompt) - 1 : -1], dim=-1)
        assert len(out.token_logprobs) == len(out.token_ids) == 6
        expected = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.token_logprobs), expected, atol=1e-4)
        for pos, top in enumerate(out.top_logprobs):
            assert len(top) == top_n
            ids = [t for t, _ in top]
            assert ids == ref[pos].topk(top_n).indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in top]), ref[pos, ids], atol=1e-4)
        # each sampled token's rank in the vocabulary, whether or not among the top ones (vLLM's Logprob.rank)
        ranks = [int((ref[p] >= ref[p, t]).sum()) for p, t in enumerate(out.token_ids)]
        assert [position[t].rank for t, position in zip(out.token_ids, out.logprobs)] == ranks
    assert max(p[t].rank for t, p in zip(sampled.token_ids, sampled.logprobs)) > 1
    # Greedy: the sampled token is the most likely one.
    assert [top[0][0] for top in greedy.top_logprobs] == greedy.token_ids
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)


def check_prompt_logprobs(out, model_dir: str, top_n: int) -> None:
    """``out``'s prompt log-probabilities against transformers' (float32)."""
    import torch

    from reference import hf_logits

    prompt = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(model_dir, prompt)[:-1], dim=-1)  # row p predicts prompt[p + 1]
    assert out.prompt_token_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_token_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
    expected = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out.prompt_token_logprobs[1:]), expected, atol=1e-4)
    # each prompt token's rank: how many tokens are at least as likely there, itself included (vLLM's Logprob.rank)
    ranks = [int((ref[p] >= ref[p, t]).sum()) for p, t in enumerate(prompt[1:])]
    assert out.prompt_ranks == [None, *ranks] and max(ranks) > 1
    for pos, top in enumerate(out.prompt_top_logprobs[1:]):
        assert [t for t, _ in top] == ref[pos].topk(top_n).indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), ref[pos].topk(top_n).values, atol=1e-4)


def test_prompt_logprobs_match_transformers(llm, qwen3_dir):
    prompt = list(range(40, 75))  # 35 tokens: two pages and a part
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    check_prompt_logprobs(first, qwen3_dir, 2)
    # Its pages are cached now: asked again, the prompt is computed whole, not served from the cache.
    again = llm.generate([prompt, [7]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    check_prompt_logprobs(again[0], qwen3_dir, 0)
    assert again[0].token_ids == first.token_ids
    assert again[1].prompt_logprobs == [None]  # a one-token prompt: nothing before it
    plain = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_prompt_logprobs_over_prefill_chunks(qwen3_dir, tp_size):
    prompt = list(range(3, 60))
    with LLM(qwen3_dir, device="cpu", tp_size=tp_size, chunked_prefill_size=16) as chunked:
        outs = chunked.generate([prompt, prompt[:20]], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1),
                                use_tqdm=False)
    for out in outs:
        check_prompt_logprobs(out, qwen3_dir, 1)


def test_calls_without_sampling_params_take_the_models_generation_config(qwen3_dir, tmp_path):
    """As vLLM's LLM: generate() given no SamplingParams samples with get_default_sampling_params(), the model's
    generation_config.json's fields (here temperature 0: greedy, so the tokens show it) with the override over them;
    a bad one fails before anything is spawned."""
    import json

    model = tmp_path / "model"
    shutil.copytree(qwen3_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0, "top_k": 5}))
    with pytest.raises(ValueError, match="override_generation_config: 'max_tokens' is not one of"):
        LLM(str(model), device="cpu", override_generation_config={"max_tokens": 3})
    with LLM(str(model), device="cpu", override_generation_config={"min_p": 0.1}) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.min_p, defaults.max_tokens) == (0.0, 5, 0.1, 16)
        prompt = "Hello world"
        greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].token_ids
        assert llm.generate(prompt, use_tqdm=False)[0].token_ids == greedy
        assert llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].token_ids == llm.chat(
            [{"role": "user", "content": "hi"}], SamplingParams(temperature=0), use_tqdm=False)[0].token_ids


def test_truncate_prompt_tokens_offline(llm):
    """SamplingParams.truncate_prompt_tokens (vLLM's) offline too (it was applied only by the server's tokenizer):
    the prompt's last k tokens, the same as giving those alone."""
    ids = llm.tokenizer.encode("Once upon a time in a land far away there lived")
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([ids], SamplingParams(truncate_prompt_tokens=3, **greedy), use_tqdm=False)[0]
    alone = llm.generate([ids[-3:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:] and cut.token_ids == alone.token_ids


def test_vllm_names_get_tokenizer_and_reset_prefix_cache(llm):
    """vLLM's LLM.get_tokenizer() and reset_prefix_cache(), which scripts ported from vLLM call."""
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("hi")
    llm.generate("Once upon a time in a land far away", SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats().kv_pages_cached > 0
    assert llm.reset_prefix_cache() and llm.stats().kv_pages_cached == 0


def test_request_outputs_carry_vllms_fields(llm):
    """vLLM's quickstart reads ``output.prompt`` (AttributeError before); ``request_id`` (a string, unique across
    calls), ``finished``, ``num_cached_tokens`` and ``CompletionOutput.finished()`` as vLLM's. ``prompt`` is a text
    prompt's text, None for token ids and chat (vLLM's TokensPrompt)."""
    from tpserve import TextPrompt, TokensPrompt

    long = "Once upon a time in a land far away there lived a king who had three daughters and a dog"
    params = SamplingParams(max_tokens=2, n=2)
    outs = llm.generate([long, TextPrompt(prompt="Hi"), TokensPrompt(prompt_token_ids=[5, 6, 7])], params,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == [long, "Hi", None]
    assert all(o.finished and all(c.finished() for c in o.outputs) for o in outs)
    again = llm.generate(long, params, use_tqdm=False)[0]
    ids = [o.request_id for o in outs + [again]]
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == 4
    assert again.num_cached_tokens > 0 and again.num_cached_tokens < len(again.prompt_token_ids)
    assert llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].prompt is None
    embedded = llm.embed(["hi"], use_tqdm=False)[0]
    assert isinstance(embedded.request_id, str) and embedded.finished


def test_logprobs_are_laid_out_as_vllms(llm):
    """vLLM's ``CompletionOutput.logprobs`` and ``RequestOutput.prompt_logprobs``: at each position a dict token id ->
    Logprob(logprob, rank, decoded_token), the chosen token first and then the asked most likely ones by rank (was a
    flat list of floats, so ``logprobs[i][token_id].logprob`` failed); the flat values stay as ``token_logprobs``,
    ``top_logprobs``, ``prompt_token_logprobs``, ``prompt_top_logprobs`` and ``prompt_ranks``."""
    from tpserve import Logprob

    decode = llm.tokenizer.decode
    prompt = list(range(40, 52))
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=1), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for token, value, top, position in zip(completion.token_ids, completion.token_logprobs, completion.top_logprobs,
                                           completion.logprobs):
        assert next(iter(position)) == token and position[token].logprob == value
        assert position[token].decoded_token == decode([token])
        top_ids = [t for t, _ in top]
        # a sampled token outside the top ones has its rank in the vocabulary too (was None)
        assert position[token].rank == top_ids.index(token) + 1 if token in top_ids else position[token].rank > 2
        assert {t: position[t] for t in top_ids} == {t: Logprob(v, r, decode([t])) for r, (t, v) in enumerate(top, 1)}
        assert len(position) == 2 + (token not in top_ids)
    assert any(t not in dict(top) for t, top in zip(completion.token_ids, completion.top_logprobs))
    assert completion.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in
                                                             zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        position, token = out.prompt_logprobs[p], prompt[p]
        assert next(iter(position)) == token
        assert position[token] == Logprob(out.prompt_token_logprobs[p], out.prompt_ranks[p], decode([token]))
        (best, value), = out.prompt_top_logprobs[p]
        assert position[best] == Logprob(value, 1, decode([best]))
    assert llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].logprobs is None


def test_priority_as_vllms(llm, qwen3_dir):
    """vLLM's ``generate(..., priority=[...])`` under ``scheduling_policy="priority"``: the outputs are those of fcfs
    (priority orders the work, not its result); under fcfs a priority other than 0 is a ValueError, as is a list
    of the wrong length."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="priority 3 needs the priority schedule policy"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 3, 0])
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False, priority=[0, 0, 0])] == plain
    with LLM(qwen3_dir, device="cpu", scheduling_policy="priority", max_num_seqs=1) as ranked:
        assert ranked.config.schedule_policy == "priority"
        assert [o.token_ids for o in ranked.generate(prompts, params, use_tqdm=False, priority=[2, -1, 0])] == plain
        with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
            ranked.generate(prompts, params, use_tqdm=False, priority=[1, 2])
