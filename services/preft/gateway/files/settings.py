"""The Files API's settings: its bucket, sizes and sweeping. One part of `preft.gateway.settings.GatewaySettings`
(flat `PREFT_GATEWAY__*` names)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from preft.common.settings import S3Settings


class FilesSettings(BaseModel):
    """The bucket of files (and of batches' inputs), and the limits on files."""

    s3: S3Settings | None = Field(
        None,
        description="The bucket holding the Files API's files (under files/) and the batches' inputs (under "
        "batches/); unset: /v1/files and /v1/batches answer 400",
    )
    files_max_bytes: int = Field(
        200 * 1024 * 1024, ge=1024, description="Largest file upload through POST /v1/files (larger: 413)"
    )
    files_max_per_tenant: int = Field(
        10_000, ge=1, description="Files one tenant holds at once (another upload: 429; batch outputs may pass it)"
    )
    files_sweep_period_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How often each gateway replica removes expired files (a bounded number each round); an expired "
        "file answers 404 at once, and counts against its tenant's files until it is removed",
    )
