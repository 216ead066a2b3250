"""Bounds the tokenizing work one request, and one tenant, can make the gateway do, so no tenant stalls the others.

- Size first: a prompt text (or a rendered conversation) over `settings.max_prompt_bytes` UTF-8 bytes is refused (413)
  before it is tokenized. Such a text cannot fit in max_prompt_tokens unless its tokens average more than
  `prompt_max_bytes_per_token` bytes, and tokenizing it costs ~1 s a MB.
- Off the event loop: long texts go to a pool of `tokenize_workers` threads, through the tokenizer's call that releases
  the GIL (``tokenization``); short ones are tokenized inline, cheaper than a thread hop.
- Per tenant: at most `tokenize_per_tenant` of a tenant's long texts are tokenized at once on this replica. Another
  waits up to `tokenize_wait_s` for a slot, then is refused with 429 and Retry-After: a burst of a few large prompts
  waits a moment, a flood is refused rather than queued. A slot is held until its thread is done, even where the
  request is gone (a client hanging up cannot start more work than its slots).
- The fewest tokens a text can have, by its size: what the rate limit is charged before tokenizing (``generation``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from preft.gateway.core.errors import PayloadTooLarge, RateLimited
from preft.gateway.core.settings import CoreSettings
from preft.gateway.core.tokenization import INLINE_MAX_CHARS, PromptTokenizer

T = TypeVar("T")


class PromptGuard:
    """Owns the tokenizing threads and each tenant's slots on them."""

    def __init__(self, tokenizer: PromptTokenizer, settings: CoreSettings) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = settings.max_prompt_bytes
        self._bytes_per_token = settings.prompt_max_bytes_per_token
        self._per_tenant = settings.tokenize_per_tenant
        self._wait_s = settings.tokenize_wait_s
        self._pool = ThreadPoolExecutor(settings.tokenize_workers, thread_name_prefix="preft-tokenize")
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: dict[str, int] = {}  # per tenant: requests holding or waiting for a slot

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fewest_tokens(self, text: str, what: str = "prompt") -> int:
        """The fewest tokens `text` can have (bytes / the bytes-per-token bound, at least 1); 413 naming the limit
        where it has more bytes than a prompt may."""
        size = len(text)  # (UTF-8 takes at least a byte a character: most too long texts are seen without encoding)
        if size <= self.max_bytes:
            size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"The {what} has more than {self.max_bytes} bytes of text; this server accepts at most "
                f"{self.max_bytes} bytes (max_prompt_tokens × {self._bytes_per_token} bytes per token)."
            )
        return max(1, math.ceil(size / self._bytes_per_token))

    async def encode(self, tenant: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text already checked by `fewest_tokens`: inline where short, else in the pool within the
        tenant's slots (RateLimited where none frees up in time)."""
        if len(text) <= INLINE_MAX_CHARS:
            return self.tokenizer.encode_now(text, add_special_tokens)
        return await self._in_slot(tenant, lambda: self.tokenizer.encode_now(text, add_special_tokens))

    async def _in_slot(self, tenant: str, work: Callable[[], T]) -> T:
        slots = self._slots.get(tenant)
        if slots is None:
            slots = self._slots[tenant] = asyncio.Semaphore(self._per_tenant)
        self._users[tenant] = self._users.get(tenant, 0) + 1
        try:
            async with asyncio.timeout(self._wait_s):
                await slots.acquire()
        except BaseException as e:
            self._leave(tenant, slots)
            if not isinstance(e, TimeoutError):
                raise
            raise RateLimited(
                f"Too many long prompts of tenant {tenant!r} are being tokenized at once (at most "
                f"{self._per_tenant}); retry in a moment.",
                retry_after_s=1.0,
            ) from None

        def freed(_: object) -> None:
            slots.release()
            self._leave(tenant, slots)

        future = asyncio.get_running_loop().run_in_executor(self._pool, work)
        future.add_done_callback(freed)
        return await asyncio.shield(future)  # (cancelled, the thread still runs: its slot is freed when it ends)

    def _leave(self, tenant: str, slots: asyncio.Semaphore) -> None:
        """A request no longer holds nor waits for a slot: the tenant's entry goes with its last."""
        self._users[tenant] -= 1
        if not self._users[tenant]:
            del self._users[tenant]
            if self._slots.get(tenant) is slots:
                del self._slots[tenant]
