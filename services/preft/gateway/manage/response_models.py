"""What the management routes answer, for /openapi.json (``core.response_models`` says why models only document
answers the routes build as dicts): adapters and their versions, share offers, and token usage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from preft.gateway.core.response_models import Documented


class AdapterFile(Documented):
    path: str
    sha256: str
    size_bytes: int


class AdapterVersion(Documented):
    """One version of an adapter (`uploader` only to its owner: it names the owner's API key)."""

    object: Literal["adapter.version"]
    id: str = Field(description="name@vN")
    name: str
    version: int
    owner: str
    digest: str
    method: Literal["lora", "direft", "unknown"]
    default_mode: Literal["prefill", "all"]
    rank: int
    target_modules: list[str]
    layers: list[int]
    base_model: str
    size_bytes: int
    files: list[AdapterFile]
    created: int
    uploader: str | None = None


class Adapter(Documented):
    """An adapter: the tenant's own by name (with whom it is shared and offered to), a shared one as owner/name."""

    object: Literal["adapter"]
    id: str
    name: str
    owner: str
    aliases: dict[str, int] = Field(description="alias → version")
    version_count: int
    latest: AdapterVersion
    shared_with: list[str] | None = None
    offered_to: list[str] | None = None


class AdapterDetail(Adapter):
    versions: list[AdapterVersion]


class AdapterList(Documented):
    object: Literal["list"]
    data: list[Adapter]


class AdapterUpload(Documented):
    created: bool = Field(description="False: the latest version already had this content and mode (200)")
    adapter: AdapterVersion


class AdapterDeleted(Documented):
    object: Literal["adapter.deleted"]
    name: str
    versions: list[int] = Field(description="The versions deleted")


class ShareOffer(Documented):
    """An offer of an adapter, as its recipient sees it."""

    object: Literal["adapter.share_offer"]
    id: str = Field(description="owner/name")
    owner: str
    name: str
    status: Literal["offered", "accepted"]
    latest: AdapterVersion


class ShareOfferList(Documented):
    object: Literal["list"]
    data: list[ShareOffer]


class ShareOfferDeleted(Documented):
    object: Literal["adapter.share_offer.deleted"]
    id: str
    deleted: Literal[True]


class UsageResult(Documented):
    object: Literal["organization.usage.completions.result"]
    input_tokens: int
    output_tokens: int
    input_cached_tokens: int
    input_audio_tokens: int
    output_audio_tokens: int
    num_model_requests: int
    project_id: None
    user_id: None
    api_key_id: None
    model: str | None = Field(description="With group_by=model")
    batch: None


class UsageBucket(Documented):
    object: Literal["bucket"]
    start_time: int
    end_time: int
    results: list[UsageResult]


class UsagePage(Documented):
    object: Literal["page"]
    data: list[UsageBucket]
    has_more: bool
    next_page: str | None = Field(description="The `page` of the next page")
