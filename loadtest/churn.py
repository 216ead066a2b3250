"""Churn with a token-exact check (issue 56, item 3): the whole local stack (gateway, registry, Redis, SeaweedFS, Ray
Serve, vLLM on CPU with the plugin, a tiny float32 model) under concurrent greedy load while adapters are uploaded,
republished, re-aliased, deleted and recreated, every answer checked token for token against the HF + peft reference
of the adapter version it may have been served by.

The engine is sized so that every tier turns over: 2 GPU slots (vLLM's max_loras), 4 adapters in host memory, a disk
tier of a few adapters, 32 adapters live across 3 tenants. Prompts are a few long shared prefixes (several 32-token KV
blocks) with short endings, so prefix-cache blocks are looked up by every adapter, mode and tenant (two of the
tenants share a prefix-cache group: the same blocks across tenants). Versions are published in both modes, some with
the content of another version (one digest in two modes, or in two tenants).

Which version served a request: the gateway's answers do not name the version it resolved, so
- a pinned reference (`name@vN`, most traffic) has one candidate: vN (its directory is kept here, so a version
  deleted mid-flight is still checked);
- an alias (`name:prod`) or the bare name (`latest`) has as candidates every version the pointer named at some moment
  in [request start - the gateway's resolution cache TTL, request end]; every pointer move is recorded with the
  interval of the call that made it (one churn thread, so moves never overlap).
An answer passes when its tokens equal one candidate's reference tokens (greedy, ignore_eos, logprobs=0: the answer's
own token strings). A request may also fail with an HTTP error (counted by status and reason); it may never carry
tokens of no candidate: that is a mismatch.

    python -m loadtest.churn --requests 2000 --out loadtest/results/churn.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from preft.common.loopback import free_port
from preft.stack.local import BASE_MODEL_ID, LocalStack, StackInfo, StackPorts, StackProfile

log = logging.getLogger("loadtest.churn")
ALIAS = "prod"
LATEST = "latest"
MODES = ("prefill", "all")
# the engine of the churn: every tier small, so adapters move between them all the time
ENGINE: dict[str, Any] = dict(
    max_loras=2,
    max_cpu_loras=4,
    prefetch_adapters=0,
    # a rank-8 LoRA of the tiny model is ~100 kB: about 8 on disk, the 4 in host memory (pinned there) and the loads of
    # the 4 clients' requests; less, and a load finds no room (503)
    disk_cache_max_bytes=800_000,
    replica={"num_replicas": 1, "num_cpus_per_replica": 1, "max_adapters_per_replica": 4},
)
PREFIXES = (  # each 60+ tokens: two or more 32-token KV blocks shared by every request that starts with it
    "the gateway serves a prompt for the tenant and the engine decodes one token after another while the registry "
    "keeps every adapter version in the blob store and the cache holds the hottest ones in memory for the next request "
    "that asks for them",
    "alpha beta gamma delta red green blue cat dog bird fish tree river mountain city road house book one two three "
    "four five six seven eight nine ten hello world yes no why how what when where who adapter prefill decode token",
    "why does the model serve the request with the adapter of the tenant and how does the slot of the layer keep "
    "the weight of each rank when the batch holds many prompts of many tenants in the same step of the engine",
)
ENDINGS = ("and then", "so the cat", "where is the river", "one two three")


@dataclass(frozen=True)
class ChurnConfig:
    """The workload: its size, its mix and the churn's pace."""

    requests: int = 2000
    concurrency: int = 4  # client threads (the host tier holds 4 adapters: more at once would find it all pinned)
    tenants: int = 3
    live_adapters: int = 32  # kept constant: a deleted adapter is replaced by a new one (its name or another)
    max_versions: int = 4  # versions per adapter before the churn deletes rather than publishes
    max_tokens: int = 8
    churn_interval_s: float = 0.5  # pause between two churn operations
    resolve_cache_ttl_s: float = 2.0  # the gateway's: how long after a move an alias may still resolve the old way
    base_fraction: float = 0.15
    alias_fraction: float = 0.2  # of adapter requests: `name:prod`
    latest_fraction: float = 0.15  # of adapter requests: `name`
    deleted_fraction: float = 0.05  # of adapter requests: a version deleted in the last few seconds, pinned
    stream_fraction: float = 0.25
    seed: int = 0

    def profile(self) -> StackProfile:
        groups = {f"t{i}": "shared" for i in range(min(2, self.tenants))}  # t0 and t1 share prefix-cache blocks
        return StackProfile(
            engine=ENGINE,
            demo=False,
            gateway_env={
                "PREFT_GATEWAY__RESOLVE_CACHE_TTL_S": str(self.resolve_cache_ttl_s),
                "PREFT_GATEWAY__CACHE_GROUPS": json.dumps(groups),
                "PREFT_GATEWAY__ACCESS_LOG": "false",
                "PREFT_GATEWAY__REDIS_TIMEOUT_S": "2",
            },
            engine_start_timeout_s=300.0,
        )


# -- what was published, and where every pointer pointed when ---------------------------------------------------------


@dataclass
class Version:
    """One published adapter version: its files kept here (the reference needs them after a delete)."""

    tenant: str
    name: str
    number: int
    directory: Path
    method: str
    mode: str
    digest: str
    deleted_s: float | None = None  # monotonic time the delete call returned

    @property
    def key(self) -> str:
        return f"{self.tenant}/{self.name}@v{self.number}"


@dataclass
class Pointer:
    """An alias's (or `latest`'s) history: each move as (call start, call end, version or None), in order."""

    moves: list[tuple[float, float, int | None]] = field(default_factory=list)

    def move(self, started_s: float, ended_s: float, version: int | None) -> None:
        self.moves.append((started_s, ended_s, version))

    def current(self) -> int | None:
        return self.moves[-1][2] if self.moves else None

    def during(self, start_s: float, end_s: float) -> set[int]:
        """Versions it may have named at some moment in [start_s, end_s]: a move's version from its call's start until
        the next move's call ended."""
        out = set()
        for (began, _, version), nxt in itertools.zip_longest(self.moves, self.moves[1:]):
            until = nxt[1] if nxt else float("inf")
            if version is not None and began <= end_s and until >= start_s:
                out.add(version)
        return out


class Catalog:
    """What the churn published: versions (never forgotten), live adapters, pointer histories. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.versions: dict[tuple[str, str, int], Version] = {}
        self.live: dict[str, dict[str, list[int]]] = {}  # tenant -> name -> live version numbers
        self.pointers: dict[tuple[str, str, str], Pointer] = {}
        self.deleted: list[Version] = []  # in the order they were deleted

    def pointer(self, tenant: str, name: str, alias: str) -> Pointer:
        return self.pointers.setdefault((tenant, name, alias), Pointer())

    def published(self, v: Version, started_s: float, ended_s: float, *, alias: bool) -> None:
        with self.lock:
            if (v.tenant, v.name, v.number) in self.versions:
                raise AssertionError(f"the registry reused version number {v.key}")
            self.versions[(v.tenant, v.name, v.number)] = v
            self.live.setdefault(v.tenant, {}).setdefault(v.name, []).append(v.number)
            self.pointer(v.tenant, v.name, LATEST).move(started_s, ended_s, v.number)
            if alias:
                self.pointer(v.tenant, v.name, ALIAS).move(started_s, ended_s, v.number)

    def deleted_version(self, tenant: str, name: str, number: int, started_s: float, ended_s: float) -> None:
        with self.lock:
            live = self.live[tenant][name]
            live.remove(number)
            v = self.versions[(tenant, name, number)]
            v.deleted_s = ended_s
            self.deleted.append(v)
            latest = self.pointer(tenant, name, LATEST)
            if latest.current() == number:
                latest.move(started_s, ended_s, max(live))

    def deleted_adapter(self, tenant: str, name: str, started_s: float, ended_s: float) -> None:
        with self.lock:
            for number in self.live[tenant].pop(name):
                v = self.versions[(tenant, name, number)]
                v.deleted_s = ended_s
                self.deleted.append(v)
            for alias in (LATEST, ALIAS):
                self.pointer(tenant, name, alias).move(started_s, ended_s, None)

    def aliased(self, tenant: str, name: str, number: int, started_s: float, ended_s: float) -> None:
        with self.lock:
            self.pointer(tenant, name, ALIAS).move(started_s, ended_s, number)

    def snapshot(self, tenant: str) -> dict[str, list[int]]:
        with self.lock:
            return {name: list(vs) for name, vs in self.live.get(tenant, {}).items()}


# -- the churn: uploads, republishes, alias moves, deletes, through the gateway's adapter API ------------------------


class Churner:
    """Owns the adapters' lifecycle during the run: one operation at a time, each recorded in the catalog."""

    def __init__(self, cfg: ChurnConfig, gateway_url: str, keys: dict[str, str], model_dir: Path, work: Path) -> None:
        self.cfg, self.keys, self.model_dir, self.work = cfg, keys, model_dir, work
        self.catalog = Catalog()
        self.http = {t: httpx.Client(base_url=gateway_url, headers={"authorization": f"Bearer {k}"}, timeout=120)
                     for t, k in keys.items()}  # fmt: skip
        self.rng = random.Random(f"churn-{cfg.seed}")
        self.seeds = itertools.count(1000)
        self.names = itertools.count()
        self.modes = itertools.cycle(MODES)  # new adapters alternate: both modes among the hot ones
        self.ops: Counter[str] = Counter()
        self.op_errors: list[str] = []

    def close(self) -> None:
        for c in self.http.values():
            c.close()

    def build(self) -> tuple[Path, str]:
        """A new random adapter directory (a LoRA of rank 4 or 8, or a DiReFT) and its method."""
        from preft.devtools.tiny import build_direft, build_lora

        seed = next(self.seeds)
        out = self.work / f"adapter-{seed}"
        kind = self.rng.choice(("lora4", "lora8", "direft"))
        if kind == "direft":
            return build_direft(out, self.model_dir, rank=4, seed=seed), "direft"
        return build_lora(out, self.model_dir, rank=int(kind[-1]), seed=seed), "lora"

    def upload(self, tenant: str, name: str, directory: Path, method: str, mode: str, *, alias: bool) -> Version:
        files = [("files", (p.name, p.read_bytes())) for p in sorted(directory.iterdir())]
        data = {"name": name, "mode": mode, **({"alias": ALIAS} if alias else {})}
        started = time.monotonic()
        answer = self.http[tenant].post("/v1/adapters", data=data, files=files)
        ended = time.monotonic()
        if answer.status_code != 201:
            raise RuntimeError(f"upload {tenant}/{name}: {answer.status_code} {answer.text}")
        entry = answer.json()["adapter"]
        v = Version(tenant, name, entry["version"], directory, method, mode, entry["digest"])
        self.catalog.published(v, started, ended, alias=alias)
        self.ops["publish"] += 1
        return v

    def create_adapter(self, tenant: str, name: str | None = None) -> None:
        directory, method = self.build()
        name = name or f"a{next(self.names)}"
        self.upload(tenant, name, directory, method, next(self.modes), alias=True)

    def populate(self) -> None:
        """The live adapters, spread over the tenants; a few of them the same files as another tenant's (one digest
        in two tenants)."""
        tenants = sorted(self.keys)
        for i in range(self.cfg.live_adapters):
            tenant = tenants[i % len(tenants)]
            if i % 8 == 7:
                other = self.catalog.versions[next(iter(self.catalog.versions))]
                self.upload(tenant, f"a{next(self.names)}", other.directory, other.method, other.mode, alias=True)
                self.ops["publish_same_files_other_tenant"] += 1
            else:
                self.create_adapter(tenant)

    def step(self) -> None:
        tenant = self.rng.choice(sorted(self.keys))
        live = self.catalog.snapshot(tenant)
        if not live:
            return
        name = self.rng.choice(sorted(live))
        versions = live[name]
        roll = self.rng.random()
        op = "publish" if roll < 0.35 else "alias" if roll < 0.6 else "delete_version" if roll < 0.85 else "replace"
        if op == "publish" and len(versions) >= self.cfg.max_versions:
            op = "delete_version"
        elif op == "delete_version" and len(versions) == 1:
            op = "publish"
        try:
            if op == "publish":
                self.publish(tenant, name, versions)
            elif op == "alias":
                self.move_alias(tenant, name, versions)
            elif op == "delete_version":
                self.delete_version(tenant, name, versions)
            else:
                self.replace(tenant, name)
        except Exception as e:  # recorded and reported: the run goes on
            self.op_errors.append(f"{type(e).__name__}: {e}"[:300])
            log.warning("churn operation failed: %s", e)

    def publish(self, tenant: str, name: str, versions: list[int]) -> None:
        latest = self.catalog.versions[(tenant, name, max(versions))]
        if self.rng.random() < 0.3:  # the same files in the other mode: a new version of the same digest
            other = "all" if latest.mode == "prefill" else "prefill"
            self.upload(tenant, name, latest.directory, latest.method, other, alias=self.rng.random() < 0.5)
            self.ops["publish_same_files_other_mode"] += 1
            return
        directory, method = self.build()
        self.upload(tenant, name, directory, method, self.rng.choice(MODES), alias=self.rng.random() < 0.5)

    def move_alias(self, tenant: str, name: str, versions: list[int]) -> None:
        number = self.rng.choice(versions)
        started = time.monotonic()
        answer = self.http[tenant].put(f"/v1/adapters/{name}/aliases/{ALIAS}", json={"version": number})
        ended = time.monotonic()
        if answer.status_code != 200:
            raise RuntimeError(f"alias {tenant}/{name}:{ALIAS} -> v{number}: {answer.status_code} {answer.text}")
        self.catalog.aliased(tenant, name, number, started, ended)
        self.ops["alias"] += 1

    def delete_version(self, tenant: str, name: str, versions: list[int]) -> None:
        aliased = self.catalog.pointer(tenant, name, ALIAS).current()
        choices = [v for v in versions if v != aliased]
        if not choices:
            return
        number = self.rng.choice(choices)
        started = time.monotonic()
        answer = self.http[tenant].delete(f"/v1/adapters/{name}/versions/{number}")
        ended = time.monotonic()
        if answer.status_code != 200:
            raise RuntimeError(f"delete {tenant}/{name}@v{number}: {answer.status_code} {answer.text}")
        self.catalog.deleted_version(tenant, name, number, started, ended)
        self.ops["delete_version"] += 1

    def replace(self, tenant: str, name: str) -> None:
        """Delete the whole adapter, then create one in its place: half the time under the same name (its versions
        numbered on from the deleted ones')."""
        started = time.monotonic()
        answer = self.http[tenant].delete(f"/v1/adapters/{name}")
        ended = time.monotonic()
        if answer.status_code != 200:
            raise RuntimeError(f"delete {tenant}/{name}: {answer.status_code} {answer.text}")
        self.catalog.deleted_adapter(tenant, name, started, ended)
        self.ops["delete_adapter"] += 1
        self.create_adapter(tenant, name if self.rng.random() < 0.5 else None)

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.cfg.churn_interval_s):
            self.step()


# -- the traffic ------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One request and what came back."""

    tenant: str
    model: str
    kind: str  # base, pinned, deleted (pinned to a version deleted before it was sent), alias, latest
    prompt: int
    stream: bool
    started_s: float
    ended_s: float = 0.0
    tokens: list[str] | None = None
    text: str | None = None
    status: int | None = None  # an HTTP error's status
    error: str | None = None
    pinned: tuple[str, str, int] | None = None


def prompts() -> list[str]:
    return [f"{p} {e}" for p in PREFIXES for e in ENDINGS]


class Traffic:
    """Owns the client threads: each picks a tenant, a model reference and a prompt, and records the answer."""

    def __init__(
        self, cfg: ChurnConfig, base_url: str, keys: dict[str, str], catalog: Catalog, logit_bias: dict[int, int]
    ) -> None:
        self.cfg, self.catalog, self.logit_bias = cfg, catalog, {str(t): b for t, b in logit_bias.items()}
        self.clients = {t: openai.OpenAI(base_url=base_url, api_key=k, max_retries=0, timeout=120)
                        for t, k in keys.items()}  # fmt: skip
        self.prompts = prompts()
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        self.issued = itertools.count()

    def pick(self, rng: random.Random) -> tuple[str, str, str, tuple[str, str, int] | None]:
        tenant = rng.choice(sorted(self.clients))
        live = self.catalog.snapshot(tenant)
        if rng.random() < self.cfg.base_fraction or not live:
            return tenant, BASE_MODEL_ID, "base", None
        roll = rng.random()
        if roll < self.cfg.deleted_fraction:
            with self.catalog.lock:
                now = time.monotonic()
                recent = [v for v in self.catalog.deleted[-8:] if v.tenant == tenant and now - v.deleted_s < 2]
            if recent:
                v = rng.choice(recent)
                return tenant, f"{v.name}@v{v.number}", "deleted", (v.tenant, v.name, v.number)
        names = sorted(live)
        weights = [1 / (i + 1) for i in range(len(names))]  # (a skew: some adapters hot, most of them cold)
        name = rng.choices(names, weights)[0]
        if roll < self.cfg.deleted_fraction + self.cfg.alias_fraction:
            return tenant, f"{name}:{ALIAS}", "alias", None
        if roll < self.cfg.deleted_fraction + self.cfg.alias_fraction + self.cfg.latest_fraction:
            return tenant, name, "latest", None
        number = rng.choice(live[name])
        return tenant, f"{name}@v{number}", "pinned", (tenant, name, number)

    def one(self, rng: random.Random) -> None:
        tenant, model, kind, pinned = self.pick(rng)
        prompt = rng.randrange(len(self.prompts))
        stream = rng.random() < self.cfg.stream_fraction
        answer = Answer(tenant, model, kind, prompt, stream, time.monotonic(), pinned=pinned)
        asked = dict(model=model, prompt=self.prompts[prompt], max_tokens=self.cfg.max_tokens, temperature=0,
                     logprobs=0, logit_bias=self.logit_bias, extra_body={"ignore_eos": True})  # fmt: skip
        try:
            client = self.clients[tenant]
            if stream:
                tokens, text = [], []
                for chunk in client.completions.create(**asked, stream=True):
                    for choice in chunk.choices:
                        text.append(choice.text)
                        tokens.extend(choice.logprobs.tokens if choice.logprobs else [])
                answer.tokens, answer.text = tokens, "".join(text)
            else:
                done = client.completions.create(**asked)
                answer.tokens, answer.text = list(done.choices[0].logprobs.tokens), done.choices[0].text
        except openai.APIStatusError as e:
            answer.status, answer.error = e.status_code, str(e.message)[:300]
        except openai.APIError as e:  # (a stream cut short, a connection error: no status)
            answer.status, answer.error = 0, f"{type(e).__name__}: {e}"[:300]
        answer.ended_s = time.monotonic()
        with self.lock:
            self.answers.append(answer)

    def worker(self, index: int, total: int) -> None:
        rng = random.Random(f"traffic-{self.cfg.seed}-{index}")
        while next(self.issued) < total:
            self.one(rng)


# -- the check --------------------------------------------------------------------------------------------------------


class Reference:
    """The HF + peft reference's greedy tokens, per (version, prompt), each version's model loaded once.

    Token for token through the OpenAI API: an answer's logprobs give each token's text, not its id, and 128 of the
    tiny tokenizer's byte tokens all decode to U+FFFD alone. Every request biases those away (`logit_bias`, the
    reference too), so each token the model can pick has a text of its own and the texts give back the ids."""

    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        from transformers import AutoTokenizer

        self.model_dir, self.max_tokens = model_dir, max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        texts = [self.tokenizer.decode([t]) for t in range(len(self.tokenizer))]
        seen = Counter(texts)
        self.logit_bias = {t: -100 for t, text in enumerate(texts) if seen[text] > 1}
        self.ids = {text: t for t, text in enumerate(texts) if seen[text] == 1}
        self.prompt_ids: list[list[int]] = []
        self.cache: dict[tuple[str | None, str, int], list[int]] = {}

    def to_ids(self, tokens: list[str]) -> list[int] | None:
        """An answer's token texts as ids (None where one is no single token's text)."""
        ids = [self.ids.get(t) for t in tokens]
        return None if None in ids else ids  # type: ignore[return-value]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def compute(self, needed: dict[tuple[str | None, str], tuple[Path | None, set[int]]]) -> None:
        """needed: (version key or None for the base model, mode) -> (adapter directory, prompt indexes)."""
        import torch
        from tests.reference import reference_generate, reference_model

        torch.set_num_threads(1)  # (tiny models: one thread is faster, the more so on a shared machine)
        for (key, mode), (directory, wanted) in needed.items():
            todo = sorted(p for p in wanted if (key, mode, p) not in self.cache)
            if not todo:
                continue
            loaded = reference_model(self.model_dir, directory, mode)
            for p in todo:
                self.cache[(key, mode, p)] = reference_generate(
                    self.model_dir, self.prompt_ids[p], directory, mode, self.max_tokens,
                    logit_bias=self.logit_bias, loaded=loaded,
                )  # fmt: skip

    def tokens(self, v: Version | None, prompt: int) -> list[int]:
        return self.cache[(v.key, v.mode, prompt) if v else (None, "prefill", prompt)]


def candidates(a: Answer, catalog: Catalog, ttl_s: float) -> list[Version | None]:
    """The versions that may have served the answer (None: the base model)."""
    if a.kind == "base":
        return [None]
    if a.pinned is not None:
        v = catalog.versions.get(a.pinned)
        return [v] if v else []
    name, _, alias = a.model.partition(":")
    pointer = catalog.pointers.get((a.tenant, name, alias or LATEST))
    if pointer is None:
        return []
    numbers = pointer.during(a.started_s - ttl_s - 0.5, a.ended_s)  # (0.5 s: a resolution under way at the move)
    return [catalog.versions[(a.tenant, name, n)] for n in sorted(numbers)]


def _need(needed: dict, v: Version | None, prompt: int) -> None:
    key, mode, directory = (v.key, v.mode, v.directory) if v else (None, "prefill", None)
    needed.setdefault((key, mode), (directory, set()))[1].add(prompt)


def check(answers: list[Answer], catalog: Catalog, ref: Reference, ttl_s: float) -> dict[str, Any]:
    """Every answer against its candidates' reference tokens; mismatches described in full."""
    ok = [a for a in answers if a.status is None]
    needed: dict[tuple[str | None, str], tuple[Path | None, set[int]]] = {}
    for a in ok:
        for v in candidates(a, catalog, ttl_s):
            _need(needed, v, a.prompt)
    started = time.monotonic()
    ref.compute(needed)
    stats: Counter[str] = Counter()
    mismatches, text_mismatches = [], []
    for a in ok:
        cands = candidates(a, catalog, ttl_s)
        stats[f"checked_{a.kind}"] += 1
        if len(cands) > 1:
            stats[f"{a.kind}_with_several_candidates"] += 1
        got = ref.to_ids(a.tokens or [])
        hits = [v for v in cands if ref.tokens(v, a.prompt) == got]
        if not hits:
            mismatches.append((a, cands, got))
            continue
        v = hits[0]
        if a.text != ref.text(ref.tokens(v, a.prompt)):
            text_mismatches.append({"model": a.model, "prompt": a.prompt, "text": a.text, "tokens": a.tokens})
        stats[f"served_in_{v.mode if v else 'base'}"] += 1
        if v is not None and v.deleted_s is not None and v.deleted_s <= a.ended_s:
            stats["served_by_a_version_deleted_before_the_answer_came"] += 1
    return {
        "checked": len(ok),
        "mismatches": len(mismatches),
        "mismatch_details": _describe(mismatches[:20], catalog, ref),
        "text_mismatches": len(text_mismatches),
        "text_mismatch_details": text_mismatches[:5],
        "by_kind": dict(sorted(stats.items())),
        "reference_versions": len(needed),
        "reference_s": round(time.monotonic() - started, 1),
    }


def _describe(mismatches: list, catalog: Catalog, ref: Reference) -> list[dict[str, Any]]:
    """What was asked, what each candidate's reference says, and whose output it was instead, if any other version of
    the tenant's (or the base model) gives it."""
    needed: dict[tuple[str | None, str], tuple[Path | None, set[int]]] = {}
    for a, _, _ in mismatches:
        _need(needed, None, a.prompt)
        for v in catalog.versions.values():
            if v.tenant == a.tenant:
                _need(needed, v, a.prompt)
    ref.compute(needed)
    out = []
    for a, cands, got in mismatches:
        others = [None, *(v for v in catalog.versions.values() if v.tenant == a.tenant)]
        out.append({
            **{k: v for k, v in asdict(a).items() if k != "pinned"},
            "got_ids": got,
            "candidates": {(v.key if v else "base"): {
                "mode": v.mode if v else "-", "digest": v.digest[:12] if v else "-",
                "deleted_s": v.deleted_s if v else None, "expected": ref.tokens(v, a.prompt)} for v in cands},
            "matches_instead": [(f"{v.key} ({v.mode})" if v else "base") for v in others
                                if ref.tokens(v, a.prompt) == got],
        })  # fmt: skip
    return out


# -- the run ----------------------------------------------------------------------------------------------------------


def engine_metrics(info: StackInfo) -> dict[str, float]:
    """The paging and prefix-cache counters of the engine replica (one replica: its /metrics through Serve)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("preft_paging_hits", "preft_paging_misses", "preft_paging_evictions", "preft_adapter_load_failures",
              "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")  # fmt: skip
    out: dict[str, float] = {}
    text = httpx.get(f"{info.engine_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for s in family.samples:
            if s.name.endswith("_total") or s.name == family.name:
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k in ("tier", "reason"))
                key = f"{family.name}{{{label}}}" if label else family.name
                out[key] = out.get(key, 0.0) + s.value
    return out


def setup_tenants(stack: LocalStack, cfg: ChurnConfig) -> dict[str, str]:
    from preft.api.v1 import registry_pb2 as pb

    keys = {}
    limits = pb.TenantLimits(requests_per_min=1_000_000, tokens_per_min=100_000_000)
    with stack.registry_client() as c:
        for i in range(cfg.tenants):
            c.call("CreateTenant", pb.CreateTenantRequest(id=f"t{i}", limits=limits))
            keys[f"t{i}"] = c.call("IssueKey", pb.IssueKeyRequest(tenant=f"t{i}", label="churn")).secret
    return keys


def tokenize(info: StackInfo, key: str, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        answer = httpx.post(f"{info.gateway_url}/tokenize", json={"model": BASE_MODEL_ID, "prompt": text},
                            headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
        out.append(answer.raise_for_status().json()["tokens"])
    return out


def run(cfg: ChurnConfig, state_dir: Path) -> dict[str, Any]:
    """Start the stack, churn under load, stop it, check every answer; the results as the JSON written."""
    ports = StackPorts(**{name: free_port() for name in asdict(StackPorts())})
    stack = LocalStack(state_dir / "stack", ports, cfg.profile())
    started = time.monotonic()
    info = stack.start()
    log.info("stack up in %.0f s", time.monotonic() - started)
    try:
        keys = setup_tenants(stack, cfg)
        churner = Churner(cfg, info.gateway_url, keys, Path(info.model_dir), state_dir / "adapters")
        churner.populate()
        texts = prompts()
        ref = Reference(Path(info.model_dir), cfg.max_tokens)
        ref.prompt_ids = tokenize(info, keys["t0"], texts)
        before = engine_metrics(info)
        traffic = Traffic(cfg, f"{info.gateway_url}/v1", keys, churner.catalog, ref.logit_bias)
        stop = threading.Event()
        load_started = time.monotonic()
        with ThreadPoolExecutor(cfg.concurrency + 1) as pool:
            churn = pool.submit(churner.run, stop)
            workers = [pool.submit(traffic.worker, i, cfg.requests) for i in range(cfg.concurrency)]
            for w in workers:
                w.result()
            stop.set()
            churn.result()
        load_s = time.monotonic() - load_started
        after = engine_metrics(info)
        churner.close()
    finally:
        stack.stop()
    _save_answers(state_dir / "answers.jsonl", traffic.answers)
    result = check(traffic.answers, churner.catalog, ref, cfg.resolve_cache_ttl_s)
    answers = traffic.answers
    errors = Counter(f"{a.status} {a.kind}: {_reason(a.error)}" for a in answers if a.status is not None)
    deleted = [a for a in answers if a.kind == "deleted"]
    return {
        "config": asdict(cfg),
        "engine": ENGINE,
        "requests": len(answers),
        **result,
        "errors": len([a for a in answers if a.status is not None]),
        "errors_by_status": dict(errors.most_common()),
        "deleted_version_requests": {
            "sent": len(deleted),
            "answered": sum(1 for a in deleted if a.status is None),
            "refused": dict(Counter(a.status for a in deleted if a.status is not None)),
        },
        "pinned_version_deleted_mid_flight": _mid_flight(answers, churner.catalog),
        "streamed": sum(1 for a in answers if a.stream),
        "requests_by_kind": dict(Counter(a.kind for a in answers)),
        "requests_by_mode": _by_mode(answers, churner.catalog),
        "load_s": round(load_s, 1),
        "requests_per_s": round(len(answers) / load_s, 2),
        "churn_ops": dict(churner.ops),
        "churn_op_errors": churner.op_errors[:20],
        "versions_published": len(churner.catalog.versions),
        "distinct_digests": len({v.digest for v in churner.catalog.versions.values()}),
        "prompt_tokens": [len(p) for p in ref.prompt_ids],
        "logit_bias_tokens": len(ref.logit_bias),
        "engine_metrics_delta": {k: after.get(k, 0) - before.get(k, 0) for k in sorted(after)},
    }


def _mid_flight(answers: list[Answer], catalog: Catalog) -> dict[str, Any]:
    """Pinned requests whose version was deleted between their start and their answer: answered (checked above
    like every answer) or refused, by status."""
    hit = []
    for a in answers:
        deleted_s = catalog.versions[a.pinned].deleted_s if a.pinned else None
        if deleted_s is not None and a.started_s <= deleted_s <= a.ended_s:
            hit.append(a)
    return {
        "requests": len(hit),
        "answered": sum(1 for a in hit if a.status is None),
        "refused": dict(Counter(a.status for a in hit if a.status is not None)),
    }


def _save_answers(path: Path, answers: list[Answer]) -> None:
    with path.open("w") as f:
        for a in answers:
            f.write(json.dumps(asdict(a)) + "\n")


def _reason(error: str | None) -> str:
    return (error or "").split(":")[0][:60]


def _by_mode(answers: list[Answer], catalog: Catalog) -> dict[str, int]:
    """Pinned requests per mode of their version (the other kinds' version is known only once checked)."""
    counts: Counter[str] = Counter()
    for a in answers:
        if a.pinned and (v := catalog.versions.get(a.pinned)):
            counts[v.mode] += 1
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=ChurnConfig.requests)
    ap.add_argument("--concurrency", type=int, default=ChurnConfig.concurrency)
    ap.add_argument("--seed", type=int, default=ChurnConfig.seed)
    ap.add_argument("--out", type=Path, required=True, help="the results JSON")
    ap.add_argument("--state-dir", type=Path, help="the stack's state and the adapters (default: a temporary one)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = ChurnConfig(requests=args.requests, concurrency=args.concurrency, seed=args.seed)
    with _state(args.state_dir) as state:
        results = {"command": " ".join(["python -m loadtest.churn", *(argv or sys.argv[1:])]), **run(cfg, state)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    summary = {k: results[k] for k in ("requests", "checked", "mismatches", "errors", "errors_by_status")}
    print(json.dumps(summary, indent=2))
    return 1 if results["mismatches"] else 0


@contextlib.contextmanager
def _state(state_dir: Path | None) -> Iterator[Path]:
    if state_dir is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
        yield state_dir
        return
    with tempfile.TemporaryDirectory(prefix="preft-churn-") as d:
        yield Path(d)


if __name__ == "__main__":
    raise SystemExit(main())
