"""Eviction during generation: a size budget holds while the cache grows, and decoding stays exact."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_llama

PROMPT, MAX_TOKENS, BUFFER = 60, 40, 8  # 33 entries per head are protected (1 sink + 32 recent)


EVERY_SCORER = [
    "streaming",
    "knorm",
    "keydiff+adaptive",
    "random+global",
    "snapkv",
    "tova+adaptive",
    "window:window=8",
    "caote",
    "critical+adaptive",
    "expected",
    "h2o",
    "importance+global",
    "vatp+adaptive",
    "trimkv+global:gates=untrained",
]


#: Quantized storage: 4-bit entries in groups of 8 channels, the newest 8 (inside the protected tail) as computed.
QUANTIZED = {"kv_bits": 4, "kv_group": 8, "kv_residual": 8}


@pytest.mark.parametrize(
    ("spec", "storage"),
    [(spec, {}) for spec in EVERY_SCORER]
    + [(spec, QUANTIZED) for spec in ("h2o", "snapkv", "trimkv+global:gates=untrained")],
)
@torch.no_grad()
def test_every_step_stays_within_budget_and_equals_the_masked_reference(model, ids, masked_reference, spec, storage):
    """Step t's logits equal a full cache that masks exactly what was evicted before step t (and, quantized, reads
    back what the cache stores)."""
    ids = torch.randint(0, 128, (1, PROMPT + 50), generator=torch.Generator().manual_seed(2))
    cache = kvsieve.compress(model, ids[:, :PROMPT], spec, max_tokens=MAX_TOKENS, buffer=BUFFER, **storage)
    assert cache.mean_stored() == MAX_TOKENS
    codec = cache.layers[0].codec if storage else None
    reference = masked_reference(model, ids[:, :PROMPT], [cache.kept_positions(i) for i in range(3)], codec)
    evictions = 0
    for t in range(PROMPT, ids.shape[1]):
        before = cache.mean_stored()
        with kvsieve.sieve_attention(model):
            ours = model(ids[:, t : t + 1], past_key_values=cache).logits
        held = cache.mean_stored()
        assert held <= MAX_TOKENS + BUFFER, f"step {t}: {held} entries per head"
        evictions += held < before
        kept = [cache.kept_positions(layer) for layer in range(3)]
        assert all(int(p.max()) == t and int(p.min()) == 0 for heads in kept for p in heads), "sink and newest kept"
        with reference:
            reference.allow(kept)
            expected = model(ids[:, t : t + 1], past_key_values=reference.cache).logits
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert evictions == 50 // BUFFER, "evicted back to the budget once every `buffer` steps"


@torch.no_grad()
def test_apply_keeps_generate_bounded_for_greedy_and_sampling(model):
    prompt = torch.randint(0, 128, (2, 50), generator=torch.Generator().manual_seed(4))
    config = kvsieve.EvictionConfig(policy="knorm+global", max_tokens=MAX_TOKENS, buffer=BUFFER)
    with kvsieve.apply(model, config) as handle:
        greedy = model.generate(prompt, max_new_tokens=120, min_new_tokens=120, do_sample=False, pad_token_id=0)
        assert greedy.shape == (2, 170)
        assert max(handle.last_cache.mean_stored(row) for row in range(2)) <= MAX_TOKENS + BUFFER
        assert handle.last_cache.get_seq_length() == 169, "the last generated token is never fed"
        sampled = model.generate(prompt[:1], max_new_tokens=100, min_new_tokens=100, do_sample=True, pad_token_id=0)
        assert sampled.shape == (1, 150) and handle.last_cache.mean_stored() <= MAX_TOKENS + BUFFER
        with pytest.raises(kvsieve.PolicyError, match="beam search cannot run on a bounded cache"):
            model.generate(prompt, max_new_tokens=4, num_beams=2, pad_token_id=0)


@torch.no_grad()
def test_a_long_bounded_run_keeps_positions_and_flat_storage():
    """Long soak on a tiny model: positions stay right, storage stays flat."""
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = kvsieve.compress(model, ids, "streaming", max_tokens=36, buffer=4)
    token = ids[:, -1:]
    allocated = []
    with kvsieve.sieve_attention(model):
        for _ in range(600):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            allocated.append(cache.allocated_nbytes())
    kept = cache.kept_positions(0)
    assert cache.get_seq_length() == 640
    newest = [p[-32:] for p in kept]
    assert all(torch.equal(p, torch.arange(608, 640)) for p in newest), "the recent window is the last 32 tokens"
    assert max(allocated[100:]) <= max(allocated[:100]), "storage does not grow once the budget is reached"


@torch.no_grad()
def test_recent_queries_are_the_last_queries_of_the_sequence(model):
    """With nothing evicted, the logged queries equal those an observed prefill of the whole sequence records."""
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :10] = 0  # left padding: positions are cache positions on both sides
    cache = kvsieve.compress(model, ids[:, :70], "snapkv", max_tokens=500, buffer=8, attention_mask=mask[:, :70])
    with kvsieve.sieve_attention(model):
        for t in range(70, 90):
            position = mask[:, : t + 1].cumsum(-1)[:, -1:] - 1  # as generate() places padded rows
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=position, past_key_values=cache)
    whole = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=32), attention_mask=mask)
    log = cache.growth.queries
    for layer in range(3):
        for row in range(2):
            stats = whole.observations[row][layer].stats
            entries = whole.entries[row]
            positions = stats.window_positions if entries is None else entries[stats.window_positions]
            torch.testing.assert_close(log.queries[layer][row], stats.window_queries, atol=1e-5, rtol=0)
            assert torch.equal(log.positions[layer][row], positions)


def test_bad_bounded_configurations_name_the_problem(model, ids):
    with pytest.raises(kvsieve.PolicyError, match="buffer and chunk bound a size budget"):
        kvsieve.compress(model, ids[:, :PROMPT], "knorm", 0.5, buffer=8)
    with pytest.raises(kvsieve.PolicyError, match="buffer must be an integer >= 1, got 0"):
        kvsieve.compress(model, ids[:, :PROMPT], "knorm", max_tokens=40, buffer=0)
    with pytest.raises(kvsieve.PolicyError, match="buffer must be an integer >= 1, got -1"):
        kvsieve.EvictionConfig(policy="h2o", max_tokens=1024, buffer=-1)
    mask = torch.ones_like(ids[:, :PROMPT])
    mask[:, :3] = 0
    with pytest.raises(kvsieve.PolicyError, match="protect_positions with a buffer take unpadded prompts"):
        kvsieve.compress(
            model,
            ids[:, :PROMPT],
            "knorm",
            max_tokens=60,
            buffer=8,
            attention_mask=mask,
            protect_positions=torch.tensor([5]),
        )
    with pytest.raises(kvsieve.PolicyError, match="give one budget, not rate and max_tokens"):
        kvsieve.EvictionConfig(rate=0.5, max_tokens=1024)


@pytest.mark.parametrize("spec", ["snapkv", "knorm+global"])
@torch.no_grad()
def test_chunked_prefill_equals_the_masked_reference_chunk_by_chunk(model, masked_reference, spec):
    """Each chunk sees exactly what was kept before it; compress(chunk=) is that loop, evicted after the last chunk."""
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(7))
    chunk = 40
    cache = kvsieve.compress(model, ids[:, :chunk], spec, max_tokens=MAX_TOKENS, buffer=chunk)
    reference = masked_reference(model, ids[:, :chunk], [cache.kept_positions(i) for i in range(3)])
    for start in range(chunk, 200, chunk):
        with kvsieve.sieve_attention(model):
            ours = model(ids[:, start : start + chunk], past_key_values=cache).logits
        assert cache.mean_stored() <= MAX_TOKENS + chunk
        with reference:
            reference.allow([cache.kept_positions(layer) for layer in range(3)])
            expected = model(ids[:, start : start + chunk], past_key_values=reference.cache).logits
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    cache.growth.evict(cache)
    chunked = kvsieve.compress(model, ids, spec, max_tokens=MAX_TOKENS, chunk=chunk)
    assert chunked.mean_stored() == MAX_TOKENS and chunked.growth is None
    for layer in range(3):
        pairs = zip(chunked.kept_positions(layer), cache.kept_positions(layer), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def test_chunked_prefill_never_holds_more_than_budget_plus_chunk(model, monkeypatch):
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(8))
    peaks = []
    update = kvsieve.SievedCache.update

    def recorded(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = update(self, key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == 2:  # the last layer: the forward's tokens are in every layer
            peaks.append(self.mean_stored())
        return out

    monkeypatch.setattr(kvsieve.SievedCache, "update", recorded)
    cache = kvsieve.compress(model, ids, "tova", max_tokens=MAX_TOKENS, chunk=32, buffer=BUFFER)
    assert len(peaks) == 300 // 32 + 1 and max(peaks) <= MAX_TOKENS + 32
    assert cache.mean_stored() == MAX_TOKENS and cache.growth.buffer == BUFFER
    assert cache.get_seq_length() == 300


def test_bad_chunking_names_the_problem(model, ids):
    with pytest.raises(kvsieve.PolicyError, match="chunk must be an integer >= 1"):
        kvsieve.compress(model, ids, "knorm", max_tokens=40, chunk=0)
    with pytest.raises(kvsieve.PolicyError, match="buffer and chunk bound a size budget"):
        kvsieve.compress(model, ids, "knorm", 0.5, chunk=32)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    with pytest.raises(kvsieve.PolicyError, match="a chunked prefill takes unpadded prompts"):
        kvsieve.compress(model, ids, "knorm", max_tokens=40, chunk=32, attention_mask=mask)


@pytest.mark.parametrize(("spec", "storage"), [("h2o", {}), ("importance+adaptive", {}), ("h2o", QUANTIZED)])
@torch.no_grad()
def test_attention_accumulated_online_equals_a_brute_force_sum(model, masked_reference, spec, storage):
    """Each entry's sum = what the prompt paid it + what every later query paid it, evicted entries aside (and,
    quantized, the sums move with the entries from the residual to the body)."""
    ids = torch.randint(0, 128, (1, PROMPT + 40), generator=torch.Generator().manual_seed(9))
    cache = kvsieve.compress(model, ids[:, :PROMPT], spec, max_tokens=MAX_TOKENS, buffer=BUFFER, **storage)
    prompt = kvsieve.observe_prefill(model, ids[:, :PROMPT], kvsieve.Needs(accumulated=True)).observations[0]
    codec = cache.layers[0].codec if storage else None
    reference = masked_reference(model, ids[:, :PROMPT], [cache.kept_positions(i) for i in range(3)], codec)
    tally = reference.tally()
    for t in range(PROMPT, ids.shape[1]):
        with kvsieve.sieve_attention(model):
            model(ids[:, t : t + 1], past_key_values=cache)
        with reference:
            reference.allow([cache.kept_positions(layer) for layer in range(3)])
            model(ids[:, t : t + 1], past_key_values=reference.cache)
    assert cache.mean_stored() < PROMPT, "entries were evicted on the way"
    for obs in kvsieve.observe_cache(model, cache):
        expected = tally[obs.layer_idx].clone()
        expected[:, :PROMPT] += prompt[obs.layer_idx].stats.received.double()
        positions = obs.positions.repeat_interleave(obs.group, dim=0).clamp(min=0)
        expected = expected.gather(1, positions).float()
        valid = obs.valid.repeat_interleave(obs.group, dim=0)
        torch.testing.assert_close(obs.stats.received[valid], expected[valid], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sums_with_nothing_evicted_equal_an_observed_prefill_of_the_whole_sequence(model):
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(10))
    cache = kvsieve.compress(model, ids[:, :50], "h2o", max_tokens=500, buffer=8, chunk=16)
    with kvsieve.sieve_attention(model):
        for t in range(50, 90):
            model(ids[:, t : t + 1], past_key_values=cache)
    whole = kvsieve.observe_prefill(model, ids, kvsieve.Needs(accumulated=True)).observations[0]
    for obs, full in zip(kvsieve.observe_cache(model, cache), whole, strict=True):
        torch.testing.assert_close(obs.stats.received, full.stats.received, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["h2o", "snapkv+adaptive", "expected"])
@torch.no_grad()
def test_a_bounded_cache_fed_in_chunks_of_the_buffer_equals_token_by_token(model, spec):
    """An empty bounded cache: forwards of `buffer` tokens evict where single-token steps would."""
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(11))
    chunked, stepped = (kvsieve.bounded_cache(model, spec, max_tokens=48, buffer=16) for _ in range(2))
    with kvsieve.sieve_attention(model):
        ours = torch.cat([model(ids[:, s : s + 16], past_key_values=chunked).logits for s in range(0, 200, 16)], 1)
        steps = []
        for t in range(200):
            steps.append(model(ids[:, t : t + 1], past_key_values=stepped).logits)
            assert max(stepped.mean_stored(row) for row in range(2)) <= 48 + 16
    torch.testing.assert_close(ours, torch.cat(steps, 1), atol=1e-4, rtol=0)
    assert chunked.stored_lengths(1) == stepped.stored_lengths(1)
    with pytest.raises(kvsieve.PolicyError, match="a bounded cache needs a size"):
        kvsieve.bounded_cache(model, spec)


@torch.no_grad()
def test_a_chunked_prefill_with_a_question_keeps_the_question(model):
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(12))
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(13))
    cache = kvsieve.compress(model, ids, "snapkv", max_tokens=80, chunk=40, question_ids=question)
    assert cache.get_seq_length() == 155 and cache.mean_stored() == 80
    for layer in range(3):
        assert all(bool(torch.isin(torch.arange(150, 155), p).all()) for p in cache.kept_positions(layer))


@torch.no_grad()
def test_apply_is_question_aware_and_keeps_the_question_while_bounded(model):
    context = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(14))
    question = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(15))  # 0 is the pad token
    gen = {"max_new_tokens": 60, "min_new_tokens": 60, "do_sample": False, "pad_token_id": 0}
    config = kvsieve.EvictionConfig(policy="snapkv", max_tokens=100, buffer=BUFFER)
    with kvsieve.apply(model, config) as handle:
        out = model.generate(context, question_ids=question, **gen)
        held = handle.last_cache
    prompt = torch.cat([context, question], dim=-1)
    assert torch.equal(out[:, :86], prompt)
    cache = kvsieve.compress(model, context, "snapkv", max_tokens=100, buffer=BUFFER, question_ids=question[:, :-1])
    with kvsieve.sieve_attention(model):
        expected = model.generate(prompt, past_key_values=cache, **gen)
    assert torch.equal(out, expected)
    assert held.get_seq_length() == 145 and held.mean_stored() <= 100 + BUFFER
    for layer in range(3):  # the question (but its last token, fed by generate) survived every eviction
        assert all(bool(torch.isin(torch.arange(80, 85), p).all()) for p in held.kept_positions(layer))
    assert torch.equal(
        kvsieve.generate(model, context, "snapkv", max_tokens=100, buffer=BUFFER, question_ids=question, **gen), out
    )


@torch.no_grad()
def test_generate_compresses_or_continues_from_the_new_tokens_only(model, ids):
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    out = kvsieve.generate(model, ids[:, :100], "snapkv", 0.5, **gen)
    cache = kvsieve.compress(model, ids[:, :99], "snapkv", 0.5)
    with kvsieve.sieve_attention(model):
        expected = model.generate(ids[:, :100], past_key_values=cache, **gen)
    assert torch.equal(out, expected)
    cache, same = (kvsieve.compress(model, ids[:, :90], "snapkv", 0.5) for _ in range(2))
    continued = kvsieve.generate(model, ids[:, 90:100], cache=cache, **gen)
    with kvsieve.sieve_attention(model):
        whole = model.generate(ids[:, :100], past_key_values=same, **gen)
    assert torch.equal(continued, whole[:, 90:]), "only the new tokens in, the same tokens out"
    again = kvsieve.compress(model, ids[:, :90], "snapkv", 0.5)
    scored = kvsieve.generate(
        model, ids[:, 90:100], cache=again, output_scores=True, return_dict_in_generate=True, **gen
    )
    assert torch.equal(scored.sequences, continued) and len(scored.scores) == gen["max_new_tokens"]
    with pytest.raises(ValueError, match="new tokens alone continue a cache of one sequence"):
        kvsieve.generate(model, ids[:, 90:100].repeat(2, 1), cache=cache.copy(rows=[0, 0]), **gen)
    with pytest.raises(kvsieve.PolicyError, match="beam search cannot run on a compressed cache"):
        kvsieve.generate(model, ids[:, :100], "snapkv", 0.5, num_beams=2, max_new_tokens=2)
