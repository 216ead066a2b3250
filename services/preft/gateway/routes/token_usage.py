"""GET /v1/organization/usage/completions: the caller's tenant's token usage, in OpenAI's usage API shape.

The tenant is the organization. Usage is kept per UTC day (``common.metering``), so buckets are one day wide
(`bucket_width=1d`, OpenAI's default; `1h` and `1m` are refused) and start at UTC midnight: a `start_time` within
a day starts at that day. `end_time` (exclusive, default now) ends the range; `limit` buckets a page (default 7,
at most 31), `page` the cursor a previous page's `next_page` gave. `group_by=model` gives one result per model,
`models` keeps only those; the other groupings OpenAI offers (project, user, API key, batch) are refused. A day
without use has no result. The usage of the last few seconds may not be in yet: each gateway replica adds it
to Redis every `metering_flush_interval_s`.
"""

from __future__ import annotations

import time
from datetime import date, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse

from preft.common import metering
from preft.common.errors import InvalidArgument
from preft.gateway.deps import CallerDep, RedisDep, SettingsDep
from preft.gateway.redis_client import guarded

router = APIRouter(tags=["usage"])
MAX_BUCKETS = 31  # a page's buckets at most (OpenAI's for 1d)


def _list_param(request: Request, name: str) -> list[str]:
    """A list parameter as `name=` or, as OpenAI's clients send lists, `name[]=`."""
    return request.query_params.getlist(name) + request.query_params.getlist(f"{name}[]")


def _page_start(page: str | None, first: date, last: date) -> date:
    if page is None:
        return first
    try:
        start = date.fromisoformat(page)
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


@router.get("/v1/organization/usage/completions")
async def completions_usage(
    request: Request,
    caller: CallerDep,
    redis: RedisDep,
    settings: SettingsDep,
    start_time: Annotated[int, Query(ge=0)],
    end_time: Annotated[int | None, Query(ge=1)] = None,
    bucket_width: Literal["1m", "1h", "1d"] = "1d",
    limit: Annotated[int, Query(ge=1, le=MAX_BUCKETS)] = 7,
    page: str | None = None,
) -> JSONResponse:
    if bucket_width != "1d":
        raise InvalidArgument(f"bucket_width {bucket_width!r}: usage is kept per day; use 1d")
    group_by = _list_param(request, "group_by")
    if set(group_by) - {"model"}:
        raise InvalidArgument(f"group_by {sorted(set(group_by) - {'model'})}: usage can be grouped by model only")
    grouped, models = "model" in group_by, set(_list_param(request, "models"))
    end = time.time() if end_time is None else end_time
    if end <= start_time:
        raise InvalidArgument("end_time must be after start_time")
    first, last = metering.day_of(start_time), metering.day_of(end - 1)
    start = _page_start(page, first, last)
    days = metering.days(start, min(last, start + timedelta(days=limit - 1)))
    pipe = redis.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(metering.day_key(caller.tenant, day))
    hashes = await guarded(pipe.execute(), settings.redis_timeout_s)
    data = []
    for day, fields in zip(days, hashes, strict=True):
        rows = [r for r in metering.day_rows(day, fields, by_model=grouped, models=models) if r.requests]
        start_s = metering.day_start_s(day)
        data.append(
            {
                "object": "bucket",
                "start_time": start_s,
                "end_time": start_s + 86_400,
                "results": [_result(r, grouped) for r in rows],
            }
        )
    more = days[-1] < last
    return JSONResponse(
        {
            "object": "page",
            "data": data,
            "has_more": more,
            "next_page": (days[-1] + timedelta(days=1)).isoformat() if more else None,
        }
    )
