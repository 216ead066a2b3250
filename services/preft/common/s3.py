"""The S3 client every service builds from its `S3Settings`, and how S3's failures read in the domain's terms.

boto3 is imported when a client is made, not when this module is: importing it takes a while.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import botocore.exceptions

from preft.common.errors import Unavailable
from preft.common.metrics import STORE_ERRORS
from preft.common.settings import S3Settings

_OUTAGE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
)
MISSING_CODES = ("404", "NoSuchKey", "NotFound")


def connect(settings: S3Settings) -> Any:
    """A boto3 S3 client for the settings' endpoint (path-style addressing, two tries per call)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key,
        aws_secret_access_key=settings.secret_key.get_secret_value() if settings.secret_key else None,
        config=Config(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )


@contextlib.contextmanager
def s3_errors() -> Iterator[None]:
    """Turn an unreachable S3 into Unavailable (counted in preft_store_errors_total)."""
    try:
        yield
    except _OUTAGE as e:
        STORE_ERRORS.labels("s3").inc()
        raise Unavailable(f"blob store (S3) unavailable: {e}") from e


def is_missing(error: botocore.exceptions.ClientError) -> bool:
    """Whether S3 answered that the object (or bucket) is not there."""
    return error.response.get("Error", {}).get("Code") in MISSING_CODES
