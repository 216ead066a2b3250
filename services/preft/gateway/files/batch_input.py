"""A Batch API input file: JSONL, one request a line, as OpenAI defines it.

    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Pure checks, no I/O: each line on its own (at upload: `check_lines`), and the whole file against the batch that
runs it (`BatchPlan`: every url the batch's endpoint, custom_ids unique, not too many lines). Blank lines are
skipped; lines are numbered as an editor numbers them (from 1), requests by their order among the others (from 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from preft.common.errors import InvalidArgument

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512
MAX_ERRORS = 100  # a failed batch's `errors` name at most this many lines


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch: where it sits in the file, and what it asks for."""

    number: int  # the line's number in the file (from 1)
    index: int  # the request's position among the file's requests (from 0)
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_line(raw: bytes | str, number: int, index: int) -> BatchLine:
    """One line as a request; InvalidArgument naming the line and the field otherwise."""
    where = f"line {number}"
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument(f"{where}: not valid JSON (a batch file holds one JSON object a line)") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: a JSON object with custom_id, method, url and body, not {type(data).__name__}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidArgument(f"{where}: custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InvalidArgument(f"{where}: custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters")
    if data.get("method") != "POST":
        raise InvalidArgument(f"{where}: method must be POST")
    url = data.get("url")
    if url not in ENDPOINTS:
        raise InvalidArgument(f"{where}: url must be one of {', '.join(ENDPOINTS)}, not {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise InvalidArgument(f"{where}: body must be a JSON object (the request's body)")
    return BatchLine(number, index, custom_id, url, body)


def numbered(lines: Iterable[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """(line number, request index, line) of each line that is not blank."""
    index = 0
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            yield number, index, raw
            index += 1


def requests(lines: Iterable[bytes]) -> Iterator[BatchLine]:
    """The file's requests, in order (InvalidArgument at the first bad line)."""
    for number, index, raw in numbered(lines):
        yield parse_line(raw, number, index)


def check_lines(lines: Iterable[bytes], max_requests: int) -> int:
    """Check a file uploaded for batches; its number of requests (InvalidArgument naming the first bad line)."""
    count = 0
    for line in requests(lines):
        count += 1
        if count > max_requests:
            raise InvalidArgument(f"line {line.number}: a batch file holds at most {max_requests} requests")
    if not count:
        raise InvalidArgument("the file holds no requests (one JSON object a line)")
    return count


@dataclass
class BatchPlan:
    """The whole file checked against its batch: the requests it holds, or why the batch fails (OpenAI's `errors`
    entries, each naming its line)."""

    endpoint: str
    max_requests: int
    total: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set, repr=False)

    def _error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})

    def add(self, number: int, index: int, raw: bytes) -> None:
        self.total += 1
        try:
            line = parse_line(raw, number, index)
        except InvalidArgument as e:
            self._error("invalid_request", e.message, number)
            return
        if line.url != self.endpoint:
            self._error(
                "mismatched_url",
                f"line {number}: url {line.url!r} is not the batch's endpoint {self.endpoint!r}",
                number,
                "url",
            )
        if line.custom_id in self._seen:
            self._error("duplicate_custom_id", f"line {number}: custom_id {line.custom_id!r} is used twice", number)
        self._seen.add(line.custom_id)

    def finish(self) -> None:
        """The checks on the file as a whole (after every line was added)."""
        self._seen.clear()
        if not self.total:
            self._error("empty_file", "the input file holds no requests", None)
        elif self.total > self.max_requests:
            self._error("too_many_requests", f"a batch holds at most {self.max_requests} requests", None)

    @classmethod
    def of(cls, lines: Iterable[bytes], endpoint: str, max_requests: int) -> BatchPlan:
        plan = cls(endpoint, max_requests)
        for number, index, raw in numbered(lines):
            plan.add(number, index, raw)
        plan.finish()
        return plan
