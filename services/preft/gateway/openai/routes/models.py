"""GET /v1/models (and /v1/models/{model}): the base model and the adapters the caller's tenant may use.

A tenant's own adapters are listed by bare name, adapters shared with it as `owner/name`: each id is a valid
`model` for the generation routes. Adapters of other tenants never appear, and retrieving one answers 404
exactly like a model that does not exist.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse

from preft.gateway.core.deps import CallerDep, RegistryDep, ResolverDep, SettingsDep
from preft.gateway.core.openapi import errors
from preft.gateway.openai.response_models import Model, ModelList

router = APIRouter(tags=["models"])


def model_entry(model_id: str, owner: str, created_unix_ms: int = 0) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created_unix_ms // 1000, "owned_by": owner}


@router.get("/v1/models", response_model=ModelList)
async def list_models(caller: CallerDep, registry: RegistryDep, settings: SettingsDep) -> JSONResponse:
    base = settings.served_model_name
    data = [model_entry(base, "preft")]
    for a in await registry.list_adapters(caller.tenant):
        # A bare name equal to the base model's would mean the base model: qualify it.
        own = a.tenant == caller.tenant and not settings.is_base_model(a.name)
        data.append(model_entry(a.name if own else f"{a.tenant}/{a.name}", a.tenant, a.latest.created_unix_ms))
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model:path}", response_model=Model, responses=errors(404))
async def retrieve_model(model: str, caller: CallerDep, resolver: ResolverDep, settings: SettingsDep) -> JSONResponse:
    if settings.is_base_model(model):
        return JSONResponse(model_entry(settings.served_model_name, "preft"))
    version = await resolver.find(caller.tenant, model)
    return JSONResponse(model_entry(model, version.owner, version.created_unix_ms))
