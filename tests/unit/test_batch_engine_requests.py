"""How many engine requests a batch line asks for (``batch_lines.engine_requests``): the slots it takes of the fleet's
cap on batch requests at the engines."""

from __future__ import annotations

from typing import Any

import pytest

from preft.gateway.batch_lines import engine_requests

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("url", "body", "count"),
    [
        (COMPLETIONS, {"prompt": "a"}, 1),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, 1),
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, 6),
        (COMPLETIONS, {"prompt": [[1], [2]], "n": 2, "best_of": 3}, 6),
        (COMPLETIONS, {"prompt": ["a"], "n": "2", "best_of": True}, 1),
        (CHAT, {"messages": [], "n": 4}, 4),
        (CHAT, {"messages": [], "n": -1}, 1),
        ("/v1/responses", {"input": "a", "n": 3}, 1),
    ],
)
def test_a_line_counts_the_engine_requests_it_asks_for(url: str, body: dict[str, Any], count: int):
    assert engine_requests(url, body) == count
