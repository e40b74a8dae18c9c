"""/v1/responses in-process: the conversions to and from the chat pipeline (input items, tools,
text.format, reasoning), the output items and their stream events, the store and the 400s.
The response bodies and events are checked against the openai package's typed models."""

from __future__ import annotations

import asyncio
import json
import math
import time
import typing

import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from stub_frontend import StubFrontend
from test_api_unit import LIMITS, MODEL, assert_error, make_client
from tpserve.message.frontend import ApiOutput, RequestRejected
from tpserve.parsers.chat_output import ChatDelta
from tpserve.parsers.tool_calls import ToolCallDelta
from tpserve.server.conversation_store import ConversationStore
from tpserve.server.errors import APIError
from tpserve.server.metrics import ServerMetrics
from tpserve.server.responses_protocol import ResponsesRequest
from tpserve.server.response_output import OutputItems, stored_item
from tpserve.server.response_store import EventLog, ResponseStore, StoredResponse
from tpserve.server.responses import create_response, get_response
from tpserve.server.responses_request import chat_messages, chat_request
from tpserve.server.serving import Serving
from tpserve.server.truncation import first_fitting, kept, starts
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer

RESPONSES = "/v1/responses"
_EVENTS = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
EVENT_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in _EVENTS}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
HERMES_REPLY = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def events_of(resp) -> list[dict]:
    """The SSE events, each checked against the openai type its ``type`` names."""
    assert resp.status_code == 200, resp.text
    lines = [line for line in resp.iter_lines() if line]
    assert "data: [DONE]" not in lines
    events = parsed_events(lines)
    assert [line[len("event: "):] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def parsed_events(lines: list[str]) -> list[dict]:
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    for e in events:
        EVENT_MODELS[e["type"]].model_validate(e)
    return events


# ---- input conversion ----
def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                                        {"type": "input_text", "text": "Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
             for i, c in ((1, "Rome"), (2, "Oslo"))]
    assert chat_messages("Sys.", items) == [
        {"role": "system", "content": "Sys."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in\nRome?"},  # a line a part, as chat's (vLLM's)
        {"role": "assistant", "content": "Checking.", "reasoning_content": "hmm", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    # a call straight after reasoning opens its own assistant turn; trailing reasoning gets one too
    lone = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "a"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "b"}]}]
    assert chat_messages(None, lone) == [
        {"role": "assistant", "content": "", "reasoning_content": "a",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "b"},
    ]
    # reasoning no answer followed, then the user (a response cut while thinking, continued): its turn stays in place
    cut = [{"role": "user", "content": "q"}, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]},
           {"role": "user", "content": "hi"}]
    assert chat_messages(None, cut) == [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "", "reasoning_content": "t"},
                                        {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("item, fragment", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0]: input_image"),
    ({"type": "web_search_call", "id": "ws"}, "input[0].type 'web_search_call' is not supported"),
    ({"type": "item_reference", "id": "msg_1"}, "'item_reference' is not supported"),
    ({"role": "tool", "content": "x"}, "input[0].role must be one of"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id must be a string"),
    ({"type": "function_call_output", "call_id": "c", "output": 5}, "input[0].output must be a string"),
    ("hello", "input[0] must be an object"),
])
def test_bad_input_items_are_400_naming_the_item(item, fragment):
    with pytest.raises(APIError) as err:
        chat_messages(None, [item])
    assert err.value.status == 400 and fragment in err.value.message and err.value.param == "input"


def test_input_of_the_wrong_type_is_named_in_words():
    c, _ = make_client()
    assert_error(c.post(RESPONSES, json={"input": ["hi"]}), 400, "input must be a string or a list of objects", "input")


def test_chat_request_maps_tools_format_reasoning_and_extensions():
    body = ResponsesRequest.model_validate({
        "model": "m", "input": "hi", "instructions": "Sys.", "max_output_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "reasoning": {"effort": "none"}, "seed": 3, "ignore_eos": True,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        "unknown_vendor_field": 1,
    })
    chat = chat_request(body, [])
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.ignore_eos) == (7, 0.5, 0.9, 3, True)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                           "parameters": WEATHER}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                          "strict": True}}
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert "unknown_vendor_field" not in chat.model_dump()
    narrowed = ResponsesRequest.model_validate({"input": "hi", "tools": [FLAT_TOOL], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}})
    assert chat_request(narrowed, []).tool_choice == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    thinking = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "high"},
                                                "chat_template_kwargs": {"x": 1}})
    assert chat_request(thinking, []).chat_template_kwargs == {"x": 1, "enable_thinking": True}


# ---- output items and events ----
def test_output_items_from_reasoning_content_and_calls():
    items = OutputItems()
    events = items.add(ChatDelta(reasoning="think"))
    events += items.add(ChatDelta(content="Let me look."))
    events += items.add(ChatDelta(tool_calls=[ToolCallDelta(0, "call_a", "f"), ToolCallDelta(0, arguments='{"x"')]))
    events += items.add(ChatDelta(tool_calls=[ToolCallDelta(0, arguments=": 1}")]))
    events += items.close()
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    reasoning, message, call = items.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert message["content"][0]["text"] == "Let me look."
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == ("call_a", "f", '{"x": 1}', "completed")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert all(i["status"] == "in_progress" for i in added) and added[2]["arguments"] == ""


def test_logprobs_go_with_the_message_text():
    items = OutputItems()
    events = items.add(ChatDelta(reasoning="hmm"), 1, [{"token": "hmm"}], reasoning=True)  # reasoning's: left out
    events += items.add(ChatDelta(), 1, [{"token": "<to"}])  # text the parser holds back: waits for it
    events += items.add(ChatDelta(content="<to"), 1, [{"token": "x"}])
    events += items.add(ChatDelta(content="!"), 1, [{"token": "!"}])
    events += items.add(ChatDelta(tool_calls=[ToolCallDelta(0, "call_a", "f")]), 1, [{"token": "<tool_call>"}])
    events += items.close()
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"] == [
        [{"token": "<to"}, {"token": "x"}], [{"token": "!"}]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == items.items[1]["content"][0]["logprobs"] == [{"token": t} for t in ("<to", "x", "!")]


def test_events_show_each_item_as_it_stood_sharing_the_per_token_entries():
    items = OutputItems()
    entries = [{"token": "a", "top_logprobs": [{"token": "b"}]}, {"token": "c", "top_logprobs": []}]
    events = items.add(ChatDelta(content="a"), 1, entries[:1])
    events += items.add(ChatDelta(content="c"), 1, entries[1:])
    events += items.close()
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    part_added = next(e for e in events if e["type"] == "response.content_part.added")["part"]
    assert added["content"] == [] and added["status"] == "in_progress"  # not the item's later state
    assert part_added["text"] == "" and part_added["logprobs"] == []
    done = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    assert done["content"][0]["text"] == "ac"
    # the entries themselves are shared (never changed once made), not copied again for every event
    assert all(shown is entry for shown, entry in zip(done["content"][0]["logprobs"], entries, strict=True))


def test_the_open_items_text_is_written_when_read_not_token_by_token():
    items = OutputItems()
    for piece in ("a", "b", "c"):
        items.add(ChatDelta(content=piece))
    assert items.items[0]["content"][0]["text"] == ""  # the pieces wait: each one added copied the whole text
    assert items.so_far()[0]["content"][0]["text"] == "abc"
    items.add(ChatDelta(content="d"))
    items.add(ChatDelta(tool_calls=[ToolCallDelta(0, "call_a", "f"), ToolCallDelta(0, arguments='{"x"')]))
    items.add(ChatDelta(tool_calls=[ToolCallDelta(0, arguments=": 1}")]))
    assert items.items[0]["content"][0]["text"] == "abcd"  # ended by the call
    done = next(e for e in items.close() if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == items.items[1]["arguments"] == '{"x": 1}'


def test_an_empty_output_is_an_empty_message():
    items = OutputItems()
    events = items.close("incomplete")
    assert items.items[0]["content"][0]["text"] == "" and items.items[0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.output_item.done"


# ---- HTTP, whole and streamed ----
def test_response_object_echoes_the_request():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    body = {"model": "tiny-test", "input": "hi", "instructions": "Sys.", "max_output_tokens": 9, "temperature": 0.3,
            "metadata": {"k": "v"}, "user": "u1", "text": {"format": {"type": "json_object"}}, "max_tool_calls": 2,
            "safety_identifier": "h1", "prompt_cache_key": "p1", "service_tier": "auto"}
    resp = c.post(RESPONSES, json=body).json()
    Response.model_validate(resp)
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["status"] == "completed"
    assert resp["output"][0]["content"][0]["text"] == "Hello 你好!" and resp["incomplete_details"] is None
    keys = ("instructions", "max_output_tokens", "temperature", "metadata", "user", "store", "max_tool_calls",
            "safety_identifier", "prompt_cache_key", "service_tier")
    assert {k: resp[k] for k in keys} == {
        "instructions": "Sys.", "max_output_tokens": 9, "temperature": 0.3, "metadata": {"k": "v"}, "user": "u1",
        "store": True, "max_tool_calls": 2, "safety_identifier": "h1", "prompt_cache_key": "p1",
        "service_tier": "default"}
    assert resp["usage"]["input_tokens"] == 5 and resp["usage"]["output_tokens"] == 3
    assert resp["usage"]["total_tokens"] == 8
    req = stub.submitted[-1]
    assert req.messages == [{"role": "system", "content": "Sys."}, {"role": "user", "content": "hi"}]
    assert req.params.max_tokens == 9 and req.params.structured.kind == "json_object"


def test_stream_events_rebuild_the_whole_response():
    c, _ = make_client(stub=StubFrontend(finish="length", pieces=3))
    whole = c.post(RESPONSES, json={"input": "hi"}).json()
    with c.stream("POST", RESPONSES, json={"input": "hi", "stream": True}) as resp:
        events = events_of(resp)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert len(deltas) == 3 and "".join(deltas) == done["text"] == whole["output"][0]["content"][0]["text"]
    assert final["response"]["output"][0]["content"] == whole["output"][0]["content"]
    assert final["response"]["usage"] == whole["usage"]
    # the stored streamed response is the final event's
    assert c.get(f"{RESPONSES}/{final['response']['id']}").json() == final["response"]


def test_logprobs_whole_and_streamed():
    c, stub = make_client(stub=StubFrontend(finish="stop", pieces=3))
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    resp = c.post(RESPONSES, json=body).json()
    Response.model_validate(resp)
    assert stub.submitted[-1].params.logprobs == 2 and resp["top_logprobs"] == 2
    part = resp["output"][0]["content"][0]
    assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"]  # a token per piece (the stub's)
    first = part["logprobs"][0]
    assert first["logprob"] == -1.0 and first["bytes"] == list(first["token"].encode())
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [(first["token"] + "~0", -2.0),
                                                                          (first["token"] + "~1", -3.0)]
    with c.stream("POST", RESPONSES, json={**body, "stream": True}) as r:
        events = events_of(r)
    deltas = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
    # the events' logprobs are OpenAI's (and vLLM's) of those events: token, logprob, top_logprobs (token, logprob),
    # without the part's bytes (they carried them)
    in_events = [{"token": lp["token"], "logprob": lp["logprob"],
                  "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
                 for lp in part["logprobs"]]
    assert [len(d) for d in deltas] == [1, 1, 1] and sum(deltas, []) == in_events
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == in_events
    assert part["logprobs"] == events[-1]["response"]["output"][0]["content"][0]["logprobs"]
    # top_logprobs alone asks for none, as OpenAI's API
    plain = c.post(RESPONSES, json={"input": "hi", "top_logprobs": 2}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == [] and stub.submitted[-1].params.logprobs is None


def test_function_calls_with_a_tool_parser_whole_and_streamed():
    c, stub = make_client(stub=StubFrontend(reply=HERMES_REPLY, pieces=7, finish="stop"), tool_call_parser="hermes")
    body = {"input": "Weather in Rome?", "tools": [FLAT_TOOL]}
    resp = c.post(RESPONSES, json=body).json()
    Response.model_validate(resp)
    message, call = resp["output"]
    assert message["content"][0]["text"] == "Let me look." and resp["status"] == "completed"
    assert call["type"] == "function_call" and call["call_id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Rome"}
    assert stub.submitted[-1].tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
    with c.stream("POST", RESPONSES, json={**body, "stream": True}) as r:
        events = events_of(r)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(args) == json.loads(done["arguments"]) == {"city": "Rome"}
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]


def test_reasoning_item_and_thinking_switch():
    stub = StubFrontend(reply="let me think</think>\n\nThe answer", pieces=9, finish="stop", prompt_in_reasoning=True)
    c, _ = make_client(stub=stub, reasoning_parser="qwen3")
    resp = c.post(RESPONSES, json={"input": "hi", "reasoning": {"effort": "low"}}).json()
    Response.model_validate(resp)
    reasoning, message = resp["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "let me think"
    assert message["content"][0]["text"] == "The answer"
    assert 0 < resp["usage"]["output_tokens_details"]["reasoning_tokens"] < resp["usage"]["output_tokens"]
    assert stub.submitted[-1].chat_template_kwargs == {"enable_thinking": True}
    with c.stream("POST", RESPONSES, json={"input": "hi", "stream": True}) as r:
        events = events_of(r)
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "let me think" and events[-1]["response"]["output"] == [
        {**reasoning, "id": events[-1]["response"]["output"][0]["id"]},
        {**message, "id": events[-1]["response"]["output"][1]["id"]}]


def test_logprobs_of_the_think_block_its_tags_and_the_newlines_after_are_left_out():
    """The message's logprobs are its text's tokens: not those of a '</think>' written in pieces the parser
    held back, nor of the newlines it drops after it."""
    stub = StubFrontend(reply="<think>hmm</think>\n\nAnswer!", pieces=14, finish="stop")  # 2 characters a token
    c, _ = make_client(stub=stub, reasoning_parser="qwen3")
    body = {"input": "hi", "include": ["message.output_text.logprobs"]}
    resp = c.post(RESPONSES, json=body).json()
    reasoning, message = resp["output"]
    part = message["content"][0]
    assert reasoning["content"][0]["text"] == "hmm" and part["text"] == "Answer!"
    assert "".join(lp["token"] for lp in part["logprobs"]) == "Answer!"
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 10  # "<t" ... "k>", "\n\n"
    with c.stream("POST", RESPONSES, json={**body, "stream": True}) as r:
        events = events_of(r)
    deltas = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for lp in sum(deltas, [])] == [lp["token"] for lp in part["logprobs"]]


# ---- store ----
def test_previous_response_id_continues_and_get_delete():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    first = c.post(RESPONSES, json={"input": "one", "instructions": "Sys."}).json()
    second = c.post(RESPONSES, json={"input": [{"role": "user", "content": "two"}],
                                     "previous_response_id": first["id"]}).json()
    assert second["previous_response_id"] == first["id"]
    # instructions are not carried over; the history is the first call's input and output
    assert stub.submitted[-1].messages == [{"role": "user", "content": "one"},
                                           {"role": "assistant", "content": "Hello 你好!"},
                                           {"role": "user", "content": "two"}]
    c.post(RESPONSES, json={"input": "three", "previous_response_id": second["id"]})
    assert [m["content"] for m in stub.submitted[-1].messages] == ["one", "Hello 你好!", "two", "Hello 你好!", "three"]
    assert c.get(f"{RESPONSES}/{first['id']}").json() == first
    assert c.delete(f"{RESPONSES}/{first['id']}").json() == {"id": first["id"], "object": "response.deleted",
                                                             "deleted": True}
    assert_error(c.get(f"{RESPONSES}/{first['id']}"), 404, "not found")
    assert_error(c.delete(f"{RESPONSES}/{first['id']}"), 404, "not found")
    err = assert_error(c.post(RESPONSES, json={"input": "x", "previous_response_id": first["id"]}), 400,
                       "Previous response", "previous_response_id")
    assert err["type"] == "invalid_request_error"
    unstored = c.post(RESPONSES, json={"input": "x", "store": False}).json()
    assert unstored["store"] is False
    assert_error(c.get(f"{RESPONSES}/{unstored['id']}"), 404)


def test_an_unknown_previous_response_has_openais_code():
    """Clients (Codex, proxies) resend the whole conversation when the code says the previous response is gone."""
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    unstored = c.post(RESPONSES, json={"input": "x", "store": False}).json()["id"]
    for rid in ("resp_nope", unstored):
        err = assert_error(c.post(RESPONSES, json={"input": "y", "previous_response_id": rid}), 400,
                           f"Previous response with id '{rid}' not found.", "previous_response_id")
        assert (err["type"], err["code"]) == ("invalid_request_error", "previous_response_not_found")


def test_items_already_in_the_previous_responses_history_are_a_400():
    """As OpenAI's: an input item (or item_reference) whose id the previous_response_id chain holds is a duplicate."""
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    first = c.post(RESPONSES, json={"input": [{"type": "message", "id": "msg_in", "role": "user", "content": "one"}]})
    out = first.json()["output"][0]
    second = c.post(RESPONSES, json={"input": "two", "previous_response_id": first.json()["id"]}).json()
    submitted = len(stub.submitted)
    for item in ({"type": "item_reference", "id": out["id"]}, {"type": "item_reference", "id": "msg_in"}, out):
        err = assert_error(c.post(RESPONSES, json={"input": [item, {"role": "user", "content": "three"}],
                                                   "previous_response_id": second["id"]}), 400,
                           "Duplicate item found with id", "input")
        assert item["id"] in err["message"]
    assert len(stub.submitted) == submitted  # nothing ran
    # without previous_response_id the same items are a new conversation
    assert c.post(RESPONSES, json={"input": [{"type": "item_reference", "id": out["id"]}]}).status_code == 200


def test_input_items_lists_the_request_items_with_ids_and_pages():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    first = c.post(RESPONSES, json={"input": "one", "instructions": "Sys."}).json()
    listed = c.get(f"{RESPONSES}/{first['id']}/input_items").json()
    ResponseItemList.model_validate(listed)
    (item,) = listed["data"]  # instructions are no input item
    assert item["id"].startswith("msg_") and item["type"] == "message" and item["role"] == "user"
    assert item["content"] == [{"type": "input_text", "text": "one"}]
    assert (listed["object"], listed["first_id"], listed["last_id"], listed["has_more"]) == (
        "list", item["id"], item["id"], False)
    items = [
        {"role": "user", "content": "a"},
        {"type": "message", "id": "msg_mine", "role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
    ]
    second = c.post(RESPONSES, json={"input": items, "previous_response_id": first["id"]}).json()
    url = f"{RESPONSES}/{second['id']}/input_items"
    # only this request's items (not the history), newest first by default; the client's ids are kept
    desc = c.get(url).json()
    ResponseItemList.model_validate(desc)
    assert [i["type"] for i in desc["data"]] == ["message", "function_call_output", "function_call", "message",
                                                 "message"]
    assert desc["data"][3]["id"] == "msg_mine" and desc["data"][3]["content"][0]["type"] == "output_text"
    ids = [i["id"] for i in c.get(url, params={"order": "asc"}).json()["data"]]
    assert ids == [i["id"] for i in reversed(desc["data"])] and len(set(ids)) == 5
    page = c.get(url, params={"order": "asc", "limit": 2}).json()
    assert [i["id"] for i in page["data"]] == ids[:2] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[0], ids[1])
    page = c.get(url, params={"order": "asc", "limit": 2, "after": ids[1]}).json()
    assert [i["id"] for i in page["data"]] == ids[2:4] and page["has_more"] is True
    page = c.get(url, params={"order": "asc", "after": ids[3]}).json()
    assert [i["id"] for i in page["data"]] == ids[4:] and page["has_more"] is False
    page = c.get(url, params={"order": "asc", "limit": 2, "before": ids[4]}).json()
    assert [i["id"] for i in page["data"]] == ids[2:4] and page["has_more"] is True
    # the stored items still continue the conversation
    c.post(RESPONSES, json={"input": "more", "previous_response_id": second["id"]})
    assert [m["content"] for m in stub.submitted[-1].messages][-4:] == ["r", "d", "Hello 你好!", "more"]


def test_item_references_name_stored_items():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    first = c.post(RESPONSES, json={"input": [{"type": "message", "id": "msg_in", "role": "user", "content": "one"}]})
    out_id = first.json()["output"][0]["id"]
    refs = [{"type": "item_reference", "id": "msg_in"}, {"type": "item_reference", "id": out_id},
            {"role": "user", "content": "two"}]
    second = c.post(RESPONSES, json={"input": refs}).json()
    assert stub.submitted[-1].messages == [{"role": "user", "content": "one"},
                                           {"role": "assistant", "content": "Hello 你好!"},
                                           {"role": "user", "content": "two"}]
    listed = c.get(f"{RESPONSES}/{second['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert [i["id"] for i in listed[:2]] == ["msg_in", out_id] and listed[1]["role"] == "assistant"
    assert_error(c.post(RESPONSES, json={"input": [{"type": "item_reference", "id": "msg_nope"}]}), 400,
                 "input[0]: item_reference: no stored item has id 'msg_nope'", "input")
    # the second response stored its own copies of the referenced items: deleting it leaves the first's
    c.delete(f"{RESPONSES}/{second['id']}")
    third = c.post(RESPONSES, json={"input": refs[1:]})
    assert third.status_code == 200
    for rid in (first.json()["id"], third.json()["id"]):  # the items go with the responses that hold them
        c.delete(f"{RESPONSES}/{rid}")
    assert_error(c.post(RESPONSES, json={"input": refs[1:]}), 400, out_id, "input")
    assert len(stub.submitted) == 3


def test_get_while_streaming_shows_the_output_so_far():
    async def scenario() -> None:
        store = ResponseStore()
        serving = Serving(StubFrontend(finish="stop"), ServerMetrics(), MODEL, LIMITS)  # type: ignore[arg-type]

        async def start() -> tuple[str, typing.AsyncIterator[bytes]]:
            body = ResponsesRequest.model_validate({"input": "hi", "stream": True})
            chunks = (await create_response(serving, store, ConversationStore(), body, None)).body_iterator  # type: ignore[arg-type]
            events: list[dict] = []
            async for chunk in chunks:  # up to the first text
                events += parsed_events(chunk.decode().splitlines())
                if events[-1]["type"] == "response.output_text.delta":
                    return events[0]["response"]["id"], chunks
            raise AssertionError("no text")

        rid, chunks = await start()
        live = get_response(store, rid)
        Response.model_validate(live)
        assert live["status"] == "in_progress" and live["output"][0]["content"][0]["text"] == "Hel"
        with pytest.raises(APIError, match="still in progress"):
            body = ResponsesRequest(input="x", previous_response_id=rid)
            await create_response(serving, store, ConversationStore(), body, None)  # type: ignore[arg-type]
        async for _ in chunks:
            pass
        assert get_response(store, rid)["status"] == "completed"
        rid, chunks = await start()
        await chunks.aclose()  # the client went away: the response is dropped
        with pytest.raises(APIError, match="not found"):
            get_response(store, rid)

    asyncio.run(scenario())


class HangingFrontend(StubFrontend):
    """Answers one piece, then nothing until aborted."""

    async def _answer(self, req, queue) -> None:
        self.aborting = asyncio.Event()
        queue.put_nowait(ApiOutput(rid=req.rid, text="Hel", new_tokens=1, completion_tokens=1, prompt_tokens=5))
        await self.aborting.wait()

    async def abort(self, rid: int) -> None:
        await super().abort(rid)
        self.aborting.set()


def poll(c, rid: str, until) -> dict:
    for _ in range(200):
        resp = c.get(f"{RESPONSES}/{rid}").json()
        if until(resp):
            return resp
        time.sleep(0.01)
    raise AssertionError(resp)


def test_background_responses_poll_and_cancel():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    with c:  # one event loop for every request, where the background tasks run
        created = c.post(RESPONSES, json={"input": "hi", "background": True}).json()
        Response.model_validate(created)
        assert (created["status"], created["background"], created["output"]) == ("queued", True, [])
        done = poll(c, created["id"], lambda r: r["status"] not in ("queued", "in_progress"))
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello 你好!"
        assert done["usage"]["output_tokens"] == 3
        assert_error(c.post(f"{RESPONSES}/{done['id']}/cancel"), 400, "Cannot cancel a response that is completed")
        foreground = c.post(RESPONSES, json={"input": "hi"}).json()
        assert_error(c.post(f"{RESPONSES}/{foreground['id']}/cancel"), 400, "background: true")
        assert_error(c.post(f"{RESPONSES}/resp_nope/cancel"), 404, "not found")
    c, stub = make_client(stub=HangingFrontend())
    with c:
        rid = c.post(RESPONSES, json={"input": "hi", "background": True}).json()["id"]
        live = poll(c, rid, lambda r: r["output"])
        assert live["status"] == "in_progress" and live["output"][0]["status"] == "in_progress"
        cancelled = c.post(f"{RESPONSES}/{rid}/cancel").json()
        Response.model_validate(cancelled)
        assert cancelled["status"] == "cancelled" and cancelled["output"][0]["content"][0]["text"] == "Hel"
        assert cancelled["output"][0]["status"] == "incomplete" and stub.aborted == [stub.submitted[-1].rid]
        assert c.get(f"{RESPONSES}/{rid}").json() == c.post(f"{RESPONSES}/{rid}/cancel").json() == cancelled
        rid = c.post(RESPONSES, json={"input": "hi", "background": True}).json()["id"]
        poll(c, rid, lambda r: r["output"])
        c.delete(f"{RESPONSES}/{rid}")  # deleting a running one stops it too
        for _ in range(200):
            if len(stub.aborted) == 2:
                break
            time.sleep(0.01)
        assert stub.aborted[1] == stub.submitted[-1].rid
        # a cancel or a delete is no client going away
        assert "tpserve_client_disconnects_total 0.0" in c.get("/metrics").text
    c, _ = make_client(stub=TooLongFrontend())
    with c:  # rejected by the tokenizer once running: a failed response
        rid = c.post(RESPONSES, json={"input": "x", "max_output_tokens": 500, "background": True}).json()["id"]
        failed = poll(c, rid, lambda r: r["status"] == "failed")
        assert "lower max_output_tokens" in failed["error"]["message"] and failed["error"]["code"] == "invalid_prompt"


class WaitingFrontend(HangingFrontend):
    """Answers nothing until aborted."""

    async def _answer(self, req, queue) -> None:
        self.aborting = asyncio.Event()
        await self.aborting.wait()


def test_a_priority_without_the_priority_policy_is_a_400_for_a_background_response_too():
    """It was queued (200), then failed: the check ran as the generation started, after the background answer."""
    c, stub = make_client()
    with c:
        assert_error(c.post(RESPONSES, json={"input": "hi", "priority": 1, "background": True}), 400,
                     "priority scheduling is not enabled", "priority")
    assert stub.submitted == []


def test_a_background_response_cancelled_before_any_output_streams_its_creation():
    c, _ = make_client(stub=WaitingFrontend())
    with c:
        rid = c.post(RESPONSES, json={"input": "hi", "background": True}).json()["id"]
        assert c.post(f"{RESPONSES}/{rid}/cancel").json()["status"] == "cancelled"
        with c.stream("GET", f"{RESPONSES}/{rid}?stream=true") as resp:
            events = events_of(resp)
    assert [e["type"] for e in events] == ["response.created"] and events[0]["response"]["status"] == "queued"


def test_background_streams_and_streams_again_from_starting_after():
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    with c:
        with c.stream("POST", RESPONSES, json={"input": "hi", "background": True, "stream": True}) as resp:
            events = events_of(resp)
        done = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and done["background"] is True
        assert c.get(f"{RESPONSES}/{done['id']}").json() == done  # without stream: the object, as before
        for after, query in ((-1, ""), (-1, "&starting_after=-1"), (3, "&starting_after=3"),
                             (99, "&starting_after=99")):
            with c.stream("GET", f"{RESPONSES}/{done['id']}?stream=true{query}") as resp:
                assert resp.status_code == 200
                assert parsed_events([line for line in resp.iter_lines() if line]) == events[after + 1:]
        rid = c.post(RESPONSES, json={"input": "hi", "background": True}).json()["id"]  # not created streaming
        poll(c, rid, lambda r: r["status"] == "completed")
        with c.stream("GET", f"{RESPONSES}/{rid}?stream=true") as resp:
            assert [e["type"] for e in events_of(resp)] == [e["type"] for e in events]
        foreground = c.post(RESPONSES, json={"input": "hi"}).json()["id"]
        assert_error(c.get(f"{RESPONSES}/{foreground}?stream=true"), 400, "not created with background=true", "stream")
        assert_error(c.get(f"{RESPONSES}/resp_nope?stream=true"), 404, "not found")
        assert_error(c.get(f"{RESPONSES}/{rid}?stream=true&starting_after=x"), 400, None, "starting_after")
    c, _ = make_client(stub=TooLongFrontend())
    with c, c.stream("POST", RESPONSES, json={"input": "x", "max_output_tokens": 500, "background": True,
                                              "stream": True}) as resp:  # rejected by the tokenizer once running
        events = events_of(resp)
    # created (queued) at once, as a background response is; failed before it started
    assert [e["type"] for e in events] == ["response.created", "error", "response.failed"]
    assert events[0]["response"]["status"] == "queued"
    assert "lower max_output_tokens" in events[-1]["response"]["error"]["message"]


class GatedFrontend(StubFrontend):
    """Answers "Hel", then "lo" (the end) once ``go`` is set."""

    async def _answer(self, req, queue) -> None:
        self.go = asyncio.Event()
        common = dict(rid=req.rid, new_tokens=1, prompt_tokens=5, cached_tokens=0)
        queue.put_nowait(ApiOutput(text="Hel", completion_tokens=1, **common))
        await self.go.wait()
        queue.put_nowait(ApiOutput(text="lo", completion_tokens=2, finish_reason="stop", **common))


def test_a_background_stream_left_early_goes_on_and_a_stream_follows_it_live():
    async def scenario() -> None:
        store, stub = ResponseStore(), GatedFrontend()
        serving = Serving(stub, ServerMetrics(), MODEL, LIMITS)  # type: ignore[arg-type]
        body = ResponsesRequest.model_validate({"input": "hi", "background": True, "stream": True})
        chunks = (await create_response(serving, store, ConversationStore(), body, None)).body_iterator  # type: ignore[arg-type, union-attr]
        first = parsed_events((await anext(chunks)).decode().splitlines())
        while first[-1]["type"] != "response.output_text.delta":
            first += parsed_events((await anext(chunks)).decode().splitlines())
        await chunks.aclose()  # the client went away: the generation goes on
        rid = first[0]["response"]["id"]
        assert store.get(rid).running is not None and not stub.aborted  # type: ignore[union-attr]
        follower = get_response(store, rid, stream=True, starting_after=2).body_iterator  # type: ignore[union-attr]
        replayed = parsed_events((await anext(follower)).decode().splitlines())
        assert replayed == first[3:]
        stub.go.set()  # the follower waits for the rest, then its stream ends with the response
        rest = [e async for chunk in follower for e in parsed_events(chunk.decode().splitlines())]
        assert [e["sequence_number"] for e in replayed + rest] == list(range(3, 3 + len(replayed + rest)))
        assert rest[-1]["type"] == "response.completed"
        assert rest[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
        assert get_response(store, rid)["status"] == "completed"

    asyncio.run(scenario())


def test_stored_items_fill_in_what_openai_lists():
    reasoning = stored_item({"type": "reasoning", "summary": None, "content": [{"type": "reasoning_text", "text": "t"}]})
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == [] and reasoning["status"] == "completed"
    message = stored_item({"role": "user", "content": ["a", {"type": "text", "text": "b"}], "id": ""})
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["content"] == [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    output = stored_item({"type": "function_call_output", "id": "fco_1", "call_id": "c", "output": "o"})
    assert output == {"type": "function_call_output", "id": "fco_1", "call_id": "c", "output": "o", "status": "completed"}


def test_input_items_errors():
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    rid = c.post(RESPONSES, json={"input": "one"}).json()["id"]
    url = f"{RESPONSES}/{rid}/input_items"
    assert_error(c.get(url, params={"limit": 0}), 400, "limit", "limit")
    assert_error(c.get(url, params={"limit": 101}), 400, "limit", "limit")
    assert_error(c.get(url, params={"order": "up"}), 400, "order", "order")
    assert_error(c.get(url, params={"after": "msg_nope"}), 400, "msg_nope", "after")
    assert_error(c.get(f"{RESPONSES}/resp_nope/input_items"), 404, "not found")
    unstored = c.post(RESPONSES, json={"input": "x", "store": False}).json()["id"]
    assert_error(c.get(f"{RESPONSES}/{unstored}/input_items"), 404)


def test_store_drops_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid, "output": []}, []))
    assert store.get("a") is not None  # "b" is now the oldest
    item = {"id": "msg_c", "type": "message"}
    store.put(StoredResponse({"id": "c", "output": [item]}, [item]))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert store.item("msg_c") is item
    store.put(StoredResponse({"id": "d", "output": []}, []))
    store.put(StoredResponse({"id": "e", "output": []}, []))
    assert store.item("msg_c") is None  # dropped with its response


def test_store_keeps_the_events_of_the_latest_finished_background_responses():
    store = ResponseStore(capacity=8, event_logs=2)
    logs = {}
    for rid in ("a", "b", "c"):
        logs[rid] = EventLog()
        store.put(StoredResponse({"id": rid, "output": [], "background": True}, [], running=object(), events=logs[rid]))
    for rid in ("b", "a", "c"):  # finished in this order: "b" loses its events when "c" finishes
        store.finish(StoredResponse({"id": rid, "output": [], "background": True}, [], events=logs[rid]))
    assert store.get("b").events is None and store.get("a").events is logs["a"] and store.get("c").events is logs["c"]
    assert len(store) == 3 and list(store._entries) == ["b", "a", "c"]
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    with c:
        c.app.state.server.responses.event_logs = 1
        ids = []
        for _ in range(2):  # one after the other: the first finishes first
            ids.append(c.post(RESPONSES, json={"input": "hi", "background": True}).json()["id"])
            while c.get(f"{RESPONSES}/{ids[-1]}").json()["status"] in ("queued", "in_progress"):
                time.sleep(0.01)
        resp = c.get(f"{RESPONSES}/{ids[0]}?stream=true")
        assert resp.status_code == 400 and "no longer kept" in resp.json()["error"]["message"]
        assert c.get(f"{RESPONSES}/{ids[0]}").json()["status"] == "completed"
        assert c.get(f"{RESPONSES}/{ids[1]}?stream=true").status_code == 200


# ---- errors ----
@pytest.mark.parametrize("body, fragment, param", [
    ({"input": "x", "background": True, "store": False}, "must be stored", "background"),
    ({"input": [{"role": "user", "content": "a", "id": "m1"}, {"role": "user", "content": "b", "id": "m1"}]},
     "Duplicate item found with id m1", "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "'web_search' tools are not supported", "tools"),
    ({"input": "x", "tools": [FLAT_TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice"),
    ({"input": "x", "tools": [FLAT_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "'nope'", "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"input": "x", "tools": [FLAT_TOOL]}, "--tool-call-parser", "tools"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format type", "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "needs schema", "text.format"),
    ({"input": "x", "text": {"format": "json_schema"}}, "text.format must be an object", "text.format"),
    ({"input": "x", "reasoning": {"effort": 5}}, "reasoning.effort must be one of", "reasoning.effort"),
    ({"input": "x", "chat_template_kwargs": "x"}, "chat_template_kwargs must be an object", "chat_template_kwargs"),
    ({"input": "x", "chat_template_kwargs": 0}, "chat_template_kwargs must be an object", "chat_template_kwargs"),
    ({"input": "x", "truncation": "middle"}, None, "truncation"),
    ({"input": "x", "max_tool_calls": -1}, None, "max_tool_calls"),
    ({"input": "x", "max_tool_calls": "3"}, None, "max_tool_calls"),
    ({"input": "x", "regex": ""}, "regex must not be empty", "regex"),
    ({"input": "x", "tools": [FLAT_TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "give only one of text.format, tool_choice", "tool_choice"),
    ({"input": "x", "max_output_tokens": 2, "min_tokens": 3}, "must not exceed max_output_tokens (2)", "min_tokens"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt templates", "prompt"),
    ({"input": "x", "moderation": {"model": "omni-moderation-latest"}}, "moderation is not served", "moderation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "include"),
    ({"input": "x", "top_logprobs": 21}, None, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "no stored item has id 'msg_1'", "input"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 keys", "metadata"),
    ({"input": "x", "max_output_tokens": 0}, None, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, None, "temperature"),
    ({"input": "x", "seed": "abc"}, None, "seed"),
    ({"input": "x", "model": "other"}, "does not exist", "model"),
    ({"input": []}, "input must not be empty", "input"),
    ({}, "input must not be empty", "input"),
    ({"input": 5}, "input must be", "input"),
    ({"input": "x" * 5000}, "characters", "input"),
])
def test_bad_requests_are_400_with_an_openai_error(body, fragment, param):
    c, stub = make_client()
    resp = c.post(RESPONSES, json=body)
    assert_error(resp, 404 if param == "model" else 400, fragment, param)
    assert not stub.submitted


class TooLongFrontend(StubFrontend):
    """Rejects every request as the tokenizer worker rejects a prompt + max_tokens beyond the context."""

    async def _answer(self, req, queue) -> None:
        queue.put_nowait(RequestRejected(rid=req.rid, param="max_tokens", message=(
            "this model's context length is 128 tokens, but 505 were requested; lower max_tokens or shorten the prompt")))


def test_the_tokenizer_rejection_names_the_responses_field():
    c, _ = make_client(stub=TooLongFrontend())
    resp = c.post(RESPONSES, json={"input": "x", "max_output_tokens": 500})
    assert_error(resp, 400, "lower max_output_tokens or shorten", "max_output_tokens")


class FailingFrontend(StubFrontend):
    """Streams one piece, then fails in the scheduler."""

    async def _answer(self, req, queue) -> None:
        common = dict(rid=req.rid, new_tokens=1, prompt_tokens=5, cached_tokens=0)
        queue.put_nowait(ApiOutput(text="Hel", completion_tokens=1, finish_reason=None, **common))
        await asyncio.sleep(0.01)
        queue.put_nowait(ApiOutput(text="", completion_tokens=1, finish_reason="error", error="grammar broke", **common))


def test_a_failure_mid_stream_ends_with_response_failed_and_is_stored_so():
    c, _ = make_client(stub=FailingFrontend())
    with c.stream("POST", RESPONSES, json={"input": "hi", "stream": True}) as resp:
        events = events_of(resp)
    # the message the error cut short ends as incomplete, with its last events, as any item ends
    assert [e["type"] for e in events[-5:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "error", "response.failed"]
    assert events[-3]["item"]["status"] == "incomplete"
    assert events[-2]["message"] == "grammar broke"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "grammar broke"
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hel"
    assert c.get(f"{RESPONSES}/{failed['id']}").json() == failed
    # rejected before it streams (the client never gets an id): nothing stored
    c, _ = make_client(stub=TooLongFrontend())
    assert c.post(RESPONSES, json={"input": "x", "stream": True}).status_code == 400
    assert len(c.app.state.server.responses) == 0


# ---- truncation ----
class WordTokenizer:
    """The model's tokenizer, in small: the chat template writes a line per message (its role, its
    content, its calls' names and argument values) and a last "assistant:", and each word is a token."""

    chat_template = "one line per message"

    def __init__(self) -> None:
        self.renders = 0

    def __len__(self) -> int:
        return 700

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
        self.renders += 1
        lines = []
        for m in messages:
            calls = [[c["function"]["name"], *map(str, c["function"]["arguments"].values())]
                     for c in m.get("tool_calls", [])]
            lines.append(" ".join([f"{m['role']}:", m.get("content") or "", *sum(calls, [])]))
        return "\n".join(lines + ["assistant:"] * add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


class TokenizingFrontend(StubFrontend):
    """Checks each prompt as the tokenizer worker does (its PromptPreparer, with a WordTokenizer):
    one beyond the context is rejected with the worker's message; ``lengths``: the prompts' tokens."""

    def __init__(self) -> None:
        super().__init__(finish="stop")
        self._preparer = PromptPreparer(WordTokenizer(), PromptLimits(LIMITS.context_len, 700))
        self.lengths: list[int] = []

    async def _answer(self, req, queue) -> None:
        try:
            self.lengths.append(self._preparer.prepare(req).register.prompt_tokens)
        except InvalidRequest as e:
            queue.put_nowait(RequestRejected(rid=req.rid, message=e.message, param=e.param))
            return
        await super()._answer(req, queue)


def truncating_client():
    """A client whose server counts tokens (for truncation) with a WordTokenizer, as its frontend does."""
    c, stub = make_client(stub=TokenizingFrontend())
    tokenizer = WordTokenizer()
    c.app.state.server.tokenize_service()._tokenizer = tokenizer
    return c, stub, tokenizer


def words(n: int, word: str) -> str:
    return " ".join([word] * n)


def call(call_id: str, argument: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": json.dumps({"a": argument})}


def test_truncation_starts_keep_calls_with_their_outputs_and_pinned_messages():
    user, system = {"role": "user", "content": "u"}, {"type": "message", "role": "system", "content": "s"}
    items = [user, call("a", "x"), call("b", "y"), {"type": "function_call_output", "call_id": "a", "output": "1"},
             {"type": "function_call_output", "call_id": "b", "output": "2"}, user, system, user]
    # not 2, 3, 4 (a call apart from its output), nor 7 (the same as 6: the system message stays)
    assert starts(items) == [0, 1, 5, 6]
    assert kept(items, 6) == [system, user] and kept(items, 1) == items[1:]
    assert starts([user]) == [0]


@pytest.mark.parametrize("size", [1, 2, 5, 8, 33])
def test_truncation_search_finds_the_first_fitting_start_in_log_renders(size):
    cuts = list(range(0, 3 * size, 3))
    for threshold in range(-1, 3 * size + 2):
        tried = []

        async def fits(start: int) -> bool:
            tried.append(start)
            return start >= threshold

        found = asyncio.run(first_fitting(cuts, fits))
        assert found == next((k for k in cuts if k >= threshold), None)
        assert len(tried) <= 1 + math.ceil(math.log2(size))


def test_truncation_auto_drops_the_oldest_items_until_the_answer_fits():
    c, stub, tokenizer = truncating_client()
    first = c.post(RESPONSES, json={"input": words(40, "one")}).json()
    second = c.post(RESPONSES, json={"input": words(40, "two"), "previous_response_id": first["id"]}).json()
    # history 41 + 3 + 41 + 3 tokens, 41 more, the instructions' 2 and "assistant:": 132 > 128
    third = {"input": words(40, "three"), "previous_response_id": second["id"], "instructions": "Sys."}
    assert_error(c.post(RESPONSES, json=third), 400, "context length is 128 tokens")
    assert_error(c.post(RESPONSES, json={**third, "truncation": "disabled"}), 400, "context length is 128 tokens")
    # without max_output_tokens, one token must be left: the first user message goes
    resp = c.post(RESPONSES, json={**third, "truncation": "auto"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["truncation"] == "auto"
    assert [m["content"][:5] for m in stub.submitted[-1].messages] == ["Sys.", "Hello", "two t", "Hello", "three"]
    assert stub.lengths[-1] == 91
    # 40 tokens for the answer: the first turn goes whole (the instructions stay); the prompt fills
    # the context exactly
    renders = tokenizer.renders
    resp = c.post(RESPONSES, json={**third, "truncation": "auto", "max_output_tokens": 40})
    assert resp.status_code == 200, resp.text
    assert [m["role"] for m in stub.submitted[-1].messages] == ["system", "user", "assistant", "user"]
    assert stub.lengths[-1] == 88
    assert tokenizer.renders - renders == 4 == 1 + math.ceil(math.log2(5))  # 5 items, 5 starts: 1 + 3 renders
    # what the model saw was cut, the stored conversation is whole
    stored = c.app.state.server.responses.get(resp.json()["id"])
    assert [item["content"][0]["text"][:5] for item in stored.items] == ["one o", "Hello", "two t", "Hello", "three",
                                                                         "Hello"]
    assert [item["content"][0]["text"][:5] for item in stored.input_items] == ["three"]
    following = c.post(RESPONSES, json={"input": "more", "previous_response_id": resp.json()["id"],
                                        "truncation": "auto"})
    assert following.status_code == 200, following.text
    assert [m["content"][:5] for m in stub.submitted[-1].messages] == ["Hello", "two t", "Hello", "three", "Hello",
                                                                       "more"]


def test_truncation_auto_keeps_a_call_with_its_output_and_the_system_messages():
    c, stub, _ = truncating_client()
    items = [{"role": "system", "content": "Dev."}, {"role": "user", "content": words(10, "ask")},
             call("c1", words(40, "arg")), {"type": "function_call_output", "call_id": "c1", "output": words(10, "out")},
             {"role": "user", "content": words(40, "next")}]
    # 2 + 11 + 42 + 11 + 41 + 1 = 108 tokens; with 30 for the answer the first user message goes (the
    # developer message, a system one in the chat, stays)
    resp = c.post(RESPONSES, json={"input": items, "truncation": "auto", "max_output_tokens": 30})
    assert resp.status_code == 200, resp.text
    assert [m["role"] for m in stub.submitted[-1].messages] == ["system", "assistant", "tool", "user"]
    # with 40, dropping the call would do (56 + 40) but its output would stay alone: both go
    resp = c.post(RESPONSES, json={"input": items, "truncation": "auto", "max_output_tokens": 40})
    assert resp.status_code == 200, resp.text
    assert stub.submitted[-1].messages == [{"role": "system", "content": "Dev."},
                                           {"role": "user", "content": words(40, "next")}]
    assert stub.lengths[-1] == 44


def test_truncation_auto_too_long_even_cut_is_the_usual_400():
    c, stub, _ = truncating_client()
    first = c.post(RESPONSES, json={"input": "one"}).json()
    # the last item alone (92 tokens) leaves no room for the answer's 40
    resp = c.post(RESPONSES, json={"input": words(90, "two"), "previous_response_id": first["id"],
                                   "truncation": "auto", "max_output_tokens": 40})
    assert_error(resp, 400, "context length is 128 tokens, but 137 were requested", "max_output_tokens")
    resp = c.post(RESPONSES, json={"input": words(130, "two"), "truncation": "auto"})
    assert_error(resp, 400, "the prompt has 132 tokens", "input")
    # the whole conversation was sent, and refused as without truncation
    assert stub.submitted[-1].messages == [{"role": "user", "content": words(130, "two")}]
    assert len(c.app.state.server.responses) == 1


def test_the_response_reports_the_sampling_values_used():
    """With the model's generation-config defaults, the response object shows the temperature and top_p sampled
    with (it showed null), and a request's own values where it sets them."""
    c, stub = make_client(sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    resp = c.post(RESPONSES, json={"input": "hi"}).json()
    assert (resp["temperature"], resp["top_p"]) == (0.6, 0.95) and stub.submitted[-1].params.temperature == 0.6
    resp = c.post(RESPONSES, json={"input": "hi", "temperature": 0.2}).json()
    assert (resp["temperature"], resp["top_p"]) == (0.2, 0.95)


def test_vllm_request_fields_are_served_or_refused_as_chat_does():
    """vLLM's fields on /v1/responses were dropped silently (cache_salt's isolation too): those chat serves reach the
    backend, those it refuses are 400s, and token-id logprobs (chat's format only) are a 400."""
    c, stub = make_client()
    body = {"input": "hi", "cache_salt": "tenant-a", "truncate_prompt_tokens": 8,
            "structured_outputs": {"choice": ["yes", "no"]}}
    assert c.post(RESPONSES, json=body).status_code == 200
    params = stub.submitted[-1].params
    assert (params.cache_salt, params.truncate_prompt_tokens, params.structured.kind) == ("tenant-a", 8, "ebnf")
    for extra, param in (({"use_beam_search": True}, "use_beam_search"), ({"priority": 3}, "priority"),
                         ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
                         ({"prompt_logprobs": 1}, "prompt_logprobs")):
        assert_error(c.post(RESPONSES, json={"input": "hi", **extra}), 400, None, param)
    assert c.post(RESPONSES, json={"input": "hi", "return_tokens_as_token_ids": False}).status_code == 200
