"""What the plugin installs into vLLM, one module per part of vLLM it changes (``compat.TOUCH_POINTS`` names each
touch point and the module here that does it): the model runner's token mapping and graph dispatch (``worker``),
the scheduler (``scheduler``, ``priority_preemption``), prefix-cache keys (``prefix_cache``), the punica wrapper
(``punica``), DiReFT and the slot state's creation (``direft``), the MLP's forward (``mlp``), garbage collection
when idle (``gc_freeze``), adapters read ahead of ``add_lora`` (``load_ahead``) and adapter weight updates in place
(``weight_updates`` in the engine core, ``adapter_weights`` in the workers). Every install is idempotent
(``patching``)."""

from __future__ import annotations


def install_all() -> None:
    """Install every patch into the imported vLLM (idempotent)."""
    from preft.vllm_plugin.patches import (
        direft,
        gc_freeze,
        load_ahead,
        prefix_cache,
        punica,
        scheduler,
        weight_updates,
        worker,
    )

    worker.install()
    scheduler.install()
    prefix_cache.install()
    punica.install()
    direft.install()
    gc_freeze.install()
    load_ahead.install()
    weight_updates.install()
