"""The gateway's own server (`python -m preft.gateway`, as `preft up` runs it) writes an access log line per request
that shows no secret sent in the query string or the Authorization header."""

from __future__ import annotations

import sys

import httpx

from preft.common.loopback import LOOPBACK, free_port, wait_until
from preft.gateway.testing import STUB_ENGINE_TOKEN
from preft.stack.process import ManagedProcess

from .conftest import BASE, GATEWAY_REGISTRY_TOKEN

SECRETS = ["sk-query-ApiKey-7f3a", "sk-query-Key-19bc", "tok-query-Token-55e0", "sk-header-Bearer-c0de", "bare-d41d"]


def test_the_access_log_shows_no_query_secret_or_authorization(tmp_path, redis_url, registry, engine, tiny_models):
    port = free_port()
    env = {
        "PREFT_GATEWAY__ENVIRONMENT": "prod",
        "PREFT_GATEWAY__HOST": LOOPBACK,
        "PREFT_GATEWAY__PORT": str(port),
        "PREFT_GATEWAY__REDIS__URL": redis_url,
        "PREFT_GATEWAY__REGISTRY_ADDRESS": registry.address,
        "PREFT_GATEWAY__REGISTRY_TOKEN": GATEWAY_REGISTRY_TOKEN,
        "PREFT_GATEWAY__ENGINE_URL": engine.url,
        "PREFT_GATEWAY__ENGINE_TOKEN": STUB_ENGINE_TOKEN,
        "PREFT_GATEWAY__MODEL_DIR": str(tiny_models["model"]),
        "PREFT_GATEWAY__SERVED_MODEL_NAME": BASE,
        "PREFT_GATEWAY__MAX_MODEL_LEN": "512",
        "PREFT_GATEWAY__MAX_PROMPT_TOKENS": "256",
    }
    gateway = ManagedProcess("gateway", tmp_path / "gateway.log")
    gateway.spawn([sys.executable, "-m", "preft.gateway"], cwd=tmp_path, env=env)
    try:
        url = f"http://{LOOPBACK}:{port}"
        wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, timeout_s=60, what="gateway",
                   abort=gateway.exit_reason)  # fmt: skip
        key = registry.tenant("acme")
        body = {"model": BASE, "prompt": "hi", "max_tokens": 1}
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post(f"/v1/completions?api_key={SECRETS[0]}", json=body).status_code == 401
            assert http.post(f"/v1/completions?key={SECRETS[1]}&limit=5", json=body).status_code == 401
            headers = {"authorization": f"Bearer {SECRETS[3]}"}
            assert http.get(f"/v1/models?access_token={SECRETS[2]}&{SECRETS[4]}", headers=headers).status_code == 401
            listed = http.get("/v1/models?limit=2&order=asc", headers={"authorization": f"Bearer {key}"})
            assert listed.status_code == 200, listed.text
        shown = '"GET /v1/models?limit=2&order=asc HTTP/1.1" 200'  # (paging parameters are shown)
        wait_until(lambda: shown in gateway.log_tail(), timeout_s=10, what="the access log")
    finally:
        gateway.stop()
    log = (tmp_path / "gateway.log").read_text()
    assert '"POST /v1/completions?api_key=[redacted] HTTP/1.1" 401' in log, log
    assert '"POST /v1/completions?key=[redacted]&limit=5 HTTP/1.1" 401' in log, log
    assert '"GET /v1/models?access_token=[redacted]&[redacted] HTTP/1.1" 401' in log, log
    assert not [s for s in [*SECRETS, key] if s in log], log
