"""Batches: every sequence keeps its own entries, and each row equals compressing that sequence alone."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.runtime.api.evictions import Eviction, evictions
from kvsieve.selection.allocators import ALLOCATORS
from specs import SCORER_SPECS

LENGTHS = (120, 83, 101)
GEN = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


def _padded(ids: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Three prompts of different lengths (prefixes of different rows), padded on `side`; the pad counts on the left."""
    width = max(LENGTHS)
    batch = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    offsets = []
    for row, n in enumerate(LENGTHS):
        start = width - n if side == "left" else 0
        batch[row, start : start + n] = ids[row % ids.shape[0], :n]
        mask[row, start : start + n] = 1
        offsets.append(start)
    return batch, mask, offsets


@pytest.fixture
def prompts() -> torch.Tensor:
    return torch.randint(0, 128, (3, 140), generator=torch.Generator().manual_seed(5))


def _continue(model, cache, tokens: torch.Tensor, mask: torch.Tensor | None, lengths) -> torch.Tensor:
    """Teacher-forced logits of `tokens` after each row's own real tokens (positions from each row's length)."""
    positions = torch.tensor(lengths)[:, None] + torch.arange(tokens.shape[1])
    extended = None if mask is None else torch.cat([mask, torch.ones_like(tokens)], dim=-1)
    with kvsieve.sieve_attention(model), torch.no_grad():
        return model(tokens, past_key_values=cache, attention_mask=extended, position_ids=positions).logits


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "spec",
    [
        *SCORER_SPECS,
        *(f"snapkv+{a}" for a in ALLOCATORS),
        "importance+global",
        "expected+adaptive",
        "snapkv:merge=window",
    ],
)
def test_each_row_equals_compressing_that_sequence_alone(model, prompts, side, spec):
    batch, mask, offsets = _padded(prompts, side)
    cache = kvsieve.compress(model, batch, spec, 0.6, attention_mask=mask, n_recent=8)
    assert cache.batch_size == 3
    alone = [kvsieve.compress(model, prompts[r : r + 1, :n], spec, 0.6, n_recent=8) for r, n in enumerate(LENGTHS)]
    for row, offset in enumerate(offsets):
        assert cache.stored_lengths(row) == alone[row].stored_lengths(), "its own budget over its own real tokens"
        for layer in range(3):
            for ours, theirs in zip(cache.kept_positions(layer, row), alone[row].kept_positions(layer), strict=True):
                assert torch.equal(ours - offset, theirs), "the same entries, pads never kept"
    cont = prompts[:, 130:136]
    together = _continue(model, cache, cont, mask, LENGTHS)
    for row, n in enumerate(LENGTHS):
        single = _continue(model, alone[row], cont[row : row + 1], None, [n])
        torch.testing.assert_close(together[row : row + 1], single, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", ["snapkv+adaptive", "importance+global", "random", "snapkv+global:merge=window"])
@torch.no_grad()
def test_left_padded_generate_equals_one_at_a_time(model, prompts, spec):
    batch, mask, _ = _padded(prompts, "left")
    cache = kvsieve.compress(model, batch[:, :-1], spec, 0.7, attention_mask=mask[:, :-1], n_recent=8)
    with kvsieve.sieve_attention(model):
        together = model.generate(batch, attention_mask=mask, past_key_values=cache, **GEN)[:, -6:]
        for row, n in enumerate(LENGTHS):
            ids = prompts[row : row + 1, :n]
            alone = kvsieve.compress(model, ids[:, :-1], spec, 0.7, n_recent=8)
            ones = torch.ones_like(ids)  # never inferred from pad id 0, which random prompts contain
            assert torch.equal(
                model.generate(ids, attention_mask=ones, past_key_values=alone, **GEN)[0, -6:], together[row]
            )


@torch.no_grad()
def test_rows_of_one_prefill_equal_their_own_compression(model, ids, masked_reference):
    """A batch of different evictions of the same prefill: each row is exactly its own configuration."""
    plans = [
        Eviction("snapkv", 0.5),
        Eviction(None),
        Eviction("random+global", 0.9),
        Eviction("importance+adaptive", 0.7, protect_positions=torch.arange(40, 50)),
    ]
    prefill = kvsieve.observe_prefill(model, ids[:, :100], kvsieve.Needs(window=32, accumulated=True))
    cache = evictions(prefill, plans)
    assert cache.batch_size == 4 and prefill.cache.stored_lengths() == [[100, 100]] * 3
    kept = [[cache.kept_positions(layer, row) for layer in range(3)] for row in range(4)]
    for row, plan in enumerate(plans):
        if plan.policy is None:
            assert all(torch.equal(p, torch.arange(100)) for heads in kept[row] for p in heads)
            continue
        protect = plan.protect_positions
        alone = kvsieve.compress(model, ids[:, :100], plan.policy, plan.budget, protect_positions=protect)
        for layer in range(3):
            for a, b in zip(alone.kept_positions(layer), kept[row][layer], strict=True):
                assert torch.equal(a, b)
    ones = torch.ones(4, 120, dtype=torch.long)
    with kvsieve.sieve_attention(model):
        generated = model.generate(ids.expand(4, -1), attention_mask=ones, past_key_values=cache.copy(), **GEN)
        together = model(ids[:, 100:].expand(4, -1), past_key_values=cache).logits
    for row in range(4):
        with masked_reference(model, ids[:, :100], kept[row]) as ref:
            expected_tokens = model.generate(ids, attention_mask=ones[:1], past_key_values=ref.cache, **GEN)
        with masked_reference(model, ids[:, :100], kept[row]) as ref:
            expected = model(ids[:, 100:], past_key_values=ref.cache).logits
        torch.testing.assert_close(together[row : row + 1], expected, atol=1e-4, rtol=0)
        assert torch.equal(generated[row, -6:], expected_tokens[0, -6:])


@torch.no_grad()
def test_batched_cache_rows_can_be_selected_and_repeated(model, ids):
    """`num_return_sequences`-style expansion and row selection keep every row's own entries."""
    prefill = kvsieve.observe_prefill(model, ids[:, :100])
    cache = evictions(prefill, [Eviction("snapkv", 0.5), Eviction("random", 0.8)])
    lengths = [cache.stored_lengths(row) for row in range(2)]
    cache.batch_repeat_interleave(2)
    assert [cache.stored_lengths(row) for row in range(4)] == [lengths[0], lengths[0], lengths[1], lengths[1]]
    cache.batch_select_indices(torch.tensor([3, 0]))
    assert [cache.stored_lengths(row) for row in range(2)] == [lengths[1], lengths[0]]
    with kvsieve.sieve_attention(model):
        out = model.generate(ids.expand(2, -1), past_key_values=cache, do_sample=True, max_new_tokens=3)
    assert out.shape == (2, 123)
