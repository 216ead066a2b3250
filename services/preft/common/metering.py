"""Per-tenant token metering: what each tenant's generations used, by UTC day and model, as Redis keeps it.

The gateway writes it (``gateway.metering``); the gateway's usage route and the registry's ``GetTokenUsage`` read it.

Layout: one hash per tenant and UTC day, ``preft:usage:<tenant>:<YYYY-MM-DD>``, whose fields are ``<counter>|<model>``:
the counter one of ``COUNTERS`` and the model as the request resolved it (``owner/name@vN`` for an adapter, the
served base model's name otherwise). A day's hash expires ``RETENTION_DAYS`` after its last write. The same counts
by UTC hour, ``preft:usage-hour:<tenant>:<YYYY-MM-DDTHH>``, expire ``HOUR_RETENTION_DAYS`` after theirs, and by UTC
minute, ``preft:usage-minute:<tenant>:<YYYY-MM-DDTHH:MM>``, ``MINUTE_RETENTION_DAYS`` after theirs. Beside them, the
tenant's tokens (input and output) of each UTC month, ``preft:usage-month:<tenant>:<YYYY-MM>``, a counter the gateway's
admission reads against the tenant's `tokens_per_month` quota, kept ``MONTH_TTL_DAYS``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

PREFIX = "preft:usage:"
COUNTERS = ("requests", "input_tokens", "output_tokens")
RETENTION_DAYS = 400  # a day's counts stay this long after its last write (a year of history, and a margin)
HOUR_RETENTION_DAYS = 35  # an hour's counts stay this long after their last write (a month of hourly detail)
# a minute's counts stay this long after their last write: OpenAI's largest page of minutes (1440) is a day; a second
# day keeps all of yesterday readable until midnight, at most 2,880 small hashes per tenant
MINUTE_RETENTION_DAYS = 2
MINUTE_S, HOUR_S, DAY_S = 60, 3_600, 86_400
MONTH_TTL_DAYS = 62  # a month's token counter stays this long after its last write (past the month's end)
MAX_QUERY_DAYS = 366  # the most days one read spans


@dataclass(frozen=True)
class ModelUsage:
    """One tenant's use of one model on one UTC day."""

    day: date
    model: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


def day_of(unix_s: float) -> date:
    """The UTC day of a Unix time."""
    return datetime.fromtimestamp(unix_s, UTC).date()


def day_key(tenant: str, day: date) -> str:
    return f"{PREFIX}{tenant}:{day.isoformat()}"


def hour_key(tenant: str, hour_start_s: int) -> str:
    """The hash of the tenant's counts in the UTC hour starting at `hour_start_s`."""
    return f"preft:usage-hour:{tenant}:{datetime.fromtimestamp(hour_start_s, UTC):%Y-%m-%dT%H}"


def minute_key(tenant: str, minute_start_s: int) -> str:
    """The hash of the tenant's counts in the UTC minute starting at `minute_start_s`."""
    return f"preft:usage-minute:{tenant}:{datetime.fromtimestamp(minute_start_s, UTC):%Y-%m-%dT%H:%M}"


def month_key(tenant: str, day: date) -> str:
    """The counter of the tenant's tokens in the UTC month of `day`."""
    return f"preft:usage-month:{tenant}:{day:%Y-%m}"


def field(counter: str, model: str) -> str:
    return f"{counter}|{model}"


def days(first: date, last: date) -> list[date]:
    """Every day from first to last, both included (none when last is before first)."""
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def parse_day(day: date, fields: Mapping[bytes | str, bytes | str]) -> list[ModelUsage]:
    """A day's hash as one row per model, by model name; fields that are not ``<counter>|<model>`` are skipped."""
    counts: dict[str, dict[str, int]] = {}
    for raw_field, raw_value in fields.items():
        name = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
        counter, sep, model = name.partition("|")
        if not sep or counter not in COUNTERS:
            continue
        try:
            value = int(raw_value)
        except ValueError:
            continue
        counts.setdefault(model, {})[counter] = value
    return [ModelUsage(day, model, **counts[model]) for model in sorted(counts)]


def day_rows(
    day: date, fields: Mapping[bytes | str, bytes | str], *, by_model: bool, models: Collection[str] = ()
) -> list[ModelUsage]:
    """A day's hash as rows: one per model (those of `models`, where given), or their totals in one row, zeros
    included where nothing was used."""
    rows = [r for r in parse_day(day, fields) if not models or r.model in models]
    return rows if by_model else [totals(rows, day)]


def totals(rows: Iterable[ModelUsage], day: date, model: str = "") -> ModelUsage:
    """The rows' counts summed, labelled with `day` and `model`."""
    rows = list(rows)
    return ModelUsage(
        day,
        model,
        requests=sum(r.requests for r in rows),
        input_tokens=sum(r.input_tokens for r in rows),
        output_tokens=sum(r.output_tokens for r in rows),
    )
