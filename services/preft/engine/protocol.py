"""What an engine replica needs of an engine: the vLLM engine in production, a test engine in unit tests.

The deployment takes the engine class as a constructor argument (`engine_cls=`), as Ray Serve LLM does, so its routing,
paging, draining and HTTP behaviour are tested without vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from preft.common.engine_contract import EngineChunk, EngineRequest
from preft.engine.paging.pager import AdapterHost
from preft.engine.updates import AdapterUpdate
from preft.engine.vllm_engine import EngineOptions


class Engine(AdapterHost, Protocol):
    """An async generation engine with per-request adapters (and `add_lora` / `remove_lora` for the pager)."""

    async def start(self) -> None:
        """Start the engine (load the model); called once before anything else."""
        ...

    def generate(self, request: EngineRequest, adapter_dir: Path | None) -> AsyncIterator[EngineChunk]:
        """Stream the request's output; the last chunk carries finish_reason and usage.

        Errors (preft.common.errors): InvalidArgument for a bad prompt or adapter, Unavailable when the engine is dead.
        Closing the iterator early aborts the request in the engine.
        """
        ...

    async def update_adapter_weights(self, digest: str, tensors: Mapping[str, Any]) -> AdapterUpdate:
        """Replace tensors (named as in the adapter's safetensors file) of a loaded adapter in place; NotFound if it is
        not loaded, InvalidArgument for weights that do not fit (nothing changes)."""
        ...

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve (its processes died)."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and its processes; in-flight requests fail."""
        ...


EngineFactory = Callable[[EngineOptions], Engine]
