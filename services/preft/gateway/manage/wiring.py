"""The management routes' wiring: they use the core's collaborators alone."""

from __future__ import annotations

from fastapi import FastAPI

from preft.gateway.manage import adapters, shares, token_usage


def wire(app: FastAPI) -> None:
    """/v1/adapters (and their shares), GET /v1/organization/usage/completions."""
    for module in (adapters, shares, token_usage):
        app.include_router(module.router)
