"""/v1/responses in-process: the conversions to and from the chat pipeline (input items, tools,
text.format, reasoning), the output items and their stream events, the store and the 400s.
The response bodies and events are checked against the openai package's typed models."""

from __future__ import annotations

import asyncio
import json
import typing

import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from stub_frontend import StubFrontend
from test_api_unit import assert_error, make_client
from tpserve.message.frontend import ApiOutput, RequestRejected
from tpserve.parsers.chat_output import ChatDelta
from tpserve.parsers.tool_calls import ToolCallDelta
from tpserve.server.errors import APIError
from tpserve.server.protocol import ResponsesRequest
from tpserve.server.responses import OutputItems, ResponseStore, StoredResponse, stored_item
from tpserve.server.responses_request import chat_messages, chat_request

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
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [line[len("event: "):] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    for e in events:
        EVENT_MODELS[e["type"]].model_validate(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---- input conversion ----
def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
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
        {"role": "user", "content": "Weather in Rome?"},
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


def test_an_empty_output_is_an_empty_message():
    items = OutputItems()
    events = items.close("incomplete")
    assert items.items[0]["content"][0]["text"] == "" and items.items[0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.output_item.done"


# ---- HTTP, whole and streamed ----
def test_response_object_echoes_the_request():
    c, stub = make_client(stub=StubFrontend(finish="stop"))
    body = {"model": "tiny-test", "input": "hi", "instructions": "Sys.", "max_output_tokens": 9, "temperature": 0.3,
            "metadata": {"k": "v"}, "user": "u1", "text": {"format": {"type": "json_object"}}}
    resp = c.post(RESPONSES, json=body).json()
    Response.model_validate(resp)
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["status"] == "completed"
    assert resp["output"][0]["content"][0]["text"] == "Hello 你好!" and resp["incomplete_details"] is None
    assert {k: resp[k] for k in ("instructions", "max_output_tokens", "temperature", "metadata", "user", "store")} == {
        "instructions": "Sys.", "max_output_tokens": 9, "temperature": 0.3, "metadata": {"k": "v"}, "user": "u1",
        "store": True}
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
        store.put(StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "b" is now the oldest
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2


# ---- errors ----
@pytest.mark.parametrize("body, fragment, param", [
    ({"input": "x", "background": True}, "background", "background"),
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
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "x", "regex": ""}, "regex must not be empty", "regex"),
    ({"input": "x", "tools": [FLAT_TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "give only one of text.format, tool_choice", "tool_choice"),
    ({"input": "x", "max_output_tokens": 2, "min_tokens": 3}, "must not exceed max_output_tokens (2)", "min_tokens"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt templates", "prompt"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"input": "x", "top_logprobs": 3}, "log-probabilities", "top_logprobs"),
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


def test_a_failure_mid_stream_ends_with_response_failed_and_is_not_stored():
    c, _ = make_client(stub=FailingFrontend())
    with c.stream("POST", RESPONSES, json={"input": "hi", "stream": True}) as resp:
        events = events_of(resp)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "grammar broke"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"] == "grammar broke"
    assert len(c.app.state.server.responses) == 0
