"""GET /v1/organization/usage/completions: the caller's tenant's token usage, in OpenAI's usage API shape.

The tenant is the organization. Usage is kept per UTC day, hour and minute (``common.metering``; hours for
``HOUR_RETENTION_DAYS``, minutes for ``MINUTE_RETENTION_DAYS``), so buckets are one day wide (`bucket_width=1d`,
OpenAI's default), one hour (`1h`) or one minute (`1m`) and start on the UTC day, hour or minute that holds
`start_time`; a `start_time` before what its width keeps is refused. `end_time` (exclusive, default now) ends the
range; `limit` buckets a page (OpenAI's: for days 7 by default and at most 31, for hours 24 and 168, for minutes 60
and 1440), `page` the cursor a previous page's `next_page` gave. `group_by=model` gives one result per model, `models`
keeps only those; the other groupings OpenAI offers (project, user, API key, batch) are refused. A bucket without use
has no result. The usage of the last few seconds may not be in yet: each gateway replica adds it to Redis every
`metering_flush_interval_s`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse

from preft.common import metering
from preft.common.errors import InvalidArgument
from preft.gateway.core.deps import CallerDep, RedisDep, SettingsDep
from preft.gateway.core.openapi import errors
from preft.gateway.core.redis_client import guarded
from preft.gateway.manage.response_models import UsagePage

router = APIRouter(tags=["usage"])


@dataclass(frozen=True)
class Width:
    """A bucket width: its seconds, a page's buckets by default and at most (OpenAI's), its cursor's format, and how
    long its hashes are kept."""

    seconds: int
    default_limit: int
    max_limit: int
    cursor: str  # (strftime of the page's first bucket start, UTC)
    kept_days: int | None = None  # (None: the days', longer than a query reaches)
    noun: str = ""  # (the width in the refusal of a start_time before kept_days)
    coarser: str = ""  # (the width that refusal points to)

    def key(self, tenant: str, start_s: int) -> str:
        if self.seconds == metering.DAY_S:
            return metering.day_key(tenant, metering.day_of(start_s))
        if self.seconds == metering.HOUR_S:
            return metering.hour_key(tenant, start_s)
        return metering.minute_key(tenant, start_s)

    def kept_since(self, now_s: float) -> int | None:
        """The first bucket start whose hash is surely kept at `now_s`: a hash lives `kept_days` past its last
        write, which is not before its bucket's start."""
        if self.kept_days is None:
            return None
        return -(-(int(now_s) - self.kept_days * metering.DAY_S) // self.seconds) * self.seconds


WIDTHS = {
    "1d": Width(metering.DAY_S, 7, 31, "%Y-%m-%d"),
    "1h": Width(metering.HOUR_S, 24, 168, "%Y-%m-%dT%H:00Z", metering.HOUR_RETENTION_DAYS, "hourly", "1d"),
    "1m": Width(metering.MINUTE_S, 60, 1440, "%Y-%m-%dT%H:%MZ", metering.MINUTE_RETENTION_DAYS, "per-minute", "1h"),
}


def _list_param(request: Request, name: str) -> list[str]:
    """A list parameter as `name=` or, as OpenAI's clients send lists, `name[]=`."""
    return request.query_params.getlist(name) + request.query_params.getlist(f"{name}[]")


def _page_start(page: str | None, width: Width, first: int, last: int) -> int:
    """The Unix time the page starts at: `first` without a cursor, else the cursor's bucket start."""
    if page is None:
        return first
    try:
        start = int(datetime.strptime(page, width.cursor).replace(tzinfo=UTC).timestamp())
    except ValueError:
        raise InvalidArgument(f"page {page!r} is not a cursor this route gave (next_page)") from None
    if not first <= start <= last:
        raise InvalidArgument(f"page {page!r} lies outside start_time..end_time")
    return start


def _result(usage: metering.ModelUsage, grouped: bool) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "input_cached_tokens": 0,
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": usage.requests,
        "project_id": None,
        "user_id": None,
        "api_key_id": None,
        "model": usage.model if grouped else None,
        "batch": None,
    }


@router.get("/v1/organization/usage/completions", response_model=UsagePage, responses=errors(400))
async def completions_usage(
    request: Request,
    caller: CallerDep,
    redis: RedisDep,
    settings: SettingsDep,
    start_time: Annotated[int, Query(ge=0)],
    end_time: Annotated[int | None, Query(ge=1)] = None,
    bucket_width: Literal["1m", "1h", "1d"] = "1d",
    limit: Annotated[int | None, Query(ge=1)] = None,
    page: str | None = None,
) -> JSONResponse:
    width = WIDTHS[bucket_width]
    limit = width.default_limit if limit is None else limit
    if limit > width.max_limit:
        raise InvalidArgument(f"limit {limit}: a page holds at most {width.max_limit} buckets of {bucket_width}")
    group_by = _list_param(request, "group_by")
    if set(group_by) - {"model"}:
        raise InvalidArgument(f"group_by {sorted(set(group_by) - {'model'})}: usage can be grouped by model only")
    grouped, models = "model" in group_by, set(_list_param(request, "models"))
    end = time.time() if end_time is None else end_time
    if end <= start_time:
        raise InvalidArgument("end_time must be after start_time")
    first, last = start_time // width.seconds * width.seconds, (math.ceil(end) - 1) // width.seconds * width.seconds
    kept_since = width.kept_since(time.time())
    if kept_since is not None and first < kept_since:
        raise InvalidArgument(
            f"start_time {start_time}: {width.noun} usage is kept {width.kept_days} days (since {kept_since});"
            f" use bucket_width={width.coarser} for older usage"
        )
    start = _page_start(page, width, first, last)
    starts = range(start, min(last, start + (limit - 1) * width.seconds) + 1, width.seconds)
    pipe = redis.pipeline(transaction=False)
    for start_s in starts:
        pipe.hgetall(width.key(caller.tenant, start_s))
    hashes = await guarded(pipe.execute(), settings.redis_timeout_s)
    data = []
    for start_s, fields in zip(starts, hashes, strict=True):
        rows = metering.day_rows(metering.day_of(start_s), fields, by_model=grouped, models=models)
        data.append(
            {
                "object": "bucket",
                "start_time": start_s,
                "end_time": start_s + width.seconds,
                "results": [_result(r, grouped) for r in rows if r.requests],
            }
        )
    more = starts[-1] < last
    cursor = datetime.fromtimestamp(starts[-1] + width.seconds, UTC).strftime(width.cursor) if more else None
    return JSONResponse({"object": "page", "data": data, "has_more": more, "next_page": cursor})
