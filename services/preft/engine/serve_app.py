"""The engine as a Ray Serve application: `build_app(settings)` → replicas of `EngineDeployment`.

Routing affinity: the gateway sends each request with header `serve_multiplexed_model_id` = the adapter's content
digest (or "base"). Ray Serve's proxy routes it to a replica that has registered that id, when one is not overloaded,
else to one holding the fewest ids. A replica pages the adapter in (`Pager.ensure`), then registers its id by running
its `@serve.multiplexed` loader, which only returns a marker: Serve runs every loader call of a replica under one lock,
so paging inside the loader would page one adapter at a time per replica. Serve keeps the last
`max_adapters_per_replica` ids per replica (its own LRU, separate from the pager's tiers: set both to the same size so
what is advertised is what is in host memory).

Drain: on shutdown Serve stops routing to the replica and waits for its in-flight requests (up to
`graceful_shutdown_timeout_s`); then `__del__` drains the service (late arrivals get 503, stragglers get what is left
of the budget) and stops vLLM. A replica whose engine died answers 503 and fails `check_health`, so Serve replaces it.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlsplit

from ray import serve

from preft.common.engine_contract import BASE_MODEL_ID, AdapterSpec
from preft.engine.async_engine import AsyncPreftEngine
from preft.engine.http import create_app
from preft.engine.paging.disk import claim_slot
from preft.engine.paging.downloader import BlobSource
from preft.engine.paging.hot import HotSource, RedisHotSource, RegistryHotSource
from preft.engine.paging.pager import Pager
from preft.engine.protocol import EngineFactory
from preft.engine.ray_metrics import RayMetricsBridge
from preft.engine.residency import ResidencyPublisher, redis_client
from preft.engine.service import EngineService
from preft.engine.settings import EngineSettings

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "PreftEngine"
IMPORT_PATH = "preft.engine.serve_app:app_builder"


class ResidentAdapter:
    """What Serve's multiplexing caches per model id: a marker that this replica paged the adapter in."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id


@serve.ingress()
class EngineDeployment:
    """One engine replica: owns its EngineService (vLLM engine, pager, residency publisher), its HTTP app and the
    copy of its metrics into Ray's (`ray_metrics`)."""

    async def __init__(
        self,
        settings: EngineSettings,
        *,
        engine_cls: EngineFactory = AsyncPreftEngine,
        blobs: BlobSource | None = None,
        hot_source: HotSource | None = None,
    ) -> None:
        self._settings = settings
        _log_through_serve()
        os.environ.update(settings.process_env())  # also set by runtime_env; vLLM's processes inherit these
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id if context is not None else f"pid-{os.getpid()}"
        engine = engine_cls(settings.engine_options())
        if blobs is None:
            from preft.registry.blobstore import BlobStore

            blobs = BlobStore(settings.s3)
        disk_dir, self._disk_lock = claim_slot(settings.disk_cache_dir)  # replicas on one node do not share it
        pager = Pager(
            host=engine,
            blobs=blobs,
            disk_dir=disk_dir,
            disk_max_bytes=settings.disk_cache_max_bytes,
            host_max_adapters=settings.max_cpu_loras,
            download_timeout_s=settings.download_timeout_s,
        )
        redis = redis_client(settings.redis)
        publisher = ResidencyPublisher(
            replica_id=replica_id,
            holdings=lambda: pager.resident("host"),
            client=redis,
            heartbeat_s=settings.residency_heartbeat_s,
            ttl_s=settings.residency_ttl_s,
        )
        if hot_source is None and settings.prefetch_adapters > 0:
            if settings.registry_address and settings.registry_token:
                token = settings.registry_token.get_secret_value()
                hot_source = RegistryHotSource(settings.registry_address, token)
            else:
                hot_source = RedisHotSource(redis, settings.hot_specs_redis_key)
        self._service = EngineService(
            engine=engine,
            pager=pager,
            publisher=publisher,
            hot_source=hot_source,
            prefetch_adapters=settings.prefetch_adapters,
            tenant_label=settings.replica.metrics_tenant_label,
            max_live_adapters=settings.max_live_adapters,
        )
        # Serve's multiplexing decorator takes its size when applied, so it is applied here, from the settings.
        # "+ 1": the "base" id is registered too (every replica serves base requests).
        max_ids = settings.replica.max_adapters_per_replica + 1
        self._load_adapter = serve.multiplexed(max_num_models_per_replica=max_ids)(self._make_loader())
        self._metrics_bridge = RayMetricsBridge() if settings.replica.ray_metrics_interval_s > 0 else None
        if self._metrics_bridge is not None:  # (from the start: the prefetch's paging is counted too)
            self._metrics_bridge.start(settings.replica.ray_metrics_interval_s)
        await self._service.start()
        logger.info("replica %s started its engine in %.1f s", replica_id, self._service.start_seconds)

    @staticmethod
    def _make_loader() -> Any:
        async def load_adapter(model_id: str) -> ResidentAdapter:
            return ResidentAdapter(model_id)

        return load_adapter

    async def _on_adapter(self, model_id: str, spec: AdapterSpec | None) -> None:
        """Page the request's adapter in (loads of several adapters overlap: the pager bounds them), then register
        its id with Serve (under Serve's lock: nothing to wait for there)."""
        pager = self._service.pager
        if model_id != BASE_MODEL_ID and spec is not None and not pager.holds(spec.digest):
            await pager.ensure(spec)
        await self._load_adapter(model_id)

    def __serve_build_asgi_app__(self) -> Any:
        token = self._settings.api_token.get_secret_value()
        return create_app(self._service, token=token, on_adapter=self._on_adapter)

    async def check_health(self) -> None:
        await self._service.check_health()

    async def __del__(self) -> None:
        # Serve has already waited for in-flight requests; whatever is left of the budget goes to stragglers.
        await self._service.drain(self._settings.replica.graceful_shutdown_timeout_s / 2)
        if self._metrics_bridge is not None:
            await self._metrics_bridge.stop()


def _log_through_serve() -> None:
    """Our modules' INFO logs go where Serve puts the replica's logs (Serve configures only its own logger)."""
    ours, serves = logging.getLogger("preft"), logging.getLogger("ray.serve")
    if not ours.handlers:
        for handler in serves.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def build_app(
    settings: EngineSettings,
    *,
    engine_cls: EngineFactory = AsyncPreftEngine,
    blobs: BlobSource | None = None,
    hot_source: HotSource | None = None,
) -> serve.Application:
    """The engine application, ready for `serve.run(app, name=settings.app_name, route_prefix=settings.route_prefix)`.

    `engine_cls`, `blobs` and `hot_source` are pickled to the replicas (tests inject test doubles this way).
    """
    r = settings.replica
    deployment = serve.deployment(
        EngineDeployment,
        name=DEPLOYMENT_NAME,
        num_replicas=r.num_replicas,
        max_ongoing_requests=r.max_ongoing_requests,
        graceful_shutdown_timeout_s=r.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=r.graceful_shutdown_wait_loop_s,
        health_check_period_s=r.health_check_period_s,
        health_check_timeout_s=r.health_check_timeout_s,
        ray_actor_options={
            "num_cpus": r.num_cpus_per_replica,
            "num_gpus": r.num_gpus_per_replica,
            "runtime_env": {"env_vars": settings.process_env()},
        },
    )
    return deployment.bind(settings, engine_cls=engine_cls, blobs=blobs, hot_source=hot_source)


# Settings that are secrets: they come from the pods' environment (Kubernetes Secrets), never from the Serve config's
# `args`, which KubeRay shows in the RayService and Serve keeps in its checkpoints (in Redis, with GCS fault tolerance).
SECRET_SETTINGS = (
    ("api_token",),
    ("registry_token",),
    ("redis", "password"),
    ("s3", "access_key"),
    ("s3", "secret_key"),
)


def secrets_in_args(args: dict[str, Any]) -> list[str]:
    """The secret settings present in a Serve config's `args` (dotted names); a Redis URL with a password counts."""
    found = []
    for path in SECRET_SETTINGS:
        node: Any = args
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            found.append(".".join(path))
    url = (args.get("redis") or {}).get("url") if isinstance(args.get("redis"), dict) else None
    if isinstance(url, str) and urlsplit(url).password:
        found.append("redis.url (with a password)")
    return found


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve-config entry point (`import_path: preft.engine.serve_app:app_builder`).

    `args` holds the engine's non-secret settings (EngineSettings' fields, nested as in the class: `{"max_loras": 8,
    "replica": {"num_gpus_per_replica": 1}}`): the RayService carries them in serveConfigV2, so changing one is an
    in-place Serve update (new replicas on the same Ray cluster), not a new cluster. They override the pods'
    PREFT_ENGINE__* environment, which keeps what is secret (tokens, passwords, a Redis URL with credentials):
    secrets in `args` are refused."""
    secrets = secrets_in_args(args)
    if secrets:
        raise ValueError(f"secret settings belong in the pods' environment, not in the Serve config's args: {secrets}")
    return build_app(EngineSettings(**args))


def serve_config(
    args: dict[str, Any],
    *,
    num_replicas: int,
    http_host: str = "0.0.0.0",
    http_port: int = 8000,
    app_name: str = "preft-engine",
    route_prefix: str = "/",
) -> dict[str, Any]:
    """The Serve config that runs the engine app from `args` (a RayService's serveConfigV2, what Serve's REST API and
    `serve deploy` take): a proxy on every node and one application built by `app_builder`, as deploy/ and helm/ write
    it. `args` must hold no secret (the nodes' environment does)."""
    found = secrets_in_args(args)
    if found:
        raise ValueError(f"secret settings belong in the nodes' environment, not in the Serve config's args: {found}")
    app = {
        "name": app_name,
        "route_prefix": route_prefix,
        "import_path": IMPORT_PATH,
        "args": args,
        "deployments": [{"name": DEPLOYMENT_NAME, "num_replicas": num_replicas}],
    }
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": http_host, "port": http_port},
        "applications": [app],
    }
