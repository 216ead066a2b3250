"""The rollout server's work, apart from HTTP: TRL's completions on one served adapter, and its weight updates.

The server serves one adapter (a PEFT LoRA or a DiReFT, in the registry's format) on one base model, in one
position mode (PreFT's ``prefill`` by default). A trainer replaces the adapter's weights in place (the engine's
``update_adapter_weights``): tensors are staged between TRL's start and finish calls (`staging`) and reach the
engine only at finish, so a bad update, or a trainer gone mid-update, leaves the previous weights serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from preft.adapters.updates import weight_manifest
from preft.common.engine_contract import EngineRequest, TokenLogprob
from preft.common.errors import FailedPrecondition, NotFound
from preft.common.modes import PositionMode
from preft.common.rollout_contract import TOKEN_PREFIX, CompletionsRequest, InitInfo, UpdateAnswer, UpdateInfo
from preft.engine.protocol import Engine
from preft.rollout.staging import UpdateStaging

logger = logging.getLogger(__name__)

Transport = Literal["nccl", "http"]


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter a rollout server serves: its directory (the weights it starts on), its name (the model id
    TRL's client sends back) and its position mode."""

    path: Path
    name: str
    mode: PositionMode = PositionMode.PREFILL


class RolloutService:
    """Owns the engine, the served adapter's identity and weight version, and the update being received.

    `transport` is how update tensors travel: ``nccl`` (TRL's group, CUDA) or ``http`` (a safetensors body). The
    NCCL receiver is built by `nccl_factory` (called with the InitInfo; production: `preft.rollout.nccl`).
    """

    def __init__(
        self,
        *,
        engine: Engine,
        adapter: ServedAdapter,
        transport: Transport,
        logprobs_mode: str = "processed_logprobs",
        nccl_factory: Any = None,
    ) -> None:
        self.engine, self.adapter, self.transport = engine, adapter, transport
        self.logprobs_mode = logprobs_mode
        self.staging = UpdateStaging(weight_manifest(adapter.path))
        self.digest: str | None = None
        self.version = 0
        self._nccl_factory = nccl_factory
        self._receiver: Any = None
        self._finish_lock = asyncio.Lock()  # (one finish at a time: the engine applies updates one by one)

    # -- lifecycle -------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine and load the adapter into it (its weights at version 0)."""
        await self.engine.start()
        info = await self.engine.add_lora(self.adapter.path)
        self.digest = info.digest
        logger.info("rollout server ready: adapter %s (%s, %s)", self.adapter.name, info.method.value, info.digest[:12])

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    def server_info(self) -> dict[str, Any]:
        """The parts of vLLM's /server_info that TRL reads, and what this server serves."""
        return {
            "model_config": {
                "model": self.adapter.name,
                "logprobs_mode": self.logprobs_mode,
                "max_model_len": getattr(self.engine, "max_model_len", None),  # (the vLLM engine's, once started)
            },
            "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
            "weight_transfer_config": {"backend": self.transport},
            "preft": {
                "adapter": self.adapter.name,
                "mode": self.adapter.mode.value,
                "digest": self.digest,
                "version": self.version,
                "update": self.staging.state,
                "tensors": {name: [list(s.shape), s.dtype] for name, s in self.staging.manifest.items()},
            },
        }

    # -- completions -----------------------------------------------------------------------------------------------

    async def complete(self, body: CompletionsRequest) -> dict[str, Any]:
        """/v1/completions for token-id prompts: `n` completions per prompt, prompt-major, with their token ids
        and (when asked) logprobs named "token_id:<id>", as TRL's client parses them."""
        if body.model is not None and body.model != self.adapter.name:
            raise NotFound(f"model {body.model!r} is not served here (this server serves {self.adapter.name!r})")
        rid = f"cmpl-{secrets.token_hex(8)}"
        jobs = [(p, j) for p in body.prompt for j in range(body.n)]
        tasks = [asyncio.ensure_future(self._one(body, p, f"{rid}-{k}", j)) for k, (p, j) in enumerate(jobs)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # (the first failure is the answer: the other generations are aborted)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        choices = [
            {"index": k, "prompt_token_ids": prompt, **choice}
            for k, ((prompt, _), choice) in enumerate(zip(jobs, results, strict=True))
        ]
        n_prompt = sum(len(p) for p in body.prompt) * body.n
        n_completion = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.adapter.name,
            "choices": choices,
            "usage": usage,
        }

    async def _one(self, body: CompletionsRequest, prompt: list[int], request_id: str, j: int) -> dict[str, Any]:
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=body.logprobs,
            seed=None if body.seed is None else body.seed + j,  # (n samples of one seeded prompt differ, as in vLLM)
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            mode=self.adapter.mode,
        )
        text, tokens, logprobs, finish = [], [], [], None
        async with contextlib.aclosing(self.engine.generate(request, self.adapter.path)) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
                tokens += chunk.token_ids
                logprobs += chunk.logprobs or []
                finish = chunk.finish_reason or finish
        return {
            "text": "".join(text),
            "token_ids": tokens,
            "logprobs": _completion_logprobs(logprobs) if body.logprobs is not None else None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    # -- weight updates --------------------------------------------------------------------------------------------

    def check_adapter(self, name: str | None) -> None:
        """NotFound unless `name` (when given) is the adapter served here."""
        if name is not None and name != self.adapter.name:
            raise NotFound(f"adapter {name!r} is not resident on this server (it serves {self.adapter.name!r})")

    def start_update(self) -> None:
        if self.staging.begin():
            logger.warning("a weight update was started before the previous one finished: that one is dropped")

    def stage(self, tensors: Mapping[str, Any]) -> None:
        """Stage tensors (named as in the adapter's safetensors file) of the open update; InvalidArgument for
        tensors that do not fit, which abandons the update."""
        self.staging.add(tensors)

    async def finish_update(self) -> UpdateAnswer:
        """Apply the staged tensors in the engine; the weights they replace serve until then."""
        started = time.perf_counter()
        async with self._finish_lock:
            tensors = self.staging.finish()
            if not tensors:
                return UpdateAnswer(version=self.version, tensors=0, seconds=0.0)
            if self.digest is None:
                raise FailedPrecondition("the server has not started")
            update = await asyncio.shield(self.engine.update_adapter_weights(self.digest, tensors))
            self.version = update.version
        seconds = time.perf_counter() - started
        logger.info("adapter %s: %d tensors applied, version %d", self.adapter.name, len(tensors), update.version)
        return UpdateAnswer(version=update.version, tensors=len(tensors), seconds=seconds)

    def _require_transport(self, transport: Transport) -> None:
        if self.transport != transport:
            if transport == "nccl":
                raise FailedPrecondition(
                    "this server takes weight updates over HTTP (no CUDA here): POST a safetensors body to "
                    "/preft/update_weights between /start_weight_update and /finish_weight_update "
                    "(preft.training.rollouts' client does)"
                )
            raise FailedPrecondition("this server takes weight updates by NCCL (TRL's /update_weights)")

    async def init_nccl(self, info: InitInfo) -> None:
        """Join the trainer's NCCL group (blocks until the trainer joins too, off the event loop)."""
        self._require_transport("nccl")
        self._receiver = await asyncio.to_thread(self._nccl_factory, info)

    async def receive_nccl(self, info: UpdateInfo) -> None:
        """Receive a broadcast of `info`'s tensors and stage them. Everything announced is received, even tensors
        that will be refused: the trainer's broadcast would otherwise never end."""
        self._require_transport("nccl")
        if self._receiver is None:
            raise FailedPrecondition("no NCCL group: call /init_weight_transfer_engine first")
        if len({len(info.names), len(info.dtype_names), len(info.shapes)}) != 1:
            raise FailedPrecondition("update_info: names, dtype_names and shapes differ in length")
        tensors = await asyncio.to_thread(self._receiver.receive, info)
        self.stage(tensors)

    def require_http(self) -> None:
        self._require_transport("http")


def _completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """vLLM's completions logprobs with tokens named by id; each position's top entries include the chosen one."""
    tops = []
    for lp in logprobs:
        top = {f"{TOKEN_PREFIX}{t.token_id}": t.logprob for t in lp.top}
        top.setdefault(f"{TOKEN_PREFIX}{lp.token_id}", lp.logprob)
        tops.append(top)
    return {
        "text_offset": [0] * len(logprobs),
        "token_logprobs": [lp.logprob for lp in logprobs],
        "tokens": [f"{TOKEN_PREFIX}{lp.token_id}" for lp in logprobs],
        "top_logprobs": tops,
    }
