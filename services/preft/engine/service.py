"""One engine replica's request path, apart from Ray and HTTP: admission, adapter paging, generation, draining.

The Ray Serve deployment (`serve_app`) builds one of these per replica and puts an HTTP app (`http`) in front of it;
tests build it with a test engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from preft.common import metrics
from preft.common.engine_contract import EngineChunk, EngineRequest, EngineResponse
from preft.common.errors import Unavailable
from preft.engine.paging.hot import HotSource
from preft.engine.paging.pager import Pager
from preft.engine.protocol import Engine
from preft.engine.residency import ResidencyPublisher

logger = logging.getLogger(__name__)


class EngineService:
    """Owns a replica's engine, pager and residency publisher, the count of requests in flight, and the drain.

    A request is admitted unless the replica is draining or its engine died (Unavailable: the gateway retries on
    another replica); its adapter is held in host memory for the request's whole duration. Its tenant id reaches the
    engine (a label of its metrics) only with `tenant_label`.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        pager: Pager,
        publisher: ResidencyPublisher | None = None,
        hot_source: HotSource | None = None,
        prefetch_adapters: int = 0,
        tenant_label: bool = False,
    ) -> None:
        self.engine, self.pager, self._publisher = engine, pager, publisher
        self._tenant_label = tenant_label
        self._hot_source, self._prefetch_adapters = hot_source, prefetch_adapters
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._dead: str | None = None
        self.start_seconds: float | None = None  # engine start, for operators and benchmarks

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine and the pager, begin publishing residency, then prefetch hot adapters (best effort)."""
        started = time.perf_counter()
        await self.engine.start()
        self.start_seconds = time.perf_counter() - started
        await self.pager.start()
        if self._publisher is not None:
            self._publisher.start()
        if self._hot_source is not None and self._prefetch_adapters > 0:
            specs = await self._hot_source.hot_specs(self._prefetch_adapters)
            loaded = await self.pager.prefetch(specs)
            logger.info("prefetched %d of %d hot adapters", len(loaded), len(specs))
            self._residency_changed()
        logger.info("engine replica ready (engine start %.1f s)", self.start_seconds)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (503), let those in flight finish for up to `timeout_s`, then stop everything.

        Returns True when every request finished in time (the rest fail when the engine stops).
        """
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            drained = True
        except TimeoutError:
            drained = False
            logger.warning("drain: %d requests still running after %.1f s; stopping anyway", self._in_flight, timeout_s)
        if self._publisher is not None:
            await self._publisher.stop()
        await self.pager.close()
        await self.engine.shutdown()
        return drained

    async def check_health(self) -> None:
        """Raise Unavailable when the engine can no longer serve (Ray Serve then replaces the replica)."""
        try:
            await self.engine.check_health()
        except Exception as e:
            self._dead = str(e)
            raise Unavailable(f"engine unhealthy: {e}") from e

    # -- requests --------------------------------------------------------------------------------------------------

    def _admit(self) -> None:
        if self._draining:
            raise Unavailable("this replica is shutting down; retry on another")
        if self._dead is not None:
            raise Unavailable(f"this replica's engine failed ({self._dead}); retry on another")
        self._in_flight += 1
        self._idle.clear()
        metrics.QUEUE_DEPTH.labels("engine").inc()

    def _release(self) -> None:
        self._in_flight -= 1
        metrics.QUEUE_DEPTH.labels("engine").dec()
        if self._in_flight == 0:
            self._idle.set()

    def _residency_changed(self) -> None:
        if self._publisher is not None:
            self._publisher.changed()

    async def _run(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self._admit()
        try:
            if request.adapter is None:
                async with contextlib.aclosing(self.engine.generate(request, None)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            was_resident = self.pager.holds(request.adapter.digest)
            async with self.pager.use(request.adapter) as adapter_dir:
                if not was_resident:
                    self._residency_changed()
                async with contextlib.aclosing(self.engine.generate(request, adapter_dir)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        finally:
            self._release()

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Start the request and return its chunks. Everything that can fail before the first chunk (admission,
        adapter paging, validation) raises here, so it can still become an HTTP status; closing the returned
        iterator early aborts the request."""
        if request.tenant and not self._tenant_label:  # (the tenant id is a metrics label only; see ReplicaSettings)
            request = request.model_copy(update={"tenant": ""})
        chunks = self._run(request)
        try:
            first = await anext(chunks)
        except BaseException:
            await chunks.aclose()
            raise
        return _prepend(first, chunks)

    async def complete(self, request: EngineRequest) -> EngineResponse:
        """Run the request to the end and return its whole output."""
        text, token_ids, logprobs, prompt_logprobs, last = [], [], [], [], None
        async with contextlib.aclosing(await self.stream(request)) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
                token_ids += chunk.token_ids
                logprobs += chunk.logprobs or []
                prompt_logprobs += chunk.prompt_logprobs or []
                last = chunk
        if last is None or last.finish_reason is None or last.usage is None:
            raise Unavailable("the engine ended the request without a final chunk")
        return EngineResponse(
            text="".join(text),
            token_ids=token_ids,
            logprobs=logprobs if request.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs if request.prompt_logprobs is not None else None,
            finish_reason=last.finish_reason,
            usage=last.usage,
        )


async def _prepend(first: EngineChunk, rest: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
    async with contextlib.aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk
