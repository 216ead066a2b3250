"""Live requests preempt running offline ones, on vLLM's own Scheduler (built in-process over a tiny model's config
and a small KV cache, with the plugin's scheduler patch; steps are answered with one sampled token each): short of a
sequence slot or of KV blocks, a waiting request of a higher priority stops the lowest-priority running request,
which runs again later from position 0; requests of one priority, or under the fcfs policy, never preempt; and a
request held back by something else (max_loras here) makes its victim once."""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from preft.common.engine_contract import LIVE_PRIORITY, OFFLINE_PRIORITY
from preft.vllm_plugin.patches import scheduler as scheduler_patch
from preft.vllm_plugin.patches.priority_preemption import make_room

BLOCK = 16
TOKEN = 7  # what every step samples
_arrivals = itertools.count(1)


@pytest.fixture(scope="module", autouse=True)
def _patched():
    scheduler_patch.install()  # (as the plugin does in each vLLM process; idempotent)


def _scheduler(model_dir, *, seqs: int, blocks: int = 64, policy: str = "priority", max_loras: int | None = None):
    model = ModelConfig(model=str(model_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    scheduling = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=256, policy=policy, is_encoder_decoder=False
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=8) if max_loras else None
    config = VllmConfig(model_config=model, scheduler_config=scheduling, cache_config=cache, lora_config=lora)
    cache.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=BLOCK)


def _request(request_id: str, priority: int, prompt: int, max_tokens: int, lora: int | None = None) -> Request:
    return Request(
        request_id,
        prompt_token_ids=list(range(3, 3 + prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=float(next(_arrivals)),
        lora_request=LoRARequest(f"adapter-{lora}", lora, f"/adapters/{lora}") if lora else None,
        priority=priority,
    )


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One step: schedule, then a token for each request whose known tokens are all computed; returns the step's
    tokens by request."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        request = scheduler.requests[request_id]
        sampled.append([TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
    answer = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    scheduler.update_from_output(out, answer)
    return dict(out.num_scheduled_tokens)


def _run(scheduler: Scheduler, requests: dict[str, Request]) -> list[str]:
    """Steps until every request is done; returns their ids in the order they finished."""
    finished: list[str] = []
    for _ in range(500):
        _step(scheduler)
        finished += [i for i, r in requests.items() if r.is_finished() and i not in finished]
        if len(finished) == len(requests):
            return finished
    raise AssertionError(f"not done after 500 steps: {sorted(set(requests) - set(finished))}")


def _started(
    scheduler: Scheduler, *, prompt: int, max_tokens: int, steps: int, lora: int | None = None, ids=("off-0", "off-1")
) -> dict[str, Request]:
    """Offline requests of those ids, received and run for `steps` steps."""
    offline = {i: _request(i, OFFLINE_PRIORITY, prompt, max_tokens, lora) for i in ids}
    for request in offline.values():
        scheduler.add_request(request)
    for _ in range(steps):
        _step(scheduler)
    return offline


def _running(scheduler: Scheduler) -> list[str]:
    return sorted(r.request_id for r in scheduler.running)


def test_a_live_request_short_of_a_slot_preempts_the_latest_offline_one(model_dirs):
    s = _scheduler(model_dirs["llama"], seqs=2)
    offline = _started(s, prompt=20, max_tokens=40, steps=5)
    assert _running(s) == ["off-0", "off-1"] and len(offline["off-1"].output_token_ids) == 5

    live = _request("live", LIVE_PRIORITY, prompt=12, max_tokens=4)
    s.add_request(live)
    assert _step(s) == {"off-0": 1, "live": 12}  # (it starts at once: off-1, the later, made room)
    assert offline["off-1"].status == RequestStatus.PREEMPTED and offline["off-1"].num_preemptions == 1
    assert offline["off-1"].num_computed_tokens == 0 and len(offline["off-1"].output_token_ids) == 5

    order = _run(s, {**offline, "live": live})
    assert order[0] == "live"
    assert [len(r.output_token_ids) for r in offline.values()] == [40, 40]  # (the preempted one ran to its end)
    assert offline["off-0"].num_preemptions == 0


def test_the_preempted_request_runs_again_from_position_zero(model_dirs):
    s = _scheduler(model_dirs["llama"], seqs=1)
    _started(s, prompt=20, max_tokens=30, steps=4, ids=("off",))
    s.add_request(live := _request("live", LIVE_PRIORITY, prompt=8, max_tokens=2))
    assert _step(s) == {"live": 8}
    _run(s, {"live": live})
    assert _step(s) == {"off": 20 + 4}  # (its prompt and its four tokens, recomputed in one chunk)


def test_a_live_request_short_of_kv_blocks_preempts_until_it_fits(model_dirs):
    s = _scheduler(model_dirs["llama"], seqs=8, blocks=8)  # (128 tokens of KV)
    offline = _started(s, prompt=40, max_tokens=60, steps=2)
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    assert _running(s) == ["off-0", "off-1"] and free < 3  # (each holds three blocks or more)

    s.add_request(live := _request("live", LIVE_PRIORITY, prompt=40, max_tokens=4))  # (three blocks)
    assert "live" in _step(s)
    assert offline["off-1"].num_preemptions == 1 and offline["off-0"].num_preemptions == 0
    assert _run(s, {**offline, "live": live})[0] == "live"
    assert [len(r.output_token_ids) for r in offline.values()] == [60, 60]


def test_a_long_live_prompt_preempts_for_the_blocks_vllm_wants_free_to_admit_it(model_dirs):
    """A 150-token prompt: its first chunk takes 4 blocks, its whole sequence 10; vLLM 0.28 admits it only with the
    whole sequence's free (`scheduler_reserve_full_isl`, its default), 0.26 with the first chunk's."""
    s = _scheduler(model_dirs["llama"], seqs=8, blocks=12)  # (192 tokens of KV)
    offline = _started(s, prompt=70, max_tokens=30, steps=4)
    free = s.kv_cache_manager.block_pool.get_num_free_blocks()
    assert _running(s) == ["off-0", "off-1"] and free == 1  # (five blocks each, and vLLM's null block)

    s.add_request(live := _request("live", LIVE_PRIORITY, prompt=150, max_tokens=2))
    assert "live" in _step(s)
    whole = getattr(s, "scheduler_reserve_full_isl", False)
    assert [r.num_preemptions for r in offline.values()] == [1 if whole else 0, 1]
    assert _run(s, {**offline, "live": live})[0] == "live"


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
@pytest.mark.parametrize("live_before", [True, False])
def test_requests_of_one_priority_or_under_fcfs_wait_for_a_slot(model_dirs, policy, live_before):
    """Also once the scheduler has served both priorities (`live_before`), and before (when nothing is looked at)."""
    s = _scheduler(model_dirs["llama"], seqs=2, policy=policy)
    if live_before:
        s.add_request(earlier := _request("earlier", LIVE_PRIORITY, prompt=4, max_tokens=1))
        _run(s, {"earlier": earlier})
    first = _started(s, prompt=20, max_tokens=10, steps=1)
    late = _request("late", OFFLINE_PRIORITY if policy == "priority" else LIVE_PRIORITY, prompt=8, max_tokens=2)
    s.add_request(late)
    assert make_room(s) == []
    assert set(_step(s)) == {"off-0", "off-1"}
    assert _run(s, {**first, "late": late})[-1] == "late"
    assert all(r.num_preemptions == 0 for r in first.values())


def test_a_request_held_back_by_something_else_makes_one_victim(model_dirs):
    """max_loras 1: a live request of another adapter cannot start beside the running one's adapter, whatever
    room it is given; its one victim sits out that step (as vLLM's own victims do), takes the slot back the step
    after, from position 0, and is not preempted again."""
    s = _scheduler(model_dirs["llama"], seqs=2, max_loras=1)
    offline = _started(s, prompt=20, max_tokens=12, steps=1, lora=1)
    s.add_request(live := _request("live", LIVE_PRIORITY, prompt=8, max_tokens=2, lora=2))
    assert _step(s) == {"off-0": 1}
    assert _step(s) == {"off-0": 1, "off-1": 20 + 1}
    for _ in range(4):
        assert "live" not in _step(s)
    assert offline["off-1"].num_preemptions == 1 and offline["off-0"].num_preemptions == 0
    assert _run(s, {**offline, "live": live})[-1] == "live"
    assert offline["off-1"].num_preemptions == 1
