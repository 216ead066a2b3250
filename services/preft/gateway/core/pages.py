"""Shapes the OpenAI API shares across resources: a page of a list, and `metadata`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

# `metadata` of a response or a conversation: up to 16 pairs of short strings
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16, description="Up to 16 pairs (keys up to 64 characters, values up to 512)"),
]


def item_list(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A page of items, as the API lists them."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
