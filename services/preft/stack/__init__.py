"""Local infrastructure servers (Redis, S3 via SeaweedFS) on loopback, for tests and `preft up`."""

from preft.common.loopback import ServerError, free_port, wait_until
from preft.stack.servers import LocalServer, RedisServer, SeaweedS3

__all__ = ["LocalServer", "RedisServer", "SeaweedS3", "ServerError", "free_port", "wait_until"]
