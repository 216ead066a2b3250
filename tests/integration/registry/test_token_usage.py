"""`GetTokenUsage` and `preft-admin usage` against a real registry and Redis, over hashes laid out as the gateway
writes them (``common.metering``): totals, every day shown, by-model rows, range checks, errors and exit codes."""

from __future__ import annotations

import json
import time
from datetime import date, timedelta

import pytest
from typer.testing import CliRunner

from preft.api.v1 import registry_pb2 as pb
from preft.cli.admin import app
from preft.common import metering
from preft.common.errors import InvalidArgument, NotFound, Unauthenticated
from preft.registry.client import RegistryClient

from .conftest import TOKEN

runner = CliRunner()
D1, D2, D3 = date(2026, 3, 1), date(2026, 3, 2), date(2026, 3, 3)
CHAT = "acme/support@3"


def meter(redis_client, tenant: str, day: date, model: str, requests: int, input_tokens: int, output_tokens: int):
    """Add counts as the gateway does: HINCRBY on the tenant's day hash, one field per counter and model."""
    key = metering.day_key(tenant, day)
    for counter, value in zip(metering.COUNTERS, (requests, input_tokens, output_tokens), strict=True):
        redis_client.hincrby(key, metering.field(counter, model), value)


@pytest.fixture
def metered(client, redis_client) -> RegistryClient:
    for t in ("acme", "beta"):
        client.call("CreateTenant", pb.CreateTenantRequest(id=t))
    meter(redis_client, "acme", D1, CHAT, 2, 100, 40)
    meter(redis_client, "acme", D1, "base", 1, 10, 5)
    meter(redis_client, "acme", D3, CHAT, 1, 120, 50)
    meter(redis_client, "acme", D3, CHAT, 2, 180, 70)  # a second batch adds to the same fields
    redis_client.hset(metering.day_key("acme", D3), "not-a-counter", "9")  # fields of another shape are skipped
    meter(redis_client, "acme", D1 - timedelta(days=1), "base", 60, 6000, 600)  # outside the range
    meter(redis_client, "acme", D3 + timedelta(days=1), "base", 50, 5000, 500)  # outside the range
    meter(redis_client, "beta", D2, "base", 7, 70, 7)  # another tenant's
    return client


def rows(res: pb.GetTokenUsageResponse) -> list[tuple]:
    return [(r.date, r.model, r.requests, r.input_tokens, r.output_tokens) for r in res.rows]


def total(res: pb.GetTokenUsageResponse) -> tuple[int, int, int]:
    return res.total.requests, res.total.input_tokens, res.total.output_tokens


def test_usage_per_day_with_every_day_and_totals(metered):
    res = metered.token_usage("acme", D1, D3)
    assert (res.tenant, res.start_date, res.end_date) == ("acme", "2026-03-01", "2026-03-03")
    assert rows(res) == [
        ("2026-03-01", "", 3, 110, 45),
        ("2026-03-02", "", 0, 0, 0),  # no use that day: a row of zeros
        ("2026-03-03", "", 3, 300, 120),
    ]
    assert total(res) == (6, 410, 165)
    beta = metered.token_usage("beta", D1, D3)
    assert rows(beta) == [("2026-03-01", "", 0, 0, 0), ("2026-03-02", "", 7, 70, 7), ("2026-03-03", "", 0, 0, 0)]
    assert total(beta) == (7, 70, 7)


def test_usage_by_model_omits_days_without_use(metered):
    res = metered.token_usage("acme", D1, D3, by_model=True)
    assert rows(res) == [
        ("2026-03-01", CHAT, 2, 100, 40),
        ("2026-03-01", "base", 1, 10, 5),
        ("2026-03-03", CHAT, 3, 300, 120),
    ]
    assert total(res) == (6, 410, 165)
    one_day = metered.token_usage("acme", D3 + timedelta(days=1), D3 + timedelta(days=1), by_model=True)
    assert rows(one_day) == [("2026-03-04", "base", 50, 5000, 500)] and total(one_day) == (50, 5000, 500)
    nothing = metered.token_usage("acme", D2, D2, by_model=True)
    assert rows(nothing) == [] and total(nothing) == (0, 0, 0)


def test_usage_range_limits(metered):
    longest = metered.token_usage("acme", D3 - timedelta(days=metering.MAX_QUERY_DAYS - 1), D3)
    assert len(longest.rows) == metering.MAX_QUERY_DAYS and longest.rows[-1].date == "2026-03-03"
    assert total(longest) == (6 + 60, 410 + 6000, 165 + 600)
    with pytest.raises(InvalidArgument, match=f"spans {metering.MAX_QUERY_DAYS + 1} days"):
        metered.token_usage("acme", D3 - timedelta(days=metering.MAX_QUERY_DAYS), D3)
    with pytest.raises(InvalidArgument, match=r"ends \(2026-03-01\) before it starts \(2026-03-03\)"):
        metered.token_usage("acme", D3, D1)
    for start, end, word in (
        ("2026-3-01", "2026-03-03", "start_date '2026-3-01' is not a date written YYYY-MM-DD"),
        ("", "2026-03-03", "start_date '' is not"),
        ("2026-03-01", "20260303", "end_date '20260303' is not a date"),
        ("2026-02-29", "2026-03-03", "start_date '2026-02-29' is not a day of the calendar"),
    ):
        with pytest.raises(InvalidArgument) as info:
            metered.token_usage("acme", start, end)
        assert word in str(info.value)


def test_usage_of_unknown_tenant_and_non_admin_caller(metered, registry_address):
    with pytest.raises(NotFound, match="tenant 'ghost' does not exist"):
        metered.token_usage("ghost", D1, D3)
    with pytest.raises(InvalidArgument, match="tenant id"):
        metered.token_usage("Not A Name", D1, D3)
    secret = metered.call("IssueKey", pb.IssueKeyRequest(tenant="acme")).secret  # a tenant's key is no admin token
    for token in (secret, "not-the-token"):
        with RegistryClient(registry_address, token) as c, pytest.raises(Unauthenticated, match="admin token"):
            c.token_usage("acme", D1, D3)


# -- preft-admin usage ---------------------------------------------------------------------------------------------


@pytest.fixture
def admin(registry_address):
    def run(*args: str, expect: int = 0, token: str = TOKEN) -> str:
        result = runner.invoke(app, ["--registry", registry_address, "--token", token, *args])
        assert result.exit_code == expect, f"{args}: exit {result.exit_code}\n{result.output}"
        return result.output

    return run


def table_rows(output: str) -> list[list[str]]:
    """The cells of a rich table's lines (title, rules and header left out)."""
    lines = [line.strip("│┃ ") for line in output.splitlines() if "│" in line]
    return [[cell.strip() for cell in line.split("│")] for line in lines]


def test_cli_usage_table_and_json(metered, admin):
    out = admin("usage", "acme", "--since", "2026-03-01", "--until", "2026-03-03")
    assert "acme: 2026-03-01 .. 2026-03-03" in out
    assert table_rows(out) == [
        ["2026-03-01", "3", "110", "45"],
        ["2026-03-02", "0", "0", "0"],
        ["2026-03-03", "3", "300", "120"],
        ["total", "6", "410", "165"],
    ]
    out = admin("usage", "acme", "--since", "2026-02-28", "--until", "2026-03-04", "--by-model")
    assert table_rows(out) == [
        ["2026-02-28", "base", "60", "6,000", "600"],
        ["2026-03-01", CHAT, "2", "100", "40"],
        ["2026-03-01", "base", "1", "10", "5"],
        ["2026-03-03", CHAT, "3", "300", "120"],
        ["2026-03-04", "base", "50", "5,000", "500"],
        ["total", "", "116", "11,410", "1,265"],
    ]
    as_json = json.loads(admin("--json", "usage", "acme", "--since", "2026-03-01", "--until", "2026-03-02"))
    assert as_json == {
        "tenant": "acme",
        "start_date": "2026-03-01",
        "end_date": "2026-03-02",
        "rows": [
            {"date": "2026-03-01", "model": "", "requests": "3", "input_tokens": "110", "output_tokens": "45"},
            {"date": "2026-03-02", "model": "", "requests": "0", "input_tokens": "0", "output_tokens": "0"},
        ],
        "total": {"requests": "3", "input_tokens": "110", "output_tokens": "45"},
    }


def test_cli_usage_last_days_end_today(client, redis_client, admin):
    client.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
    today = metering.day_of(time.time())
    meter(redis_client, "acme", today, "base", 4, 40, 4)
    meter(redis_client, "acme", today - timedelta(days=2), CHAT, 1, 10, 1)
    meter(redis_client, "acme", today - timedelta(days=3), CHAT, 100, 1000, 100)  # before --days 3
    meter(redis_client, "acme", today + timedelta(days=1), CHAT, 100, 1000, 100)  # after today
    res = json.loads(admin("--json", "usage", "acme", "--days", "3"))
    assert (res["start_date"], res["end_date"]) == ((today - timedelta(days=2)).isoformat(), today.isoformat())
    assert [(r["date"], r["requests"]) for r in res["rows"]] == [
        ((today - timedelta(days=2)).isoformat(), "1"),
        ((today - timedelta(days=1)).isoformat(), "0"),
        (today.isoformat(), "4"),
    ]
    assert res["total"] == {"requests": "5", "input_tokens": "50", "output_tokens": "5"}
    week = json.loads(admin("--json", "usage", "acme"))  # 7 days by default
    assert [r["date"] for r in week["rows"]] == [(today - timedelta(days=6 - i)).isoformat() for i in range(7)]
    assert week["total"]["requests"] == "105"
    since = json.loads(admin("--json", "usage", "acme", "--since", (today - timedelta(days=1)).isoformat()))
    assert (since["end_date"], since["total"]["requests"]) == (today.isoformat(), "4")  # --until defaults to today


def test_cli_usage_exit_codes(metered, admin):
    # 2: wrong usage, caught before anything is sent
    assert "YYYY-MM-DD" in admin("usage", "acme", "--since", "2026-3-01", expect=2)
    assert "not a day of the calendar" in admin("usage", "acme", "--since", "2026-02-30", expect=2)
    assert "before it starts" in admin("usage", "acme", "--since", "2026-03-03", "--until", "2026-03-01", expect=2)
    assert "spans 367 days" in admin("usage", "acme", "--since", "2025-03-01", "--until", "2026-03-02", expect=2)
    assert "not both" in admin("usage", "acme", "--days", "3", "--since", "2026-03-01", expect=2)
    assert "--until needs --since" in admin("usage", "acme", "--until", "2026-03-01", expect=2)
    admin("usage", "acme", "--days", "0", expect=2)
    admin("usage", "acme", "--days", str(metering.MAX_QUERY_DAYS + 1), expect=2)
    admin("usage", expect=2)  # no tenant
    # 1: the registry refuses
    assert "tenant 'ghost' does not exist" in admin("usage", "ghost", expect=1)
    assert "admin token" in admin("usage", "acme", expect=1, token="wrong")
