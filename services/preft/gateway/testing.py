"""Test doubles for the gateway: a stub engine that speaks `preft.common.engine_contract`, and uvicorn in a thread.

Used by tests/integration/gateway and loadtest/bench_gateway.py; not part of a deployment. The stub has no
model: it answers `max_tokens` deterministic fake tokens (` w<id>` each; asked for logprobs, token i's is -(i+1)/8,
less seed/64 where seeded, its top alternatives the next ids, each 1 lower; prompt token i + 1's likewise, unseeded,
asked for prompt logprobs), optionally `token_delay_s` apart (or a scripted `reply`), records what it received (and
how many requests of each priority it answered at once), and can be told to fail its next requests with a given
status (before any byte) or to break a stream after some chunks. It refuses requests whose multiplexing header does
not match the adapter's digest, and (401) requests without its token, so tests catch a gateway that routes wrongly or
does not authenticate itself as the real engine requires. Serve it with
`uvicorn --factory preft.gateway.testing:create_stub_engine`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from preft.common.engine_contract import (
    AUTH_HEADER,
    BASE_MODEL_ID,
    MULTIPLEX_HEADER,
    EngineChunk,
    EngineError,
    EngineRequest,
    EngineResponse,
    FinishReason,
    TokenLogprob,
    TopLogprob,
    Usage,
    bearer,
)
from preft.common.loopback import LOOPBACK, free_port, wait_until

REPLY_PIECE = 4  # characters of a scripted reply per token
STUB_ENGINE_TOKEN = "stub-engine-token"  # the stub's token unless told another (the gateway's engine_token)
GATE_WAIT_S = 30.0  # the longest a gated failure waits for its test (a test that never opens it still ends)


@dataclass
class Failure:
    """How the next request(s) fail: an HTTP status before any byte; or, for streams, after `after_chunks`
    chunks, a dropped connection (status None) or an EngineError line of that status (as the engine does).
    `replica_lost`: a bare 500 "Internal Server Error", as Ray Serve's proxy answers when the replica died.
    `gate`: where set, a stream breaks only once it is set (a test sets it when its client holds the chunks before the
    break: a connection dropped while they were still unread would discard them, as aiohttp does with unread data)."""

    status: int | None = 503
    times: int = 1
    after_chunks: int | None = None
    replica_lost: bool = False
    gate: threading.Event | None = None


@dataclass
class StubEngine:
    """Owns the stub's behaviour (delay, failures) and what it has received: (multiplexed model id, request)."""

    token_delay_s: float = 0.0
    health_delay_s: float = 0.0  # before GET /healthz answers (long: a replica too busy to answer it)
    vocab_size: int = 384
    record: bool = True
    token: str = STUB_ENGINE_TOKEN  # required on /generate, as the real engine requires its api_token
    reply: str | None = None  # answer this text (in REPLY_PIECE-character tokens, then "stop"), not ` w<id>` tokens
    # where set (a Hugging Face tokenizer), `reply` comes as its tokens instead: their ids, each one's text the piece
    # it adds, as a real engine's would
    tokenizer: Any = None
    received: list[tuple[str, EngineRequest]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    # requests being answered now, and the most at once, by priority (live 0, offline 1)
    in_flight: Counter[int] = field(default_factory=Counter)
    most_in_flight: Counter[int] = field(default_factory=Counter)

    async def healthz(self, request: Request) -> Response:
        await asyncio.sleep(self.health_delay_s)
        return JSONResponse({"status": "ok"})

    def fail_next(
        self,
        status: int | None = 503,
        times: int = 1,
        *,
        after_chunks: int | None = None,
        replica_lost: bool = False,
        gate: threading.Event | None = None,
    ) -> None:
        self.failures.append(Failure(status, times, after_chunks, replica_lost, gate))

    def _take_failure(self) -> Failure | None:
        if not self.failures:
            return None
        failure = self.failures[0]
        failure.times -= 1
        if failure.times <= 0:
            self.failures.pop(0)
        return failure

    def tokens(self, req: EngineRequest) -> list[int]:
        start = (sum(req.prompt_token_ids) + (req.seed or 0)) % self.vocab_size
        n = req.max_tokens if self.reply is None else min(req.max_tokens, len(self._reply_pieces()))
        if self.reply is not None and self.tokenizer is not None:
            return self.tokenizer.encode(self.reply, add_special_tokens=False)[:n]
        return [(start + 7 * i) % self.vocab_size for i in range(n)]

    def texts(self, ids: list[int]) -> list[str]:
        """Each token's text: ` w<id>`, or the next piece of `reply`."""
        return self._reply_pieces()[: len(ids)] if self.reply is not None else [_text([t]) for t in ids]

    def finish_reason(self, req: EngineRequest) -> FinishReason:
        return "stop" if self.reply is not None and len(self._reply_pieces()) <= req.max_tokens else "length"

    def _reply_pieces(self) -> list[str]:
        reply = self.reply or ""
        if self.tokenizer is None:
            return [reply[i : i + REPLY_PIECE] for i in range(0, len(reply), REPLY_PIECE)]
        ids, pieces, before = self.tokenizer.encode(reply, add_special_tokens=False), [], ""
        for n in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n])
            pieces.append(text[len(before) :])
            before = text
        return pieces

    def logprobs(self, req: EngineRequest, ids: list[int]) -> list[TokenLogprob] | None:
        """The fake logprobs of `ids` (None where the request asked for none)."""
        return None if req.logprobs is None else self._fake_logprobs(ids, req.logprobs, (req.seed or 0) / 64)

    def prompt_logprobs(self, req: EngineRequest) -> list[TokenLogprob] | None:
        """The fake logprobs of the prompt's tokens but the first (None where the request asked for none)."""
        if req.prompt_logprobs is None:
            return None
        return self._fake_logprobs(req.prompt_token_ids[1:], req.prompt_logprobs, 0.0)

    def _fake_logprobs(self, ids: list[int], k: int, lower: float) -> list[TokenLogprob]:
        out = []
        for i, t in enumerate(ids):
            top_ids = [(t + j) % self.vocab_size for j in range(k)]
            logprob = -(i + 1) / 8 - lower
            top = [TopLogprob(token_id=u, token=_text([u]), logprob=logprob - j) for j, u in enumerate(top_ids)]
            out.append(TokenLogprob(token_id=t, token=_text([t]), logprob=logprob, top=top))
        return out

    async def generate(self, request: Request) -> Response:
        if request.headers.get(AUTH_HEADER) != bearer(self.token):  # (a test double: no constant-time compare)
            return _error(401, "unauthenticated", "missing or wrong engine token")
        try:
            req = EngineRequest.model_validate_json(await request.body())
        except ValidationError as e:
            return _error(400, "invalid_request", f"bad request: {e.error_count()} errors")
        model_id = request.headers.get(MULTIPLEX_HEADER, "")
        expected = req.adapter.digest if req.adapter else BASE_MODEL_ID
        if model_id != expected:
            return _error(400, "invalid_request", f"{MULTIPLEX_HEADER} {model_id!r} does not match {expected!r}")
        if self.record:
            self.received.append((model_id, req))
        failure = self._take_failure()
        if failure is not None and failure.replica_lost:
            return PlainTextResponse("Internal Server Error", status_code=500)
        if failure is not None and failure.after_chunks is None:
            status = failure.status or 503
            return _error(status, _KINDS.get(status, "internal"), "injected failure")
        ids = self.tokens(req)
        if not req.stream:
            with self._answering(req):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s * len(ids))
            usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(ids))
            logprobs = self.logprobs(req, ids)
            out = EngineResponse(
                text="".join(self.texts(ids)),
                token_ids=ids,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs(req),
                finish_reason=self.finish_reason(req),
                usage=usage,
            )
            return Response(out.model_dump_json(), media_type="application/json")
        return StreamingResponse(self._stream(req, ids, failure), media_type="application/x-ndjson")

    @contextmanager
    def _answering(self, req: EngineRequest):
        self.in_flight[req.priority] += 1
        self.most_in_flight[req.priority] = max(self.most_in_flight[req.priority], self.in_flight[req.priority])
        try:
            yield
        finally:
            self.in_flight[req.priority] -= 1

    async def _stream(self, req: EngineRequest, ids: list[int], failure: Failure | None):
        with self._answering(req):
            async for piece in self._pieces(req, ids, failure):
                yield piece

    async def _pieces(self, req: EngineRequest, ids: list[int], failure: Failure | None):
        logprobs, texts = self.logprobs(req, ids), self.texts(ids)
        for i, t in enumerate(ids):
            if failure is not None and i >= (failure.after_chunks or 0):
                if failure.gate is not None:
                    await asyncio.to_thread(failure.gate.wait, GATE_WAIT_S)
                if failure.status is None:
                    raise ConnectionAbortedError("injected stream failure")  # uvicorn drops the connection
                kind = _KINDS.get(failure.status, "internal")
                yield EngineError(type=kind, message="injected failure").model_dump_json().encode() + b"\n"  # type: ignore[arg-type]
                return
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            chunk = EngineChunk(text=texts[i], token_ids=[t], logprobs=None if logprobs is None else [logprobs[i]])
            if i == 0:
                chunk.prompt_logprobs = self.prompt_logprobs(req)
            yield chunk.model_dump_json().encode() + b"\n"
        usage = Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(ids))
        yield EngineChunk(finish_reason=self.finish_reason(req), usage=usage).model_dump_json().encode() + b"\n"


_KINDS = {400: "invalid_request", 503: "unavailable", 500: "internal"}


def _text(ids: list[int]) -> str:
    return "".join(f" w{t}" for t in ids)


def _error(status: int, kind: str, message: str) -> Response:
    return JSONResponse(EngineError(type=kind, message=message).model_dump(), status_code=status)  # type: ignore[arg-type]


def create_stub_engine(stub: StubEngine | None = None) -> Starlette:
    """The stub as an ASGI app (POST /generate, GET /healthz); `app.state.stub` is its StubEngine."""
    stub = stub or StubEngine(record=False)
    routes = [Route("/generate", stub.generate, methods=["POST"]), Route("/healthz", stub.healthz, methods=["GET"])]
    app = Starlette(routes=routes)
    app.state.stub = stub
    return app


class ThreadedServer:
    """Owns a uvicorn server for an ASGI app on 127.0.0.1, run in a daemon thread with its own event loop."""

    def __init__(self, app: object, port: int | None = None) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(
            app,  # type: ignore[arg-type]
            host=LOOPBACK,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ThreadedServer:
        self._thread.start()
        wait_until(
            lambda: self.server.started,
            timeout_s=timeout_s,
            what=f"uvicorn on port {self.port}",
            abort=lambda: None if self._thread.is_alive() else "the server thread exited (see the log above)",
        )
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
