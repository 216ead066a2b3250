"""The engine core's side of in-place updates on a stand-in scheduler (vLLM's own runs in
tests/engine/test_weight_updates.py): when an update is applied, which requests are held and re-stamped, and the
versions the prefix-cache keys carry."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from preft.engine.async_engine import UPDATE_UTILITY
from preft.vllm_plugin.patches import prefix_cache, weight_updates
from preft.vllm_plugin.patches.scheduler import _add_request, _schedule

X, Y = 1, 2  # LoRA ids


class Queue(list):
    """vLLM's RequestQueue as the patch uses it."""

    def add_request(self, request) -> None:
        self.append(request)

    def remove_requests(self, requests) -> None:
        for request in requests:
            self.remove(request)


class FakeScheduler:
    def __init__(self) -> None:
        self.lora_config = SimpleNamespace(max_loras=8)
        self.running: list = []
        self.waiting, self.skipped_waiting = Queue(), Queue()
        self.scheduled: list = []  # the waiting requests each schedule() saw

    def add_request(self, request) -> None:
        self.waiting.add_request(request)

    def schedule(self):
        self.scheduled.append(list(self.waiting))
        return "output"


FakeScheduler.add_request = _add_request(FakeScheduler.add_request)
FakeScheduler.schedule = _schedule(FakeScheduler.schedule)


class FakeRequest:
    """What the patches read of a vLLM Request; its block hashes record the version they were made under."""

    def __init__(self, lora_id: int | None, *, computed: int = 0, prompt: int = 8) -> None:
        self.lora_request = None if lora_id is None else SimpleNamespace(lora_int_id=lora_id)
        self.sampling_params = SimpleNamespace(extra_args=None)
        self.num_computed_tokens, self.num_prompt_tokens, self.priority = computed, prompt, 0
        self.finished = False
        self.block_hashes: list = []
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        self.block_hashes.extend([("hash", prefix_cache.version_extra_key(self))])

    def is_finished(self) -> bool:
        return self.finished


class FakeExecutor:
    def __init__(self) -> None:
        self.calls: list = []
        self.error: str | None = None

    def collective_rpc(self, method, args=()):
        self.calls.append(args)
        return [self.error]


def _core():
    return SimpleNamespace(scheduler=FakeScheduler(), model_executor=FakeExecutor())


def test_an_update_with_no_prompt_in_flight_applies_at_once_and_restamps_the_waiting():
    core = _core()
    s = core.scheduler
    waiting, decoding, other = FakeRequest(X), FakeRequest(X, computed=8), FakeRequest(Y)
    s.add_request(waiting)
    s.add_request(other)
    s.running.append(decoding)
    result = weight_updates.update_adapter_weights(core, X, "/tmp/w.safetensors")
    assert result == {"version": 1, "waited_steps": 0, "waited_for": 0}
    assert core.model_executor.calls == [(X, "/tmp/w.safetensors")]
    assert waiting.block_hashes == [("hash", (prefix_cache.VERSION_KEY, 1))]  # (hashed again, under version 1)
    assert other.block_hashes == [("hash", None)] and decoding.block_hashes == [("hash", None)]
    late = FakeRequest(X)  # (built, and hashed, by vLLM before the update reached the scheduler)
    s.add_request(late)
    assert late.block_hashes == [("hash", (prefix_cache.VERSION_KEY, 1))]


def test_an_update_waits_for_prompts_in_flight_and_holds_the_adapters_waiting_requests():
    core = _core()
    s = core.scheduler
    in_prompt, queued, other = FakeRequest(X, computed=4), FakeRequest(X), FakeRequest(Y)
    s.running.append(in_prompt)
    s.add_request(queued)
    s.add_request(other)
    future = weight_updates.update_adapter_weights(core, X, "/tmp/w.safetensors")
    assert isinstance(future, Future) and not future.done() and not core.model_executor.calls
    s.schedule()
    assert s.scheduled[-1] == [other], "a request of the adapter whose update waits started its prompt"
    assert list(s.waiting) == [other, queued]  # (back after the step)
    in_prompt.num_computed_tokens = 8  # (its prompt is done)
    s.schedule()
    assert future.result() == {"version": 1, "waited_steps": 1, "waited_for": 1}
    assert s.scheduled[-1] == [other, queued]
    assert queued.block_hashes[-1] == ("hash", (prefix_cache.VERSION_KEY, 1))
    assert in_prompt.block_hashes == [("hash", None)]  # (its KV is the old weights')


def test_a_request_that_kept_old_kv_is_restamped_once_back_at_position_zero():
    core = _core()
    s = core.scheduler
    decoding = FakeRequest(X, computed=10)
    s.running.append(decoding)
    weight_updates.update_adapter_weights(core, X, "/tmp/w.safetensors")
    s.schedule()
    assert decoding.block_hashes == [("hash", None)]
    s.running.remove(decoding)  # (preempted: its prompt is recomputed, on the new weights)
    decoding.num_computed_tokens = 0
    s.waiting.add_request(decoding)
    s.schedule()
    assert decoding.block_hashes == [("hash", (prefix_cache.VERSION_KEY, 1))]


def test_refused_weights_change_no_version():
    core = _core()
    core.model_executor.error = "tensor 'x': holds NaN or infinite values"
    queued = FakeRequest(X)
    core.scheduler.add_request(queued)
    assert weight_updates.update_adapter_weights(core, X, "/tmp/w.safetensors") == {"error": core.model_executor.error}
    assert prefix_cache.adapter_version(core.scheduler, X) == 0 and queued.block_hashes == [("hash", None)]


def test_removing_an_updated_adapter_bumps_its_version():
    core = _core()
    removed = []
    remove_lora = weight_updates._remove_lora(lambda self, lora_id: removed.append(lora_id) or True)
    remove_lora(core, Y)
    assert prefix_cache.adapter_version(core.scheduler, Y) == 0  # (never updated: its blob's weights, version 0)
    weight_updates.update_adapter_weights(core, X, "/tmp/w.safetensors")
    remove_lora(core, X)
    assert prefix_cache.adapter_version(core.scheduler, X) == 2 and removed == [Y, X]


def test_the_engine_calls_the_utility_the_plugin_installs():
    assert UPDATE_UTILITY == weight_updates.UTILITY
