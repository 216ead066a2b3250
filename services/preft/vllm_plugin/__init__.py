"""PreFT plugin for vLLM: per-request adapters (LoRA, DiReFT) applied to prompt positions only, or to all.

Loaded by vLLM in every process through the ``vllm.general_plugins`` entry point; ``register`` is idempotent.
A request picks its mode with ``SamplingParams(extra_args={"preft_mode": "prefill" | "all"})`` (see
``modes``); its adapter comes as a ``LoRARequest`` (a DiReFT directory is accepted there too).

Layers (import-linter checks them): ``patches`` (what is installed into vLLM) over ``step`` (the step's slot and
token state inside a worker) over ``kernels`` (the LoRA kernels and the policy that picks them) over ``settings``
(read once, here) and ``tiles``; ``compat`` lists every vLLM internal touched.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Read the plugin's settings and install its patches into vLLM (see ``compat`` for the internals touched)."""
    global _registered
    if _registered:
        return
    from preft.vllm_plugin import compat, settings
    from preft.vllm_plugin.patches import install_all

    settings.load()
    version = compat.check_version()
    install_all()
    _registered = True
    logger.info("preft plugin registered on vLLM %s", version)
