"""The scheduler patch hides the adapters of running prefill-mode requests past their prompt, and only when
the max_loras bound can bind (vLLM's scheduler itself is exercised by tests/engine/test_slots_and_failures)."""

from __future__ import annotations

from types import SimpleNamespace

from preft.common.modes import mode_extra_args
from preft.vllm_plugin.patches.scheduler import _add_request, _schedule


class FakeScheduler:
    """Just what the patch reads of vLLM's Scheduler; `schedule` records the adapters it saw."""

    def __init__(self, max_loras: int) -> None:
        self.lora_config = SimpleNamespace(max_loras=max_loras)
        self.running: list = []
        self.waiting: list = []
        self.seen: list = []

    def add_request(self, request) -> None:
        self.running.append(request)

    def schedule(self):
        self.seen = [r.lora_request for r in self.running]
        return "output"


FakeScheduler.add_request = _add_request(FakeScheduler.add_request)
FakeScheduler.schedule = _schedule(FakeScheduler.schedule)


def _request(lora: str | None, mode: str | None, computed: int, prompt: int = 4):
    params = SimpleNamespace(extra_args=mode_extra_args(mode) if mode else None)
    return SimpleNamespace(
        lora_request=lora, sampling_params=params, num_computed_tokens=computed, num_prompt_tokens=prompt, priority=0
    )


def _scheduler_with_mix(max_loras: int) -> FakeScheduler:
    s = FakeScheduler(max_loras)
    for req in (
        _request("a", "prefill", computed=6),  # past its prompt: hidden
        _request("b", "prefill", computed=2),  # still in its prompt: keeps its adapter
        _request("c", "all", computed=6),  # `all` mode: always keeps it
        _request(None, None, computed=6),  # base request
    ):
        s.add_request(req)
    return s


def test_prefill_mode_past_prompt_is_hidden_during_schedule_and_restored():
    s = _scheduler_with_mix(max_loras=2)  # 3 adapters running > 2 slots: the bound can bind
    assert s.schedule() == "output"
    assert s.seen == [None, "b", "c", None]
    assert [r.lora_request for r in s.running] == ["a", "b", "c", None]


def test_nothing_hidden_when_the_bound_cannot_bind():
    s = _scheduler_with_mix(max_loras=4)  # every running adapter fits, nothing waits
    s.schedule()
    assert s.seen == ["a", "b", "c", None]
    s.waiting.append(_request("d", "prefill", computed=0))  # something to admit: hide again
    s.schedule()
    assert s.seen == [None, "b", "c", None]


def test_prefill_only_is_decided_when_the_request_arrives():
    s = _scheduler_with_mix(max_loras=1)
    assert [r._preft_prefill_only for r in s.running] == [True, True, False, False]
