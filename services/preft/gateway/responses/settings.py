"""The Responses API's settings: stored responses, conversations, background runs. One part of
`preft.gateway.settings.GatewaySettings` (flat `PREFT_GATEWAY__*` names)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ResponsesSettings(BaseModel):
    """How long responses and conversations are kept, how large conversations grow, how many run in the background."""

    responses_store_ttl_s: float = Field(
        0.0,
        ge=0,
        description="How long POST /v1/responses keeps a response for previous_response_id and GET, and a "
        "conversation after its last change (0: neither is stored)",
    )
    conversations_max_items: int = Field(
        4096, ge=1, description="Items one conversation holds (adding past it: 400; a response's output may pass it)"
    )
    conversations_max_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Bytes of items (as JSON) one conversation holds (past it: 400, as items)"
    )
    conversations_max_per_tenant: int = Field(
        10_000, ge=1, description="Conversations one tenant holds at once (another: 429 until some expire or go)"
    )
    responses_background_max: int = Field(
        256, ge=0, description="Background responses one gateway replica runs at once (more: 503)"
    )
