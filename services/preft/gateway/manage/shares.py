"""Sharing an adapter is an offer its recipient accepts: an owner cannot push adapters into another tenant's models.

    PUT    /v1/adapters/{name}/shares/{tenant}                  owner: offer it (202, the owner's adapter entry)
    DELETE /v1/adapters/{name}/shares/{tenant}                  owner: withdraw the offer or the share (200)
    GET    /v1/adapters/shares/offers                           recipient: offers to it, pending and accepted
    POST   /v1/adapters/shares/offers/{owner}/{name}/accept     recipient: accept; then usable as owner/name (200)
    DELETE /v1/adapters/shares/offers/{owner}/{name}            recipient: decline, or leave an accepted share (200)

The owner's answers never tell whether the named tenant exists: an offer to any well-formed name is taken and
answered alike (202, the same body, the same Redis work); one to a name no tenant has yet waits under that name.
The recipient's answers are one 404 for a missing owner, adapter or offer. Only accepted shares list in the
recipient's `/v1/models` and `/v1/adapters` and resolve for it; the recipient sees the owner's tenant id (it is in
the model id) but never who uploaded a version (`uploader` names the owner's API key). An operator can still share
directly, with no offer to accept (`preft-admin adapter share`, the registry's Share without `offer`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse

from preft.api.v1 import registry_pb2 as pb
from preft.gateway.core.deps import CallerDep, RegistryDep
from preft.gateway.core.openapi import REGISTRY_ERRORS, errors
from preft.gateway.manage.adapters import adapter_entry, version_entry
from preft.gateway.manage.response_models import Adapter, ShareOffer, ShareOfferDeleted, ShareOfferList

router = APIRouter(tags=["adapters"])


def offer_entry(o: pb.ShareOffer) -> dict[str, Any]:
    """An offer as its recipient sees it."""
    a = o.adapter
    return {
        "object": "adapter.share_offer",
        "id": f"{a.tenant}/{a.name}",
        "owner": a.tenant,
        "name": a.name,
        "status": "accepted" if o.accepted else "offered",
        "latest": version_entry(a.latest, own=False),
    }


@router.put(
    "/v1/adapters/{name}/shares/{tenant}",
    status_code=202,
    response_model=Adapter,
    responses=errors(*REGISTRY_ERRORS),
)
async def offer(name: str, tenant: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    request_pb = pb.ShareRequest(tenant=caller.tenant, name=name, add=[tenant], offer=True)
    return JSONResponse(adapter_entry(await registry.manage("Share", request_pb), caller.tenant), status_code=202)


@router.delete("/v1/adapters/{name}/shares/{tenant}", response_model=Adapter, responses=errors(*REGISTRY_ERRORS))
async def withdraw(name: str, tenant: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    # (offer=True: the registry looks the tenant up neither way, so this answers alike for an unknown one)
    request_pb = pb.ShareRequest(tenant=caller.tenant, name=name, remove=[tenant], offer=True)
    return JSONResponse(adapter_entry(await registry.manage("Share", request_pb), caller.tenant))


@router.get("/v1/adapters/shares/offers", response_model=ShareOfferList, responses=errors(*REGISTRY_ERRORS))
async def list_offers(caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    listed = await registry.manage("ListShareOffers", pb.ListShareOffersRequest(tenant=caller.tenant))
    return JSONResponse({"object": "list", "data": [offer_entry(o) for o in listed.offers]})


@router.post(
    "/v1/adapters/shares/offers/{owner}/{name}/accept", response_model=ShareOffer, responses=errors(*REGISTRY_ERRORS)
)
async def accept(owner: str, name: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    request_pb = pb.AnswerShareOfferRequest(tenant=caller.tenant, owner=owner, name=name, accept=True)
    return JSONResponse(offer_entry(await registry.manage("AnswerShareOffer", request_pb)))


@router.delete(
    "/v1/adapters/shares/offers/{owner}/{name}",
    response_model=ShareOfferDeleted,
    responses=errors(*REGISTRY_ERRORS),
)
async def decline(owner: str, name: str, caller: CallerDep, registry: RegistryDep) -> JSONResponse:
    request_pb = pb.AnswerShareOfferRequest(tenant=caller.tenant, owner=owner, name=name, accept=False)
    await registry.manage("AnswerShareOffer", request_pb)
    return JSONResponse({"object": "adapter.share_offer.deleted", "id": f"{owner}/{name}", "deleted": True})
