"""The Conversations API with the official `openai` client (real gateway, Redis and registry; the stub engine): a
conversation's items are kept, paged, read and deleted; a response given `conversation` answers after its items and
adds its input and output to it, whole, streamed and in the background; bad requests are 4xx and change nothing."""

from __future__ import annotations

import openai
import pytest
import redis

from .conftest import BASE, error_of
from .test_responses import _until

FIRST = [
    {"role": "user", "content": "I am Bob."},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi Bob."}]},
]


def _kinds(items) -> list[tuple]:
    """Items as (type, role or call id, text or output)."""
    return [
        (i.type, i.role, i.content[0].text)
        if i.type == "message"
        else (i.type, i.call_id, getattr(i, "output", None) or i.name)
        for i in items
    ]


def test_conversations_keep_page_and_delete_items(make_gateway, registry):
    acme = registry.tenant("acme")
    client = make_gateway(responses_store_ttl_s=60).openai(acme)
    conv = client.conversations.create(items=FIRST, metadata={"topic": "intro"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "intro"} and conv.created_at > 0
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "intro"}
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "function_call", "call_id": "call_1", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
        ],
    )
    assert [i.type for i in added.data] == ["function_call", "function_call_output"] and not added.has_more
    everything = list(client.conversations.items.list(conv.id, order="asc", limit=1))  # (paged through `after`)
    assert _kinds(everything) == [
        ("message", "user", "I am Bob."),
        ("message", "assistant", "Hi Bob."),
        ("function_call", "call_1", "time"),
        ("function_call_output", "call_1", "noon"),
    ]
    newest = client.conversations.items.list(conv.id, limit=3, include=["message.output_text.logprobs"])
    assert [i.id for i in newest.data] == [i.id for i in everything[::-1][:3]] and newest.has_more
    assert client.conversations.items.retrieve(everything[2].id, conversation_id=conv.id).call_id == "call_1"
    assert client.conversations.items.delete(everything[2].id, conversation_id=conv.id).id == conv.id
    assert len(list(client.conversations.items.list(conv.id))) == 3
    with pytest.raises(openai.NotFoundError, match="no item"):
        client.conversations.items.retrieve(everything[2].id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError, match="no item"):
        client.conversations.items.delete(everything[2].id, conversation_id=conv.id)
    assert client.conversations.update(conv.id, metadata={"topic": "time"}).metadata == {"topic": "time"}

    with pytest.raises(openai.NotFoundError):  # (another tenant's)
        make_gateway(responses_store_ttl_s=60).openai(registry.tenant("beta")).conversations.retrieve(conv.id)
    assert client.conversations.delete(conv.id).deleted
    for gone in (
        lambda: client.conversations.retrieve(conv.id),
        lambda: client.conversations.delete(conv.id),
        lambda: client.conversations.items.list(conv.id),
        lambda: client.conversations.items.create(conv.id, items=FIRST),
        lambda: client.conversations.update(conv.id, metadata={}),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()
    empty = client.conversations.create()
    assert client.conversations.items.list(empty.id).data == [] and empty.metadata == {}


def test_responses_continue_conversations(make_gateway, registry, stub, tokenizer):
    """A response given a conversation answers after its items and adds its input and output to it (its items the
    response's input items); streamed and background responses too; one that fails adds nothing."""
    client = make_gateway(responses_store_ttl_s=60).openai(registry.tenant("acme"))
    conv = client.conversations.create(items=FIRST)
    stub.reply = "You are Bob."
    answer = client.responses.create(model=BASE, conversation=conv.id, input="Who am I?", max_output_tokens=20)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert prompt.startswith("user: I am Bob.\nassistant: Hi Bob.\nuser: Who am I?")
    assert answer.conversation.id == conv.id and answer.output_text == "You are Bob."
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert _kinds(items)[2:] == [("message", "user", "Who am I?"), ("message", "assistant", "You are Bob.")]
    assert items[3].id == answer.output[0].id
    assert items[2].id == client.responses.input_items.list(answer.id).data[0].id

    stub.reply = "Still Bob."
    with client.responses.stream(model=BASE, conversation={"id": conv.id}, input="Sure?") as events:
        streamed = events.get_final_response()
    assert "assistant: You are Bob.\nuser: Sure?" in tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert _kinds(client.conversations.items.list(conv.id, limit=2).data) == [
        ("message", "assistant", "Still Bob."),
        ("message", "user", "Sure?"),
    ]
    assert streamed.conversation.id == conv.id

    stub.reply = "Yes."
    queued = client.responses.create(model=BASE, conversation=conv.id, input="Really?", background=True)
    _until(lambda: client.responses.retrieve(queued.id), lambda r: r.status == "completed")
    last = _until(lambda: client.conversations.items.list(conv.id, limit=2).data, lambda i: i[1].id != items[-1].id)
    assert _kinds(last) == [("message", "assistant", "Yes."), ("message", "user", "Really?")]

    held = len(list(client.conversations.items.list(conv.id)))
    stub.reply = "An answer cut short."
    stub.fail_next(503, after_chunks=2)  # (the engine fails midway: the background run fails, adding nothing)
    broken = client.responses.create(model=BASE, conversation=conv.id, input="Fail.", background=True)
    assert _until(lambda: client.responses.retrieve(broken.id), lambda r: r.status == "failed").output
    unkept = client.responses.create(model=BASE, conversation=conv.id, input="Not stored.", store=False)
    assert unkept.store is False  # (the conversation still takes its items)
    assert len(list(client.conversations.items.list(conv.id))) == held + 2


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/conversations", {"items": [{"role": "wizard", "content": "x"}]}, "items.0: role"),
        ("/v1/conversations", {"items": [{"type": "web_search_call", "id": "ws_1"}]}, "not supported"),
        ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/conversations", {"title": "x"}, "title"),
        ("{conv}", {"metadata": None}, "metadata"),
        ("{conv}/items", {"items": []}, "items"),
        ("{conv}/items", {"items": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
        ("{conv}/items", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]}, "only text"),
        ("{conv}/items", {"items": [{"role": "user", "content": "x"}] * 3}, "at most 4"),
        ("{conv}/items", {"items": [{"role": "user", "content": "x" * 900}]}, "at most 1024"),  # (bytes)
        ("/v1/conversations", {"items": [{"role": "user", "content": "x" * 1100}]}, "at most 1024"),
        ("{conv}/items?include=everything", {"items": [{"role": "user", "content": "x"}]}, "include"),
        ("{conv}/items?include[]=everything", {"items": [{"role": "user", "content": "x"}]}, "include"),
    ],
)
def test_bad_conversation_requests_are_400_and_change_nothing(make_gateway, registry, redis_url, path, body, says):
    key = registry.tenant("acme")
    gateway = make_gateway(responses_store_ttl_s=60, conversations_max_items=4, conversations_max_bytes=1024)
    http = gateway.http(key)
    conv = http.post("/v1/conversations", json={"items": FIRST, "metadata": {"a": "b"}}).json()
    items = http.get(f"/v1/conversations/{conv['id']}/items").json()["data"]
    keys = sorted(redis.Redis.from_url(redis_url).scan_iter("preft:conversation*"))
    refused = http.post(path.format(conv=f"/v1/conversations/{conv['id']}"), json=body)
    assert refused.status_code == 400 and says in error_of(refused)["message"], refused.text
    assert http.get(f"/v1/conversations/{conv['id']}").json() == conv
    assert http.get(f"/v1/conversations/{conv['id']}/items").json()["data"] == items and len(items) == 2
    assert sorted(redis.Redis.from_url(redis_url).scan_iter("preft:conversation*")) == keys


def test_responses_refuse_conversations_they_cannot_continue(make_gateway, registry, stub):
    key = registry.tenant("acme")
    gateway = make_gateway(responses_store_ttl_s=60, conversations_max_items=3)
    client = gateway.openai(key)
    conv = client.conversations.create(items=FIRST)
    sent = len(stub.received)
    first = client.responses.create(model=BASE, input="hi")
    for body, error, says in [
        ({"conversation": conv.id, "previous_response_id": first.id}, openai.BadRequestError, "cannot both"),
        ({"conversation": "conv_" + "0" * 32}, openai.NotFoundError, "no conversation"),
        ({"conversation": "nope"}, openai.NotFoundError, "no conversation"),
        ({"conversation": conv.id}, openai.BadRequestError, "at most 3"),  # (2 held, the input and an answer: 4)
    ]:
        with pytest.raises(error, match=says):
            client.responses.create(model=BASE, input="hi", **body)
    assert len(stub.received) == sent + 1 and len(client.conversations.items.list(conv.id).data) == 2
    unstored = make_gateway().openai(key)
    with pytest.raises(openai.BadRequestError, match="does not store conversations"):
        unstored.responses.create(model=BASE, input="hi", conversation=conv.id)
    with pytest.raises(openai.BadRequestError, match="does not store conversations"):
        unstored.conversations.create()
    with pytest.raises(openai.NotFoundError):
        unstored.conversations.retrieve(conv.id)


def test_a_tenant_holds_so_many_conversations_of_so_many_bytes(make_gateway, registry):
    """Past the conversations a tenant may hold, another is a 429 (another tenant's are its own); deleting one makes
    room. A conversation's bytes count its items as kept: deleting an item gives its bytes back."""
    gateway = make_gateway(responses_store_ttl_s=60, conversations_max_per_tenant=2, conversations_max_bytes=1024)
    client, other = gateway.openai(registry.tenant("acme")), gateway.openai(registry.tenant("beta"))
    first, _ = client.conversations.create(), client.conversations.create()
    with pytest.raises(openai.RateLimitError, match="holds 2 conversations"):
        client.conversations.create()
    assert other.conversations.create().id
    client.conversations.delete(first.id)
    third = client.conversations.create()
    big = {"role": "user", "content": "x" * 350}  # (~460 bytes as kept: two fit, three do not)
    added = client.conversations.items.create(third.id, items=[big]).data[0]
    client.conversations.items.create(third.id, items=[big])
    with pytest.raises(openai.BadRequestError, match="at most 1024"):
        client.conversations.items.create(third.id, items=[big])
    client.conversations.items.delete(added.id, conversation_id=third.id)
    assert client.conversations.items.create(third.id, items=[big]).data
    assert len(client.conversations.items.list(third.id).data) == 2
