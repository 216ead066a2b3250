"""Numbers at the edges of their types, and values of the wrong type, in completions, chat and Responses bodies
(property-based, bounded): the gateway answers each with a success or a 4xx in OpenAI's shape, never a 5xx, and
passes the engine only numbers in the engine's range (vLLM sends a request to its engine core as msgpack, which
refuses ints outside int64/uint64; its seeds are int64, -1 meaning none): out of range is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preft.common.engine_contract import EngineRequest

from .conftest import BASE, error_of

INT64 = (-(2**63), 2**63 - 1)
MAX_SEED = 2**63 - 1
EDGES = [
    0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**63) - 1,
    -(2**64),
]  # fmt: skip
NUMBERS = st.one_of(
    st.sampled_from(EDGES),
    st.integers(),
    st.floats(),  # (NaN and ±Infinity included: Python's JSON writes and reads them)
    st.sampled_from([None, True, False, "", "1", "1e400", [], [1], {}, {"a": 1}]),
)
USER_HI = [{"role": "user", "content": "hi"}]
SAMPLING = (
    "max_tokens", "temperature", "top_p", "seed", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "top_k", "min_p", "min_tokens", "truncate_prompt_tokens",
)  # fmt: skip
ROUTES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {  # a valid body, and the numeric fields to vary in it
    "/v1/completions": ({"model": BASE, "prompt": "hi", "max_tokens": 2}, (*SAMPLING, "logprobs", "best_of")),
    "/v1/chat/completions": (
        {"model": BASE, "messages": USER_HI, "max_tokens": 2},
        (*SAMPLING, "max_completion_tokens", "top_logprobs"),
    ),
    "/v1/responses": (
        {"model": BASE, "input": "hi", "max_output_tokens": 2, "store": False},
        ("max_output_tokens", "temperature", "top_p", "top_logprobs", "seed", "top_k", "min_tokens"),
    ),
}


def _bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """The route's valid body with one to three of its numeric fields (a token id list, a logit bias) set to odd
    values (few at once, so that one odd value is not always hidden behind another's 400)."""
    base, fields = ROUTES[path]
    values = {f: NUMBERS for f in fields} | {
        "stop_token_ids": st.lists(NUMBERS, max_size=2),
        "logit_bias": st.dictionaries(st.sampled_from(["5", "-1", str(2**64)]), NUMBERS, max_size=2),
    }
    chosen = st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=True)
    odd = chosen.flatmap(lambda names: st.fixed_dictionaries({n: values[n] for n in names}))
    return odd.map(lambda fields: base | fields)


def _out_of_range(value: Any, at: str = "") -> list[str]:
    """Where a request as the engine got it holds an int outside int64."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _out_of_range(k, at) + _out_of_range(v, f"{at}.{k}")]
    if isinstance(value, list):
        return [p for v in value for p in _out_of_range(v, at)]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        return [f"{at} = {value}"]
    return []


def _engine_takes(req: EngineRequest) -> list[str]:
    bad = _out_of_range(req.model_dump())
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        bad.append(f"seed = {req.seed}")
    return bad


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_numbers_at_the_edges_get_an_answer_or_a_400_and_reach_the_engine_in_range(make_gateway, registry, stub, path):
    http = make_gateway(responses_store_ttl_s=60).http(registry.tenant("acme", rpm=10**6, tpm=10**9))
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(body=_bodies(path))
    def answered(body: dict[str, Any]) -> None:
        seen = len(stub.received)
        answer = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        assert answer.status_code < 500, (body, answer.text)
        if answer.status_code >= 400:
            error_of(answer)
        bad = [b for _, req in stub.received[seen:] for b in _engine_takes(req)]
        assert not bad, (body, bad)

    answered()
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # (both kinds were met)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 2**64), ("seed", 2**70), ("seed", -(2**63) - 1), ("seed", -1), ("seed", 2**63), ("top_k", 2**64)],
)
def test_a_number_out_of_the_engines_range_is_a_400_naming_it(gateway, registry, stub, path, field, value):
    body = ROUTES[path][0] | {field: value}
    answer = gateway.http(registry.tenant("acme")).post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert error_of(answer)["message"].startswith(f"invalid request: {field}: "), answer.text
    assert not stub.received


def test_the_largest_seed_is_taken_and_each_samples_seed_wraps_into_range(gateway, registry, stub):
    http = gateway.http(registry.tenant("acme"))
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2, "n": 2, "seed": MAX_SEED}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert sorted(req.seed for _, req in stub.received) == [0, MAX_SEED]
