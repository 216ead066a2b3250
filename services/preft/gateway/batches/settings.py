"""The Batch API's settings: how many batches and lines run, leases, parts. One part of
`preft.gateway.settings.GatewaySettings` (flat `PREFT_GATEWAY__*` names)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class BatchesSettings(BaseModel):
    """How batches run over the replicas: their caps, leases, parts and how long they are kept."""

    batches_max_requests: int = Field(
        50_000, ge=1, description="Requests one batch input file holds at most (more: 400 at upload)"
    )
    batches_max_running: int = Field(
        4, ge=0, description="Batches one gateway replica runs at once (others wait for a replica with room)"
    )
    batches_max_running_per_tenant: int = Field(
        2,
        ge=0,
        description="Batches of one tenant run at once over all replicas (0: no limit); the others wait, and waiting "
        "batches start in turn across tenants, those with the fewest running first",
    )
    batches_max_open_per_tenant: int = Field(
        100, ge=1, description="Batches of one tenant not ended yet (another create: 429)"
    )
    batches_line_concurrency: int = Field(
        8, ge=1, description="Requests of one batch answered at once (batches take no per-minute rate limits)"
    )
    batches_max_lines_in_flight: int = Field(
        32,
        ge=0,
        description="Batch requests at the engines at once over all gateway replicas (0: no limit beyond each "
        "replica's own); keep it below the engines' room, replicas × max_ongoing_requests, so that live requests "
        "never queue behind batch lines",
    )
    batches_completion_window_s: float = Field(
        86_400.0,
        gt=0,
        description="How long a batch has (OpenAI's completion_window 24h); requests not answered by then expire",
    )
    batches_lease_s: float = Field(
        30.0, gt=0, description="A batch's lease: another replica takes it on this long after its replica stopped"
    )
    batches_poll_s: float = Field(
        1.0, gt=0, description="How often a replica renews its batches' leases, sees cancels and looks for batches"
    )
    batches_part_lines: int = Field(
        1000,
        ge=1,
        le=10_000,
        description="Answered lines of a running batch written to S3 as one part (and then recorded in Redis) at "
        "most; lines answered but not yet in a recorded part are answered again after a crash",
    )
    batches_part_s: float = Field(
        10.0,
        gt=0,
        description="How often a running batch writes the lines it answered as a part, however few: how late its "
        "request_counts are at most, and the answers a crash loses at most (fewer, larger parts: raise it)",
    )
    batches_compact_parts: int = Field(
        32,
        ge=0,
        description="Recorded parts of a running batch from which it merges runs of its small parts into one "
        "(tiered: a line is rewritten a few times at most), so finalizing downloads few (0: never)",
    )
    batches_keep_s: float = Field(30 * 86_400.0, gt=0, description="How long a batch is kept after it ended")

    @model_validator(mode="after")
    def _check_batches(self) -> BatchesSettings:
        if self.batches_poll_s * 2 >= self.batches_lease_s:
            raise ValueError("batches_poll_s must be under half of batches_lease_s (a lease is renewed every poll)")
        return self
