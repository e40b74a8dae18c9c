"""End to end at TP 2 on the CPU with the official openai SDK: what agents and apps send.
Tool calls (required, named, streamed, and a multi-turn exchange with a tool message),
structured output (chat.completions.parse with a pydantic model, json_object, regex),
penalties, and reasoning separation. The model has random weights: only constrained decoding
makes its output valid, which is the point. One server for the module."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_process import ABORTED, aborts, metrics_after_an_abort, running_server

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    yield from running_server(["--model", qwen3_dir, "--device", "cpu", "--tp-size", "2", "--served-model-name", "tiny",
                             "gpt-4o-mini", "--reasoning-parser", "qwen3", "--max-model-len", "1024"])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(client):
    # one call (parallel_tool_calls=False): the grammar then bounds the output, where a random model may write calls
    # until max_tokens (how many, and whether it stops, changed with the prompt's rendering of the tools)
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=200, seed=1)
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message, set(SCHEMAS))
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, tools=TOOLS, tool_choice=named,
                                          max_tokens=200, seed=2)
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message, {"get_weather"})


def test_streamed_tool_call_rebuilt_by_the_sdk_and_a_second_turn(client):
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, seed=3) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    check_calls(message, set(SCHEMAS))
    assert len(message.tool_calls) == 1 and final.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "temp": 21})},
    ]
    resp = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.prompt_tokens > 100  # tools in the prompt


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool
    level: int = Field(ge=0, le=99)


def test_parse_with_pydantic_json_object_and_regex(client):
    parsed = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Forecast, max_tokens=200,
                                           seed=4).choices[0].message.parsed
    assert isinstance(parsed, Forecast)
    resp = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=64, seed=5)
    text = resp.choices[0].message.content
    assert text.startswith("{") and (resp.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    resp = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, seed=6,
                                          extra_body={"regex": r"(sunny|rainy) [0-9]{1,2}C"})
    assert re.fullmatch(r"(sunny|rainy) [0-9]{1,2}C", resp.choices[0].message.content)


def test_vllm_structured_outputs_and_guided_fields(client):
    """vLLM's structured_outputs (json, regex, choice, grammar, json_object) and its older guided_* fields (were
    ignored: the output was unconstrained), through the openai client's extra_body as vLLM's users send them."""
    choices = ["positive", "negative \"quoted\"", "naïve"]
    for seed, extra in enumerate([{"structured_outputs": {"choice": choices}}, {"guided_choice": choices}]):
        resp = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, seed=seed, extra_body=extra)
        assert resp.choices[0].message.content in choices and resp.choices[0].finish_reason == "stop"
    for extra in ({"structured_outputs": {"regex": "(sunny|rainy) [0-9]{1,2}C"}}, {"guided_regex": "(sunny|rainy) [0-9]{1,2}C"},
                  {"structured_outputs": {"grammar": 'root ::= ("sunny" | "rainy") " " [0-9] "C"'}}):
        text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, seed=7,
                                              extra_body=extra).choices[0].message.content
        assert re.fullmatch(r"(sunny|rainy) [0-9]{1,2}C", text), (extra, text)
    schema = Forecast.model_json_schema()
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, seed=4,
                                              extra_body=extra).choices[0].message.content
        Forecast.model_validate_json(text)
    # (no string of limited length: in a structural tag xgrammar lets one hold raw control characters, docs/api.md)
    level = {"type": "object", "properties": {"sunny": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
             "maximum": 99}}, "required": ["sunny", "level"], "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "end": "</w>", "content": {
        "type": "json_schema", "json_schema": level}}}
    text = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, seed=4,
                                          response_format=tag).choices[0].message.content
    assert text.startswith("<w>") and text.endswith("</w>"), text
    got = json.loads(text[3:-4])
    assert set(got) == {"sunny", "level"} and isinstance(got["sunny"], bool) and 0 <= got["level"] <= 99, got
    text = client.completions.create(model="tiny", prompt="Weather:", max_tokens=64, seed=5,
                                     extra_body={"structured_outputs": {"json_object": True}}).choices[0].text
    assert text.startswith("{")
    for extra, fragment in (({"guided_choice": choices, "regex": "a"}, "give only one of regex, guided_choice"),
                            ({"structured_outputs": {"choice": []}}, "choice must be a list of non-empty strings"),
                            ({"structured_outputs": {"structural_tag": "x"}}, "the structural tag is not valid JSON"),
                            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "not regex and choice")):
        with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=extra)


def test_lenient_fields_and_penalties(client):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        max_completion_tokens=6, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": -100}, n=None,
        reasoning_effort="low", extra_body={"min_tokens": 6, "repetition_penalty": 1.2, "include_stop_str_in_output": False},
    )
    assert resp.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="image_url content is not supported"):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_reasoning_content_split_from_content(client):
    # a regex makes the random model think, then answer
    think = {"regex": r"<think>[a-z]{1,8}</think>\n\n(yes|no)"}
    resp = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, seed=7, extra_body=think)
    msg = resp.choices[0].message
    assert re.fullmatch("[a-z]{1,8}", msg.reasoning_content) and msg.content in ("yes", "no")
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, seed=7, stream=True,
                                                 extra_body=think))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content
    # thinking switched off: the template closes the block, so nothing is reasoning
    off = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
    msg = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, extra_body=off).choices[0].message
    assert msg.content and msg.reasoning_content is None


def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", max_tokens=200, seed=8,
                     max_retries=0, timeout=120)
    reply = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(reply.tool_calls[0]["args"], WEATHER_PARAMS)
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke("Forecast for Paris?")
    assert isinstance(forecast, Forecast)
    forecast = llm.with_structured_output(Forecast, method="function_calling").invoke("Forecast for Paris?")
    assert isinstance(forecast, Forecast)


def test_penalties_at_tp2_equal_the_offline_engine(client, qwen3_dir):
    from tpserve import LLM, SamplingParams

    prompt = [20, 21, 22, 20, 21]
    edits = dict(repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.3, logit_bias={302: -5.0, 9: 3.0})
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                     presence_penalty=0.7, frequency_penalty=0.3, logit_bias={"302": -5, "9": 3},
                                     extra_body={"repetition_penalty": 1.4, "ignore_eos": True, "min_tokens": 16})
    with LLM(qwen3_dir, device="cpu") as llm:
        offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **edits),
                               use_tqdm=False)[0]
    assert resp.choices[0].text == offline.text


def test_litellm_tools_and_response_format(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm

    common = dict(model="openai/tiny", api_base=f"{server.url}/v1", api_key="unused", max_tokens=200, seed=9)
    resp = litellm.completion(messages=ASK, tools=TOOLS, tool_choice="required", **common)
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message, set(SCHEMAS))
    resp = litellm.completion(messages=ASK, response_format=Forecast, **common)
    Forecast.model_validate_json(resp.choices[0].message.content)


# ---- the Responses API (/v1/responses), as the Agents SDK and client.responses drive it ----
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
NO_THINKING = {"effort": "none"}  # Qwen3's enable_thinking off: all the output is the message


def test_responses_text_whole_and_streamed(client):
    kwargs = dict(model="tiny", input="Tell me about Paris", instructions="Be brief.", max_output_tokens=12,
                  temperature=0, reasoning=NO_THINKING, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.output_text
    assert (whole.usage.output_tokens, whole.usage.total_tokens) == (12, whole.usage.input_tokens + 12)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)  # the SDK checks each event against the response it rebuilds
    final = events[-1].response  # get_final_response() wants response.completed, and this one is incomplete
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # streamed ones are stored too


def test_responses_function_call_round_trip(client):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=FLAT_TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, extra_body={"seed": 11})
    (call,) = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sunny"})}
    common = dict(model="tiny", tools=FLAT_TOOLS, max_output_tokens=4, extra_body={"ignore_eos": True})
    by_id = client.responses.create(previous_response_id=first.id, input=[result], tool_choice="none", **common)
    assert by_id.previous_response_id == first.id and by_id.status == "incomplete"
    # its input items are the request's own, as the SDK pages them (one a page here)
    listed = list(client.responses.input_items.list(by_id.id, order="asc", limit=1))
    assert [(i.type, i.call_id, i.output) for i in listed] == [("function_call_output", call.call_id, result["output"])]
    explicit = [{"role": "user", "content": "What is the weather in Paris?"},
                call.model_dump(exclude_none=True), result]
    by_items = client.responses.create(input=explicit, tool_choice="none", **common)
    # the stored history renders the same prompt as the items sent in full
    assert by_id.usage.input_tokens == by_items.usage.input_tokens > first.usage.input_tokens
    named = client.responses.create(model="tiny", input="Time in Berlin?", tools=FLAT_TOOLS, max_output_tokens=100,
                                    tool_choice={"type": "function", "name": "get_time"}, extra_body={"seed": 12})
    assert [(o.type, o.name) for o in named.output] == [("function_call", "get_time")]
    jsonschema.validate(json.loads(named.output[0].arguments), SCHEMAS["get_time"])


def test_responses_streamed_function_call(client):
    with client.responses.stream(model="tiny", input="Weather in Rome?", tools=FLAT_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, extra_body={"seed": 13}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(args), SCHEMAS[call.name])


def test_responses_structured_output_and_reasoning(client):
    parsed = client.responses.parse(model="tiny", input="Forecast for Paris?", text_format=Forecast,
                                    max_output_tokens=200, extra_body={"seed": 14})
    assert isinstance(parsed.output_parsed, Forecast) and parsed.status == "completed"
    think = {"regex": r"<think>[a-z]{1,8}</think>\n\n(yes|no)"}  # the random model thinks, then answers
    resp = client.responses.create(model="tiny", input="Sunny?", max_output_tokens=40, extra_body={**think, "seed": 7})
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and re.fullmatch("[a-z]{1,8}", reasoning.content[0].text)
    assert resp.output_text in ("yes", "no") and resp.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_store_and_errors(client):
    resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning=NO_THINKING)
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError, match="Previous response"):
        client.responses.create(model="tiny", input="Hi", previous_response_id=resp.id)
    with pytest.raises(openai.BadRequestError, match="'web_search' tools are not supported"):
        client.responses.create(model="tiny", input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="background responses must be stored"):
        client.responses.create(model="tiny", input="Hi", background=True, store=False)
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    with pytest.raises(openai.BadRequestError, match="input_image content is not supported"):
        client.responses.create(model="tiny", input=image)


def test_responses_logprobs_equal_chat_completions(client):
    common = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True, "chat_template_kwargs": {
        "enable_thinking": False}})
    kwargs = dict(input="Tell me about Paris", max_output_tokens=6, include=["message.output_text.logprobs"],
                  top_logprobs=2, **common)
    part = client.responses.create(**kwargs).output[0].content[0]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Tell me about Paris"}], max_tokens=6,
                                          logprobs=True, top_logprobs=2, **common).choices[0].logprobs.content
    assert [(e.token, e.bytes, round(e.logprob, 4)) for e in part.logprobs] == [
        (e.token, e.bytes, round(e.logprob, 4)) for e in chat]
    assert [[t.token for t in e.top_logprobs] for e in part.logprobs] == [[t.token for t in e.top_logprobs] for e in chat]
    with client.responses.stream(**kwargs) as stream:
        deltas = [lp for e in stream if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [e.token for e in deltas] == [e.token for e in part.logprobs]


def test_responses_background_poll_cancel_and_item_reference(client, server):
    common = dict(model="tiny", reasoning=NO_THINKING, extra_body={"ignore_eos": True})
    resp = client.responses.create(input="Hi", background=True, max_output_tokens=8, **common)
    assert resp.background and resp.status in ("queued", "in_progress")
    while resp.status in ("queued", "in_progress"):
        time.sleep(0.05)
        resp = client.responses.retrieve(resp.id)
    assert resp.status == "incomplete" and resp.usage.output_tokens == 8 and resp.output_text
    # its output item, named by item_reference, is the message sent in full
    more = {"role": "user", "content": "More"}
    by_ref = client.responses.create(input=[{"type": "item_reference", "id": resp.output[0].id}, more],
                                     max_output_tokens=1, **common)
    explicit = client.responses.create(input=[{"role": "assistant", "content": resp.output_text}, more],
                                       max_output_tokens=1, **common)
    assert by_ref.usage.input_tokens == explicit.usage.input_tokens
    before = aborts(server.url)
    long = client.responses.create(input="Once upon a time", background=True, max_output_tokens=900, **common)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    now = metrics_after_an_abort(server.url, before)
    assert now[ABORTED] == before + 1
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a response that is incomplete"):
        client.responses.cancel(resp.id)


def test_responses_background_stream_left_and_resumed_with_the_sdk(client, server):
    before = aborts(server.url)
    stream = client.responses.create(model="tiny", input="Hi", background=True, stream=True, max_output_tokens=8,
                                     reasoning=NO_THINKING, extra_body={"ignore_eos": True})
    first = [next(stream) for _ in range(3)]
    stream.close()  # a background response goes on without its client
    rest = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 8
    assert aborts(server.url) == before


def test_responses_stream_disconnect_aborts(server):
    before = aborts(server.url)
    body = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(12):
            next(lines)
    now = metrics_after_an_abort(server.url, before)
    assert now[ABORTED] == before + 1
    assert now["tpserve_num_requests_running"] == 0


def test_conversations_carry_the_turns(client):
    common = dict(model="tiny", max_output_tokens=4, reasoning=NO_THINKING, extra_body={"ignore_eos": True})
    brief = {"role": "developer", "content": "Be brief."}
    conv = client.conversations.create(items=[brief], metadata={"app": "e2e"})
    assert conv.id.startswith("conv_") and client.conversations.retrieve(conv.id).metadata == {"app": "e2e"}
    first = client.responses.create(input="What is the capital of France?", conversation=conv.id, **common)
    second = client.responses.create(input="And of Italy?", conversation={"id": conv.id}, **common)
    assert first.conversation.id == second.conversation.id == conv.id
    # the second prompt holds the first turn: it is the prompt of the same items sent in full
    explicit = [brief, {"role": "user", "content": "What is the capital of France?"},
                *[o.model_dump(exclude_none=True) for o in first.output], {"role": "user", "content": "And of Italy?"}]
    by_items = client.responses.create(input=explicit, **common)
    assert second.usage.input_tokens == by_items.usage.input_tokens > first.usage.input_tokens
    items = list(client.conversations.items.list(conv.id, order="asc", limit=2))  # the SDK pages them
    assert [getattr(i, "role", None) for i in items] == ["developer", "user", "assistant", "user", "assistant"]
    assert items[2].content[0].text == first.output_text and items[4].id == second.output[0].id
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(input="Hi", conversation=conv.id, **common)


def test_responses_truncation_auto_continues_a_chain_beyond_the_context(client):
    common = dict(model="tiny", max_output_tokens=8, reasoning=NO_THINKING, extra_body={"ignore_eos": True})
    turn = "a b c d e f g h " * 50  # a turn of about 470 tokens: three are more than the 1024-token context
    first = client.responses.create(input=turn, **common)
    second = client.responses.create(input=turn, previous_response_id=first.id, **common)
    assert 2 * first.usage.input_tokens < second.usage.input_tokens < 1024 - 8
    with pytest.raises(openai.BadRequestError, match="context length is 1024 tokens"):
        client.responses.create(input=turn, previous_response_id=second.id, **common)
    third = client.responses.create(input=turn, previous_response_id=second.id, truncation="auto", **common)
    # the oldest items went: a prompt longer than the second's (a turn more), with room for the answer
    assert third.truncation == "auto" and third.usage.output_tokens == 8
    assert second.usage.input_tokens < third.usage.input_tokens <= 1024 - 8
    # the stored chain is whole: it goes on only with truncation
    with pytest.raises(openai.BadRequestError, match="context length is 1024 tokens"):
        client.responses.create(input="Hi", previous_response_id=third.id, truncation="disabled", **common)
    assert client.responses.create(input="Hi", previous_response_id=third.id, truncation="auto", **common).id
