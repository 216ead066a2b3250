"""What a request's `model` means for a tenant: the base model, or one adapter version with its position mode.

`model` is the served base model's name, or an adapter reference as the registry reads it (`name`, `name@v3`,
`name:alias`, `owner/name...` for adapters shared with the tenant). A name equal to the base model's always
means the base model. Resolutions are cached per (tenant, model) for `resolve_cache_ttl_s`: a moved alias, a
new version or a withdrawn share is seen within that time, and while the registry is down, cached models keep
working for the rest of their TTL (uncached ones get 503). Concurrent misses for one key share one registry call.
Anything a tenant may not use answers exactly like a model that does not exist (404 `model_not_found`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from preft.api.v1 import adapter_pb2 as apb
from preft.common.engine_contract import BASE_MODEL_ID, AdapterSpec
from preft.common.errors import InvalidArgument, NotFound
from preft.common.modes import PositionMode
from preft.common.refs import AdapterRef
from preft.gateway.core.cache import TTLCache
from preft.gateway.core.errors import ModelNotFound
from preft.gateway.core.registry import AsyncRegistry
from preft.gateway.core.usage import UsageRecorder
from preft.registry.specs import adapter_spec, default_mode


@dataclass(frozen=True)
class AdapterVersion:
    """A resolved adapter version: what the engine needs, its registered default mode, and its identity."""

    spec: AdapterSpec
    default_mode: PositionMode
    owner: str
    name: str
    version: int
    created_unix_ms: int

    @classmethod
    def from_manifest(cls, m: apb.AdapterManifest) -> AdapterVersion:
        return cls(adapter_spec(m), default_mode(m), m.tenant, m.name, m.version, m.created_unix_ms)


@dataclass(frozen=True)
class Resolution:
    """One request's model: the adapter (None for the base model) and the position mode to apply it with."""

    adapter: AdapterSpec | None
    mode: PositionMode

    @property
    def model_id(self) -> str:
        """The Ray Serve multiplexed model id: the adapter's content digest, or "base"."""
        return self.adapter.digest if self.adapter else BASE_MODEL_ID

    @property
    def method(self) -> str:
        return self.adapter.method if self.adapter else "none"


class AdapterResolver:
    """Owns the (tenant, model) -> adapter version cache, the mode policy, and counting uses."""

    def __init__(
        self,
        registry: AsyncRegistry,
        usage: UsageRecorder,
        *,
        is_base_model: Callable[[str], bool],
        ttl_s: float,
        max_entries: int,
        allow_mode_override: bool,
    ) -> None:
        self._registry = registry
        self._usage = usage
        self.is_base_model = is_base_model
        self._allow_mode_override = allow_mode_override
        self._cache: TTLCache[tuple[str, str], AdapterVersion] = TTLCache(ttl_s, max_entries)

    async def resolve(self, tenant: str, model: str, requested_mode: PositionMode | None = None) -> Resolution:
        """The adapter and mode for `model` as `tenant` sees it; counts the use (batched, never failing)."""
        if requested_mode is not None and not self._allow_mode_override:
            raise InvalidArgument("preft_mode cannot be chosen per request on this deployment (operator setting)")
        if self.is_base_model(model):
            return Resolution(None, PositionMode.PREFILL)  # no adapter: the mode changes nothing
        version = await self.find(tenant, model)
        self._usage.record(version.owner, version.name, version.version)
        return Resolution(version.spec, requested_mode or version.default_mode)

    async def find(self, tenant: str, model: str) -> AdapterVersion:
        """The adapter version `model` names for `tenant` (cached); ModelNotFound when it may not use one."""
        try:
            AdapterRef.parse(model)
        except InvalidArgument:
            raise ModelNotFound(model) from None
        return await self._cache.get_or_load((tenant, model), lambda: self._load(tenant, model))

    async def _load(self, tenant: str, model: str) -> tuple[AdapterVersion, None]:
        try:
            manifest = await self._registry.resolve(tenant, model)
        except (NotFound, InvalidArgument):
            raise ModelNotFound(model) from None
        return AdapterVersion.from_manifest(manifest), None
