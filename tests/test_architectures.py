"""Every family kvsieve evicts: gates train and load, trimkv+global evicts exactly, other models are refused clearly."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import FAMILIES, tiny_family, tiny_gemma3, tiny_llama
from kvsieve.harness.training.data import TrainingData
from kvsieve.harness.training.retention import RetentionTape
from kvsieve.harness.training.train import TrainConfig, train_gates, train_step
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.modeling.rotary import find_rotary
from kvsieve.selection.checkpoint import GateCheckpointError, load_gates

SEQ = 64
CONFIG = TrainConfig(capacity=8, steps=10, seq_len=SEQ, lr=5e-2, width=8, bias_init=4.0, save_every=10)
MODELS = {
    **{name: lambda name=name: tiny_family(name) for name in FAMILIES},
    "gemma3": tiny_gemma3,
    "llama": tiny_llama,
}


def _loss(model: torch.nn.Module, gates: RetentionGates, data: TrainingData) -> float:
    tape = RetentionTape(gates, *find_rotary(model)(torch.arange(SEQ)))
    with torch.no_grad():
        return sum(float(train_step(model, gates, tape, ids, CONFIG)["loss"]) for ids in data.sequences)


@pytest.mark.parametrize("family", sorted(MODELS))
@torch.no_grad()
def test_gates_train_load_and_evict_exactly(family, tmp_path, masked_reference):
    model = MODELS[family]()
    vocab = model.get_input_embeddings().num_embeddings
    ids = [torch.randint(1, vocab, (1, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    data = TrainingData(ids, {})
    with torch.enable_grad():
        gates, record = train_gates(model, None, CONFIG, tmp_path, family, data=data, show_progress=False)
    torch.manual_seed(CONFIG.seed)
    fresh = RetentionGates(gate_shape(model, CONFIG.width), bias_init=CONFIG.bias_init)
    assert _loss(model, gates, data) < 0.9 * _loss(model, fresh, data), "training lowers the loss"
    assert record.architecture == type(model).__name__ and gates.shape.layers == gate_shape(model).layers

    prompt = torch.randint(1, vocab, (1, 90), generator=torch.Generator().manual_seed(7))
    cache = kvsieve.compress(model, prompt[:, :80], f"trimkv+global:gates={tmp_path}", rate=0.6)
    full = cache.full_layers
    assert cache.mean_stored() < 80, "entries are evicted"
    with kvsieve.sieve_attention(model):
        ours = model(prompt[:, 80:], past_key_values=cache).logits
    kept = {layer: cache.kept_positions(layer) for layer in full}
    with masked_reference(model, prompt[:, :80], kept) as ref:
        expected = model(prompt[:, 80:], past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_gates_of_another_architecture_are_refused_by_name(tmp_path):
    qwen = tiny_family("qwen2")
    data = TrainingData([torch.randint(1, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))], {})
    train_gates(qwen, None, CONFIG, tmp_path, "qwen", data=data, show_progress=False)
    with pytest.raises(GateCheckpointError, match=r"trained for a Qwen2ForCausalLM .*this model is a LlamaForCausalLM"):
        load_gates(tmp_path, tiny_llama())
    with pytest.raises(GateCheckpointError, match="weights hash"):
        load_gates(tmp_path, tiny_family("qwen2", seed=1))  # same architecture, other weights


def test_a_model_without_full_attention_has_no_gates():
    from conftest import tiny_mistral

    with pytest.raises(kvsieve.UnhookableModelError, match="no full-attention layer"):
        gate_shape(tiny_mistral())
