"""Adapters read ahead of vLLM's add_lora (the plugin's load_ahead), with stand-ins for a worker and its LoRA
manager: a read is taken once by the add_lora of the same adapter and path, a failed read leaves add_lora to read
(and fail) itself, reads nobody takes are bounded, and the engine core's utility answers when an in-process read
ends."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from preft.vllm_plugin.patches import load_ahead


@dataclass(frozen=True)
class Request:
    lora_int_id: int
    lora_path: str


class Manager:
    """A LoRA manager whose reads wait for `release` and go through the plugin's take, as the wrapped one does."""

    def __init__(self, fail: bool = False) -> None:
        self.reads: list[int] = []
        self.release = threading.Event()
        self.fail = fail
        self.loaded: set[int] = set()

    def list_adapters(self) -> set[int]:
        return self.loaded

    def _load_adapter(self, request: Request):
        read = load_ahead.take(request)
        if read is not None:
            return read
        self.reads.append(request.lora_int_id)
        assert self.release.wait(10)
        if self.fail:
            raise ValueError(f"adapter {request.lora_int_id} is broken")
        return f"model-{request.lora_int_id}@{request.lora_path}"


def _worker(manager: Manager):
    return SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))


@pytest.fixture(autouse=True)
def _empty():
    load_ahead._prepared.clear()
    yield
    load_ahead._prepared.clear()


def test_a_read_is_taken_once_by_the_add_of_the_same_adapter():
    manager = Manager()
    read = load_ahead.start_read(_worker(manager), Request(7, "/a"), os.getpid())
    assert isinstance(read, Future) and not read.done()
    # a second prepare of the same adapter shares the read
    assert load_ahead.start_read(_worker(manager), Request(7, "/a"), os.getpid()) is read
    manager.release.set()
    assert read.result(10) == "model-7@/a"
    assert manager._load_adapter(Request(7, "/a")) == "model-7@/a"  # taken: no second read
    assert manager.reads == [7]
    assert manager._load_adapter(Request(7, "/a")) == "model-7@/a" and manager.reads == [7, 7]  # (taken once)


def test_an_add_waits_for_a_read_still_running():
    manager = Manager()
    load_ahead.start_read(_worker(manager), Request(1, "/a"), os.getpid())
    threading.Timer(0.2, manager.release.set).start()
    assert manager._load_adapter(Request(1, "/a")) == "model-1@/a"
    assert manager.reads == [1]


def test_another_path_for_the_same_id_is_read_again():
    manager = Manager()
    manager.release.set()
    load_ahead.start_read(_worker(manager), Request(1, "/old"), os.getpid()).result(10)
    assert manager._load_adapter(Request(1, "/new")) == "model-1@/new"
    assert manager.reads == [1, 1]


def test_a_failed_read_leaves_add_lora_to_fail_with_its_own_error():
    manager = Manager(fail=True)
    manager.release.set()
    read = load_ahead.start_read(_worker(manager), Request(3, "/bad"), os.getpid())
    with pytest.raises(ValueError):
        read.result(10)
    assert 3 not in load_ahead._prepared
    with pytest.raises(ValueError, match="broken"):
        manager._load_adapter(Request(3, "/bad"))
    assert manager.reads == [3, 3]


def test_loaded_adapters_are_not_read_and_a_worker_in_another_process_returns_no_future():
    manager = Manager()
    manager.loaded.add(5)
    assert load_ahead.start_read(_worker(manager), Request(5, "/a"), os.getpid()) is None
    assert 5 not in load_ahead._prepared
    manager.release.set()
    assert load_ahead.start_read(_worker(manager), Request(6, "/a"), os.getpid() + 1) is None  # (not this process)
    assert 6 in load_ahead._prepared


def test_reads_nobody_takes_are_dropped_oldest_first():
    manager = Manager()
    manager.release.set()
    for i in range(load_ahead.MAX_PREPARED + 3):
        load_ahead.start_read(_worker(manager), Request(i, "/a"), os.getpid())
    assert list(load_ahead._prepared) == list(range(3, load_ahead.MAX_PREPARED + 3))


@pytest.mark.parametrize("fail", [False, True])
def test_the_engine_core_utility_answers_when_the_in_process_read_ends(fail):
    manager = Manager(fail=fail)
    core = SimpleNamespace(
        model_executor=SimpleNamespace(
            collective_rpc=lambda fn, args: [fn(_worker(manager), *args)]  # (the uniprocess executor: one worker)
        )
    )
    answer = load_ahead.prepare_adapter(core, Request(9, "/a"))
    assert isinstance(answer, Future) and not answer.done()
    manager.release.set()
    assert answer.result(10) is not fail  # a failed read: False, never an error (add_lora raises vLLM's)
    other = SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=lambda fn, args: [None, None]))
    assert load_ahead.prepare_adapter(other, Request(9, "/a")) is True  # workers of their own: answered at once
