"""Live requests preempt running offline ones: under vLLM's priority policy, a waiting request that cannot start for
want of a sequence slot (``max_num_seqs``) or of KV blocks (as many as vLLM wants free to admit it) stops running
requests of a lower priority (a larger number: a batch's lines, ``contract.OFFLINE_PRIORITY``) to make room.

vLLM itself only preempts by priority when a *running* request needs blocks; a waiting request of a higher
priority waits until a slot frees, so a live request sent while batch lines fill an engine waits for one of them
to finish. Here, before each ``schedule()``, the waiting requests are taken in vLLM's priority order for as long as
some running request has a lower priority than theirs; each that would not start is given a slot and its blocks by
preempting the lowest-priority running request (the latest to arrive among equals, as vLLM picks its victims),
through vLLM's own ``_preempt_request``: the victim goes back to the waiting queue and is recomputed when it runs
again (its prompt with its adapter, its output without, as for any preemption). A request never preempts one of its
own priority or a higher one, so requests of one priority never thrash. Victims sit out the step they were
preempted for (``requeue`` puts them back once it is built), as vLLM admits nothing from the waiting queue in a step
where it preempted: with asynchronous scheduling a victim's last step may still be in flight, and vLLM 0.26 would
resume it before that step's token arrives.

Nothing is looked at while the scheduler has only ever received requests of one priority (``note_arrival``).
A waiting request gets room made for it once between two preemptions of its own: one that still does not start
(held back by something else: ``max_loras``, a step's token budget) makes no further victims. The check costs a few
comparisons a step while there is room for any request; past that, one pass over the running requests.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from typing import Any

PRIORITY_POLICY = "priority"  # vLLM's SchedulerConfig.policy that orders the waiting queue by (priority, arrival)
ROOM_MADE = "_preft_room_made"  # set on a vLLM Request: its num_preemptions when room was last made for it
PRIORITIES_SEEN = "_preft_priorities"  # set on vLLM's Scheduler: the priorities of the requests it has received


def note_arrival(scheduler: Any, request: Any) -> None:
    """Record the priority of a request the scheduler receives (until it has seen two, nothing can be preempted)."""
    seen = scheduler.__dict__.setdefault(PRIORITIES_SEEN, set())
    if len(seen) < 2:
        seen.add(request.priority)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks_for(scheduler: Any, tokens: int) -> int:
    """KV blocks vLLM wants free to admit a request of that many tokens still to compute: its first chunk's, or its
    whole sequence's where the scheduler reserves it (vLLM 0.28's ``scheduler_reserve_full_isl``, on by default),
    plus the watermark (prefix-cache hits not counted: the bound is an upper one)."""
    if not getattr(scheduler, "scheduler_reserve_full_isl", False):
        tokens = min(tokens, scheduler.max_num_scheduled_tokens)
    return _cdiv(tokens, scheduler.block_size) + scheduler.kv_cache_manager.watermark_blocks


def _blocks_held(scheduler: Any, request: Any) -> int:
    """KV blocks a running request holds (back in the pool once it is preempted, unless shared); counted from its
    tokens, as vLLM may return the blocks themselves only when its step in flight ends."""
    return _cdiv(request.num_computed_tokens, scheduler.block_size)


def _free_slots(scheduler: Any) -> int:
    streaming = getattr(scheduler, "num_waiting_for_streaming_input", 0)  # (vLLM 0.28: paused sessions hold one)
    return scheduler.max_num_running_reqs - len(scheduler.running) - streaming


def _victim(running: list[Any]) -> Any:
    """The running request vLLM would preempt first: the lowest priority, the latest to arrive among those."""
    return max(running, key=lambda r: (r.priority, r.arrival_time))


def _ready_waiting(scheduler: Any) -> Iterator[Any]:
    """The waiting requests that could start now, in vLLM's order (its two queues merged; copies, so the victims
    added meanwhile are not met)."""
    skipped = getattr(scheduler, "skipped_waiting", None) or ()
    ready_skipped = (r for r in skipped if not scheduler._is_blocked_waiting_status(r.status))
    return heapq.merge(scheduler.waiting, ready_skipped)


def _best_waiting_priority(scheduler: Any) -> int:
    queues = (scheduler.waiting, getattr(scheduler, "skipped_waiting", None))
    return min(q.peek_request().priority for q in queues if q)


def make_room(scheduler: Any) -> list[Any]:
    """Preempt lower-priority running requests for the waiting requests that would not start; returns those
    preempted (vLLM's Request objects), held out of the waiting queue until ``requeue``."""
    running = scheduler.running
    if not running or len(scheduler.__dict__.get(PRIORITIES_SEEN, ())) < 2:
        return []
    if scheduler.scheduler_config.policy != PRIORITY_POLICY:
        return []
    if not scheduler.waiting and not getattr(scheduler, "skipped_waiting", None):
        return []
    slots = _free_slots(scheduler)
    free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    if slots > 0 and free_blocks >= _blocks_for(scheduler, scheduler.max_model_len):
        return []  # (the usual step: any request would find its blocks)
    if _best_waiting_priority(scheduler) >= max(r.priority for r in running):
        return []  # (nothing waits that outranks a running request)
    preempted = _preempt_for_waiting(scheduler, slots, free_blocks)
    if preempted:
        scheduler.waiting.remove_requests(preempted)  # (vLLM's _preempt_request queued them)
    return preempted


def _preempt_for_waiting(scheduler: Any, slots: int, free_blocks: int) -> list[Any]:
    """The waiting requests in order, each short of a slot or blocks given them by preempting running requests of a
    lower priority; returns those preempted."""
    running = scheduler.running
    preempted: list[Any] = []
    timestamp = time.monotonic()
    for request in _ready_waiting(scheduler):
        if not running or request.priority >= _victim(running).priority:
            break  # (no running request is of a lower priority than this one or any after it)
        if getattr(request, ROOM_MADE, None) == request.num_preemptions:
            continue  # (room was made for it and it did not start: something else holds it back)
        need = _blocks_for(scheduler, request.num_tokens - request.num_computed_tokens)
        if slots < 1 or free_blocks < need:
            setattr(request, ROOM_MADE, request.num_preemptions)
        while slots < 1 or free_blocks < need:
            if not running or (victim := _victim(running)).priority <= request.priority:
                return preempted
            running.remove(victim)
            slots += 1
            free_blocks += _blocks_held(scheduler, victim)
            scheduler._preempt_request(victim, timestamp)
            preempted.append(victim)
        slots -= 1
        free_blocks -= need
    return preempted


def requeue(scheduler: Any, preempted: list[Any]) -> None:
    """Put the requests ``make_room`` preempted back into the waiting queue (after the step they sat out)."""
    for request in preempted:
        scheduler.waiting.add_request(request)
