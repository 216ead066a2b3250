"""The registry's gRPC face: proto <-> record conversion, the servicer, and the one interceptor that checks the
caller's token and its role's RPCs (`roles`) and turns domain errors into status codes (and anything else into
INTERNAL, logged once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.api.v1 import registry_pb2_grpc
from preft.common.errors import InvalidArgument, PreftError
from preft.common.metering import COUNTERS, ModelUsage
from preft.registry.model import (
    AdapterMethod,
    AdapterSummary,
    ApiKeyRecord,
    BaseModelRecord,
    FileEntry,
    Manifest,
    PositionMode,
    ShareOffer,
    TenantLimits,
    TenantRecord,
)
from preft.registry.roles import Role, TokenRoles
from preft.registry.service import RegistryService

log = logging.getLogger(__name__)

METHOD_TO_PROTO = {AdapterMethod.LORA: apb.ADAPTER_METHOD_LORA, AdapterMethod.DIREFT: apb.ADAPTER_METHOD_DIREFT}
MODE_TO_PROTO = {PositionMode.PREFILL: apb.POSITION_MODE_PREFILL, PositionMode.ALL: apb.POSITION_MODE_ALL}
MODE_FROM_PROTO = {v: k for k, v in MODE_TO_PROTO.items()}


def manifest_pb(m: Manifest) -> apb.AdapterManifest:
    return apb.AdapterManifest(
        tenant=m.tenant,
        name=m.name,
        version=m.version,
        digest=m.digest,
        method=METHOD_TO_PROTO[m.method],
        default_mode=MODE_TO_PROTO[m.default_mode],
        rank=m.rank,
        target_modules=m.target_modules,
        layers=m.layers,
        base_model=m.base_model,
        base_model_digest=m.base_model_digest,
        size_bytes=m.size_bytes,
        files=[apb.AdapterFile(path=f.path, sha256=f.sha256, size_bytes=f.size_bytes) for f in m.files],
        created_unix_ms=m.created_unix_ms,
        uploader=m.uploader,
    )


def tenant_pb(t: TenantRecord) -> pb.Tenant:
    return pb.Tenant(
        id=t.id,
        disabled=t.disabled,
        limits=limits_pb(t.limits),
        adapter_count=t.adapter_count,
        bytes_used=t.bytes_used,
        created_unix_ms=t.created_unix_ms,
    )


def limits_pb(limits: TenantLimits) -> pb.TenantLimits:
    return pb.TenantLimits(**vars(limits))


def limits_from_pb(limits: pb.TenantLimits) -> TenantLimits:
    return TenantLimits(
        limits.requests_per_min,
        limits.tokens_per_min,
        limits.max_adapters,
        limits.max_bytes,
        limits.tokens_per_month if limits.HasField("tokens_per_month") else None,
    )


def key_pb(k: ApiKeyRecord) -> pb.ApiKey:
    return pb.ApiKey(**vars(k))


def base_pb(b: BaseModelRecord) -> pb.BaseModel:
    return pb.BaseModel(**vars(b))


def adapter_pb(a: AdapterSummary) -> pb.Adapter:
    return pb.Adapter(
        tenant=a.tenant,
        name=a.name,
        aliases=a.aliases,
        shared_with=a.shared_with,
        version_count=a.version_count,
        latest=manifest_pb(a.latest),
        offered_to=a.offered_to,
    )


def share_offer_pb(o: ShareOffer) -> pb.ShareOffer:
    adapter = adapter_pb(o.adapter) if o.adapter else pb.Adapter(tenant=o.owner, name=o.name)
    return pb.ShareOffer(adapter=adapter, accepted=o.accepted)


def usage_row_pb(u: ModelUsage) -> pb.TokenUsageRow:
    return pb.TokenUsageRow(
        date=u.day.isoformat(),
        model=u.model,
        requests=u.requests,
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
    )


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """Maps each RPC onto RegistryService; no rules live here."""

    def __init__(self, service: RegistryService) -> None:
        self.svc = service

    def CreateTenant(self, request: pb.CreateTenantRequest, context: Any) -> pb.Tenant:
        return tenant_pb(self.svc.create_tenant(request.id, limits_from_pb(request.limits)))

    def ListTenants(self, request: pb.ListTenantsRequest, context: Any) -> pb.ListTenantsResponse:
        return pb.ListTenantsResponse(tenants=[tenant_pb(t) for t in self.svc.list_tenants()])

    def SetTenantDisabled(self, request: pb.SetTenantDisabledRequest, context: Any) -> pb.Tenant:
        return tenant_pb(self.svc.set_tenant_disabled(request.id, request.disabled))

    def SetTenantLimits(self, request: pb.SetTenantLimitsRequest, context: Any) -> pb.Tenant:
        return tenant_pb(self.svc.set_tenant_limits(request.id, limits_from_pb(request.limits)))

    def IssueKey(self, request: pb.IssueKeyRequest, context: Any) -> pb.IssueKeyResponse:
        record, secret = self.svc.issue_key(request.tenant, request.label, request.ttl_s)
        return pb.IssueKeyResponse(key=key_pb(record), secret=secret)

    def RevokeKey(self, request: pb.RevokeKeyRequest, context: Any) -> pb.ApiKey:
        return key_pb(self.svc.revoke_key(request.id))

    def ListKeys(self, request: pb.ListKeysRequest, context: Any) -> pb.ListKeysResponse:
        return pb.ListKeysResponse(keys=[key_pb(k) for k in self.svc.list_keys(request.tenant or None)])

    def Authenticate(self, request: pb.AuthenticateRequest, context: Any) -> pb.Tenant:
        return tenant_pb(self.svc.authenticate(request.secret))

    def RegisterBaseModel(self, request: pb.RegisterBaseModelRequest, context: Any) -> pb.BaseModel:
        return base_pb(self.svc.register_base_model(request.id, request.config_json))

    def ListBaseModels(self, request: pb.ListBaseModelsRequest, context: Any) -> pb.ListBaseModelsResponse:
        return pb.ListBaseModelsResponse(models=[base_pb(b) for b in self.svc.list_base_models()])

    def MissingBlobs(self, request: pb.MissingBlobsRequest, context: Any) -> pb.MissingBlobsResponse:
        return pb.MissingBlobsResponse(sha256=self.svc.missing_blobs(list(request.sha256)))

    def UploadBlob(self, request_iterator: Iterator[pb.UploadBlobChunk], context: Any) -> apb.AdapterFile:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("empty upload: the first message must declare sha256 and size_bytes")

        def chunks() -> Iterator[bytes]:
            yield first.data
            for msg in request_iterator:
                yield msg.data

        entry = self.svc.upload_blob(first.sha256, first.size_bytes, chunks())
        return apb.AdapterFile(sha256=entry.sha256, size_bytes=entry.size_bytes)

    def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        if request.default_mode not in (apb.POSITION_MODE_UNSPECIFIED, *MODE_FROM_PROTO):
            raise InvalidArgument(f"unknown default_mode {request.default_mode}")
        manifest, created = self.svc.publish(
            request.tenant,
            request.name,
            [FileEntry(f.path, f.sha256, f.size_bytes) for f in request.files],
            default_mode=MODE_FROM_PROTO.get(request.default_mode, PositionMode.PREFILL),
            alias=request.alias,
            base_model=request.base_model,
            uploader=request.uploader,
        )
        return pb.PublishResponse(manifest=manifest_pb(manifest), created=created)

    def Resolve(self, request: pb.ResolveRequest, context: Any) -> apb.AdapterManifest:
        return manifest_pb(self.svc.resolve(request.tenant, request.ref))

    def ListAdapters(self, request: pb.ListAdaptersRequest, context: Any) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[adapter_pb(a) for a in self.svc.list_adapters(request.tenant or None)])

    def GetAdapter(self, request: pb.GetAdapterRequest, context: Any) -> pb.Adapter:
        return adapter_pb(self.svc.get_adapter(request.tenant, request.name))

    def ListVersions(self, request: pb.ListVersionsRequest, context: Any) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(
            versions=[manifest_pb(m) for m in self.svc.versions(request.tenant, request.name)]
        )

    def SetAlias(self, request: pb.SetAliasRequest, context: Any) -> pb.Adapter:
        return adapter_pb(self.svc.set_alias(request.tenant, request.name, request.alias, request.version))

    def Share(self, request: pb.ShareRequest, context: Any) -> pb.Adapter:
        add, remove = list(request.add), list(request.remove)
        return adapter_pb(self.svc.share(request.tenant, request.name, add, remove, offer=request.offer))

    def ListShareOffers(self, request: pb.ListShareOffersRequest, context: Any) -> pb.ListShareOffersResponse:
        return pb.ListShareOffersResponse(offers=[share_offer_pb(o) for o in self.svc.share_offers(request.tenant)])

    def AnswerShareOffer(self, request: pb.AnswerShareOfferRequest, context: Any) -> pb.ShareOffer:
        offer = self.svc.answer_share_offer(request.tenant, request.owner, request.name, request.accept)
        return share_offer_pb(offer)

    def Delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse(versions=self.svc.delete(request.tenant, request.name, request.version or None))

    def RecordUse(self, request: pb.RecordUseRequest, context: Any) -> pb.RecordUseResponse:
        score = self.svc.record_use(request.tenant, request.name, request.version, request.weight or 1.0)
        return pb.RecordUseResponse(score=score)

    def Hot(self, request: pb.HotRequest, context: Any) -> pb.HotResponse:
        entries = self.svc.hot(request.limit or 20)
        return pb.HotResponse(entries=[pb.HotEntry(manifest=manifest_pb(e.manifest), score=e.score) for e in entries])

    def GetTokenUsage(self, request: pb.GetTokenUsageRequest, context: Any) -> pb.GetTokenUsageResponse:
        rows = self.svc.token_usage(
            request.tenant, request.start_date, request.end_date, by_model=request.group_by_model
        )
        return pb.GetTokenUsageResponse(
            tenant=request.tenant,
            start_date=request.start_date,
            end_date=request.end_date,
            rows=[usage_row_pb(r) for r in rows],
            total=pb.TokenCounts(**{c: sum(getattr(r, c) for r in rows) for c in COUNTERS}),
        )

    def CollectGarbage(self, request: pb.CollectGarbageRequest, context: Any) -> pb.CollectGarbageResponse:
        min_age_s = request.min_age_s if request.HasField("min_age_s") else None
        report = self.svc.collect_garbage(min_age_s=min_age_s, dry_run=request.dry_run)
        return pb.CollectGarbageResponse(
            deleted_blobs=report.deleted_blobs,
            deleted_bytes=report.deleted_bytes,
            aborted_uploads=report.aborted_uploads,
            kept_blobs=report.kept_blobs,
        )


class GuardInterceptor(grpc.ServerInterceptor):
    """Checks `authorization: Bearer <token>` against the tokens' roles and maps errors to statuses, for every
    registry RPC: no known token is UNAUTHENTICATED, a role without the RPC is PERMISSION_DENIED."""

    def __init__(self, roles: TokenRoles, *, open_prefixes: tuple[str, ...] = ("/grpc.health.",)) -> None:
        self._roles = roles
        self._open = open_prefixes

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        role = self._roles.role_of(sent)
        for kind in ("unary_unary", "stream_unary"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                factory = getattr(grpc, f"{kind}_rpc_method_handler")
                return factory(
                    self._guard(behavior, role, handler_call_details.method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    @staticmethod
    def _guard(behavior: Callable, role: Role | None, method: str) -> Callable:
        rpc = method.rsplit("/", 1)[-1]

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if role is None:
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "missing or wrong registry token (admin token, or a role's)"
                )
            if not role.allows(rpc):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the registry's {role.name} token may not call {rpc}")
            try:
                return behavior(request, context)
            except PreftError as e:
                code, message = getattr(grpc.StatusCode, e.grpc_code), e.message
            except Exception:
                if not context.is_active():  # the caller went away (e.g. a killed upload): nothing to answer
                    log.info("registry: %s cancelled by the caller", method)
                    return None
                log.exception("registry: %s failed", method)
                code, message = grpc.StatusCode.INTERNAL, "internal registry error (logged by the registry)"
            context.abort(code, message)

        return guarded
