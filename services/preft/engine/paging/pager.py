"""The adapter pager of one replica: brings adapters through the tiers S3 → local disk → host memory (→ GPU slots).

Tiers, fastest first:
- GPU slots: vLLM's `max_loras`; vLLM (with the plugin) fills them per step. Not managed here.
- host memory: vLLM's CPU LoRA cache. This pager's LRU of `host_max_adapters` is authoritative: it calls the engine's
  `add_lora` / `remove_lora`, and vLLM's own cache is sized larger (by the adds and removals that may be on their
  way at once) so it never evicts on its own.
- local disk: `<disk_dir>/<digest>/`, bounded by bytes, LRU; an adapter is pinned there while it is in host memory
  (vLLM may re-read the path) or being loaded. Rebuilt from the directory at start, so it survives restarts.
- S3: the blob store, one sha256-checked blob per file; the directory's content digest must equal the spec's.

An adapter whose weights were updated in place (``EngineService.update_adapter_weights``) is pinned in host memory
until its published weights are restored: its blob on disk is untouched, and evicting it would page those back in.

Concurrent requests for the same cold adapter share one load (one task per digest); a failed load reaches every
waiter and is not remembered, so the next request tries again. The engine reads an adapter (`prepare_lora`) before
the pager takes its lock for `add_lora`: loads of several adapters overlap, and the engine's steps wait only for the
insertion. When S3 is unreachable only cold adapters fail
(Unavailable); resident ones keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Literal, Protocol

from preft.adapters import AdapterInfo
from preft.common import metrics
from preft.common.engine_contract import AdapterSpec
from preft.common.errors import InvalidArgument, NotFound, PreftError, Unavailable
from preft.engine.paging.disk import DiskStore
from preft.engine.paging.downloader import BlobSource, fetch_adapter
from preft.engine.paging.lru import CapacityError, LruPolicy

logger = logging.getLogger(__name__)

Tier = Literal["host", "disk"]
_MAX_ATTEMPTS = 3  # loads of one request's adapter before giving up (each can be evicted by others' loads)
ADDS_IN_FLIGHT = 8  # add_lora calls out at once (vLLM's host cache has room for them: vllm_engine's headroom)


class AdapterHost(Protocol):
    """What the pager needs of the engine: loading adapters into host memory and dropping them."""

    async def prepare_lora(self, adapter_dir: Path) -> None:
        """Read the adapter from disk ahead of `add_lora`, beside the engine's steps (best effort: a failed read
        surfaces at `add_lora`)."""
        ...

    async def add_lora(self, adapter_dir: Path) -> AdapterInfo:
        """Validate the adapter against the model (InvalidArgument) and load it into host memory."""
        ...

    async def remove_lora(self, digest: str) -> None:
        """Drop a loaded adapter from host memory."""
        ...


class Pager:
    """Owns which adapters this replica holds in host memory and on disk, and moving them between tiers."""

    def __init__(
        self,
        *,
        host: AdapterHost,
        blobs: BlobSource,
        disk_dir: Path,
        disk_max_bytes: int,
        host_max_adapters: int,
        download_timeout_s: float,
    ) -> None:
        self._engine = host
        self._blobs = blobs
        self._store = DiskStore(disk_dir)
        self._host: LruPolicy[str] = LruPolicy(max_entries=host_max_adapters)
        self._disk: LruPolicy[str] = LruPolicy(max_bytes=disk_max_bytes)
        self._download_timeout_s = download_timeout_s
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._removing: dict[str, asyncio.Task[None]] = {}  # removals sent to the engine, not yet answered
        self._policy_lock = asyncio.Lock()  # a load's admission and the evictions it decides, as one step
        # add_lora calls out at once: the engine core runs every call that arrived during a step before its next
        # step, so calls sent together wait for one step, not one step each
        self._adds = asyncio.Semaphore(ADDS_IN_FLIGHT)
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the disk tier's index from its directory (oldest use first); trim it if the limit shrank."""
        entries = await asyncio.to_thread(self._store.scan)
        retired = []
        for entry in entries:
            try:
                victims = self._disk.admit(entry.digest, entry.size_bytes)
            except CapacityError:  # bigger than the whole tier now
                retired.append(self._store.retire(entry.digest))
                continue
            retired += [self._store.retire(v) for v in victims]
        await asyncio.to_thread(lambda: [DiskStore.remove(p) for p in retired])
        self._started = True
        self._update_gauges()
        logger.info("disk tier: %d adapters, %d bytes in %s", len(self._disk), self._disk.total_bytes, self._store.root)

    async def close(self) -> None:
        """Cancel loads in progress (their waiters get CancelledError); let removals sent to the engine finish."""
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        await asyncio.gather(*self._removing.values(), return_exceptions=True)

    # -- serving ---------------------------------------------------------------------------------------------------

    async def ensure(self, spec: AdapterSpec) -> Path:
        """Make the adapter resident in host memory (loading it through the tiers if needed); return its directory."""
        return await self._acquire(spec, pin=False)

    @contextlib.asynccontextmanager
    async def use(self, spec: AdapterSpec) -> AsyncIterator[Path]:
        """Hold the adapter in host memory (and on disk) for the duration of a request."""
        path = await self._acquire(spec, pin=True)
        try:
            yield path
        finally:
            self._host.unpin(spec.digest)

    async def prefetch(self, specs: Iterable[AdapterSpec]) -> list[str]:
        """Warm host memory with adapters, hottest first in `specs`; at most the tier's capacity. Best effort:
        an adapter that fails to load is logged and skipped. Returns the digests resident afterwards."""
        chosen = list(dict((s.digest, s) for s in specs).values())[: self._host.max_entries]
        for spec in reversed(chosen):  # the hottest loaded last = most recently used = evicted last
            try:
                await self.ensure(spec)
            except PreftError as e:
                logger.warning("prefetch of %s skipped: %s", spec.ref, e.message)
        return [s.digest for s in chosen if self.holds(s.digest)]

    def pin(self, digest: str) -> None:
        """Keep a resident adapter in host memory (and on disk) until `unpin`: an adapter whose weights were updated in
        place must never be evicted, which would page its blob's weights back in. NotFound if it is not resident."""
        if not self.holds(digest):
            raise NotFound(f"adapter {digest[:12]} is not resident on this replica")
        self._host.pin(digest)

    def unpin(self, digest: str) -> None:
        self._host.unpin(digest)

    def path(self, digest: str) -> Path:
        """The directory of an adapter held on disk (its published files)."""
        return self._store.path(digest)

    def holds(self, digest: str, tier: Tier = "host") -> bool:
        if tier == "host":
            return digest in self._host and digest not in self._loading
        return digest in self._disk

    def resident(self, tier: Tier = "host") -> list[str]:
        """Digests held in a tier, least recently used first."""
        if tier == "host":
            return [d for d in self._host if d not in self._loading]
        return list(self._disk)

    # -- mechanism -------------------------------------------------------------------------------------------------

    async def _acquire(self, spec: AdapterSpec, *, pin: bool) -> Path:
        if not self._started:
            raise Unavailable("the adapter pager has not started")
        digest, missed = spec.digest, False
        for _ in range(_MAX_ATTEMPTS):
            if self.holds(digest):
                if not missed:
                    metrics.PAGING_HITS.labels("host").inc()
                self._host.touch(digest)
                if pin:
                    self._host.pin(digest)
                return self._store.path(digest)
            if not missed:
                metrics.PAGING_MISSES.labels("host").inc()
                missed = True
            task = self._loading.get(digest)
            if task is None:
                task = self._loading[digest] = asyncio.create_task(self._load(spec), name=f"load-{digest[:12]}")
                task.add_done_callback(lambda t, d=digest: self._load_done(d, t))
            # shield: a waiter that goes away (client disconnect) must not cancel the load the others wait for
            await asyncio.shield(task)
        raise Unavailable(f"adapter {spec.ref}: evicted again before it could be used (host memory too small)")

    def _load_done(self, digest: str, task: asyncio.Task[None]) -> None:
        if self._loading.get(digest) is task:
            del self._loading[digest]
        if not task.cancelled() and (error := task.exception()) is not None:  # (retrieved: no "never retrieved")
            logger.info("loading adapter %s failed: %s", digest[:12], error)
            reason = error.grpc_code.lower() if isinstance(error, PreftError) else "internal"
            metrics.ADAPTER_LOAD_FAILURES.labels(reason).inc()

    async def _load(self, spec: AdapterSpec) -> None:
        """Disk (fetching from S3 if needed), then host memory; one run per digest at a time."""
        started = time.perf_counter()
        path = await self._to_disk(spec)  # pinned on disk for the rest of the load
        try:
            # the read first: reads of several adapters overlap, and add_lora is left only the insertion, the one
            # part the engine's steps wait for
            try:
                await self._engine.prepare_lora(path)
            except PreftError as e:
                logger.info("reading adapter %s ahead failed: %s", spec.ref, e.message)
            async with self._policy_lock:
                try:  # (pinned while it loads: another load's admission must not pick it)
                    victims = self._host.admit(spec.digest, self._disk.size_of(spec.digest), pin=True)
                except CapacityError as e:
                    raise Unavailable(f"adapter {spec.ref}: host memory is full of adapters in use ({e})") from e
                for victim in victims:
                    self._evict_from_host(victim)
            try:
                removal = self._removing.get(spec.digest)  # its own removal, from an earlier eviction, still on its way
                if removal is not None:
                    await asyncio.shield(removal)
                async with self._adds:
                    info = await self._engine.add_lora(path)
                if info.method.value != spec.method:
                    await self._engine.remove_lora(spec.digest)
                    raise InvalidArgument(f"adapter {spec.ref} is a {info.method.value} adapter, not {spec.method}")
            except BaseException:
                self._host.remove(spec.digest)
                raise
            self._host.unpin(spec.digest)
            self._disk.pin(spec.digest)  # held while in host memory
        finally:
            self._disk.unpin(spec.digest)
            self._update_gauges()
        metrics.PAGING_LOAD_SECONDS.labels("host").observe(time.perf_counter() - started)

    def _evict_from_host(self, digest: str) -> None:
        """Count the eviction, release the adapter's disk pin and send its removal to the engine (not awaited: a
        load of the same adapter waits for it, in `_load`)."""
        metrics.PAGING_EVICTIONS.labels("host").inc()
        if digest in self._disk:
            self._disk.unpin(digest)
        task = asyncio.ensure_future(self._remove_from_engine(digest))
        self._removing[digest] = task
        task.add_done_callback(lambda t: self._removing.pop(digest) if self._removing.get(digest) is t else None)

    async def _remove_from_engine(self, digest: str) -> None:
        try:
            await self._engine.remove_lora(digest)
        except Exception:
            # vLLM's own cache is larger than ours, so a stale entry there costs memory, not correctness
            logger.exception("removing adapter %s from the engine failed", digest[:12])

    async def _to_disk(self, spec: AdapterSpec) -> Path:
        """Make the adapter present on disk and pinned once; fetch it from the blob store when absent."""
        digest = spec.digest
        if digest in self._disk:
            metrics.PAGING_HITS.labels("disk").inc()
            self._disk.touch(digest)
            self._disk.pin(digest)
            self._store.touch(digest)
            return self._store.path(digest)
        metrics.PAGING_MISSES.labels("disk").inc()
        started = time.perf_counter()
        staging = self._store.new_staging(digest)
        try:
            size = await self._fetch(spec, staging)
            try:
                victims = self._disk.admit(digest, size, pin=True)
            except CapacityError as e:
                raise Unavailable(f"adapter {spec.ref}: no room in the disk cache ({e})") from e
            try:
                path = self._store.install(staging, digest)
            except BaseException:
                self._disk.remove(digest)
                raise
        except BaseException:
            await asyncio.to_thread(DiskStore.remove, staging)
            raise
        retired = [self._store.retire(v) for v in victims]
        metrics.PAGING_EVICTIONS.labels("disk").inc(len(victims))
        await asyncio.to_thread(lambda: [DiskStore.remove(p) for p in retired])
        metrics.PAGING_LOAD_SECONDS.labels("disk").observe(time.perf_counter() - started)
        return path

    async def _fetch(self, spec: AdapterSpec, staging: Path) -> int:
        """fetch_adapter in a thread, bounded by the download timeout. A timed-out thread cannot be stopped: its
        staging directory is removed when it finishes."""
        work = asyncio.ensure_future(asyncio.to_thread(fetch_adapter, self._blobs, spec, staging))
        try:
            size = await asyncio.wait_for(asyncio.shield(work), self._download_timeout_s)
        except TimeoutError:
            work.add_done_callback(lambda _: DiskStore.remove(staging))
            metrics.PAGING_MISSES.labels("s3").inc()
            raise Unavailable(
                f"adapter {spec.ref}: fetching it from the blob store took over {self._download_timeout_s:g} s"
            ) from None
        except PreftError:
            metrics.PAGING_MISSES.labels("s3").inc()
            raise
        except OSError as e:
            metrics.PAGING_MISSES.labels("s3").inc()
            raise Unavailable(f"adapter {spec.ref}: could not write it to the disk cache: {e}") from e
        metrics.PAGING_HITS.labels("s3").inc()
        return size

    def _update_gauges(self) -> None:
        for tier, policy in (("host", self._host), ("disk", self._disk)):
            metrics.PAGING_RESIDENT_ADAPTERS.labels(tier).set(len(policy))
            metrics.PAGING_RESIDENT_BYTES.labels(tier).set(policy.total_bytes)
