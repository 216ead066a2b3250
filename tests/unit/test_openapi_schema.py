"""The gateway's /openapi.json documents every body and answer: each operation that reads a body has its
requestBody (the model the route validates, or the upload form), each has a non-empty schema for its success answer,
and its errors are the error envelope (400, never FastAPI's 422). Built from the app alone: nothing is served.

That the answers really match these schemas is the conformance test's (tests/e2e/test_openapi_conformance.py)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from preft.gateway.app import create_app
from preft.gateway.core.errors import error_body
from preft.gateway.core.pages import item_list
from preft.gateway.openai.routes.models import model_entry
from preft.gateway.settings import GatewaySettings

# The operations that read a body, and the schema (component) or form it is.
JSON_BODIES = {
    ("post", "/v1/completions"): "CompletionBody",
    ("post", "/v1/chat/completions"): "ChatBody",
    ("post", "/tokenize"): "TokenizeBody",
    ("post", "/detokenize"): "DetokenizeBody",
    ("post", "/v1/responses"): "ResponsesBody",
    ("post", "/v1/conversations"): "NewConversation",
    ("post", "/v1/conversations/{conversation_id}"): "ConversationChange",
    ("post", "/v1/conversations/{conversation_id}/items"): "NewItems",
    ("post", "/v1/batches"): "NewBatch",
    ("put", "/v1/adapters/{name}/aliases/{alias}"): "AliasBody",
}
FORMS = {
    ("post", "/v1/files"): {"file", "purpose"},
    ("post", "/v1/adapters"): {"name", "files"},
}
STREAMED = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/v1/responses")}
STREAMED |= {("get", "/v1/responses/{response_id}")}
PROBES = {"/healthz", "/readyz", "/healthz/deps"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return create_app(GatewaySettings(environment="dev")).openapi()


def operations(schema: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method, path): op for path, ops in schema["paths"].items() for method, op in ops.items()}


def resolved(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    assert ref.startswith("#/components/schemas/"), ref
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def validator(schema: dict[str, Any], component: str) -> jsonschema.Draft202012Validator:
    """A validator of `component` within the document (so its $refs resolve)."""
    root = {"$ref": f"#/components/schemas/{component}", "components": schema["components"]}
    return jsonschema.Draft202012Validator(root)


def test_every_operation_that_reads_a_body_documents_it_and_no_other_has_one(schema):
    ops = operations(schema)
    with_body = {key for key, op in ops.items() if "requestBody" in op}
    assert with_body == set(JSON_BODIES) | set(FORMS)
    for key, component in JSON_BODIES.items():
        body = ops[key]["requestBody"]
        assert body["required"] and list(body["content"]) == ["application/json"], key
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{component}"}
        assert resolved(schema, body["content"]["application/json"]["schema"])["properties"], key
    for key, fields in FORMS.items():
        form = ops[key]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert set(form["required"]) == fields and fields <= set(form["properties"]), key


def test_request_schemas_are_the_models_the_routes_validate(schema):
    chat = validator(schema, "ChatBody")
    chat.validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert not chat.is_valid({"model": "m"})  # (messages are required)
    assert not chat.is_valid({"model": "m", "messages": [{"role": "user"}], "n": 9})  # (n is at most 8)
    batch = validator(schema, "NewBatch")
    batch.validate({"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h"})
    assert not batch.is_valid({"input_file_id": "file-1", "endpoint": "/v1/embeddings", "completion_window": "24h"})


def test_every_operation_documents_its_success_answer(schema):
    for key, op in operations(schema).items():
        successes = {status: answer for status, answer in op["responses"].items() if status.startswith("2")}
        assert successes, key
        for answer in successes.values():
            content = answer["content"]
            assert content and all(media["schema"] for media in content.values()), key
            if "application/json" in content:
                assert resolved(schema, content["application/json"]["schema"]).get("properties"), key
        assert ("text/event-stream" in successes.get("200", {}).get("content", {})) == (key in STREAMED), key


def test_errors_are_the_envelope_and_authenticated_operations_declare_the_keys_refusals(schema):
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for (method, path), op in operations(schema).items():
        errors = {status: answer for status, answer in op["responses"].items() if status[0] in "45"}
        assert "422" not in errors, (method, path)
        if path == "/healthz/deps":
            assert set(errors) == {"503"}  # (its own report, not an API error)
            continue
        assert all(answer["content"]["application/json"]["schema"] == envelope for answer in errors.values())
        if path in PROBES:
            assert not errors and "security" not in op
        else:
            assert {"401", "403", "503"} <= set(errors) and op["security"] == [{"TenantApiKey": []}], (method, path)
        if (method, path) in JSON_BODIES:
            assert {"400", "413"} <= set(errors), (method, path)
        if any(p["schema"].get("type") == "integer" for p in op.get("parameters", [])):
            assert "400" in errors, (method, path)  # (a bad number is a 400 naming it)


def test_the_answers_builders_match_their_schemas(schema):
    validator(schema, "ErrorResponse").validate(error_body(429, "slow down", "rate_limit_exceeded", "tokens"))
    validator(schema, "Model").validate(model_entry("tiny", "preft"))
    validator(schema, "ItemPage").validate(item_list([], has_more=False))
    item = {"id": "msg_1", "type": "message", "role": "user", "content": [], "status": "completed"}
    validator(schema, "ItemPage").validate(item_list([item], has_more=True))
    assert not validator(schema, "ItemPage").is_valid(item_list([{**item, "id": 5}], has_more=False))
