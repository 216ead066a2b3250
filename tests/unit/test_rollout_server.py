"""The rollout server's protocol (TRL's vLLM server endpoints) and its refusals, over a scripted engine: completions
answer as TRL's client parses them; an update reaches the engine only at finish, all of it or nothing; bad tensors,
bodies, orders and adapters are refused with a clear message and leave the engine's weights untouched."""

from __future__ import annotations

import math
import time

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save

from preft.common.rollout_contract import HTTP_UPDATE_PATH, SAFETENSORS_MEDIA_TYPE
from preft.devtools.tiny import build_direft, build_lora
from preft.rollout.app import create_app
from preft.rollout.service import RolloutService, ServedAdapter
from tests.fake_engine import ScriptedEngine

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def lora_dir(model_dirs, tmp_path_factory):
    return build_lora(tmp_path_factory.mktemp("rollout") / "lora", model_dirs["llama"], rank=4, seed=3)


def _server(model_dir, adapter_dir, transport="http"):
    engine = ScriptedEngine(model_dir=model_dir)
    service = RolloutService(engine=engine, adapter=ServedAdapter(adapter_dir, "policy"), transport=transport)
    return engine, service, TestClient(create_app(service))


@pytest.fixture()
def served(model_dirs, lora_dir):
    engine, service, client = _server(model_dirs["llama"], lora_dir)
    with client:
        yield engine, service, client


def _body(tensors) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def _post_tensors(client, tensors, **params):
    return client.post(
        HTTP_UPDATE_PATH, content=_body(tensors), headers={"content-type": SAFETENSORS_MEDIA_TYPE}, params=params
    )


def test_discovery_endpoints_answer_what_trl_reads(served):
    _, _, client = served
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "policy"
    assert client.get("/get_world_size").json() == {"world_size": 1}
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["weight_transfer_config"] == {"backend": "http"}
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["preft"]["mode"] == "prefill" and info["preft"]["version"] == 0 and info["preft"]["update"] == "none"
    assert client.post("/reset_prefix_cache").json() == {"success": True}


def test_completions_are_prompt_major_with_token_ids_and_logprobs(served):
    engine, _, client = served
    body = {"model": "policy", "prompt": [[5, 6, 7], [9, 10]], "n": 2, "max_tokens": 3, "logprobs": 0}
    answer = client.post("/v1/completions", json=body, params={}).json()
    choices = answer["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]]
    assert [c["token_ids"] for c in choices[::2]] == [[18, 19, 20], [19, 20, 21]]  # (the scripted engine's tokens)
    assert all(c["finish_reason"] == "length" for c in choices)
    assert answer["usage"]["completion_tokens"] == 12
    assert engine.seen_adapters and all(a == engine.seen_adapters[0] for a in engine.seen_adapters)


def test_completions_refuse_text_prompts_and_other_models(served):
    _, _, client = served
    text = client.post("/v1/completions", json={"prompt": ["hello"], "max_tokens": 2})
    assert text.status_code == 400 and "token-id prompts" in text.json()["message"]
    other = client.post("/v1/completions", json={"model": "other", "prompt": [[3]], "max_tokens": 2})
    assert other.status_code == 404 and "'other' is not served" in other.json()["message"]
    unknown = client.post("/v1/completions", json={"prompt": [[3]], "best_of": 2})
    assert unknown.status_code == 400 and "best_of" in unknown.json()["message"]
    outside = client.post("/v1/completions", json={"prompt": [[3], [5, 10**6]], "n": 3, "max_tokens": 2})
    assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["message"]


def test_an_update_reaches_the_engine_only_at_finish(served, lora_dir):
    engine, service, client = served
    tensors = load_file(str(lora_dir / WEIGHTS))
    names = sorted(tensors)
    half = names[: len(names) // 2]
    assert client.post("/start_weight_update", json={}).status_code == 200
    assert _post_tensors(client, {n: tensors[n] * 2 for n in half}).json() == {"staged": len(half)}
    assert _post_tensors(client, {n: tensors[n] * 2 for n in names[len(half) :]}).status_code == 200
    assert engine.updates == [], "tensors reached the engine before the update finished"
    done = client.post("/finish_weight_update", json={}).json()
    assert done["version"] == 1 and done["tensors"] == len(names)
    assert engine.updates == [(service.digest, names)]
    empty = client.post("/start_weight_update"), client.post("/finish_weight_update")
    assert empty[1].json()["tensors"] == 0 and len(engine.updates) == 1


def test_bad_updates_are_refused_and_reach_nothing(served, lora_dir, model_dirs, tmp_path):
    engine, _, client = served
    good = load_file(str(lora_dir / WEIGHTS))
    name = sorted(good)[0]
    nan = good[name].clone()
    nan[0, 0] = math.nan
    direft = load_file(str(build_direft(tmp_path / "d", model_dirs["llama"], rank=4, layers=(0,)) / WEIGHTS))
    bad = {
        "unknown name": (direft, "unknown tensor names"),
        "shape": ({name: good[name].T.contiguous()}, "has shape"),
        "dtype": ({name: good[name].to(torch.bfloat16)}, "has dtype BF16"),
        "NaN": ({name: nan}, "NaN or infinite"),
    }
    for label, (tensors, says) in bad.items():
        client.post("/start_weight_update")
        refused = _post_tensors(client, tensors)
        assert refused.status_code == 400 and says in refused.json()["message"], (label, refused.text)
        after = client.post("/finish_weight_update")
        assert after.status_code == 409 and "abandoned" in after.json()["message"], label
    client.post("/start_weight_update")
    truncated = client.post(
        HTTP_UPDATE_PATH, content=_body(good)[:-7], headers={"content-type": SAFETENSORS_MEDIA_TYPE}
    )
    assert truncated.status_code == 400 and "not a complete safetensors file" in truncated.json()["message"]
    client.post("/start_weight_update")
    elsewhere = _post_tensors(client, good, adapter="someone-else")
    assert elsewhere.status_code == 404 and "not resident" in elsewhere.json()["message"]
    twice = _post_tensors(client, {name: good[name]})
    assert _post_tensors(client, {name: good[name]}).json()["message"].endswith(f"sent twice in one update: {name}")
    assert twice.status_code == 200
    assert engine.updates == [], "a refused update reached the engine"


def test_out_of_order_calls_are_refused(served, lora_dir):
    engine, _, client = served
    tensors = load_file(str(lora_dir / WEIGHTS))
    assert client.post("/finish_weight_update").status_code == 409
    early = _post_tensors(client, tensors)
    assert early.status_code == 409 and "/start_weight_update first" in early.json()["message"]
    nccl = client.post(
        "/update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}}
    )
    assert nccl.status_code == 409 and "over HTTP" in nccl.json()["message"]
    init = {"master_address": "127.0.0.1", "master_port": 5, "rank_offset": 1, "world_size": 2}
    assert client.post("/init_weight_transfer_engine", json={"init_info": init}).status_code == 409
    assert engine.updates == []


def test_a_trainer_gone_mid_update_leaves_the_previous_weights(served, lora_dir):
    """Started and sent, never finished: nothing applied; the next update starts over without the lost tensors."""
    engine, service, client = served
    tensors = load_file(str(lora_dir / WEIGHTS))
    names = sorted(tensors)
    client.post("/start_weight_update")
    _post_tensors(client, {names[0]: tensors[names[0]] + 1})
    assert engine.updates == [] and service.version == 0
    client.post("/start_weight_update")  # (a trainer restarted)
    _post_tensors(client, {names[1]: tensors[names[1]]})
    client.post("/finish_weight_update")
    assert engine.updates == [(service.digest, [names[1]])]


def test_engine_refusals_keep_their_status(model_dirs, lora_dir):
    engine, _, client = _server(model_dirs["llama"], lora_dir)
    with client:
        engine.refuse_updates = True
        client.post("/start_weight_update")
        _post_tensors(client, load_file(str(lora_dir / WEIGHTS)))
        refused = client.post("/finish_weight_update")
        assert refused.status_code == 400 and "refused by the test engine" in refused.json()["message"]
        engine.loaded.clear()  # (the engine no longer holds the adapter)
        engine.refuse_updates = False
        client.post("/start_weight_update")
        _post_tensors(client, load_file(str(lora_dir / WEIGHTS)))
        gone = client.post("/finish_weight_update")
        assert gone.status_code == 404 and "not loaded" in gone.json()["message"]


def test_a_trainer_that_disconnects_mid_body_changes_nothing(model_dirs, lora_dir):
    """A real socket closed half-way through a body: the open update is abandoned, nothing reaches the engine, and
    the next update goes through."""
    import socket

    import httpx

    from preft.gateway.testing import ThreadedServer

    engine = ScriptedEngine(model_dir=model_dirs["llama"])
    service = RolloutService(engine=engine, adapter=ServedAdapter(lora_dir, "policy"), transport="http")
    body = _body(load_file(str(lora_dir / WEIGHTS)))
    with ThreadedServer(create_app(service)) as server:
        assert httpx.post(f"{server.url}/start_weight_update").status_code == 200
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            head = (
                f"POST {HTTP_UPDATE_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: {SAFETENSORS_MEDIA_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            raw.sendall(head.encode() + body[: len(body) // 2])
        for _ in range(100):  # (until the server has seen the disconnect)
            state = httpx.get(f"{server.url}/server_info").json()["vllm_config"]["preft"]["update"]
            if state.startswith("abandoned"):
                break
            time.sleep(0.05)
        assert "disconnected" in state, state
        finish = httpx.post(f"{server.url}/finish_weight_update")
        assert finish.status_code == 409 and "disconnected" in finish.json()["message"], finish.text
        assert engine.updates == [] and service.version == 0
        httpx.post(f"{server.url}/start_weight_update")
        sent = httpx.post(
            f"{server.url}{HTTP_UPDATE_PATH}", content=body, headers={"content-type": SAFETENSORS_MEDIA_TYPE}
        )
        assert sent.status_code == 200
        assert httpx.post(f"{server.url}/finish_weight_update").json()["version"] == 1
