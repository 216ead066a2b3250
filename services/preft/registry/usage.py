"""Reading the gateway's token metering (layout in ``common.metering``) for ``GetTokenUsage``: date ranges and rows.

Pure logic; the registry's index reads the day hashes and the admin CLI checks its arguments with the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import date

from preft.common.metering import MAX_QUERY_DAYS, ModelUsage, day_rows, days

_ISO_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def parse_iso_day(text: str, what: str) -> date:
    """A YYYY-MM-DD date; ValueError naming `what` (e.g. "start_date") otherwise."""
    if not _ISO_DAY.fullmatch(text):
        raise ValueError(f"{what} {text!r} is not a date written YYYY-MM-DD")
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a day of the calendar") from None


def query_days(first: date, last: date) -> list[date]:
    """Every day from first to last, both included; ValueError if last is before first or the span is too long."""
    if last < first:
        raise ValueError(f"the range ends ({last}) before it starts ({first})")
    span = days(first, last)
    if len(span) > MAX_QUERY_DAYS:
        raise ValueError(f"{first}..{last} spans {len(span)} days; one query spans at most {MAX_QUERY_DAYS}")
    return span


def usage_rows(
    day_hashes: Iterable[tuple[date, Mapping[bytes | str, bytes | str]]], *, by_model: bool
) -> list[ModelUsage]:
    """Rows by day (then model) from each day's hash: per model, days without use omitted; else one row per day,
    zeros included, so a table shows every day."""
    return [row for day, fields in day_hashes for row in day_rows(day, fields, by_model=by_model)]
