"""A test engine for the replica's request path: deterministic tokens, no vLLM (injected as `engine_cls=`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from preft.adapters import AdapterInfo, ModelShape, inspect_adapter
from preft.common.engine_contract import EngineChunk, EngineRequest, Usage
from preft.common.errors import InvalidArgument, NotFound, Unavailable
from preft.engine.updates import AdapterUpdate


class ScriptedEngine:
    """A test engine: token i of a request is (sum(prompt) + i) % 97, with `delay_s` between tokens."""

    def __init__(self, options=None, *, model_dir: Path | None = None, delay_s: float = 0.0) -> None:
        self.shape = ModelShape.from_model_dir(model_dir or options.model)
        self.delay_s = delay_s
        self.started = self.stopped = False
        self.dead = False
        self.loaded: set[str] = set()
        self.prepared: list[Path] = []  # (prepare_lora's calls: add_lora's reads ahead)
        self.aborted: list[str] = []
        self.seen_adapters: list[Path | None] = []
        self.seen_tenants: list[str] = []  # (the tenant id is what the real engine labels its metrics with)
        self.updates: list[tuple[str, list[str]]] = []  # (digest, tensor names) per in-place update
        self.refuse_updates = False

    async def start(self) -> None:
        self.started = True

    async def prepare_lora(self, adapter_dir: Path) -> None:
        self.prepared.append(adapter_dir)

    async def add_lora(self, adapter_dir: Path) -> AdapterInfo:
        info = inspect_adapter(adapter_dir, self.shape, max_rank=16)
        self.loaded.add(info.digest)
        return info

    async def remove_lora(self, digest: str) -> None:
        self.loaded.discard(digest)

    async def update_adapter_weights(self, digest: str, tensors) -> AdapterUpdate:
        """Records the update (names only) and answers a new version; `refuse_updates` makes it InvalidArgument."""
        if digest not in self.loaded:
            raise NotFound(f"adapter {digest[:12]} is not loaded")
        if self.refuse_updates:
            raise InvalidArgument("adapter update: refused by the test engine")
        self.updates.append((digest, sorted(tensors)))
        return AdapterUpdate(version=len(self.updates), seconds=0.0, waited_for=0, waited_steps=0)

    async def generate(self, request: EngineRequest, adapter_dir: Path | None) -> AsyncIterator[EngineChunk]:
        if self.dead:
            raise Unavailable("engine dead")
        if max(request.prompt_token_ids) >= self.shape.vocab_size:
            raise InvalidArgument("prompt token id outside the vocabulary")
        self.seen_adapters.append(adapter_dir)
        self.seen_tenants.append(request.tenant)
        base = sum(request.prompt_token_ids)
        finished = False
        try:
            for i in range(request.max_tokens):
                await asyncio.sleep(self.delay_s)
                last = i == request.max_tokens - 1
                tok = (base + i) % 97
                yield EngineChunk(
                    text=f"<{tok}>",
                    token_ids=[tok],
                    finish_reason="length" if last else None,
                    usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1) if last else None,
                )
            finished = True
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    async def check_health(self) -> None:
        if self.dead:
            raise Unavailable("engine processes died")

    async def shutdown(self) -> None:
        self.stopped = True


class OverlapWitnessEngine(ScriptedEngine):
    """ScriptedEngine that shows whether adapter adds overlap: while `<witness_dir>/hold` exists, each `add_lora` waits
    (up to `HOLD_S`) for another add to be in flight beside it; every add writes the most adds this engine saw at once
    to `<witness_dir>/most-<pid>` (a replica's process is the engine's)."""

    HOLD_S = 10.0

    def __init__(self, options=None, *, witness_dir: Path, **kwargs) -> None:
        super().__init__(options, **kwargs)
        self.witness_dir = Path(witness_dir)
        self._adding = self._most = 0

    async def add_lora(self, adapter_dir: Path) -> AdapterInfo:
        self._adding += 1
        self._most = max(self._most, self._adding)
        try:
            if (self.witness_dir / "hold").exists():
                deadline = time.monotonic() + self.HOLD_S
                while self._most < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            (self.witness_dir / f"most-{os.getpid()}").write_text(str(self._most))
            return await super().add_lora(adapter_dir)
        finally:
            self._adding -= 1
