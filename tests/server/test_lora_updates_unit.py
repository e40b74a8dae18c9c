"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter in-process (TestClient, a stub backend that answers the
LoRA updates): vLLM's success lines, its checks as OpenAI-style 400s and 404s, the gate, /v1/models and the names
generation requests may use."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from stub_frontend import StubFrontend
from tpserve.engine_config import EngineConfig
from tpserve.launch.args import ServerArgs
from tpserve.message import LoadLoRA, LoRAAnswer, UnloadLoRA
from tpserve.server.api import AppState, create_app
from tpserve.server.limits import RequestLimits
from tpserve.server.serving import Serving

MODEL = "tiny-test"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class LoRAStub(StubFrontend):
    """Each replica answers a LoRA update with ``errors[replica]`` (None: done)."""

    def __init__(self, errors: list[str | None] | None = None) -> None:
        super().__init__()
        self.errors = errors or [None]
        self.updates: list[LoadLoRA | UnloadLoRA] = []

    async def update_lora(self, update, replicas, timeout):
        self.updates.append(update)
        errors = self.errors if isinstance(update, LoadLoRA) else [None] * replicas
        return [LoRAAnswer(update.rid, error) for error in errors[:replicas]]


def make_client(enabled: bool = True, stub: LoRAStub | None = None, dp_size: int = 1, **engine):
    args = ServerArgs(engine=EngineConfig(model="/nonexistent", dp_size=dp_size, **engine), served_model_name=MODEL,
                      context_len=128, vocab_size=700, model_aliases=("alias",), allow_runtime_lora_updating=enabled)
    state = AppState(args)
    stub = stub or LoRAStub()
    state.serving = Serving(stub, state.metrics, MODEL, RequestLimits(128, 64), ("alias",),  # type: ignore[arg-type]
                            lora_adapters=state.adapters)
    return TestClient(create_app(state)), stub


@pytest.fixture(scope="module")
def adapter(qwen3_dir, tmp_path_factory) -> str:
    from lora_adapters import make_adapter

    return make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("lora")), ("q_proj", "v_proj"), rank=8)


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    return resp.json()["error"]


def test_load_lists_serves_and_unload_forgets_the_adapter(adapter):
    client, stub = make_client()
    resp = client.post(LOAD, json={"lora_name": "sql", "lora_path": adapter})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' added successfully."
    assert isinstance(stub.updates[-1], LoadLoRA) and (stub.updates[-1].name, stub.updates[-1].path) == ("sql", adapter)
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "alias", "sql"]
    assert cards[2]["root"] == adapter and cards[2]["parent"] == MODEL
    assert client.get("/v1/models/sql").status_code == 200
    resp = client.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == "sql"
    assert stub.submitted[-1].params.lora == "sql"

    resp = client.post(UNLOAD, json={"lora_name": "sql"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'sql' removed successfully."
    assert isinstance(stub.updates[-1], UnloadLoRA) and stub.updates[-1].name == "sql"
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [MODEL, "alias"]
    error = error_of(client.post("/v1/completions", json={"model": "sql", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found"
    # loaded again (its slot freed), under the same name
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": adapter}).status_code == 200


def test_the_checks_are_400s_and_404s(adapter, tmp_path):
    client, stub = make_client(max_lora_rank=4)
    cases = [
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_path": adapter}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": MODEL, "lora_path": adapter}, 400, "is the served model's name"),
        ({"lora_name": "alias", "lora_path": adapter}, 400, "is the served model's name"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 404, "No adapter found for"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, 400, "needs adapter_config.json and adapter_model"),
        ({"lora_name": "x", "lora_path": adapter}, 400, "has rank 8, more than --max-lora-rank 4"),
        ({"lora_name": 3, "lora_path": adapter}, 400, None),
    ]
    for body, status, message in cases:
        error = error_of(client.post(LOAD, json=body), status)
        assert message is None or message in error["message"], (body, error)
    assert not stub.updates, "each was refused before any rank saw it"
    error = error_of(client.post(UNLOAD, json={"lora_name": "x"}), 404)
    assert error["message"] == "The lora adapter 'x' cannot be found."
    error_of(client.post(UNLOAD, json={}), 400)


def test_a_name_loaded_twice_and_the_engines_refusal_are_400s(adapter):
    client, stub = make_client(stub=LoRAStub())
    assert client.post(LOAD, json={"lora_name": "a", "lora_path": adapter}).status_code == 200
    error = error_of(client.post(LOAD, json={"lora_name": "a", "lora_path": adapter}), 400)
    assert error["message"] == "The lora adapter 'a' has already been loaded."
    stub.errors = ["tp rank 1: No adapter found for /b on node 1"]
    error = error_of(client.post(LOAD, json={"lora_name": "b", "lora_path": adapter}), 400)
    assert error["message"] == "tp rank 1: No adapter found for /b on node 1"
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [MODEL, "alias", "a"]


def test_a_replica_that_could_not_load_undoes_the_others(adapter):
    """With --dp-size 2, one replica that could not read the adapter: the replica that loaded it unloads it, the load
    is a 400."""
    stub = LoRAStub([None, "No adapter found for /a on node 1"])
    client, _ = make_client(stub=stub, dp_size=2)
    error_of(client.post(LOAD, json={"lora_name": "a", "lora_path": adapter}), 400)
    assert [type(u) for u in stub.updates] == [LoadLoRA, UnloadLoRA]
    assert "a" not in [c["id"] for c in client.get("/v1/models").json()["data"]]


def test_disabled_unless_the_flag_or_vllms_environment_variable(adapter, monkeypatch):
    client, stub = make_client(enabled=False)
    for path, body in ((LOAD, {"lora_name": "a", "lora_path": adapter}), (UNLOAD, {"lora_name": "a"})):
        error = error_of(client.post(path, json=body), 404)
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true" in error["message"], error
    assert not stub.updates
    from tpserve.launch.args import runtime_updating_allowed

    values = ("1", "True", " true", "0", "")
    assert [runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": v}) for v in values] \
        == [True, True, True, False, False]
    assert not runtime_updating_allowed({})


@pytest.mark.parametrize("config", [[], {"r": 8, "lora_alpha": "16"}, {"r": 8, "lora_alpha": None},
                                    {"r": 8, "target_modules": [1]}, {"r": 8, "lora_alpha": True}])
def test_a_malformed_adapter_config_is_a_400(adapter, tmp_path, config):
    """adapter_config.json's values are the client's files: a wrong type is a 400 naming the adapter, not a 500."""
    import json
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(adapter, path)
    (path / "adapter_config.json").write_text(json.dumps(config))
    client, stub = make_client()
    error = error_of(client.post(LOAD, json={"lora_name": "x", "lora_path": str(path)}), 400)
    assert f"LoRA adapter {path}" in error["message"] and not stub.updates


def test_an_unload_the_engine_did_not_answer_keeps_the_adapter_served(adapter):
    """A 503 unload (no answer in time) may not have reached the ranks: the adapter stays served, so the unload can
    be tried again (forgetting it would leave its slot taken and its name refused by every later load)."""

    class SlowUnload(LoRAStub):
        slow = True

        async def update_lora(self, update, replicas, timeout):
            if isinstance(update, UnloadLoRA) and self.slow:
                self.slow = False
                raise TimeoutError
            return await super().update_lora(update, replicas, timeout)

    client, stub = make_client(stub=SlowUnload())
    assert client.post(LOAD, json={"lora_name": "a", "lora_path": adapter}).status_code == 200
    error_of(client.post(UNLOAD, json={"lora_name": "a"}), 503)
    assert "a" in [c["id"] for c in client.get("/v1/models").json()["data"]]
    assert client.post(UNLOAD, json={"lora_name": "a"}).status_code == 200
    assert "a" not in [c["id"] for c in client.get("/v1/models").json()["data"]]


def test_an_unload_waits_for_the_searches_pinning_its_adapter(adapter):
    """A beam search names its adapter at every step (``ServedAdapters.pinned``): the ranks unload it only once the
    search is done, though new requests get the 404 at once (a search lost its adapter mid-way: a 400)."""
    import asyncio

    from tpserve.server.errors import APIError
    from tpserve.server.lora_updates import LoadLoRAAdapterRequest, LoRAUpdates, ServedAdapters
    from tpserve.server.lora_updates import UnloadLoRAAdapterRequest

    async def scenario() -> None:
        stub = LoRAStub()
        adapters = ServedAdapters([("sql", adapter)])
        updates = LoRAUpdates(adapters, (MODEL,), max_rank=8, replicas=1, enabled=True)
        with adapters.pinned("sql"):
            unload = asyncio.create_task(updates.unload(stub, UnloadLoRAAdapterRequest(lora_name="sql")))
            await asyncio.sleep(0.2)
            assert not unload.done() and not stub.updates and "sql" not in adapters
            load = asyncio.create_task(updates.load(stub, LoadLoRAAdapterRequest(lora_name="sql", lora_path=adapter)))
            await asyncio.sleep(0.1)
            assert not load.done()  # the name's next load waits for the unload
        assert await unload == "Success: LoRA adapter 'sql' removed successfully."
        await load
        assert [type(update) for update in stub.updates] == [UnloadLoRA, LoadLoRA]
        with pytest.raises(APIError) as gone:  # a search naming an adapter no longer served: the model's 404
            with adapters.pinned("other"):
                pass
        assert gone.value.status == 404

    asyncio.run(scenario())


def test_an_adapter_unloaded_before_its_request_reached_the_engine_is_the_models_404(adapter):
    """The server checked the name, then the unload reached the engine before the request did: the engine's refusal
    ('not loaded (this engine has ...)', a 400) is the unknown model's 404, as a request sent after the unload gets."""
    from tpserve.message.frontend import ApiOutput

    class UnloadedMeanwhile(LoRAStub):
        async def submit(self, requests, queue) -> None:
            self.submitted.extend(requests)
            state.adapters.remove("sql")
            for req in requests:
                queue.put_nowait(ApiOutput(rid=req.rid, text="", new_tokens=0, completion_tokens=0, prompt_tokens=2,
                                           finish_reason="error", error="LoRA adapter 'sql' is not loaded"))

    client, stub = make_client(stub=UnloadedMeanwhile())
    state = client.app.state.server
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": adapter}).status_code == 200
    for stream in (False, True):
        state.adapters.add("sql", adapter)
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2, "stream": stream}
        error = error_of(client.post("/v1/completions", json=body), 404)
        assert error["code"] == "model_not_found" and "`sql` does not exist" in error["message"]
