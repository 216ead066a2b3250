"""PreFT plugin for vLLM: per-request adapters (LoRA, DiReFT) applied to prompt positions only, or to all.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point; ``register`` is idempotent.
A request picks its mode with ``SamplingParams(extra_args={"preft_mode": "prefill" | "all"})`` (see
``modes``); its adapter comes as a ``LoRARequest`` (a DiReFT directory is accepted there too).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Install the PreFT patches into vLLM (see ``compat`` for the list of internals touched)."""
    global _registered
    if _registered:
        return
    from preft.vllm_plugin import compat, direft, gc_freeze, prefix_cache, punica, scheduler_patch, worker_patch

    version = compat.check_version()
    worker_patch.install()
    scheduler_patch.install()
    prefix_cache.install()
    punica.install()
    direft.install()
    gc_freeze.install()
    _registered = True
    logger.info("preft plugin registered on vLLM %s", version)
