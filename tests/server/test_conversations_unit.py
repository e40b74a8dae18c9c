"""/v1/conversations and responses.create(conversation=...) in-process (a stub frontend): every
route and its errors, the items a response appends (or not: failed, cancelled, left), the lock
a running response holds, and the store's bounds. Bodies are checked against the openai
package's typed models."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItemList
from openai.types.conversations.conversation_item import ConversationItem
from openai.types.responses import Response
from pydantic import TypeAdapter
from stub_frontend import StubFrontend
from test_api_unit import LIMITS, MODEL, assert_error, make_client
from test_responses_unit import HERMES_REPLY, FLAT_TOOL, FailingFrontend, HangingFrontend, TooLongFrontend, poll
from tpserve.server.conversation_store import ConversationStore
from tpserve.server.errors import APIError
from tpserve.server.metrics import ServerMetrics
from tpserve.server.responses_protocol import ResponsesRequest
from tpserve.server.response_store import ResponseStore
from tpserve.server.responses import create_response
from tpserve.server.serving import Serving

CONVERSATIONS, RESPONSES = "/v1/conversations", "/v1/responses"
ITEM = TypeAdapter(ConversationItem)
REPLY = "Hello 你好!"


def new_conversation(c, **body) -> str:
    resp = c.post(CONVERSATIONS, json=body)
    assert resp.status_code == 200, resp.text
    Conversation.model_validate(resp.json())
    return resp.json()["id"]


def items_of(c, cid: str) -> list[dict]:
    listed = c.get(f"{CONVERSATIONS}/{cid}/items", params={"order": "asc", "limit": 100}).json()
    ConversationItemList.model_validate(listed)
    for item in listed["data"]:
        ITEM.validate_python(item)
    return listed["data"]


def texts(items: list[dict]) -> list[tuple[str, str]]:
    return [(i["role"], i["content"][0]["text"]) for i in items]


# ---- the routes ----
def test_create_get_update_delete():
    c, _ = make_client()
    created = c.post(CONVERSATIONS, json={"metadata": {"topic": "demo"}, "safety_identifier": "u1"}).json()
    Conversation.model_validate(created)
    assert created["id"].startswith("conv_") and created["object"] == "conversation"
    assert created["metadata"] == {"topic": "demo"} and isinstance(created["created_at"], int)
    url = f"{CONVERSATIONS}/{created['id']}"
    assert c.get(url).json() == created
    updated = c.post(url, json={"metadata": {"k": "v"}}).json()  # replaces the metadata
    assert updated == {**created, "metadata": {"k": "v"}} and c.get(url).json() == updated
    assert c.post(url, json={"metadata": None}).json()["metadata"] == {}
    assert c.post(CONVERSATIONS, json={}).json()["metadata"] == {}  # an empty body: no items, no metadata
    deleted = c.delete(url).json()
    ConversationDeletedResource.model_validate(deleted)
    assert deleted == {"id": created["id"], "object": "conversation.deleted", "deleted": True}
    for resp in (c.get(url), c.delete(url), c.post(url, json={"metadata": {}}), c.get(f"{url}/items"),
                 c.post(f"{url}/items", json={"items": [{"role": "user", "content": "x"}]}),
                 c.get(f"{url}/items/msg_1"), c.delete(f"{url}/items/msg_1")):
        assert_error(resp, 404, f"Conversation with id '{created['id']}' not found.", "conversation_id")


def test_items_add_list_page_get_delete():
    c, _ = make_client()
    cid = new_conversation(c, items=[{"role": "developer", "content": "Be brief."},
                                      {"type": "message", "id": "msg_mine", "role": "user", "content": "one"}])
    added = c.post(f"{CONVERSATIONS}/{cid}/items", json={"items": [
        {"role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
    ]}).json()
    ConversationItemList.model_validate(added)
    assert [i["type"] for i in added["data"]] == ["message", "function_call", "function_call_output", "reasoning"]
    assert [i["id"][:3] for i in added["data"]] == ["msg", "fc_", "fco", "rs_"] and added["has_more"] is False
    assert (added["first_id"], added["last_id"]) == (added["data"][0]["id"], added["data"][-1]["id"])
    ids = [i["id"] for i in items_of(c, cid)]
    assert len(ids) == 6 and ids[1] == "msg_mine" and ids[2:] == [i["id"] for i in added["data"]]
    url = f"{CONVERSATIONS}/{cid}/items"
    desc = c.get(url).json()  # newest first by default
    assert [i["id"] for i in desc["data"]] == ids[::-1] and desc["has_more"] is False
    page = c.get(url, params={"limit": 2}).json()
    assert [i["id"] for i in page["data"]] == [ids[5], ids[4]] and page["has_more"] is True
    page = c.get(url, params={"limit": 2, "after": page["last_id"]}).json()
    assert [i["id"] for i in page["data"]] == [ids[3], ids[2]] and page["has_more"] is True
    page = c.get(url, params={"order": "asc", "after": ids[3]}).json()
    assert [i["id"] for i in page["data"]] == ids[4:] and page["has_more"] is False
    item = c.get(f"{url}/msg_mine").json()
    ITEM.validate_python(item)
    assert item == {"type": "message", "id": "msg_mine", "role": "user", "status": "completed",
                    "content": [{"type": "input_text", "text": "one"}]}
    conversation = c.delete(f"{url}/msg_mine").json()  # answers the conversation
    Conversation.model_validate(conversation)
    assert conversation == c.get(f"{CONVERSATIONS}/{cid}").json()
    assert [i["id"] for i in items_of(c, cid)] == [ids[0]] + ids[2:]
    assert_error(c.get(f"{url}/msg_mine"), 404, "Item with id 'msg_mine' not found.", "item_id")
    assert_error(c.delete(f"{url}/msg_mine"), 404, "not found", "item_id")
    empty = c.get(f"{CONVERSATIONS}/{new_conversation(c)}/items").json()
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_item_references_resolve_to_stored_items():
    c, _ = make_client(stub=StubFrontend(finish="stop"))
    out = c.post(RESPONSES, json={"input": "one"}).json()["output"][0]
    cid = new_conversation(c, items=[{"type": "item_reference", "id": out["id"]}])
    assert items_of(c, cid) == [out]
    assert_error(c.post(f"{CONVERSATIONS}/{cid}/items", json={"items": [{"type": "item_reference", "id": "x"}]}),
                 400, "items[0]: item_reference: no stored item has id 'x'", "items")


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("path, body, fragment, param", [
    ("", {"items": [USER] * 21}, "at most 20 items may be added at a time, got 21", "items"),
    ("/items", {"items": [USER] * 21}, "at most 20 items", "items"),
    ("/items", {"items": []}, "items must not be empty", "items"),
    ("/items", {}, "missing required parameter 'items'", "items"),
    ("/items", {"items": "x"}, None, "items"),
    ("", {"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "items[0].content[0]: input_image content is not supported", "items"),
    ("/items", {"items": [USER, {"type": "web_search_call"}]}, "items[1].type 'web_search_call' is not supported",
     "items"),
    ("/items", {"items": [{"role": "tool", "content": "x"}]}, "items[0].role must be one of", "items"),
    ("", {"items": [{**USER, "id": "msg_a"}, {**USER, "id": "msg_a"}]},
     "Duplicate item found with id msg_a. Remove duplicate items from your input and try again.", "items"),
    ("/items", {"items": [{**USER, "id": "msg_first"}]}, "Duplicate item found with id msg_first", "items"),
    ("", {"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16 keys", "metadata"),
    ("", {"metadata": {"k": 1}}, None, "metadata.k"),
    ("update", {"metadata": {"k": "v" * 513}}, "values at most 512", "metadata"),
])
def test_bad_items_and_metadata_are_400(path, body, fragment, param):
    c, _ = make_client()
    cid = new_conversation(c, items=[{**USER, "id": "msg_first"}])
    url = CONVERSATIONS if path == "" else f"{CONVERSATIONS}/{cid}" + ("/items" if path == "/items" else "")
    assert_error(c.post(url, json=body), 400, fragment, param)
    assert len(items_of(c, cid)) == 1 and len(c.app.state.server.conversations) == 1


def test_list_parameters_are_checked():
    c, _ = make_client()
    cid = new_conversation(c, items=[USER])
    url = f"{CONVERSATIONS}/{cid}/items"
    assert_error(c.get(url, params={"limit": 0}), 400, "limit", "limit")
    assert_error(c.get(url, params={"limit": 101}), 400, "limit", "limit")
    assert_error(c.get(url, params={"order": "up"}), 400, "order", "order")
    assert_error(c.get(url, params={"after": "msg_nope"}), 400, "this conversation has no item with id 'msg_nope'",
                 "after")


# ---- responses.create(conversation=...) ----
def test_responses_continue_the_conversation_and_append_their_items():
    c, stub = make_client()  # the stub's responses are incomplete (max tokens): they count as finished
    cid = new_conversation(c, items=[{"role": "developer", "content": "Be brief."}])
    first = c.post(RESPONSES, json={"input": "one", "instructions": "Sys.", "conversation": cid}).json()
    Response.model_validate(first)
    assert first["conversation"] == {"id": cid} and first["status"] == "incomplete"
    assert stub.submitted[-1].messages == [{"role": "system", "content": "Sys."},
                                           {"role": "system", "content": "Be brief."},  # (as chat's developer)
                                           {"role": "user", "content": "one"}]
    items = items_of(c, cid)  # the input and the output (not the instructions)
    assert texts(items) == [("developer", "Be brief."), ("user", "one"), ("assistant", REPLY)]
    assert items[2] == first["output"][0]
    assert c.get(f"{RESPONSES}/{first['id']}/input_items").json()["data"] == [items[1]]
    second = c.post(RESPONSES, json={"input": [{"role": "user", "content": "two"}], "conversation": {"id": cid},
                                     "store": False}).json()
    assert second["conversation"] == {"id": cid} and second["previous_response_id"] is None
    assert [m["content"] for m in stub.submitted[-1].messages] == ["Be brief.", "one", REPLY, "two"]
    assert texts(items_of(c, cid))[3:] == [("user", "two"), ("assistant", REPLY)]  # not stored, still appended
    assert_error(c.get(f"{RESPONSES}/{second['id']}"), 404)
    c.post(RESPONSES, json={"input": [], "conversation": cid})  # the conversation alone is the prompt
    assert [m["content"] for m in stub.submitted[-1].messages][-2:] == ["two", REPLY]
    assert len(items_of(c, cid)) == 6
    plain = c.post(RESPONSES, json={"input": "x"}).json()
    assert plain["conversation"] is None


def test_streamed_and_background_responses_append_when_they_complete():
    c, _ = make_client(stub=StubFrontend(finish="stop", pieces=3))
    with c:
        cid = new_conversation(c)
        with c.stream("POST", RESPONSES, json={"input": "one", "conversation": cid, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert '"response.completed"' in lines[-1] and f'"conversation":{{"id":"{cid}"}}' in lines[0]
        assert texts(items_of(c, cid)) == [("user", "one"), ("assistant", REPLY)]
        rid = c.post(RESPONSES, json={"input": "two", "conversation": cid, "background": True}).json()["id"]
        assert poll(c, rid, lambda r: r["status"] == "completed")["conversation"] == {"id": cid}
        assert texts(items_of(c, cid))[2:] == [("user", "two"), ("assistant", REPLY)]


def test_function_calls_and_reasoning_carry_over():
    c, stub = make_client(stub=StubFrontend(reply=HERMES_REPLY, pieces=7, finish="stop"), tool_call_parser="hermes")
    cid = new_conversation(c)
    first = c.post(RESPONSES, json={"input": "Weather in Rome?", "tools": [FLAT_TOOL], "conversation": cid}).json()
    message, call = first["output"]
    assert [i["type"] for i in items_of(c, cid)] == ["message", "message", "function_call"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    c.post(RESPONSES, json={"input": [result], "tools": [FLAT_TOOL], "conversation": cid})
    assert stub.submitted[-1].messages[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": call["call_id"], "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}]
    assert [i["type"] for i in items_of(c, cid)][3:] == ["function_call_output", "message", "function_call"]
    stub = StubFrontend(reply="let me think</think>\n\nThe answer", pieces=9, finish="stop", prompt_in_reasoning=True)
    c, _ = make_client(stub=stub, reasoning_parser="qwen3")
    cid = new_conversation(c)
    c.post(RESPONSES, json={"input": "hi", "conversation": cid})
    assert [i["type"] for i in items_of(c, cid)] == ["message", "reasoning", "message"]
    c.post(RESPONSES, json={"input": "more", "conversation": cid})
    assert stub.submitted[-1].messages[1] == {"role": "assistant", "content": "The answer",  # both names, as vLLM's
                                              "reasoning_content": "let me think", "reasoning": "let me think"}


def test_failed_rejected_and_cancelled_responses_add_nothing():
    c, _ = make_client(stub=FailingFrontend())
    cid = new_conversation(c, items=[USER])
    with c.stream("POST", RESPONSES, json={"input": "hi", "conversation": cid, "stream": True}) as resp:
        assert '"response.failed"' in [line for line in resp.iter_lines() if line.startswith("data: ")][-1]
    assert len(items_of(c, cid)) == 1 and c.app.state.server.conversations.get(cid).running is None
    c, _ = make_client(stub=TooLongFrontend())  # rejected by the tokenizer: a 400, nothing added
    cid = new_conversation(c, items=[USER])
    assert_error(c.post(RESPONSES, json={"input": "x", "conversation": cid}), 400, "lower max_output_tokens")
    assert_error(c.post(RESPONSES, json={"input": "x", "conversation": cid}), 400, "lower max_output_tokens")
    assert len(items_of(c, cid)) == 1
    c, stub = make_client(stub=HangingFrontend())
    with c:
        cid = new_conversation(c, items=[USER])
        rid = c.post(RESPONSES, json={"input": "hi", "background": True, "conversation": cid}).json()["id"]
        poll(c, rid, lambda r: r["output"])
        for resp in (c.post(RESPONSES, json={"input": "x", "conversation": cid}),
                     c.post(f"{CONVERSATIONS}/{cid}/items", json={"items": [USER]}),
                     c.delete(f"{CONVERSATIONS}/{cid}/items/{items_of(c, cid)[0]['id']}")):
            err = assert_error(resp, 400, f"currently operating on this conversation (response {rid})", "conversation")
            assert err["code"] == "conversation_locked"  # while it runs, the conversation is held
        assert c.post(f"{CONVERSATIONS}/{cid}", json={"metadata": {"k": "v"}}).status_code == 200
        assert c.post(f"{RESPONSES}/{rid}/cancel").json()["status"] == "cancelled"
        assert len(items_of(c, cid)) == 1
        c.post(f"{CONVERSATIONS}/{cid}/items", json={"items": [USER]})  # released
        rid = c.post(RESPONSES, json={"input": "hi", "background": True, "conversation": cid}).json()["id"]
        poll(c, rid, lambda r: r["output"])
        c.delete(f"{RESPONSES}/{rid}")  # deleting it stops it: released, nothing added
        for _ in range(200):
            if c.app.state.server.conversations.get(cid).running is None:
                break
            time.sleep(0.01)
        assert c.app.state.server.conversations.get(cid).running is None and len(items_of(c, cid)) == 2


def test_a_client_leaving_a_stream_adds_nothing_and_releases():
    async def scenario() -> None:
        store, conversations = ResponseStore(), ConversationStore()
        stub = StubFrontend(finish="stop", pieces=3)
        serving = Serving(stub, ServerMetrics(), MODEL, LIMITS)  # type: ignore[arg-type]
        conversation = conversations.create({}, [])
        body = ResponsesRequest.model_validate({"input": "hi", "stream": True, "conversation": conversation.id})
        response = await create_response(serving, store, conversations, body, None)  # type: ignore[arg-type]
        chunks = response.body_iterator  # type: ignore[union-attr]
        await anext(chunks)
        assert conversation.running is not None
        await chunks.aclose()
        assert conversation.running is None and not conversation.items

    asyncio.run(scenario())


def test_a_conversation_changed_while_truncation_counts_tokens_is_not_held():
    """``truncation: "auto"`` reads the history, then awaits the token count: another response that ran on the
    conversation meanwhile made this one's prompt miss its items while its own landed after them."""
    async def scenario() -> None:
        store, conversations = ResponseStore(), ConversationStore()
        stub = StubFrontend(finish="stop")
        serving = Serving(stub, ServerMetrics(), MODEL, LIMITS)  # type: ignore[arg-type]
        conversation = conversations.create({}, [])

        async def slow_count(_) -> int:
            await asyncio.sleep(0.2)
            return 10

        def body(text: str, **kw) -> ResponsesRequest:
            return ResponsesRequest.model_validate({"input": text, "conversation": conversation.id, **kw})

        fitting = asyncio.create_task(create_response(serving, store, conversations, body("A", truncation="auto"),
                                                      None, slow_count))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert (await create_response(serving, store, conversations, body("B"), None)).status_code == 200
        with pytest.raises(APIError, match="changed while this response's input was being prepared") as e:
            await fitting
        assert e.value.code == "conversation_locked" and conversation.running is None
        assert [item["role"] for item in conversation.items.values()] == ["user", "assistant"]  # B's only

    asyncio.run(scenario())


@pytest.mark.parametrize("body, status, fragment, param", [
    ({"input": "x", "conversation": "conv_nope"}, 404, "Conversation with id 'conv_nope' not found.", "conversation"),
    ({"input": "x", "conversation": {"id": "conv_nope"}}, 404, "not found", "conversation"),
    ({"input": "x", "conversation": {"name": "c"}}, 400, 'a conversation id or {"id"', "conversation"),
    ({"input": "x", "conversation": ""}, 400, "a conversation id", "conversation"),
    ({"input": "x", "conversation": 5}, 400, None, "conversation"),
    ({"input": "x", "conversation": "CID", "previous_response_id": "resp_1"}, 400,
     "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' or 'conversation'.",
     "conversation"),
    ({"input": [{**USER, "id": "msg_first"}], "conversation": "CID"}, 400, "Duplicate item found with id msg_first",
     "input"),
    ({"input": [{**USER, "id": "m"}, {**USER, "id": "m"}], "conversation": "CID"}, 400, "Duplicate item", "input"),
    ({"input": [], "conversation": "EMPTY"}, 400, "input must not be empty", "input"),
    ({"input": [{"role": "user", "content": 5}], "conversation": "CID"}, 400, "input[0].content", "input"),
])
def test_bad_conversation_requests(body, status, fragment, param):
    c, stub = make_client()
    cid = new_conversation(c, items=[{**USER, "id": "msg_first"}])
    empty = new_conversation(c)
    if body.get("conversation") in ("CID", "EMPTY"):
        body = {**body, "conversation": cid if body["conversation"] == "CID" else empty}
    assert_error(c.post(RESPONSES, json=body), status, fragment, param)
    assert not stub.submitted and len(items_of(c, cid)) == 1
    assert c.app.state.server.conversations.get(cid).running is None


# ---- the store's bounds ----
def test_store_drops_the_least_recently_used_and_bounds_items():
    store = ConversationStore(capacity=2, max_items=3)
    a, b = store.create({}, []), store.create({}, [])
    store.get(a.id)  # "b" is now the oldest
    c = store.create({}, [])
    with pytest.raises(APIError, match="not found"):
        store.get(b.id)
    assert store.get(a.id) is a and store.get(c.id) is c and len(store) == 2
    items = [{"id": f"msg_{i}"} for i in range(4)]
    with pytest.raises(APIError, match="would hold 4 items; at most 3"):
        store.create({}, items)
    a.add(items[:3])
    with pytest.raises(APIError, match="at most 3") as err:
        store.hold(a, "resp_1", items[3:], items[:3])
    assert err.value.param == "input" and a.running is None
    store.hold(c, "resp_2", items[:1], [])  # a response appends its output past the bound
    store.release(c.id, "resp_1", items)  # not the response holding it: ignored
    assert c.running == "resp_2" and not c.items
    store.release(c.id, "resp_2", items)
    store.release(c.id, "resp_2", [{"id": "msg_9"}])  # only the first release counts
    assert c.running is None and list(c.items) == [i["id"] for i in items]
    c_client, _ = make_client()
    c_client.app.state.server.conversations.capacity = 1
    first, second = new_conversation(c_client), new_conversation(c_client)
    assert_error(c_client.get(f"{CONVERSATIONS}/{first}"), 404)
    assert c_client.get(f"{CONVERSATIONS}/{second}").status_code == 200
