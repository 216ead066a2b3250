"""Locust traffic for a running stack: many tenants with their own adapters, prefill-only and all-token.

    .venv/bin/python -m loadtest.fleet                      # tenants, keys, adapters -> .preft/stack/fleet.json
    .venv/bin/locust -f loadtest/locustfile.py --headless   # stages from PREFT_LOAD_STAGES (or the table below)

One User class per traffic type: non-streaming completions on `prefill`-mode adapters, the same on `all`-mode
adapters, streaming chat on either, and a little base-model traffic. Options come from the command line or env:
PREFT_LOAD_FLEET, PREFT_LOAD_POPULARITY (uniform | zipf), PREFT_LOAD_ZIPF_S, PREFT_LOAD_PROMPT_WORDS and
PREFT_LOAD_OUTPUT_TOKENS (distributions: `fixed:N`, `uniform:A:B`, `normal:MEAN:STD`), PREFT_LOAD_STAGES
(`END_S:USERS:SPAWN_RATE,...`, cumulative end times). Requests are grouped by route and mode (`name=`), never
by adapter, so the statistics table stays bounded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from locust import HttpUser, LoadTestShape, between, events, task
from locust.env import Environment

from preft.devtools.tiny import WORDS  # the words the tiny tokenizer was trained on

DEFAULT_STAGES = "20:2:1,50:4:1,60:1:1"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument(
        "--fleet",
        env_var="PREFT_LOAD_FLEET",
        default=".preft/stack/fleet.json",
        help="Fleet JSON written by `python -m loadtest.fleet`",
    )
    parser.add_argument(
        "--popularity",
        env_var="PREFT_LOAD_POPULARITY",
        choices=["uniform", "zipf"],
        default="zipf",
        help="How adapters are picked",
    )
    parser.add_argument("--zipf-s", env_var="PREFT_LOAD_ZIPF_S", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument(
        "--prompt-words",
        env_var="PREFT_LOAD_PROMPT_WORDS",
        default="uniform:8:64",
        help="Prompt length distribution, in words",
    )
    parser.add_argument(
        "--output-tokens", env_var="PREFT_LOAD_OUTPUT_TOKENS", default="uniform:8:32", help="max_tokens distribution"
    )
    parser.add_argument(
        "--stages",
        env_var="PREFT_LOAD_STAGES",
        default=DEFAULT_STAGES,
        help="END_S:USERS:SPAWN_RATE,... (cumulative end times)",
    )


@dataclass(frozen=True)
class Distribution:
    """A length distribution written as `fixed:N`, `uniform:A:B` or `normal:MEAN:STD` (clipped to >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Distribution:
        kind, *nums = text.split(":")
        if kind not in ("fixed", "uniform", "normal") or len(nums) != (1 if kind == "fixed" else 2):
            raise ValueError(f"bad distribution {text!r}: use fixed:N, uniform:A:B or normal:MEAN:STD")
        return cls(kind, *(float(n) for n in nums))

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = rng.gauss(self.a, self.b)
        return max(1, round(value))


@dataclass(frozen=True)
class Target:
    """One adapter a user may call: whose key, which model name, its registered mode."""

    api_key: str
    model: str
    mode: str


class Fleet:
    """The fleet file plus the popularity law over its adapters, per mode."""

    def __init__(self, options) -> None:
        data = json.loads(Path(options.fleet).read_text())
        self.gateway_url = data["gateway_url"]
        self.base_model = data.get("base_model", "base")
        self.keys = [t["api_key"] for t in data["tenants"]]
        self.targets = {
            mode: [
                Target(t["api_key"], a["model"], a["mode"])
                for t in data["tenants"]
                for a in t["adapters"]
                if a["mode"] == mode or mode == "any"
            ]
            for mode in ("prefill", "all", "any")
        }
        self.weights = {}
        rng = random.Random(0)
        for mode, targets in self.targets.items():
            if options.popularity == "uniform":
                self.weights[mode] = [1.0] * len(targets)
            else:
                ranks = list(range(1, len(targets) + 1))
                rng.shuffle(ranks)  # popularity unrelated to tenant order
                self.weights[mode] = [1.0 / r**options.zipf_s for r in ranks]
        self.prompt_words = Distribution.parse(options.prompt_words)
        self.output_tokens = Distribution.parse(options.output_tokens)

    def pick(self, mode: str, rng: random.Random) -> Target:
        return rng.choices(self.targets[mode], weights=self.weights[mode])[0]

    def prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(self.prompt_words.sample(rng)))


FLEET: Fleet | None = None


@events.init.add_listener
def _load_fleet(environment: Environment, **_kw) -> None:
    global FLEET
    FLEET = Fleet(environment.parsed_options)
    if not environment.host:
        environment.host = FLEET.gateway_url


class _TenantUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.rng = random.Random()

    def _post(self, path: str, target: Target, body: dict, name: str) -> None:
        headers = {"Authorization": f"Bearer {target.api_key}"}
        with self.client.post(path, json=body, headers=headers, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
            elif not body.get("stream") and not resp.json().get("choices"):
                resp.failure("no choices in the answer")

    def _completion(self, mode: str) -> None:
        target = FLEET.pick(mode, self.rng)
        body = {
            "model": target.model,
            "prompt": FLEET.prompt(self.rng),
            "max_tokens": FLEET.output_tokens.sample(self.rng),
            "temperature": 0,
        }
        self._post("/v1/completions", target, body, f"/v1/completions [{mode}]")


class PrefillAdapterUser(_TenantUser):
    """Non-streaming completions on adapters registered as `prefill` (PreFT)."""

    weight = 3

    @task
    def completion(self) -> None:
        self._completion("prefill")


class AllTokenAdapterUser(_TenantUser):
    """Non-streaming completions on adapters registered as `all` (classic PEFT)."""

    weight = 3

    @task
    def completion(self) -> None:
        self._completion("all")


class StreamingChatUser(_TenantUser):
    """Streaming chat on any adapter; the whole stream is read before the request counts as done."""

    weight = 2

    @task
    def chat(self) -> None:
        target = FLEET.pick("any", self.rng)
        body = {
            "model": target.model,
            "messages": [{"role": "user", "content": FLEET.prompt(self.rng)}],
            "max_tokens": FLEET.output_tokens.sample(self.rng),
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {target.api_key}"}
        name = f"/v1/chat/completions stream [{target.mode}]"
        with self.client.post(
            "/v1/chat/completions", json=body, headers=headers, name=name, stream=True, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code}: {resp.text[:200]}")
                return
            lines = [line for line in resp.iter_lines() if line]
            if not lines or lines[-1] != b"data: [DONE]":
                resp.failure("stream did not end with [DONE]")


class BaseModelUser(_TenantUser):
    """A little base-model traffic (no adapter)."""

    weight = 1

    @task
    def completion(self) -> None:
        key = self.rng.choice(FLEET.keys)
        body = {
            "model": FLEET.base_model,
            "prompt": FLEET.prompt(self.rng),
            "max_tokens": FLEET.output_tokens.sample(self.rng),
        }
        self._post("/v1/completions", Target(key, FLEET.base_model, "base"), body, "/v1/completions [base]")


class StagesShape(LoadTestShape):
    """Users over time from the stages table (`END_S:USERS:SPAWN_RATE,...`); stops after the last stage."""

    def tick(self):
        stages = [
            tuple(float(x) for x in s.split(":")) for s in self.runner.environment.parsed_options.stages.split(",")
        ]
        run_time = self.get_run_time()
        for end_s, users, rate in stages:
            if run_time < end_s:
                return int(users), rate
        return None
