"""The platform on a testbed of network-namespace hosts (`preft testbed up`), started once through the CLI: a data
host, a Ray head, two Ray worker hosts with one engine replica each (vLLM on CPU), a gateway host with two gateway
processes. Every hop is real: the tenant's adapters are served through both gateways, a worker host whose link is cut
leaves the other replica serving within a bound and comes back as a new Ray node once restored, and `preft testbed
down` leaves no namespace or process behind after the supervisor was SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from preft.api.v1 import adapter_pb2 as apb
from preft.api.v1 import registry_pb2 as pb
from preft.devtools.tiny import build_direft, build_lora
from preft.engine.residency import residency_key
from preft.registry.client import scan_adapter_dir
from preft.stack import netns
from preft.stack.testbed import DATA, GATEWAY, HEAD, Testbed, TestbedInfo, supervisor_pid

PROMPT = "the adapter serves a prompt for the tenant and the engine decodes"
CUT_BOUND_S = 30.0  # a cut worker host's adapter is served by the other replica within this (Ray's node death: ~5 s)
BACK_BOUND_S = 300.0  # a restored host runs a replica again within this (Ray node ~20 s, vLLM start ~30-90 s)


def _cli(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preft.cli.main", "testbed", *args], capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Testbed:
    state_dir = tmp_path_factory.mktemp("testbed")
    started = time.monotonic()
    up = _cli("up", "--state-dir", str(state_dir), "--json")
    assert up.returncode == 0, f"{up.stderr[-3000:]}\n{(state_dir / 'logs' / 'supervisor.log').read_text()[-6000:]}"
    print(f"testbed up in {time.monotonic() - started:.0f} s: {up.stdout}")
    try:
        yield Testbed(state_dir)
    finally:
        _cli("down", "--state-dir", str(state_dir), timeout_s=120)


@pytest.fixture(scope="module")
def acme(bed: Testbed, tmp_path_factory) -> dict:
    """A tenant with a key and five adapters: three for the first requests, two fresh ones for after the restore."""
    work = tmp_path_factory.mktemp("testbed-adapters")
    model = bed.state_dir / "model"
    builders = {
        "lora-a": lambda d: build_lora(d, model, rank=4, seed=71),
        "direft-b": lambda d: build_direft(d, model, rank=4, layers=(1,), seed=72),
        "lora-c": lambda d: build_lora(d, model, rank=8, seed=73),
        "fresh-d": lambda d: build_lora(d, model, rank=4, seed=74),
        "fresh-e": lambda d: build_lora(d, model, rank=4, seed=75),
    }
    digests = {}
    with bed.registry_client() as c:
        c.call("CreateTenant", pb.CreateTenantRequest(id="acme"))
        for name, build in builders.items():
            files = scan_adapter_dir(build(work / name))
            c.upload_adapter(files, tenant="acme", name=name, mode=apb.POSITION_MODE_PREFILL)
            digests[name] = c.resolve("acme", name).digest
        key = c.call("IssueKey", pb.IssueKeyRequest(tenant="acme")).secret
    return {"key": key, "digests": digests}


def _client(url: str, key: str, timeout_s: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout_s)


def _complete(url: str, key: str, model: str, timeout_s: float = 60.0) -> str:
    r = _client(url, key, timeout_s).completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8
    return r.choices[0].text


def _holdings(bed: Testbed) -> dict[str, set[str]]:
    """The adapters each worker host's replica holds (its residency in Redis, keyed by Serve's replica id)."""
    redis = bed.redis_admin()
    try:
        return {
            host: set().union(*(redis.smembers(residency_key(r["replica_id"])) for r in replicas))
            for host, replicas in bed.replicas_by_host().items()
            if host != HEAD
        }
    finally:
        redis.close()


def _holding(bed: Testbed, digest: str) -> dict[str, set[str]] | None:
    """The worker hosts' holdings once one of them holds `digest`."""
    h = _holdings(bed)
    return h if any(digest in held for held in h.values()) else None


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(interval_s)
    return value


def _listening(namespace: str) -> set[str]:
    """The addresses TCP sockets listen on in `namespace` (IPv4-mapped ones as IPv4)."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-Hltn"], capture_output=True, text=True, check=True)
    found = {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.stdout.splitlines() if line.strip()}
    return {a.removeprefix("::ffff:") for a in found}


def test_one_replica_per_worker_host_and_each_service_on_its_hosts_address(bed: Testbed):
    layout = bed.layout
    nodes = bed.ray_nodes()
    assert sorted(n["node_ip"] for n in nodes) == sorted(layout.address(h) for h in layout.ray_hosts)
    assert [n["node_ip"] for n in nodes if n["is_head_node"]] == [layout.address(HEAD)]
    assert {h: len(r) for h, r in bed.replicas_by_host().items()} == {HEAD: 0, "w1": 1, "w2": 1}
    # Redis, SeaweedFS, the registry and the gateways bind their host's address (SeaweedFS's internal gRPC also its
    # loopback, which only its host's processes reach), none every address (Ray's servers do, on their hosts)
    assert _listening(layout.network.host(GATEWAY).namespace) == {layout.address(GATEWAY)}
    assert _listening(layout.network.host(DATA).namespace) == {layout.address(DATA), "127.0.0.1"}


def test_both_gateways_serve_the_tenants_adapters_alike_from_both_replicas(bed: Testbed, acme: dict):
    gw1, gw2 = bed.gateway_urls
    answers = {}
    for name in ("lora-a", "direft-b", "lora-c"):
        answers[name] = _complete(gw1, acme["key"], name)
        assert _complete(gw2, acme["key"], name) == answers[name], name  # greedy: the same tokens on any replica
    base = _complete(gw1, acme["key"], "tiny-llama")
    assert any(text != base for text in answers.values())  # (the adapters change the answer)
    digests = {acme["digests"][n] for n in answers}

    # Serve routes an adapter new to every replica to the one holding the fewest: the three land on both hosts
    def served_by_both() -> dict[str, set[str]] | None:
        h = _holdings(bed)
        return h if all(h.values()) and set().union(*h.values()) >= digests else None

    holdings = _wait(served_by_both, 20, "both replicas holding the adapters they served")
    assert set(holdings) == {"w1", "w2"} and all(holdings[h] & digests for h in holdings)


def test_a_cut_worker_host_leaves_the_other_serving_and_comes_back_when_restored(bed: Testbed, acme: dict):
    gw1, gw2 = bed.gateway_urls
    key, digests = acme["key"], acme["digests"]
    holdings = _holdings(bed)
    adapter = next(n for n in ("lora-a", "direft-b", "lora-c") if digests[n] in holdings["w1"] | holdings["w2"])
    victim = "w1" if digests[adapter] in holdings["w1"] else "w2"
    survivor = "w2" if victim == "w1" else "w1"
    expected = _complete(gw1, key, adapter)

    bed.cut_link(victim)
    cut = time.monotonic()
    try:
        # requests for the victim's adapter, through both gateways in turn, until the survivor answers them
        served_after_s, attempts = None, 0
        while served_after_s is None:
            assert time.monotonic() - cut < CUT_BOUND_S, f"{adapter} not served within {CUT_BOUND_S} s of the cut"
            attempts += 1
            try:
                text = _complete((gw1, gw2)[attempts % 2], key, adapter, timeout_s=10)
            except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError):
                time.sleep(0.2)
                continue
            served_after_s = time.monotonic() - cut
        assert text == expected
        assert [_complete(gw, key, adapter, timeout_s=10) for gw in (gw1, gw2, gw1, gw2)] == [expected] * 4
        print(f"{adapter} served by {survivor} {served_after_s:.1f} s after {victim}'s cut ({attempts} attempts)")
        _wait(lambda: not bed.replicas_by_host()[victim], CUT_BOUND_S, f"Serve dropping {victim}'s replica")
        assert digests[adapter] in _holdings(bed)[survivor]
    finally:
        bed.restore_link(victim)
    restored = time.monotonic()

    # the victim's raylet learns it was declared dead and exits; the supervisor starts Ray there again (a new node),
    # and Serve places the missing replica on it
    _wait(
        lambda: {h: len(r) for h, r in bed.replicas_by_host().items()} == {HEAD: 0, "w1": 1, "w2": 1},
        BACK_BOUND_S,
        f"a replica on {victim} again",
        interval_s=1,
    )
    print(f"{victim} runs a replica again {time.monotonic() - restored:.0f} s after the restore")
    assert bed.services()[f"ray-{victim}"]["starts"] == 2
    # an adapter new to both replicas goes to the one holding the fewest: the restored one serves it
    for fresh in ("fresh-d", "fresh-e"):
        text = _complete(gw2, key, fresh)
        assert _complete(gw1, key, fresh) == text
        holdings = _wait(lambda f=fresh: _holding(bed, digests[f]), 20, f"{fresh} in a replica's residency")
        if digests[fresh] in holdings[victim]:
            break
    else:
        pytest.fail(f"no fresh adapter was served by {victim}'s new replica: {holdings}")
    assert _complete(gw1, key, adapter) == expected  # (the survivor still serves the old one)


def test_a_restarted_service_is_started_again_and_answers(bed: Testbed, acme: dict):
    before = bed.services()["registry"]
    took_s = bed.restart_service("registry", timeout_s=60)
    after = bed.services()["registry"]
    assert after["starts"] == before["starts"] + 1 and after["pid"] != before["pid"] and after["ready"]
    with bed.registry_client() as c:  # (its data is Redis's and S3's: all there)
        assert c.resolve("acme", "lora-a").digest == acme["digests"]["lora-a"]
    print(f"the registry answered again {took_s:.1f} s after its restart began")


def test_down_after_the_supervisor_is_killed_leaves_no_namespace_or_process(bed: Testbed):
    prefix = f"preft-{bed.layout.testbed_id}-"
    pids = {p for host in bed.network.hosts for p in bed.network.pids(host)}
    assert len(pids) > 20  # (Ray, vLLM, the servers: what must not outlive the testbed)
    supervisor = supervisor_pid(bed.state_dir)
    assert supervisor is not None
    os.kill(supervisor, signal.SIGKILL)
    _wait(lambda: supervisor_pid(bed.state_dir) is None, 10, "the supervisor's death")
    assert sum(_alive(p) for p in pids) > 20  # the hosts' processes outlived it

    down = _cli("down", "--state-dir", str(bed.state_dir), timeout_s=120)
    assert down.returncode == 0, down.stderr
    assert not [n for n in (*netns.namespaces(), *netns.links()) if n.startswith(prefix)]
    assert not [p for p in pids if _alive(p)]
    assert not bed.layout.ray_temp_root.exists()
    assert not _processes_naming(str(bed.state_dir), str(bed.layout.ray_temp_root))
    info = TestbedInfo.read(bed.state_dir)
    assert info is not None and not info.ready  # (`preft testbed up` starts it again rather than finding it up)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _processes_naming(*markers: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if any(m in cmdline for m in markers) and int(proc.name) != os.getpid():
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found
