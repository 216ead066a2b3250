"""TRL 1.16's own client and generation classes, as preft.training.rollouts subclasses them, against a rollout
server (a real HTTP server over a scripted engine): TRL's calls are answered as it parses them; a sync pushes the
adapter's own tensors (named as its saved file), in one update, over HTTP; what stock TRL would push (the model's
parameters) is refused; a GRPOTrainer built inside ``rollout_server`` syncs through it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from preft.gateway.testing import ThreadedServer
from preft.rollout.app import create_app
from preft.rollout.service import RolloutService, ServedAdapter
from preft.training import DireftConfig, PreftModel
from tests.fake_engine import ScriptedEngine

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
rollouts = pytest.importorskip("preft.training.rollouts")

WEIGHTS = "adapter_model.safetensors"


def _policy(model_dir, method: str) -> PreftModel:
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if method == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return PreftModel.for_lora(base, config, mode="prefill")
    return PreftModel.for_direft(base, DireftConfig(rank=4, layers=(0, 2), seed=0), mode="prefill")


@pytest.fixture(params=["lora", "direft"])
def served(request, model_dirs, tmp_path):
    """(policy, its saved adapter dir, the scripted engine, the service, the server's URL)."""
    policy = _policy(model_dirs["llama"], request.param)
    adapter0 = policy.save_pretrained(tmp_path / "adapter0")
    engine = ScriptedEngine(model_dir=model_dirs["llama"])
    service = RolloutService(engine=engine, adapter=ServedAdapter(adapter0, "policy"), transport="http")
    with ThreadedServer(create_app(service)) as server:
        yield policy, adapter0, engine, service, server.url


def test_trl_client_generates_and_pushes_the_adapter_tensors(served):
    policy, adapter0, engine, service, url = served
    client = rollouts.PreftVLLMClient(base_url=url, connection_timeout=10)
    assert client.model == "policy"
    out = client.generate([[5, 6, 7], [9, 10]], n=2, max_tokens=3, logprobs=0)
    assert out["prompt_ids"] == [[5, 6, 7], [9, 10]]
    assert out["completion_ids"] == [[18, 19, 20], [18, 19, 20], [19, 20, 21], [19, 20, 21]]

    client.init_communicator(device="cpu")
    tensors = rollouts.adapter_tensors(policy)
    assert sorted(tensors) == sorted(load_file(str(adapter0 / WEIGHTS))), "not named as the saved adapter's file"
    with client.weight_update():  # (one update, however many bodies: TRL's grouping)
        for name, tensor in tensors.items():
            client.update_named_param(name, tensor * 2)
    assert engine.updates == [(service.digest, sorted(tensors))]
    assert client.last_update["version"] == 1 and client.last_update["tensors"] == len(tensors)

    # what stock TRL would push for a PEFT model (merged base weights) or a DiReFT (every parameter): refused
    params = list(policy.model.named_parameters())
    metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params]
    with pytest.raises(Exception, match=r"400.*unknown tensor names"):
        client.update_named_params(metadata, iter(params))
    assert len(engine.updates) == 1


def test_trls_own_client_cannot_sync_without_cuda(served):
    """Why the subclass: TRL 1.16's client syncs only by NCCL."""
    from trl.generation.vllm_client import VLLMClient

    *_, url = served
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        VLLMClient(base_url=url, connection_timeout=10).init_communicator(device="cpu")


def test_a_grpo_trainer_built_in_rollout_server_syncs_the_adapter(served, model_dirs, tmp_path):
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer import grpo_trainer

    policy, adapter0, engine, service, url = served
    synced = []
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        bf16=False,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=10,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
    )
    rows = datasets.Dataset.from_list([{"prompt": "the adapter"}, {"prompt": "a prompt"}])
    with rollouts.rollout_server(policy, on_update=synced.append):
        trainer = trl.GRPOTrainer(
            model=policy.model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=rows,
            processing_class=AutoTokenizer.from_pretrained(str(model_dirs["llama"])),
        )
    assert grpo_trainer.VLLMGeneration is VLLMGeneration, "TRL's class was not put back"
    assert isinstance(trainer.vllm_generation, rollouts.PreftVLLMGeneration)
    trainer.vllm_generation.sync_weights()  # (TRL's own sync, as its trainer calls it before each step's rollouts)
    assert engine.updates == [(service.digest, sorted(load_file(str(adapter0 / WEIGHTS))))]
    assert [s["version"] for s in synced] == [1]
