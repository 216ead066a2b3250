"""One error tree for the platform's domain.

Each class carries the status it becomes at a boundary (gRPC in the registry's interceptor, HTTP in the gateway's
error handlers); nothing below those boundaries knows about either protocol.
"""

from __future__ import annotations

from typing import ClassVar


class PreftError(Exception):
    """A request the platform refuses or cannot serve; the message is safe to show to the caller."""

    grpc_code: ClassVar[str] = "INTERNAL"  # name of a grpc.StatusCode
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class InvalidArgument(PreftError):
    """Malformed input: a bad name, a broken adapter file, a shape that does not fit the base model."""

    grpc_code, http_status = "INVALID_ARGUMENT", 400


class NotFound(PreftError):
    """No such thing, or the caller may not know it exists."""

    grpc_code, http_status = "NOT_FOUND", 404


class AlreadyExists(PreftError):
    """Creating something whose name is taken."""

    grpc_code, http_status = "ALREADY_EXISTS", 409


class FailedPrecondition(PreftError):
    """The request is well formed but the current state forbids it (e.g. deleting a version an alias names)."""

    grpc_code, http_status = "FAILED_PRECONDITION", 409


class Unauthenticated(PreftError):
    """Missing, unknown, expired or revoked credentials."""

    grpc_code, http_status = "UNAUTHENTICATED", 401


class PermissionDenied(PreftError):
    """Known caller, forbidden action (e.g. a disabled tenant)."""

    grpc_code, http_status = "PERMISSION_DENIED", 403


class ResourceExhausted(PreftError):
    """A quota or size limit is reached."""

    grpc_code, http_status = "RESOURCE_EXHAUSTED", 429


class Unavailable(PreftError):
    """A dependency (Redis, S3, the registry) cannot be reached; retrying later may work."""

    grpc_code, http_status = "UNAVAILABLE", 503


ERRORS_BY_GRPC_CODE: dict[str, type[PreftError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
    )
}
