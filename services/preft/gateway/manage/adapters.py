"""Tenants manage their own adapters with their API key: upload a version, list, inspect, alias and delete (sharing:
`preft.gateway.manage.shares`).

The registry does the work as it does for `preft-admin` (validation against the base model, content-addressed
blobs, atomic publish, the tenant's quotas); the gateway calls it for the caller's tenant only, so a key reaches
its own tenant's adapters and nothing else (another tenant's adapter answers 404, as a missing one). A new version
is served once the gateway's adapter cache lets go of the old one (`resolve_cache_ttl_s`).

    POST   /v1/adapters                         multipart: name, files (the adapter directory's files), mode, alias
    GET    /v1/adapters                         the tenant's adapters and those shared with it (accepted shares)
    GET    /v1/adapters/{name}                  one of its own, with every version
    PUT    /v1/adapters/{name}/aliases/{alias}  {"version": N}: point the alias at a version
    DELETE /v1/adapters/{name}/aliases/{alias}
    DELETE /v1/adapters/{name}/versions/{version}
    DELETE /v1/adapters/{name}                  every version
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import CallerDep, LimiterDep, RegistryDep, SettingsDep, check_multipart_upload, json_body
from preft.gateway.core.openapi import REGISTRY_ERRORS, errors, multipart_body
from preft.gateway.core.registry import AsyncRegistry, BlobUpload
from preft.gateway.manage.response_models import Adapter, AdapterDeleted, AdapterDetail, AdapterList, AdapterUpload

router = APIRouter(tags=["adapters"])

METHODS = {apb.ADAPTER_METHOD_LORA: "lora", apb.ADAPTER_METHOD_DIREFT: "direft"}
MODES = {"prefill": apb.POSITION_MODE_PREFILL, "all": apb.POSITION_MODE_ALL}
MODE_NAMES = {v: k for k, v in MODES.items()}
MAX_FILES = 16
HASH_CHUNK = 1024 * 1024
MAX_VERSION = 2**31 - 1  # (an int32 in the registry's messages: a larger one could not even be sent)
UPLOAD_FORM = multipart_body(
    {
        "name": {"type": "string", "description": "The adapter's name (a new version of it where it exists)"},
        "files": {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "maxItems": MAX_FILES,
            "description": "The adapter directory's files (adapter_config.json and its weights), by plain name",
        },
        "mode": {"type": "string", "enum": list(MODES), "default": "prefill"},
        "alias": {"type": "string", "description": "An alias to point at the new version"},
    },
    required=["name", "files"],
)


def version_entry(m: apb.AdapterManifest, *, own: bool = True) -> dict[str, Any]:
    """One adapter version as the API shows it; to another tenant than its owner without `uploader` (it names the
    owner's API key)."""
    entry = {
        "object": "adapter.version",
        "id": f"{m.name}@v{m.version}",
        "name": m.name,
        "version": m.version,
        "owner": m.tenant,
        "digest": m.digest,
        "method": METHODS.get(m.method, "unknown"),
        "default_mode": MODE_NAMES.get(m.default_mode, "prefill"),
        "rank": m.rank,
        "target_modules": list(m.target_modules),
        "layers": list(m.layers),
        "base_model": m.base_model,
        "size_bytes": m.size_bytes,
        "files": [{"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in m.files],
        "created": m.created_unix_ms // 1000,
        "uploader": m.uploader,
    }
    if not own:
        del entry["uploader"]
    return entry


def adapter_entry(a: pb.Adapter, tenant: str) -> dict[str, Any]:
    """An adapter as the API shows it to `tenant` (its own by name with whom it is shared with and offered to, a
    shared one as owner/name without them)."""
    own = a.tenant == tenant
    entry = {
        "object": "adapter",
        "id": a.name if own else f"{a.tenant}/{a.name}",
        "name": a.name,
        "owner": a.tenant,
        "aliases": dict(sorted(a.aliases.items())),
        "version_count": a.version_count,
        "latest": version_entry(a.latest, own=own),
    }
    return {**entry, "shared_with": list(a.shared_with), "offered_to": list(a.offered_to)} if own else entry


async def _blob(upload: UploadFile) -> BlobUpload:
    """A file part hashed (its name checked: a plain file name, as the adapter directory had it)."""
    name = upload.filename or ""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise InvalidArgument(f"files: each part needs the adapter file's plain name, not {name!r}")
    digest, size = hashlib.sha256(), 0
    await upload.seek(0)
    while chunk := await upload.read(HASH_CHUNK):
        await asyncio.to_thread(digest.update, chunk)
        size += len(chunk)
    return BlobUpload(path=name, sha256=digest.hexdigest(), size_bytes=size, source=upload)


def _field(form: Any, name: str) -> str:
    value = form.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}: a form field, not a file")
    return value


@router.post(
    "/v1/adapters",
    status_code=201,
    response_model=AdapterUpload,
    responses={200: {"model": AdapterUpload, "description": "Not new"}, **errors(*REGISTRY_ERRORS, 411, 413)},
    openapi_extra=UPLOAD_FORM,
)
async def upload_adapter(
    request: Request, caller: CallerDep, registry: RegistryDep, settings: SettingsDep, limiter: LimiterDep
) -> JSONResponse:
    """A new version of one of the tenant's adapters (201; 200 where the latest already has this content and mode);
    it counts as one request against the tenant's requests per minute."""
    limit = settings.max_adapter_upload_bytes
    check_multipart_upload(
        request,
        max_bytes=limit,
        too_large=f"The upload is larger than {limit} bytes.",
        not_multipart="send the adapter as multipart/form-data: fields name (and mode, alias) and files",
    )
    admission = await limiter.admit(caller.tenant, 0)
    async with request.form(max_files=MAX_FILES, max_fields=8) as form:
        name, mode, alias = _field(form, "name"), _field(form, "mode") or "prefill", _field(form, "alias")
        if not name:
            raise InvalidArgument("name: give the adapter's name")
        if mode not in MODES:
            raise InvalidArgument(f"mode: prefill or all, not {mode!r}")
        parts = [p for p in form.getlist("files") if isinstance(p, UploadFile)]
        if not parts:
            raise InvalidArgument("files: give the adapter directory's files (adapter_config.json and its weights)")
        blobs = [await _blob(p) for p in parts]
        published = await registry.publish(
            caller.tenant,
            name,
            blobs,
            mode=MODES[mode],
            alias=alias,
            uploader=f"{caller.tenant}:key {caller.key_id}",
        )
    body = {"created": published.created, "adapter": version_entry(published.manifest)}
    return JSONResponse(body, status_code=201 if published.created else 200, headers=admission.headers())


@router.get("/v1/adapters", response_model=AdapterList)
async def list_adapters(caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    adapters = await registry.list_adapters(caller.tenant)
    return JSONResponse({"object": "list", "data": [adapter_entry(a, caller.tenant) for a in adapters]})


@router.get("/v1/adapters/{name}", response_model=AdapterDetail, responses=errors(*REGISTRY_ERRORS))
async def get_adapter(name: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    adapter = await registry.manage("GetAdapter", pb.GetAdapterRequest(tenant=caller.tenant, name=name))
    versions = await registry.manage("ListVersions", pb.ListVersionsRequest(tenant=caller.tenant, name=name))
    entry = adapter_entry(adapter, caller.tenant)
    return JSONResponse({**entry, "versions": [version_entry(m) for m in versions.versions]})


class AliasBody(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"version": 1}]})

    version: int = Field(ge=1, le=MAX_VERSION, description="The version the alias points at")


@router.put("/v1/adapters/{name}/aliases/{alias}", response_model=Adapter, responses=errors(*REGISTRY_ERRORS))
async def set_alias(
    name: str,
    alias: str,
    caller: CallerDep,
    body: Annotated[AliasBody, Depends(json_body(AliasBody))],
    registry: RegistryDep,
) -> JSONResponse:
    request_pb = pb.SetAliasRequest(tenant=caller.tenant, name=name, alias=alias, version=body.version)
    return JSONResponse(adapter_entry(await registry.manage("SetAlias", request_pb), caller.tenant))


@router.delete("/v1/adapters/{name}/aliases/{alias}", response_model=Adapter, responses=errors(*REGISTRY_ERRORS))
async def remove_alias(name: str, alias: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    request_pb = pb.SetAliasRequest(tenant=caller.tenant, name=name, alias=alias, version=0)
    return JSONResponse(adapter_entry(await registry.manage("SetAlias", request_pb), caller.tenant))


@router.delete(
    "/v1/adapters/{name}/versions/{version}", response_model=AdapterDeleted, responses=errors(*REGISTRY_ERRORS)
)
async def delete_version(
    name: str, version: Annotated[int, Path(ge=1, le=MAX_VERSION)], caller: CallerDep, registry: RegistryDep
) -> JSONResponse:
    return await _delete(caller.tenant, name, version, registry)


@router.delete("/v1/adapters/{name}", response_model=AdapterDeleted, responses=errors(*REGISTRY_ERRORS))
async def delete_adapter(name: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    return await _delete(caller.tenant, name, 0, registry)


async def _delete(tenant: str, name: str, version: int, registry: AsyncRegistry) -> JSONResponse:
    deleted = await registry.manage("Delete", pb.DeleteRequest(tenant=tenant, name=name, version=version))
    return JSONResponse({"object": "adapter.deleted", "name": name, "versions": list(deleted.versions)})
