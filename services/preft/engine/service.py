"""One engine replica's request path, apart from Ray and HTTP: admission, adapter paging, generation, draining.

The Ray Serve deployment (`serve_app`) builds one of these per replica and puts an HTTP app (`http`) in front of it;
tests build it with a test engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

from preft.adapters.formats import WEIGHTS
from preft.common import metrics
from preft.common.engine_contract import AdapterSpec, EngineChunk, EngineRequest, EngineResponse
from preft.common.errors import InvalidArgument, NotFound, PreftError, Unavailable
from preft.common.refs import AdapterRef
from preft.engine.live import LiveAdapter, LiveAdapters
from preft.engine.paging.hot import HotSource
from preft.engine.paging.pager import Pager
from preft.engine.protocol import Engine
from preft.engine.residency import ResidencyPublisher
from preft.engine.updates import AdapterUpdate

logger = logging.getLogger(__name__)


class EngineService:
    """Owns a replica's engine, pager and residency publisher, the count of requests in flight, and the drain.

    A request is admitted unless the replica is draining or its engine died (Unavailable: the gateway retries on
    another replica); its adapter is held in host memory for the request's whole duration. Its tenant id reaches the
    engine (a label of its metrics) only with `tenant_label`.

    Adapter weights can be updated in place for the adapter's owner (`update_adapter_weights`, `restore_adapter`):
    a live adapter (`preft.engine.live`) is pinned in host memory until its published weights are restored.
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
        max_live_adapters: int = 2,
    ) -> None:
        self.engine, self.pager, self._publisher = engine, pager, publisher
        self.live = LiveAdapters(max_live=max_live_adapters)
        self._users: Counter[tuple[str, str | None]] = Counter()  # requests in flight by (digest, adapter owner)
        self._update_lock = asyncio.Lock()  # one update at a time: the engine applies them one by one anyway
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

    def _check_serving(self) -> None:
        if self._draining:
            raise Unavailable("this replica is shutting down; retry on another")
        if self._dead is not None:
            raise Unavailable(f"this replica's engine failed ({self._dead}); retry on another")

    def _admit(self) -> None:
        self._check_serving()
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
            user = (request.adapter.digest, _owner(request.adapter))
            self.live.check_request(*user)
            was_resident = self.pager.holds(request.adapter.digest)
            self._users[user] += 1
            try:
                async with self.pager.use(request.adapter) as adapter_dir:
                    if not was_resident:
                        self._residency_changed()
                    async with contextlib.aclosing(self.engine.generate(request, adapter_dir)) as chunks:
                        async for chunk in chunks:
                            yield chunk
            finally:
                self._users[user] -= 1
                if not self._users[user]:
                    del self._users[user]
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

    # -- in-place adapter updates ------------------------------------------------------------------------------------

    async def update_adapter_weights(self, digest: str, tensors: Mapping[str, Any], *, owner: str) -> LiveAdapter:
        """Replace tensors of an adapter resident here, for its owner (a tenant id); see
        `preft.engine.async_engine.AsyncPreftEngine.update_adapter_weights` for the tensors and when they serve.

        NotFound if the adapter is not resident, PermissionDenied / FailedPrecondition / ResourceExhausted as
        `LiveAdapters.check_update` decides, InvalidArgument for weights that do not fit: the served weights are then
        unchanged. Once the engine has the tensors, the update completes even if the caller goes away.
        """
        return await asyncio.shield(self._locked(self._update, digest, tensors, owner))

    async def restore_adapter(self, digest: str, *, owner: str) -> AdapterUpdate:
        """Write an updated adapter's published weights (its blob, on disk) back in place, under a new version; it
        is no longer live, and may be evicted again. NotFound if it is not live here, PermissionDenied if not the
        owner's."""
        return await asyncio.shield(self._locked(self._restore, digest, owner))

    async def _locked(self, work: Any, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            async with self._update_lock:
                self._check_serving()
                result = await work(*args)
        except BaseException as e:
            outcome = e.grpc_code.lower() if isinstance(e, PreftError) else "internal"
            metrics.ADAPTER_WEIGHT_UPDATES.labels(outcome).inc()
            raise
        metrics.ADAPTER_WEIGHT_UPDATES.labels("ok").inc()
        metrics.ADAPTER_WEIGHT_UPDATE_SECONDS.observe(time.perf_counter() - started)
        metrics.LIVE_ADAPTERS.set(len(self.live))
        return result

    async def _update(self, digest: str, tensors: Mapping[str, Any], owner: str) -> LiveAdapter:
        if not self.pager.holds(digest):
            raise NotFound(f"adapter {digest[:12]} is not resident on this replica")
        others = sum(n for (d, o), n in self._users.items() if d == digest and o != owner)
        self.live.check_update(digest, owner, other_users=others)
        first = digest not in self.live
        if first:
            self.pager.pin(digest)  # (before the engine has live weights: never evicted with them)
        try:
            update = await self.engine.update_adapter_weights(digest, tensors)
        except BaseException:
            if first:
                self.pager.unpin(digest)
            raise
        logger.info("adapter %s updated in place to version %d in %.3f s", digest[:12], update.version, update.seconds)
        return self.live.record(digest, owner, update.version)

    async def _restore(self, digest: str, owner: str) -> AdapterUpdate:
        from safetensors.torch import load_file

        self.live.check_restore(digest, owner)
        try:
            tensors = await asyncio.to_thread(load_file, str(self.pager.path(digest) / WEIGHTS))
        except OSError as e:
            raise Unavailable(f"adapter {digest[:12]}: its published weights cannot be read: {e}") from e
        update = await self.engine.update_adapter_weights(digest, tensors)
        self.live.forget(digest)
        self.pager.unpin(digest)
        logger.info("adapter %s restored to its published weights (version %d)", digest[:12], update.version)
        return update


def _owner(spec: AdapterSpec) -> str | None:
    """The tenant whose adapter the spec is (its registry reference names it)."""
    try:
        return AdapterRef.parse(spec.ref).owner
    except InvalidArgument:
        return None


async def _prepend(first: EngineChunk, rest: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
    async with contextlib.aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk
