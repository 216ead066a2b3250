"""Bad requests get a 4xx with an OpenAI-shaped JSON error body, never FastAPI's 422 or an HTML page, and never
reach the engine."""

from __future__ import annotations

from .conftest import BASE, error_of

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "hi"}]
# a chat body with one tool, open at the end for more fields
CHAT_TOOLS = (
    b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], '
    b'"tools": [{"type": "function", "function": {"name": "f"}}]'
)

BAD_BODIES = [
    (COMPLETIONS, b"{not json", "Invalid JSON"),
    (COMPLETIONS, b"[1, 2]", "should be an object"),
    (COMPLETIONS, b'{"prompt": "hi"}', "model"),
    (COMPLETIONS, b'{"model": "tiny-llama"}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": "lots"}', "max_tokens"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "temperature": -1}', "temperature"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "stream": "yes please"}', "stream"),
    (COMPLETIONS, b'{"model": 7, "prompt": "hi"}', "model"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ""}', "prompt is empty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": [1, 99999]}', "token ids"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ["a", ""]}', "prompt is empty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": [[5, 6], [7, 99999]]}', "token ids"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ["a", 5]}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny-llama", "n": 8, "prompt": [' + b", ".join([b'"a"'] * 33) + b"]}", "33 prompts × 8"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "n": 9}', "n"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "n": 0}', "n"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "best_of": 2, "stream": true}', "cannot be streamed"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "best_of": 2, "n": 3}', "at least n (3)"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "best_of": 9}', "best_of"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "logprobs": 6}', "logprobs"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "logprobs": -1}', "logprobs"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "suffix": "end"}', "suffix is not supported"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "echo": "loud"}', "echo"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "presence_penalty": 2.5}', "presence_penalty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "frequency_penalty": "high"}', "frequency_penalty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "guided_regex": "a+"}', "guided_regex is not supported"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "use_beam_search": true}', "use_beam_search is not"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "bad_words": [""]}', "bad_words"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "bad_words": ["ok", "  "]}', "other than whitespace"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "bad_words": [' + b'"a", ' * 64 + b'"a"]}', "bad_words"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "skip_special_tokens": "maybe"}', "skip_special_tokens"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "truncate_prompt_tokens": -2}', "truncate_prompt_tokens"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "truncate_prompt_tokens": 0}', "prompt is empty"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "truncation_side": "middle"}', "truncation_side"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "top_k": -2}', "top_k"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "min_p": 1.5}', "min_p"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "min_tokens": 5}', "min_tokens (5)"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "stop_token_ids": [99999]}', "stop_token_ids: token"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "allowed_token_ids": [-1]}', "allowed_token_ids: token"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "stop_token_ids": [' + b"1, " * 32 + b"1]}", "stop_token"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"hello": 1}}', "logit_bias: keys"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"99999": 1}}', "token ids in [0, "),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "logit_bias": {"5": 101}}', "logit_bias"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 5}}', "keys"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 600}', "maximum context length"),
    (CHAT, b'{"model": "tiny-llama", "messages": []}', "messages"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "wizard", "content": "hi"}]}', "role"),
    (CHAT, b'{"model": "tiny-llama", "messages": "hi"}', "messages"),
    (
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        "only text",
    ),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "tools.0.type"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "functions": [{}]}', "functions"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}', "give t"),
    (CHAT, CHAT_TOOLS + b', "tool_choice": {"type": "function", "function": {"name": "g"}}}', "no tool is named 'g'"),
    (CHAT, CHAT_TOOLS + b', "tool_choice": "sometimes"}', "tool_choice"),
    (CHAT, CHAT_TOOLS + b', "top_logprobs": 2}', "set logprobs to true"),
    (
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "continue_final_message": true}',
        "the last message must be the assistant's",
    ),
    (CHAT, CHAT_TOOLS + b', "tool_choice": "required", "response_format": {"type": "json_object"}}', "response_f"),
    (
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        b'"function": {"name": "has space"}}]}',
        "tools.0.function.name",
    ),
    (
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        b'"function": {"name": "f", "parameters": {"type": 5}}}]}',
        "not a valid JSON Schema",
    ),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "logprobs"),
    (CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}', "top_logp"),
    # constraints
    (
        CHAT,
        b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "response_format": "json"}',
        "resp",
    ),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "response_format": {"type": "xml"}}', "response_format"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "response_format": {"type": "json_schema"}}', "needs a"),
    (
        COMPLETIONS,
        b'{"model": "tiny-llama", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
        b'{"name": "x", "schema": {"type": "nonsense"}}}}',
        "not a valid JSON Schema at type",
    ),
    (
        COMPLETIONS,
        b'{"model": "tiny-llama", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
        b'{"name": "no spaces", "schema": {"type": "object"}}}}',
        "json_schema.name",
    ),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {}}', "exactly one of json, json_o"),
    (
        COMPLETIONS,
        b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}',
        "given: regex, choice",
    ),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {"choice": []}}', "choice"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {"json": "{"}}', "not JSON"),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {"regx": "a"}}', "regx"),
    (
        COMPLETIONS,
        b'{"model": "tiny-llama", "prompt": "hi", "structured_outputs": {"regex": "a"}, '
        b'"response_format": {"type": "json_object"}}',
        "not both",
    ),
]


def test_malformed_bodies_are_400_with_a_json_error(gateway, registry, stub):
    http = gateway.http(registry.tenant("acme"))
    for path, raw, says in BAD_BODIES:  # one gateway for all cases: each case's request names it on failure
        answer = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400, (raw, answer.text)
        error = error_of(answer)
        assert error["type"] == "invalid_request_error", raw
        assert says in error["message"], (raw, error["message"])
    assert stub.received == []


def test_too_long_prompts_and_bodies_are_413(make_gateway, registry, stub):
    gateway = make_gateway(max_prompt_tokens=16, max_request_bytes=64 * 1024)
    http = gateway.http(registry.tenant("acme"))
    long_prompt = "hello world " * 40
    for path, body in [
        (COMPLETIONS, {"model": BASE, "prompt": long_prompt}),
        (COMPLETIONS, {"model": BASE, "prompt": list(range(3, 20))}),
        (CHAT, {"model": BASE, "messages": [{"role": "user", "content": long_prompt}]}),
    ]:
        answer = http.post(path, json=body)
        assert answer.status_code == 413, answer.text
        assert "at most 16" in error_of(answer)["message"]
    huge = http.post(COMPLETIONS, json={"model": BASE, "prompt": "x" * 100_000})
    assert huge.status_code == 413 and "larger than 65536 bytes" in error_of(huge)["message"]
    assert stub.received == []
    # at the limit is fine
    assert http.post(COMPLETIONS, json={"model": BASE, "prompt": list(range(3, 19))}).status_code == 200


def test_missing_key_unknown_route_and_wrong_method_are_json_errors(gateway):
    http = gateway.http()
    no_key = http.post(COMPLETIONS, json={"model": BASE, "prompt": "hi"})
    assert no_key.status_code == 401 and "didn't provide an API key" in error_of(no_key)["message"]
    # the key is checked before the body is even read
    assert http.post(COMPLETIONS, content=b"{broken").status_code == 401
    assert http.get("/v1/models").status_code == 401
    for answer, status in [(http.get("/v1/nothing"), 404), (http.get(COMPLETIONS), 405)]:
        assert answer.status_code == status
        assert error_of(answer)["code"] == f"http_{status}"
