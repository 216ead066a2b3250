"""The hop to the engine app (Ray Serve's HTTP proxy), speaking `preft.common.engine_contract`.

Each request carries the adapter's content digest (or "base") in the multiplexing header, so Ray Serve routes it
to a replica that already holds the adapter. A request is retried once, at once, when the engine could not be
reached (connect errors, a pooled connection the engine had closed), answered 503 (replica draining, queue
full, adapter not fetchable there) or answered a 500 outside the contract (Ray Serve's proxy answers a bare
"Internal Server Error" when the replica handling the request died), as long as no token has reached the
client: for a stream, until its first chunk has arrived (each retry is counted and logged with what failed).
A second failure is a 503 to the client, or a 500 after a second 500. Engine 400s become 400s with the
engine's message; other engine failures (an EngineError of type "internal") become a 500 that says the engine
failed, not retried. A stream that fails after its status was sent ends with an EngineError line, which
raises the same errors.

Fail fast where no replica takes the request: response headers not there within `unresponsive_s` (both tries
together) while the engine shows no life (``engine_health``) is a 503 (with Retry-After) at that deadline, not a
wait until Serve has started a new replica; where it shows life the request waits on (queued behind a busy replica,
or a long non-streaming generation, whose headers come with its last token), bounded by the read timeout. A request
whose replica died under it (the proxy's bare 500) was accepted: its retry waits for a replacement, as before.

The client is aiohttp, not httpx: posting to the engine stub (`testing`) on a 2-core machine, httpx 0.28 /
httpcore 1.0.9 went from ~1,000 requests/s with 1 request in flight to ~300 with 32, its CPU spent in the
connection pool's bookkeeping, while aiohttp went from ~2,500 to ~6,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import aiohttp
from pydantic import ValidationError

from preft.common.engine_contract import (
    AUTH_HEADER,
    MULTIPLEX_HEADER,
    EngineChunk,
    EngineError,
    EngineRequest,
    EngineResponse,
    bearer,
)
from preft.common.errors import InvalidArgument, PreftError, Unavailable
from preft.common.metrics import ENGINE_RETRIES
from preft.gateway.core.engine_health import HEALTH_PATH, EngineHealth

logger = logging.getLogger(__name__)

GENERATE_PATH = "/generate"
ERROR_STATUS = {"invalid_request": 400, "unavailable": 503, "internal": 500}  # EngineError.type -> its status
# Below the engine's (uvicorn's, Ray Serve's) 5 s keep-alive, so we rarely reuse a connection it is closing.
KEEPALIVE_S = 4.0
# Failures after which no token can have reached the client: nothing was sent, or the pooled connection was dead.
RETRYABLE_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError)


class EngineFailed(PreftError):
    """The engine answered with an internal error or something outside the contract."""


class EngineUnresponsive(Unavailable):
    """No response from the engine by the deadline, and no sign of life from it: no replica took the request."""


class EngineClient:
    """Owns the pooled HTTP connections to the engine app (opened lazily, in the running loop) and the retries."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 300.0,
        max_connections: int = 1024,
        unresponsive_s: float = 2.0,
    ) -> None:
        base = base_url.rstrip("/")
        self._url = base + GENERATE_PATH
        self._auth = bearer(token)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._max_connections = max_connections
        self._unresponsive_s = unresponsive_s
        self._session: aiohttp.ClientSession | None = None
        self.health = EngineHealth(base + HEALTH_PATH, self._open)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def aclose(self) -> None:
        await self.health.aclose()
        if self._session is not None:
            await self._session.close()

    def _deadline(self) -> float:
        """When a request without response headers is dropped, unless the engine shows life (loop time)."""
        return asyncio.get_running_loop().time() + self._unresponsive_s

    async def _post(self, req: EngineRequest, model_id: str, deadline_s: float | None) -> aiohttp.ClientResponse:
        """The engine's response (status, headers) to the request; EngineUnresponsive at `deadline_s` (None: no
        deadline) where none came and the engine shows no life."""
        posting = asyncio.ensure_future(
            self._open().post(
                self._url,
                data=req.model_dump_json(exclude_none=True).encode(),
                headers={MULTIPLEX_HEADER: model_id, AUTH_HEADER: self._auth, "content-type": "application/json"},
            )
        )
        try:
            if deadline_s is not None and not await self.health.worth_waiting(posting, deadline_s):
                raise EngineUnresponsive(
                    f"no engine replica answered within {self._unresponsive_s:g} s and the engine shows no sign of "
                    "life; retry later"
                )
            resp = await posting
        except BaseException:
            _abandon(posting)  # (closing its connection drops the request from the proxy's queue)
            raise
        if resp.status < 500:
            self.health.seen()
        return resp

    async def generate(self, req: EngineRequest, model_id: str) -> EngineResponse:
        """The whole output of a non-streaming request."""
        deadline_s = self._deadline()
        for attempt in (1, 2):
            try:
                async with await self._post(req, model_id, deadline_s) as resp:
                    status, body = resp.status, await resp.read()
            except RETRYABLE_ERRORS as e:
                if attempt == 1:
                    _retrying("connect", e)
                    continue
                raise Unavailable("the engine is unreachable; retry later") from e
            except (aiohttp.ClientError, TimeoutError) as e:
                raise _transport_error(e) from e
            if attempt == 1 and (reason := _retry_reason(status, body)):
                _retrying(reason, f"HTTP {status}")
                deadline_s = _after(reason, deadline_s)
                continue
            if status != 200:
                raise _error_from(status, body)
            try:
                return EngineResponse.model_validate_json(body)
            except ValidationError as e:
                raise EngineFailed("the engine's answer did not follow the contract") from e
        raise AssertionError("unreachable")

    async def stream(self, req: EngineRequest, model_id: str) -> EngineStream:
        """A stream whose first chunk has already arrived (so errors before any token raise here, not later).

        Iterate it to the end or `aclose()` it: closing early drops the connection, which tells the engine to
        stop generating. Failures while iterating raise Unavailable (or the error the engine reported).
        """
        deadline_s = self._deadline()
        for attempt in (1, 2):
            resp: aiohttp.ClientResponse | None = None
            try:
                resp = await self._post(req, model_id, deadline_s)
                if resp.status != 200:
                    body = await resp.read()
                    _drop(resp)
                    if attempt == 1 and (reason := _retry_reason(resp.status, body)):
                        _retrying(reason, f"HTTP {resp.status}")
                        deadline_s = _after(reason, deadline_s)
                        continue
                    raise _error_from(resp.status, body)
                first = await _next_chunk(resp)
            except EngineUnresponsive:
                raise  # (its deadline is spent: no retry)
            except Unavailable as e:
                _drop(resp)
                if attempt == 1:  # an error line before any chunk: nothing reached the client yet
                    _retrying("unavailable", e)
                    continue
                raise
            except RETRYABLE_ERRORS as e:
                _drop(resp)
                if attempt == 1:
                    _retrying("connect", e)
                    continue
                raise Unavailable("the engine is unreachable; retry later") from e
            except (aiohttp.ClientError, TimeoutError) as e:
                _drop(resp)
                raise _transport_error(e) from e
            except BaseException:
                _drop(resp)
                raise
            if first is None:
                _drop(resp)
                raise EngineFailed("the engine's stream ended without a chunk")
            return EngineStream(resp, first, self.health)
        raise AssertionError("unreachable")


class EngineStream:
    """An open engine stream: iterate its chunks; `aclose()` (idempotent) ends it early and frees the connection."""

    def __init__(self, resp: aiohttp.ClientResponse, first: EngineChunk, health: EngineHealth | None = None) -> None:
        self._resp: aiohttp.ClientResponse | None = resp
        self._first: EngineChunk | None = first
        self._health = health

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> EngineChunk:
        if self._first is not None:
            chunk, self._first = self._first, None
            return chunk
        if self._resp is None:
            raise StopAsyncIteration
        try:
            chunk = await _next_chunk(self._resp)
        except (aiohttp.ClientError, TimeoutError) as e:
            await self.aclose()
            raise Unavailable("the engine's stream broke off") from e
        except BaseException:
            await self.aclose()
            raise
        if chunk is None:
            await self.aclose()
            raise StopAsyncIteration
        if self._health is not None:
            self._health.seen()  # (a replica streaming is alive, whatever else it has queued)
        return chunk

    async def aclose(self) -> None:
        resp, self._resp = self._resp, None
        _drop(resp)


async def _next_chunk(resp: aiohttp.ClientResponse) -> EngineChunk | None:
    """The next chunk; an EngineError line (the engine failed after the status was sent) raises its error."""
    while line := await resp.content.readline():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if isinstance(data, dict) and "message" in data and "type" in data:
                raise _error_from(ERROR_STATUS.get(data["type"], 500), line)
            return EngineChunk.model_validate(data)
        except (ValueError, ValidationError) as e:
            raise EngineFailed("the engine's stream did not follow the contract") from e
    return None


def _drop(resp: aiohttp.ClientResponse | None) -> None:
    """Release a response: back to the pool when fully read, else its connection is closed (the engine sees the
    client gone). Synchronous, so it also runs in a task that is being cancelled."""
    if resp is not None:
        with contextlib.suppress(Exception):
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()


def _after(reason: str, deadline_s: float | None) -> float | None:
    """The deadline of a retry: none after the replica that had taken the request died (it was accepted: it waits for
    a replacement, as before, bounded by the read timeout), else the request's own."""
    return None if reason == "replica_lost" else deadline_s


def _abandon(posting: asyncio.Future) -> None:
    """Stop waiting for a request's response: cancel it, or close the response that came meanwhile."""
    if not posting.done():
        posting.cancel()
    elif not posting.cancelled() and posting.exception() is None:
        posting.result().close()


def _transport_error(e: BaseException) -> Unavailable:
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return Unavailable("the engine did not answer in time")
    return Unavailable("the connection to the engine broke")


def _retrying(reason: str, cause: object) -> None:
    """Count and log a retry (a flaky engine shows in the log with what failed, not only in the metric)."""
    ENGINE_RETRIES.labels(reason=reason).inc()
    logger.warning("engine request failed before any token (%s: %r); retrying once", reason, cause)


def _retry_reason(status: int, body: bytes) -> str | None:
    """Why an answer with no token in it is worth one more try: the metric's reason, or None."""
    if status == 503:
        return "unavailable"
    if status == 500 and _engine_error(body) is None:
        return "replica_lost"  # not our engine's error: the proxy's, for a replica that died (or Serve's own)
    return None


def _engine_error(body: bytes) -> EngineError | None:
    try:
        return EngineError.model_validate_json(body)
    except ValidationError:
        return None


def _error_from(status: int, body: bytes) -> PreftError:
    error = _engine_error(body)
    message = error.message if error is not None else ""
    if status == 400:
        return InvalidArgument(message or "the engine refused the request")
    if status == 503:
        return Unavailable(f"the engine is unavailable{': ' + message if message else ''}; retry later")
    if status == 401:  # (a deployment error, not the client's: it sees a 500)
        logger.error("the engine refused the gateway's token: PREFT_GATEWAY__ENGINE_TOKEN differs from the engine's")
    return EngineFailed(f"the engine failed (HTTP {status}); the error is in the engine's log")
