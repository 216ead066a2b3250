"""The registry's operations, independent of gRPC: each method is one RPC's meaning."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from preft.adapters import content_digest
from preft.common.errors import FailedPrecondition, InvalidArgument
from preft.common.metering import ModelUsage
from preft.common.refs import LATEST, AdapterRef, check_name
from preft.common.settings import RegistrySettings
from preft.registry.blobstore import BlobStore, check_digest
from preft.registry.index import LIMIT_FIELDS, RedisIndex, now_ms
from preft.registry.model import (
    AdapterSummary,
    ApiKeyRecord,
    BaseModelRecord,
    FileEntry,
    GcReport,
    HotEntry,
    Manifest,
    PositionMode,
    ShareOffer,
    TenantLimits,
    TenantRecord,
)
from preft.registry.usage import parse_iso_day, query_days, usage_rows
from preft.registry.validation import architecture_digest, check_files, check_uploaded_adapter, model_shape

log = logging.getLogger(__name__)
MAX_HOT = 1000
# Pending offers one adapter may have: an offer to any name is taken (answers must not tell which tenants exist),
# so this bounds what one tenant can write into others' offer sets.
MAX_PENDING_OFFERS = 100


class RegistryService:
    """Owns the rules (names, limits, validation, atomic publish, gc); storage is the index's and the blob store's."""

    def __init__(self, settings: RegistrySettings, *, index: RedisIndex, blobs: BlobStore) -> None:
        self.settings = settings
        self.index = index
        self.blobs = blobs

    # -- tenants and keys ----------------------------------------------------------------------------------------

    def create_tenant(self, tenant: str, limits: TenantLimits | None = None) -> TenantRecord:
        return self.index.create_tenant(check_name(tenant, "tenant id"), self._fill_limits(limits))

    def list_tenants(self) -> list[TenantRecord]:
        return self.index.list_tenants()

    def set_tenant_disabled(self, tenant: str, disabled: bool) -> TenantRecord:
        return self.index.update_tenant(check_name(tenant, "tenant id"), disabled="1" if disabled else "0")

    def set_tenant_limits(self, tenant: str, limits: TenantLimits) -> TenantRecord:
        """Change the non-zero limits, and the monthly quota when given (0 removes it); the rest keep their value."""
        changes = {f: getattr(limits, f) for f in LIMIT_FIELDS if getattr(limits, f)}
        if any(v < 0 for v in changes.values()):
            raise InvalidArgument("limits must be positive (0 keeps the current value)")
        if limits.tokens_per_month is not None:
            changes["tokens_per_month"] = _monthly_quota(limits.tokens_per_month)
        return self.index.update_tenant(check_name(tenant, "tenant id"), **changes)

    def issue_key(self, tenant: str, label: str = "", ttl_s: int = 0) -> tuple[ApiKeyRecord, str]:
        """A new API key; the secret is returned here only (Redis keeps its sha256)."""
        if ttl_s < 0:
            raise InvalidArgument("ttl_s must be 0 (never expires) or positive")
        if len(label) > 200:
            raise InvalidArgument("label is longer than 200 characters")
        key_id = secrets.token_hex(6)
        secret = f"preft_{key_id}_{secrets.token_urlsafe(32)}"
        created = now_ms()
        record = ApiKeyRecord(
            id=key_id,
            tenant=check_name(tenant, "tenant id"),
            label=label,
            created_unix_ms=created,
            expires_unix_ms=created + ttl_s * 1000 if ttl_s else 0,
        )
        self.index.add_key(record, secret)
        return record, secret

    def revoke_key(self, key_id: str) -> ApiKeyRecord:
        return self.index.revoke_key(key_id)

    def list_keys(self, tenant: str | None) -> list[ApiKeyRecord]:
        return self.index.list_keys(check_name(tenant, "tenant id") if tenant else None)

    def authenticate(self, secret: str) -> TenantRecord:
        return self.index.authenticate(secret)

    def _fill_limits(self, limits: TenantLimits | None) -> TenantLimits:
        s = self.settings
        given = limits or TenantLimits(0, 0, 0, 0)
        if any(getattr(given, f) < 0 for f in LIMIT_FIELDS):
            raise InvalidArgument("limits must be positive (0 takes the registry's default)")
        return TenantLimits(
            requests_per_min=given.requests_per_min or s.default_requests_per_min,
            tokens_per_min=given.tokens_per_min or s.default_tokens_per_min,
            max_adapters=given.max_adapters or s.default_max_adapters,
            max_bytes=given.max_bytes or s.default_max_bytes,
            tokens_per_month=_monthly_quota(given.tokens_per_month or 0),
        )

    # -- base models ---------------------------------------------------------------------------------------------

    def register_base_model(self, model_id: str, config_json: str) -> BaseModelRecord:
        shape = model_shape(config_json)
        record = BaseModelRecord(
            id=check_name(model_id, "base model id"),
            architecture_digest=architecture_digest(shape),
            config_json=config_json,
            created_unix_ms=now_ms(),
        )
        return self.index.put_base_model(record)

    def list_base_models(self) -> list[BaseModelRecord]:
        return self.index.list_base_models()

    def _base_model(self, model_id: str) -> BaseModelRecord:
        if model_id:
            return self.index.get_base_model(check_name(model_id, "base model id"))
        models = self.index.list_base_models()
        if len(models) != 1:
            known = ", ".join(m.id for m in models) or "none is registered"
            raise InvalidArgument(f"name the base model to validate against ({known})")
        return models[0]

    # -- upload and publish --------------------------------------------------------------------------------------

    def missing_blobs(self, digests: Sequence[str]) -> list[str]:
        for d in digests:
            check_digest(d)
        missing = self.blobs.missing(digests)
        # a publish is about to reference the present ones: keep gc off them
        self.index.touch_blobs([d for d in digests if d not in missing])
        return missing

    def upload_blob(self, digest: str, size_bytes: int, chunks: Iterable[bytes]) -> FileEntry:
        check_digest(digest)
        if not 0 <= size_bytes <= self.settings.max_adapter_bytes:
            raise InvalidArgument(f"declared size {size_bytes} is outside 0..{self.settings.max_adapter_bytes} bytes")
        self.index.touch_blobs([digest])
        self.blobs.put(digest, size_bytes, chunks)
        return FileEntry(path="", sha256=digest, size_bytes=size_bytes)

    def publish(
        self,
        tenant: str,
        name: str,
        files: Sequence[FileEntry],
        *,
        default_mode: PositionMode = PositionMode.PREFILL,
        alias: str = "",
        base_model: str = "",
        uploader: str = "",
    ) -> tuple[Manifest, bool]:
        """Validate uploaded files and commit them as the adapter's next version; (manifest, created)."""
        s = self.settings
        tenant, name = check_name(tenant, "tenant id"), check_name(name, "adapter name")
        if alias:
            check_name(alias, "alias")
            if alias == LATEST:
                alias = ""
        if len(uploader) > 200:
            raise InvalidArgument("uploader is longer than 200 characters")
        owner = self.index.get_tenant(tenant)
        if owner.disabled:
            raise FailedPrecondition(f"tenant {tenant!r} is disabled")
        check_files(files, max_adapter_bytes=s.max_adapter_bytes, max_config_bytes=s.max_config_bytes)
        base = self._base_model(base_model)
        check = check_uploaded_adapter(files, self.blobs, model_shape(base.config_json), max_rank=s.max_rank)
        manifest = Manifest(
            tenant=tenant,
            name=name,
            version=0,
            digest=content_digest({f.path: f.sha256 for f in files}),
            method=check.method,
            default_mode=default_mode,
            rank=check.rank,
            target_modules=check.targets,
            layers=check.layers,
            base_model=base.id,
            base_model_digest=base.architecture_digest,
            size_bytes=sum(f.size_bytes for f in files),
            files=tuple(sorted(files, key=lambda f: f.path)),
            created_unix_ms=now_ms(),
            uploader=uploader,
        )
        previous = self._latest(tenant, name)
        if previous and _same_content(previous, manifest):
            if alias:
                self.index.set_alias(tenant, name, alias, previous.version)
            return previous, False
        version = self.index.commit_version(manifest, alias)
        log.info("published %s/%s@v%d (%s, %d bytes)", tenant, name, version, manifest.method, manifest.size_bytes)
        return replace(manifest, version=version), True

    def _latest(self, tenant: str, name: str) -> Manifest | None:
        summaries = self.index.adapters([(tenant, name)])
        return summaries[0].latest if summaries else None

    # -- reading and changing adapters ---------------------------------------------------------------------------

    def resolve(self, caller: str, ref_text: str) -> Manifest:
        ref = AdapterRef.parse(ref_text)
        if caller:
            check_name(caller, "tenant id")
        elif ref.owner is None:
            raise InvalidArgument(f"{ref_text!r}: name the owner (owner/name) when resolving as an operator")
        return self.index.resolve(caller, ref.owned_by(caller))

    def list_adapters(self, tenant: str | None) -> list[AdapterSummary]:
        return self.index.adapters(self.index.visible_adapters(check_name(tenant, "tenant id") if tenant else None))

    def get_adapter(self, tenant: str, name: str) -> AdapterSummary:
        return self.index.adapter(check_name(tenant, "tenant id"), check_name(name, "adapter name"))

    def versions(self, tenant: str, name: str) -> list[Manifest]:
        return self.index.versions(check_name(tenant, "tenant id"), check_name(name, "adapter name"))

    def set_alias(self, tenant: str, name: str, alias: str, version: int) -> AdapterSummary:
        check_name(alias, "alias")
        if alias == LATEST:
            raise InvalidArgument("'latest' always names the newest version; it cannot be moved by hand")
        if version < 0:
            raise InvalidArgument("version must be positive (0 removes the alias)")
        self.index.set_alias(check_name(tenant, "tenant id"), check_name(name, "adapter name"), alias, version)
        return self.index.adapter(tenant, name)

    def share(
        self, tenant: str, name: str, add: Sequence[str], remove: Sequence[str], *, offer: bool = False
    ) -> AdapterSummary:
        """Share with `add` at once (an operator's direct share) or, with `offer`, offer it to them; stop sharing
        with (and withdraw offers to) `remove`."""
        for t in (*add, *remove):
            check_name(t, "tenant id")
        if tenant in add:
            raise InvalidArgument(f"{tenant!r} owns the adapter; sharing is for other tenants")
        if set(add) & set(remove):
            raise InvalidArgument(f"tenants {sorted(set(add) & set(remove))} are both added and removed")
        tenant, name = check_name(tenant, "tenant id"), check_name(name, "adapter name")
        self.index.share(tenant, name, add, remove, offer=offer, max_offers=MAX_PENDING_OFFERS)
        return self.index.adapter(tenant, name)

    def share_offers(self, tenant: str) -> list[ShareOffer]:
        """What is offered to `tenant` (pending) or shared with it (accepted), by owner, then name."""
        found = self.index.offers(check_name(tenant, "tenant id"))
        summaries = {(a.tenant, a.name): a for a in self.index.adapters([(o, n) for o, n, _ in found])}
        return [ShareOffer(o, n, accepted, summaries[o, n]) for o, n, accepted in found if (o, n) in summaries]

    def answer_share_offer(self, tenant: str, owner: str, name: str, accept: bool) -> ShareOffer:
        """The recipient accepts an offer, or declines it (or leaves the accepted share)."""
        tenant, owner = check_name(tenant, "tenant id"), check_name(owner, "owner")
        name = check_name(name, "adapter name")
        self.index.answer_offer(tenant, owner, name, accept)
        return ShareOffer(owner, name, accept, self.index.adapter(owner, name) if accept else None)

    def delete(self, tenant: str, name: str, version: int | None) -> list[int]:
        if version is not None and version <= 0:
            raise InvalidArgument("version must be positive")
        return self.index.delete(check_name(tenant, "tenant id"), check_name(name, "adapter name"), version)

    # -- hotness -------------------------------------------------------------------------------------------------

    def record_use(self, tenant: str, name: str, version: int, weight: float = 1.0) -> float:
        if not weight > 0:
            raise InvalidArgument("weight must be positive")
        return self.index.record_use(
            check_name(tenant, "tenant id"),
            check_name(name, "adapter name"),
            version,
            weight,
            self.settings.hot_half_life_s,
        )

    def hot(self, limit: int) -> list[HotEntry]:
        if not 1 <= limit <= MAX_HOT:
            raise InvalidArgument(f"limit must be 1..{MAX_HOT}")
        entries = []
        for tenant, name, version, score in self.index.hottest(limit, self.settings.hot_half_life_s):
            manifest = self.index.resolve("", AdapterRef(tenant, name, version))
            entries.append(HotEntry(manifest, score))
        return entries

    # -- token usage ---------------------------------------------------------------------------------------------

    def token_usage(self, tenant: str, start_date: str, end_date: str, *, by_model: bool = False) -> list[ModelUsage]:
        """A tenant's metered use per UTC day (and model) from start_date to end_date (YYYY-MM-DD, both included)."""
        check_name(tenant, "tenant id")
        try:
            span = query_days(parse_iso_day(start_date, "start_date"), parse_iso_day(end_date, "end_date"))
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self.index.get_tenant(tenant)  # NotFound for an unknown tenant, as every tenant RPC
        return usage_rows(zip(span, self.index.usage_hashes(tenant, span), strict=True), by_model=by_model)

    # -- garbage collection --------------------------------------------------------------------------------------

    def collect_garbage(self, *, min_age_s: float | None = None, dry_run: bool = False) -> GcReport:
        """Delete unreferenced blobs and abort multipart uploads, both older than the grace period."""
        grace = self.settings.gc_grace_s if min_age_s is None else min_age_s
        if grace < 0:
            raise InvalidArgument("min_age_s must not be negative")
        cutoff_s = time.time() - grace
        report = GcReport()
        referenced = self.index.referenced_blobs()
        for blob in self.blobs.list():
            if blob.digest in referenced:
                report.kept_blobs += 1
                continue
            if blob.last_modified.timestamp() > cutoff_s:
                continue
            if dry_run:
                report.deleted_blobs.append(blob.digest)
                report.deleted_bytes += blob.size_bytes
                continue
            if not self.index.claim_for_deletion(blob.digest, int(cutoff_s * 1000)):
                continue
            try:
                self.blobs.delete(blob.digest)
                report.deleted_blobs.append(blob.digest)
                report.deleted_bytes += blob.size_bytes
            finally:
                self.index.release_deleted(blob.digest)
        for upload in self.blobs.pending_uploads():
            if upload.initiated.timestamp() <= cutoff_s:
                report.aborted_uploads += 1
                if not dry_run:
                    self.blobs.abort(upload)
        log.info(
            "gc: %d blobs (%d bytes) deleted, %d uploads aborted, %d kept",
            len(report.deleted_blobs),
            report.deleted_bytes,
            report.aborted_uploads,
            report.kept_blobs,
        )
        return report


def _same_content(a: Manifest, b: Manifest) -> bool:
    return (a.digest, a.default_mode, a.base_model, a.files) == (b.digest, b.default_mode, b.base_model, b.files)


def _monthly_quota(tokens: int) -> int:
    if tokens < 0:
        raise InvalidArgument("tokens_per_month must be positive, or 0 for no quota")
    return tokens
