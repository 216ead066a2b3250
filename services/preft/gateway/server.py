"""Run the gateway: `python -m preft.gateway` (settings from PREFT_GATEWAY__* variables)."""

from __future__ import annotations

import logging

import uvicorn

from preft.gateway.app import create_app
from preft.gateway.settings import GatewaySettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        access_log=settings.access_log,
        log_config=None,  # keep the logging configured above
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()
