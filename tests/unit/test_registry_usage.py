"""The registry's reading of token metering (pure logic): date parsing, range checks, rows by day or by model."""

from __future__ import annotations

from datetime import date, timedelta

import pytest

from preft.common.metering import MAX_QUERY_DAYS, ModelUsage, field
from preft.registry.usage import parse_iso_day, query_days, usage_rows


def test_parse_iso_day_takes_only_yyyy_mm_dd():
    assert parse_iso_day("2026-02-28", "start_date") == date(2026, 2, 28)
    assert parse_iso_day("2024-02-29", "start_date") == date(2024, 2, 29)
    for text in ("2026-2-28", "20260228", "2026-W09-6", "28-02-2026", "", " 2026-02-28", "２０２６-02-28"):
        with pytest.raises(ValueError, match=r"end_date .* is not a date written YYYY-MM-DD"):
            parse_iso_day(text, "end_date")
    for text in ("2026-02-29", "2026-13-01", "2026-00-10"):
        with pytest.raises(ValueError, match="is not a day of the calendar"):
            parse_iso_day(text, "end_date")


def test_query_days_bounds():
    first = date(2025, 12, 30)
    assert query_days(first, first) == [first]
    assert query_days(first, date(2026, 1, 2)) == [first + timedelta(days=i) for i in range(4)]
    longest = query_days(first, first + timedelta(days=MAX_QUERY_DAYS - 1))
    assert len(longest) == MAX_QUERY_DAYS and longest[-1] - longest[0] == timedelta(days=MAX_QUERY_DAYS - 1)
    with pytest.raises(ValueError, match=f"spans {MAX_QUERY_DAYS + 1} days; one query spans at most {MAX_QUERY_DAYS}"):
        query_days(first, first + timedelta(days=MAX_QUERY_DAYS))
    with pytest.raises(ValueError, match=r"ends \(2025-12-29\) before it starts \(2025-12-30\)"):
        query_days(first, date(2025, 12, 29))


def test_usage_rows_fill_days_or_group_by_model():
    d1, d2, d3 = date(2026, 3, 1), date(2026, 3, 2), date(2026, 3, 3)
    hashes = [
        (
            d1,
            {
                field("requests", "base"): "1",
                field("input_tokens", "base"): "10",
                field("output_tokens", "base"): "5",
                field("requests", "acme/chat@2"): "2",
                field("input_tokens", "acme/chat@2"): "100",
                field("output_tokens", "acme/chat@2"): "40",
            },
        ),
        (d2, {}),
        (d3, {b"requests|acme/chat@2": b"3", b"output_tokens|acme/chat@2": b"7"}),  # bytes, as a raw client reads
    ]
    assert usage_rows(hashes, by_model=False) == [
        ModelUsage(d1, "", 3, 110, 45),
        ModelUsage(d2, "", 0, 0, 0),
        ModelUsage(d3, "", 3, 0, 7),
    ]
    assert usage_rows(hashes, by_model=True) == [
        ModelUsage(d1, "acme/chat@2", 2, 100, 40),
        ModelUsage(d1, "base", 1, 10, 5),
        ModelUsage(d3, "acme/chat@2", 3, 0, 7),
    ]
    assert usage_rows([], by_model=False) == []
