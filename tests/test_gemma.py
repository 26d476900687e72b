"""Gemma-3-270M (sliding and full-attention layers) as a second real model; needs its optional packages."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from kvsieve.harness.data import long_context
from kvsieve.harness.gemma import gemma_missing
from kvsieve.runtime.storage.sliding import SlidingLayer
from kvsieve.selection.checkpoint import DEFAULT_GATES, load_gates, read_gates, shipped_gates_for

pytestmark = [
    pytest.mark.gemma,
    pytest.mark.skipif(gemma_missing() is not None, reason=f"optional packages: {gemma_missing()}"),
]

PROMPT, STEPS = 600, 4  # past the 512-token window of the sliding layers


@pytest.fixture(scope="module")
def gemma():
    return kvsieve.load_model("gemma3-270m")


def test_tokenizer_prepends_bos_and_keeps_words_whole(gemma):
    _, tokenizer = gemma
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]
    assert tokenizer.convert_ids_to_tokens(tokenizer("Hi there\n\nyou").input_ids) == [
        "<bos>",
        "Hi",
        "▁there",
        "\n\n",
        "you",
    ]
    assert tokenizer.decode(tokenizer("Hi there\n\nyou").input_ids, skip_special_tokens=True) == "Hi there\n\nyou"


@torch.no_grad()
def test_compressed_decode_equals_the_masked_reference_and_bytes_count_both_kinds(gemma, masked_reference):
    model, tokenizer = gemma
    ids = long_context(tokenizer, PROMPT + STEPS)
    assert int(ids[0, 0]) == 2
    cache = kvsieve.compress(model, ids[:, :PROMPT], "snapkv", rate=0.8)
    assert cache.full_layers == [5, 11, 17]
    kept = {layer: cache.kept_positions(layer) for layer in cache.full_layers}
    assert all(len(p) == 1 + 32 + round(0.2 * (PROMPT - 33)) for heads in kept.values() for p in heads)
    with kvsieve.sieve_attention(model):
        ours = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(PROMPT, PROMPT + STEPS)]
    with masked_reference(model, ids[:, :PROMPT], kept) as reference:
        expected = [
            model(ids[:, t : t + 1], past_key_values=reference.cache).logits for t in range(PROMPT, PROMPT + STEPS)
        ]
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(expected, 1), atol=1e-4, rtol=0)
    with masked_reference(model, ids[:, :PROMPT], {}) as unmasked:
        whole = model(ids[:, PROMPT : PROMPT + STEPS], past_key_values=unmasked.cache).logits
    assert (whole - torch.cat(ours, 1)).abs().max() > 0.1, "evicting 80% of the full layers changes the logits"

    entry = 2 * 256 * 4  # key + value of head_dim 256, float32
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert len(sliding) == 15 and all(isinstance(layer, SlidingLayer) for layer in sliding)
    assert all(layer.stored_lengths() == [511] for layer in sliding)
    entries = sum(map(sum, cache.stored_lengths()))
    assert cache.nbytes() == cache.row_nbytes(0) == entries * entry
    assert cache.window_nbytes() == 15 * 511 * entry
    full = kvsieve.compress(model, ids[:, :PROMPT], "snapkv", rate=0.0)
    assert full.nbytes() == (15 * 511 + 3 * PROMPT) * entry


@torch.no_grad()
def test_shipped_gates_load_and_evict_exactly(gemma, masked_reference):
    model, tokenizer = gemma
    folder = shipped_gates_for(model)
    assert folder is not None and folder.name == "gemma3-270m", "kvsieve ships gates for Gemma-3-270M"
    _, record = read_gates(folder)
    assert record.architecture == "Gemma3ForCausalLM" and record.seconds <= 40 * 60
    assert (record.seed, record.capacity, record.steps) == (3, 128, 240), "issue 39: the seed validation picked"
    gates = load_gates(DEFAULT_GATES, model)
    assert gates.shape.layers == (5, 11, 17) and (gates.horizons.once, gates.horizons.bounded) == (math.inf, 128)
    replaced = load_gates("gemma3-270m-seed0", model)  # the gates it replaced, by name
    assert not torch.equal(replaced.state_dict()["scoring.weight"], gates.state_dict()["scoring.weight"])
    ids = long_context(tokenizer, PROMPT + STEPS)
    cache = kvsieve.compress(model, ids[:, :PROMPT], "trimkv+global", rate=0.8)
    stored = [cache.stored_lengths()[layer][0] for layer in cache.full_layers]
    assert sum(stored) == pytest.approx(3 * (1 + 32 + 0.2 * (PROMPT - 33)), abs=3), "one budget over three heads"
    kept = {layer: cache.kept_positions(layer) for layer in cache.full_layers}
    with kvsieve.sieve_attention(model):
        ours = model(ids[:, PROMPT:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :PROMPT], kept) as reference:
        expected = model(ids[:, PROMPT:], past_key_values=reference.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
