"""No replica to take a request: the gateway answers 503 with Retry-After within `engine_unresponsive_s`, not when a
new replica is up; an engine that shows life (a long non-streaming answer, a busy replica) is waited for."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from preft.common.loopback import LOOPBACK, free_port
from preft.gateway.testing import StubEngine, ThreadedServer, create_stub_engine

from .conftest import BASE, error_of

DEADLINE_S = 2.0  # (engine_unresponsive_s's default)
MARGIN_S = 0.5


@pytest.fixture
def silent_engine() -> Iterator[str]:
    """An engine address that accepts connections (the kernel completes them into the backlog) and reads requests, but
    never answers a byte: Serve's proxy queueing requests for a replica that is gone."""
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(256)
        yield f"http://{LOOPBACK}:{listener.getsockname()[1]}"


@pytest.fixture
def refusing_engine() -> str:
    """An engine address where nothing listens: connections are refused."""
    return f"http://{LOOPBACK}:{free_port()}"


def _post(gateway, key: str, stream: bool):
    body = {"model": BASE, "prompt": "hello", "max_tokens": 4, "stream": stream}
    started = time.monotonic()
    with gateway.http(key) as http:
        answer = http.post("/v1/completions", json=body, timeout=DEADLINE_S * 5)
    return answer, time.monotonic() - started


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("engine_kind", ["silent_engine", "refusing_engine"])
def test_no_replica_answers_503_within_the_deadline(engine_kind, stream, request, make_gateway, registry):
    gateway = make_gateway(engine_url=request.getfixturevalue(engine_kind))
    key = registry.tenant("acme")
    for _ in range(2):  # (the second also: nothing learnt from the first keeps it waiting)
        answer, took_s = _post(gateway, key, stream)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        code = "engine_unresponsive" if engine_kind == "silent_engine" else "unavailable"
        assert error_of(answer)["code"] == code
        assert took_s < DEADLINE_S + MARGIN_S, took_s


def test_a_long_answer_from_a_live_engine_is_not_cut(make_gateway, registry):
    """A non-streaming answer's headers come with its last token, after the deadline: the engine's health check
    answers, so the request waits on (as one queued behind a busy replica would)."""
    stub = StubEngine(token_delay_s=0.5)  # (4 tokens: the whole answer, and its headers, after 2 s)
    with ThreadedServer(create_stub_engine(stub)) as engine:
        gateway = make_gateway(engine_url=engine.url, engine_unresponsive_s=1.0)
        key = registry.tenant("acme")
        for stream in (False, True):
            answer, took_s = _post(gateway, key, stream)
            assert answer.status_code == 200, answer.text
            assert took_s >= 2.0


def test_an_engine_that_answers_nothing_sheds_requests_but_a_lost_replicas_retry_waits(make_gateway, registry):
    """No answer and no health check answer within the deadline: 503, even where the engine would answer later (a
    replica too saturated to answer anything sheds load). A request whose replica died under it (the proxy's bare
    500) was accepted: its retry waits for the replacement, as before."""
    stub = StubEngine(token_delay_s=0.5, health_delay_s=60)  # (4 tokens: the answer after 2 s)
    with ThreadedServer(create_stub_engine(stub)) as engine:
        gateway = make_gateway(engine_url=engine.url, engine_unresponsive_s=0.5)
        key = registry.tenant("acme")
        answer, took_s = _post(gateway, key, False)
        assert answer.status_code == 503, answer.text
        assert error_of(answer)["code"] == "engine_unresponsive"
        assert took_s < 0.5 + MARGIN_S

        stub.fail_next(replica_lost=True)
        answer, took_s = _post(gateway, key, False)
        assert answer.status_code == 200, answer.text
        assert took_s >= 2.0
