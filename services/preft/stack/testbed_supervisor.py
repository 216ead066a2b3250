"""The testbed's supervisor (`python -m preft.stack.testbed_supervisor run`, started by `testbed.start`): makes the
hosts' network, starts every service on its host in dependency order, deploys the engine's Serve config onto the
Ray cluster through the head's Serve REST API (as KubeRay submits a RayService's serveConfigV2), then keeps the
services running: one whose process exits is started again (as Kubernetes restarts a pod's container; a Ray worker
whose raylet the GCS declared dead exits, and comes back as a new node), unless its host is held. On SIGTERM it stops
them newest first and removes the network.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from preft.common.loopback import ServerError, wait_until
from preft.engine.serve_app import serve_config
from preft.stack import netns
from preft.stack.process import ManagedProcess
from preft.stack.ray_local import SINGLE_NODE_ENV
from preft.stack.servers import LocalServer, RedisServer, SeaweedS3
from preft.stack.testbed import (
    DATA,
    GATEWAY,
    HEAD,
    HELD_DIR,
    REDIS,
    REGISTRY,
    S3,
    SERVICES_FILE,
    Testbed,
    TestbedInfo,
    TestbedLayout,
    ray_token,
)
from preft.stack.wiring import (
    S3_ACCESS_KEY,
    PlatformSecrets,
    StackProfile,
    Wiring,
    bootstrap_registry,
    ensure_model,
)

log = logging.getLogger("preft.testbed")


@dataclass(frozen=True)
class TestbedProfile:
    """How big the testbed's engine is and how fast Ray gives up on a silent node: sized for 2 cores and a tiny
    model, one replica per worker host."""

    __test__: ClassVar[bool] = False

    stack: StackProfile = field(default_factory=StackProfile)
    # EngineSettings over the stack's (TINY_ENGINE): one core per replica, vLLM's CPU threads left unbound (its auto
    # binding, made for a machine of its own, would put every replica's thread on the same core), the smallest KV
    # cache vLLM takes (1 GiB: the tiny model's 2048-token context needs a few MiB)
    engine: dict[str, Any] = field(
        default_factory=lambda: {
            "cpu_num_threads": 1,
            "cpu_omp_threads_bind": "nobind",
            "cpu_kvcache_space_bytes": 1 << 30,
        }
    )
    worker_cpus: int = 1  # Ray CPUs of a worker host: one replica's (a replacement waits for its host to come back)
    object_store_bytes: int = 200 * 1024 * 1024  # per node (the engine passes no large objects through Ray)
    # The GCS declares a node dead after `failure_threshold` health checks missed `period_ms` apart (each waiting
    # `timeout_ms`): about 5 s, so a cut host's replica leaves the routing tables soon; Ray's default is ~15-50 s.
    ray_health_check: dict[str, int] = field(
        default_factory=lambda: {"period_ms": 1000, "timeout_ms": 2000, "failure_threshold": 5}
    )
    gcs_fault_tolerance: bool = True  # the GCS's tables in Redis: a restarted head takes the cluster back
    engine_start_timeout_s: float = 600.0
    ray_start_timeout_s: float = 180.0


class Service:
    """One service on one host: how it starts (until it answers), whether it runs, how it stops."""

    def __init__(self, name: str, host: str) -> None:
        self.name, self.host = name, host
        self.starts = 0
        self.ready = False

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.ready = False
        self.starts += 1
        self._start()
        self.ready = True


class ServerService(Service):
    """A LocalServer (Redis, SeaweedFS) on its host."""

    def __init__(self, name: str, host: str, server: LocalServer, timeout_s: float) -> None:
        super().__init__(name, host)
        self.server, self.timeout_s = server, timeout_s

    @property
    def pid(self) -> int | None:
        return self.server.pid

    @property
    def running(self) -> bool:
        return self.server.running

    def _start(self) -> None:
        self.server.stop()  # (reaps a process that died)
        self.server.start(timeout_s=self.timeout_s)

    def stop(self) -> None:
        self.server.stop()


class ProcessService(Service):
    """A process started on its host that is ready once `ready()` holds. With `owns_host`, it is all that runs there
    (a Ray node: some of Ray's processes leave its process group), so stopping it ends every process on the host."""

    def __init__(
        self,
        name: str,
        host: str,
        process: ManagedProcess,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        ready: Callable[[], bool],
        timeout_s: float,
        network: netns.Network,
        stopping: threading.Event,
        owns_host: bool = False,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name, host)
        self.process, self.argv, self.env, self.cwd = process, argv, env, cwd
        self.is_ready, self.timeout_s = ready, timeout_s
        self.network, self.stopping, self.owns_host = network, stopping, owns_host
        self.prepare = prepare  # runs before each start

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.running

    def _start(self) -> None:
        self.stop()  # (what is left of an earlier run)
        if self.prepare is not None:
            self.prepare()
        self.process.spawn(self.argv, cwd=self.cwd, env=self.env)
        wait_until(self.is_ready, timeout_s=self.timeout_s, what=self.name, interval_s=0.5, abort=self._abort)

    def _abort(self) -> str | None:
        return "the testbed is stopping" if self.stopping.is_set() else self.process.exit_reason()

    def stop(self) -> None:
        self.process.stop(timeout_s=10)
        if self.owns_host:
            self.network.kill(self.host)


class Supervisor:
    """Owns one testbed's network and services: the order they start in, restarting those that exit, and the stop."""

    def __init__(self, state_dir: Path, layout: TestbedLayout, profile: TestbedProfile | None = None) -> None:
        self.state_dir = state_dir
        self.layout = layout
        self.profile = profile or TestbedProfile()
        self.network = layout.network
        self.bed = Testbed(state_dir)
        self.secrets = PlatformSecrets.load(state_dir)
        self.model_dir = self.profile.stack.model_dir or state_dir / "model"
        self.wiring = Wiring(
            secrets=self.secrets,
            profile=self.profile.stack,
            model_dir=self.model_dir,
            redis_url=layout.redis_url,
            s3_endpoint_url=layout.s3_endpoint_url,
            registry_address=layout.registry_address,
            engine_url=layout.engine_url,
        )
        self.ray_namespace = f"preft-testbed-{layout.testbed_id}-{int(time.time())}"  # new each run, as KubeRay's
        self.services: dict[str, Service] = {}
        self.stopping = threading.Event()  # set on SIGTERM: waits for readiness give up
        self._lock = threading.Lock()
        self._build_services()

    # -- the services ----------------------------------------------------------------------------------------------

    def _launcher(self, host: str) -> list[str]:
        return self.network.host(host).launcher()

    def _build_services(self) -> None:
        L, p = self.layout, self.profile
        data = self.state_dir / "hosts" / DATA
        redis = RedisServer(
            data / "redis",
            L.ports.redis,
            persist=True,
            passwords=self.secrets.redis_passwords,
            host=L.address(DATA),
            launcher=self._launcher(DATA),
        )
        s3 = SeaweedS3(
            data / "s3",
            L.ports.s3,
            access_key=S3_ACCESS_KEY,
            secret_key=self.secrets.s3_secret,
            host=L.address(DATA),
            launcher=self._launcher(DATA),
        )
        self._add(ServerService(REDIS, DATA, redis, timeout_s=30))
        self._add(ServerService(S3, DATA, s3, timeout_s=90))
        self._add(
            self._process(
                REGISTRY,
                DATA,
                [sys.executable, "-m", "preft.registry.server"],
                self.wiring.registry_env(L.registry_address, f"{L.address(DATA)}:{L.ports.registry_metrics}"),
                ready=self._registry_answers,
                timeout_s=60,
            )
        )
        for host in L.ray_hosts:
            self._add(
                self._process(
                    f"ray-{host}",
                    host,
                    self._ray_argv(host),
                    self._ray_env(host),
                    ready=(self._head_answers if host == HEAD else lambda h=host: self._node_alive(h)),
                    timeout_s=p.ray_start_timeout_s,
                    owns_host=True,
                    # the address of the node's last `ray start`: with it, a head started again refuses to while
                    # the workers' processes (the process table is the machine's) still name that address
                    prepare=lambda h=host: (L.ray_temp_root / h / "ray_current_cluster").unlink(missing_ok=True),
                )
            )
        for name in L.gateway_services:
            url = f"http://{L.address(GATEWAY)}:{L.gateway_port(name)}"
            self._add(
                self._process(
                    name,
                    GATEWAY,
                    [sys.executable, "-m", "preft.gateway"],
                    self.wiring.gateway_env(L.address(GATEWAY), L.gateway_port(name), L.gateway_metrics_port(name)),
                    ready=lambda u=url: httpx.get(f"{u}/healthz", timeout=2).status_code == 200,
                    timeout_s=90,
                )
            )

    def _add(self, service: Service) -> None:
        self.services[service.name] = service

    def _process(
        self,
        name: str,
        host: str,
        argv: list[str],
        env: dict[str, str],
        *,
        ready: Callable[[], bool],
        timeout_s: float,
        owns_host: bool = False,
        prepare: Callable[[], None] | None = None,
    ) -> ProcessService:
        process = ManagedProcess(name, self.state_dir / "logs" / f"{name}.log", launcher=self._launcher(host))
        return ProcessService(
            name,
            host,
            process,
            argv,
            env,
            self.state_dir,
            ready,
            timeout_s,
            self.network,
            self.stopping,
            owns_host,
            prepare,
        )

    def _ray_argv(self, host: str) -> list[str]:
        L, p = self.layout, self.profile
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [
            ray, "start", "--block",  # in the foreground, exiting when a Ray process dies: what a pod's container runs
            f"--node-ip-address={L.address(host)}",
            f"--temp-dir={L.ray_temp_root / host}",
            f"--object-store-memory={p.object_store_bytes}",
            f"--metrics-export-port={L.ports.ray_metrics}",
            "--num-gpus=0",
            "--disable-usage-stats",
        ]  # fmt: skip
        if host != HEAD:
            return [*argv, f"--address={L.gcs_address}", f"--num-cpus={p.worker_cpus}"]
        argv += [
            "--head",
            f"--port={L.ports.gcs}",
            "--num-cpus=0",  # no replica on the head, as deploy/'s
            "--include-dashboard=true",
            f"--dashboard-host={L.address(HEAD)}",
            f"--dashboard-port={L.ports.dashboard}",
        ]
        if p.gcs_fault_tolerance:
            argv += ["--redis-username=ray", f"--redis-password={self.secrets.redis_passwords['ray']}"]
        return argv

    def _ray_env(self, host: str) -> dict[str, str]:
        """A Ray node's environment: the cluster's own auth token, and the engine's secrets (every node: Serve builds
        the app wherever it places the build task), as the RayService's pods get them from Kubernetes Secrets."""
        env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": ray_token(self.state_dir),
            **self.wiring.engine_secret_env(),
            # vLLM's own sockets: its guess (a route out, which no host has) would fall back to 0.0.0.0
            "VLLM_HOST_IP": self.layout.address(host),
            # a cluster of several nodes, whatever the launching process inherited: one that started a single-node
            # Ray of its own (`start_local_ray`: "0") would make every worker's `ray start` refuse to join
            **{name: "1" for name in SINGLE_NODE_ENV},
        }
        if host == HEAD:
            env |= {f"RAY_health_check_{k}": str(v) for k, v in self.profile.ray_health_check.items()}
            if self.profile.gcs_fault_tolerance:
                env |= {
                    "RAY_REDIS_ADDRESS": f"{self.layout.address(DATA)}:{self.layout.ports.redis}",
                    "RAY_external_storage_namespace": self.ray_namespace,
                }
        return env

    # -- readiness -------------------------------------------------------------------------------------------------

    def _registry_answers(self) -> bool:
        from preft.api.v1 import registry_pb2 as pb

        with self.bed.registry_client() as c:
            c.call("ListTenants", pb.ListTenantsRequest())
        return True

    def _head_answers(self) -> bool:
        return any(n["is_head_node"] for n in self.bed.ray_nodes())

    def _node_alive(self, host: str) -> bool:
        return any(n["node_ip"] == self.layout.address(host) for n in self.bed.ray_nodes())

    # -- start, keep running, stop ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the network, then start everything: Redis (the GCS keeps its tables there); then the Ray head beside
        S3, the registry and its first contents; then the engine's Serve config (Serve's controller starts and the
        app is built while the workers join, whose CPUs the replicas wait for) and the gateways. Returns once every
        service and both replicas answer."""
        started = time.monotonic()
        netns.sweep(self.layout.testbed_id)  # (what a killed supervisor of this id left)
        self.network.create()
        log.info("network %s: %s", self.layout.subnet, {h.name: h.address for h in self.network.hosts.values()})
        self._start(REDIS)
        if self.profile.gcs_fault_tolerance:
            self._drop_old_gcs_tables()
        with ThreadPoolExecutor(2 + len(self.layout.gateway_services)) as pool:
            model = pool.submit(ensure_model, self.profile.stack, self.model_dir)
            head = pool.submit(self._start_with_retries, f"ray-{HEAD}", 3)
            self._start(S3)
            self._start(REGISTRY)
            model.result()
            with self.bed.registry_client() as c:
                bootstrap_registry(c, self.state_dir, self.model_dir, self.profile.stack)
            gateways = [pool.submit(self._start, name) for name in self.layout.gateway_services]
            head.result()
            log.info("deploying the engine's Serve config (%d replicas)", self.layout.workers)
            self.submit_engine_config()
            with ThreadPoolExecutor(len(self.layout.worker_hosts)) as workers:
                for f in [workers.submit(self._start_with_retries, f"ray-{h}", 2) for h in self.layout.worker_hosts]:
                    f.result()
            self.wait_for_engine()
            for g in gateways:
                g.result()
        log.info("ready in %.0f s: gateways %s", time.monotonic() - started, ", ".join(self.layout.gateway_urls))

    def _start(self, name: str) -> None:
        service = self.services[name]
        log.info("starting %s on %s", name, service.host)
        t = time.monotonic()
        try:
            service.start()
        finally:
            self.write_services()
        log.info("%s answers (%.1f s)", name, time.monotonic() - t)

    def _start_with_retries(self, name: str, attempts: int) -> None:
        """A Ray node's start, again if it fails: on a loaded machine a Ray process may give up waiting for another
        and take its node down with it."""
        for attempt in range(1, attempts + 1):
            try:
                self._start(name)
                return
            except (ServerError, TimeoutError):
                if attempt == attempts or self.stopping.is_set():
                    raise
                log.exception("%s did not start (attempt %d of %d); again", name, attempt, attempts)

    def _drop_old_gcs_tables(self) -> None:
        """Earlier runs' GCS tables (RAY<namespace>@*): each run's namespace is new, so theirs only take room."""
        client = self.bed.redis_admin()
        try:
            stale = list(client.scan_iter("RAY*", count=1000))
            if stale:
                client.delete(*stale)
        finally:
            client.close()

    def engine_config(self) -> dict[str, Any]:
        """The Serve config deployed onto the Ray cluster: deploy/'s shape, the testbed's sizes and addresses."""
        L, p = self.layout, self.profile
        replica = {"num_replicas": L.workers, "num_cpus_per_replica": p.worker_cpus, "max_adapters_per_replica": 16}
        args = self.wiring.engine_args(self.state_dir / "adapter-cache", **p.engine, replica=replica)
        return serve_config(args, num_replicas=L.workers, http_host="0.0.0.0", http_port=L.ports.serve)

    def wait_for_engine(self) -> None:
        """Until every replica runs and the head's proxy answers for the engine."""
        t = time.monotonic()
        wait_until(
            self._engine_serves,
            timeout_s=self.profile.engine_start_timeout_s,
            what="engine replicas",
            interval_s=1,
            abort=lambda: "the testbed is stopping" if self.stopping.is_set() else None,
        )
        log.info("engine replicas run on %s (%.0f s)", self._replica_hosts(), time.monotonic() - t)

    def submit_engine_config(self, timeout_s: float = 180.0) -> None:
        """PUT the Serve config until the dashboard takes it: the first PUT starts Serve's controller inside the
        request, which a loaded head may drop (the dashboard's proxy to its Serve module gives up), as KubeRay
        retries its submission."""

        def submitted() -> bool:
            self.bed.ray_api("/api/serve/applications/", method="PUT", body=self.engine_config(), timeout_s=120)
            return True

        wait_until(submitted, timeout_s=timeout_s, what="the Serve config's submission", interval_s=2)

    def _replica_hosts(self) -> dict[str, int]:
        return {h: len(r) for h, r in self.bed.replicas_by_host().items() if r}

    def _engine_serves(self) -> bool:
        if sum(self._replica_hosts().values()) < self.layout.workers:
            return False
        return httpx.get(f"{self.layout.engine_url}/healthz", timeout=5).status_code == 200

    def write_services(self) -> None:
        with self._lock:
            data = {
                name: {"host": s.host, "pid": s.pid, "starts": s.starts, "ready": s.ready and s.running}
                for name, s in self.services.items()
            }
            tmp = self.state_dir / f".{SERVICES_FILE}.tmp"
            tmp.write_text(json.dumps(data, indent=2))
            tmp.replace(self.state_dir / SERVICES_FILE)

    def held(self, host: str) -> bool:
        return (self.state_dir / HELD_DIR / host).exists()

    def keep_running(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        """Until `stop`: start again each service whose process exited (not on a held host), each in a thread of its
        own (a worker waiting for its head must not hold the head's restart up); with the head, its Serve config
        (KubeRay re-submits it to a new head too; with the GCS's tables in Redis it is already there)."""
        backoff: dict[str, float] = {}
        restarting: dict[str, Future[None]] = {}
        with ThreadPoolExecutor(len(self.services)) as pool:
            while not stop.wait(interval_s):
                for name, service in self.services.items():
                    if name in restarting:
                        if not restarting[name].done():
                            continue
                        if restarting.pop(name).exception() is not None:
                            log.error("%s did not start again; retrying in 5 s", name)
                            backoff[name] = time.monotonic() + 5.0
                    if service.running or self.held(service.host) or stop.is_set():
                        continue
                    if time.monotonic() < backoff.get(name, 0.0):
                        continue
                    backoff.pop(name, None)
                    log.warning("%s on %s exited; starting it again", name, service.host)
                    restarting[name] = pool.submit(self._restart, name)
                self.write_services()
            self.stopping.set()  # (restarts under way give up before the pool waits for them)

    def _restart(self, name: str) -> None:
        try:
            self._start(name)
            if name == f"ray-{HEAD}":
                self.submit_engine_config()
        except Exception:
            log.exception("%s did not start again", name)
            raise

    def stop(self) -> None:
        """Stop every service newest first, remove the network and the Ray nodes' directories; one step failing does
        not keep the others from running."""
        for name in reversed(list(self.services)):
            try:
                self.services[name].stop()
                log.info("stopped %s", name)
            except Exception:
                log.exception("stopping %s failed", name)
        removed = netns.sweep(self.layout.testbed_id)
        shutil.rmtree(self.layout.ray_temp_root, ignore_errors=True)
        log.info("removed %s", ", ".join(removed) or "nothing")


def run(state_dir: Path) -> None:
    """Run the testbed of `state_dir` (its layout in testbed.json) until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (one line per readiness poll otherwise)
    info = TestbedInfo.read(state_dir)
    if info is None:
        raise ServerError(f"no {state_dir}/testbed.json: `testbed.start` writes it")
    info.supervisor_pid = os.getpid()
    info.write(state_dir)
    supervisor = Supervisor(state_dir, info.layout)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()
        supervisor.stopping.set()  # (a start under way gives up)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        supervisor.start()
        info.ready = True
        info.write(state_dir)
        supervisor.keep_running(stop)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
        log.info("stopping")
        info.ready = False
        info.write(state_dir)
        supervisor.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run a testbed's supervisor in the foreground (testbed.start runs it).")
    ap.add_argument("command", choices=["run"])
    ap.add_argument("--state-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    run(args.state_dir.resolve())


if __name__ == "__main__":
    main()
