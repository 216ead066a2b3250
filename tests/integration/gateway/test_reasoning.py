"""A thinking model's answers (`PREFT_GATEWAY__REASONING_FORMAT=think`) with the official `openai` client (real
gateway, Redis and registry; the stub engine): the thinking comes apart from the answer on chat (`reasoning`) and on
the Responses API (a `reasoning` item), whole and streamed alike, tool calls read from the answer alone; a later
turn leaves the thinking out."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import BASE
from .test_responses import TOOLS

THOUGHT = "<think>The user is Bob; be brief.</think>\n\nHello Bob."


@pytest.fixture
def hf_tokenizer(tiny_models):
    """The tiny model's tokenizer, for the stub to answer in its tokens (the thinking's tokens are counted)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models["model"]))


def test_chat_answers_carry_their_thinking_apart(make_gateway, registry, stub, tokenizer, hf_tokenizer):
    client = make_gateway(reasoning_format="think", max_prompt_tokens=450).openai(registry.tenant("acme"))
    messages = [{"role": "user", "content": "I am Bob."}]
    stub.reply, stub.tokenizer = THOUGHT, hf_tokenizer
    ids = hf_tokenizer.encode(THOUGHT, add_special_tokens=False)
    thinking = next(n for n in range(len(ids) + 1) if "</think>" in hf_tokenizer.decode(ids[:n]))
    answer = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50)
    message = answer.choices[0].message
    assert (message.reasoning, message.content) == ("The user is Bob; be brief.", "\n\nHello Bob.")
    assert answer.usage.completion_tokens_details.reasoning_tokens == thinking < answer.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=BASE, messages=messages, max_tokens=50, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert not any(getattr(d, "reasoning", None) and d.content for d in deltas)  # (the tag splits them, in order)

    stub.tokenizer = None  # (from here in 4-character pieces again)
    stub.reply = '<think>Weather: ask the tool.</think><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
    stub.reply += "</tool_call>"
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    out = client.chat.completions.create(model=BASE, messages=messages, max_tokens=80, tools=tools).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.reasoning == "Weather: ask the tool."
    assert json.loads(out.message.tool_calls[0].function.arguments) == {"city": "Oslo"} and not out.message.content
    stream = client.chat.completions.create(model=BASE, messages=messages, max_tokens=80, tools=tools, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Weather: ask the tool."
    assert "".join(t.function.arguments for d in deltas for t in d.tool_calls or []) == '{"city": "Oslo"}'

    stub.reply = "No thinking."  # (an answer that does not open with <think> is all content)
    plain = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50).choices[0].message
    assert (plain.reasoning, plain.content) == (None, "No thinking.")
    assert client.chat.completions.create(model=BASE, messages=messages, max_tokens=50).usage.completion_tokens_details
    assert plain_usage(client, messages) == 0
    answered = {"role": "assistant", "content": "Hello Bob.", "reasoning": "x"}
    later = [*messages, answered, {"role": "user", "content": "?"}]
    client.chat.completions.create(model=BASE, messages=later, max_tokens=5)
    assert "assistant: Hello Bob.\nuser: ?" in tokenizer.decode(stub.received[-1][1].prompt_token_ids)


def test_templates_that_open_the_thinking(make_gateway, registry, stub, tokenizer):
    """chat_template_kwargs reach the chat template (here enable_thinking, which opens the answer with <think>, as
    DeepSeek-R1's template does): the answer thinks until </think> without opening it; the template's own arguments
    cannot be set that way."""
    gateway, key = make_gateway(reasoning_format="think", responses_store_ttl_s=60), registry.tenant("acme")
    client = gateway.openai(key)
    stub.reply = "Short question.</think>Hi."
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "hi"}]
    message = client.chat.completions.create(model=BASE, messages=messages, max_tokens=20, extra_body=think)
    assert tokenizer.decode(stub.received[-1][1].prompt_token_ids) == "user: hi\nassistant:<think>"
    assert (message.choices[0].message.reasoning, message.choices[0].message.content) == ("Short question.", "Hi.")
    answer = client.responses.create(model=BASE, input="hi", max_output_tokens=20, extra_body=think)
    assert [i.type for i in answer.output] == ["reasoning", "message"] and answer.output_text == "Hi."
    counted = gateway.http(key).post("/tokenize", json={"model": BASE, "messages": messages, **think})
    assert counted.json()["tokens"] == stub.received[-1][1].prompt_token_ids
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            client.chat.completions.create(
                model=BASE, messages=messages, max_tokens=2, extra_body={"chat_template_kwargs": bad}
            )


def test_reasoning_effort_reaches_the_template(make_gateway, registry, stub, tokenizer):
    """reasoning_effort (chat) and reasoning.effort (Responses) go to the chat template as vLLM gives them: the effort,
    and enable_thinking unless the effort is none (here the tiny template opens the thinking under it); a
    chat_template_kwargs' own enable_thinking wins."""
    client = make_gateway(reasoning_format="think", responses_store_ttl_s=60).openai(registry.tenant("acme"))
    messages = [{"role": "user", "content": "hi"}]
    stub.reply = "Short.</think>Hi."

    def prompt() -> str:
        return tokenizer.decode(stub.received[-1][1].prompt_token_ids)

    answer = client.chat.completions.create(model=BASE, messages=messages, max_tokens=20, reasoning_effort="high")
    assert prompt().endswith("assistant:<think>") and answer.choices[0].message.reasoning == "Short."
    client.chat.completions.create(model=BASE, messages=messages, max_tokens=20, reasoning_effort="none")
    assert prompt().endswith("assistant:")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    client.chat.completions.create(model=BASE, messages=messages, max_tokens=20, reasoning_effort="low", extra_body=off)
    assert prompt().endswith("assistant:")
    response = client.responses.create(model=BASE, input="hi", max_output_tokens=20, reasoning={"effort": "medium"})
    assert prompt().endswith("assistant:<think>") and response.reasoning.effort == "medium"
    assert [i.type for i in response.output] == ["reasoning", "message"]
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.responses.create(model=BASE, input="hi", reasoning={"effort": "enormous"})


def test_responses_put_the_thinking_in_a_reasoning_item(make_gateway, registry, stub, tokenizer, hf_tokenizer):
    client = make_gateway(reasoning_format="think", responses_store_ttl_s=60).openai(registry.tenant("acme"))
    stub.reply, stub.tokenizer = THOUGHT, hf_tokenizer
    whole = client.responses.create(model=BASE, input="I am Bob.", max_output_tokens=50)
    reasoning, message = whole.output
    assert message.type == "message" and reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == "The user is Bob; be brief." and whole.output_text == "\n\nHello Bob."
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=BASE, input="I am Bob.", max_output_tokens=50) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert [(i.type, i.status) for i in streamed.output] == [("reasoning", "completed"), ("message", "completed")]
    assert streamed.output[0].content[0].text == reasoning.content[0].text and streamed.output_text == whole.output_text
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning.content[0].text
    assert streamed.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning.content[0].text and done.item_id == streamed.output[0].id

    stub.reply = "Yes."  # (a later turn: the earlier thinking is left out of the prompt, from the store or the input)
    client.responses.create(model=BASE, previous_response_id=whole.id, input="Sure?", max_output_tokens=5)
    assert "assistant: \n\nHello Bob.\nuser: Sure?" in tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    again = [{"role": "user", "content": "I am Bob."}, *[i.model_dump() for i in whole.output]]
    client.responses.create(model=BASE, input=[*again, {"role": "user", "content": "Sure?"}], max_output_tokens=5)
    prompt = tokenizer.decode(stub.received[-1][1].prompt_token_ids)
    assert "assistant: \n\nHello Bob.\nuser: Sure?" in prompt and "be brief" not in prompt


def plain_usage(client, messages) -> int:
    """The reasoning tokens counted in an answer that did not think."""
    answer = client.chat.completions.create(model=BASE, messages=messages, max_tokens=50)
    return answer.usage.completion_tokens_details.reasoning_tokens
