"""KVzip (arXiv 2505.23416): the reconstruction pass against eager attention, real eviction against the masked
reference under every allocator, and the errors where the score is not defined."""

from __future__ import annotations

import copy

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.eviction.growth import BoundedGrowth
from kvsieve.runtime.observing.reconstruction import flash_attention, materialized_attention, repeat_prompt_ids
from kvsieve.selection.allocators import ALLOCATORS
from kvsieve.selection.budget import MaxTokens
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.observation import Needs, Reconstruction
from kvsieve.selection.scorers.kvzip import REPEAT_PROMPT, KVzipScorer
from tokenizer import VOCAB_SIZE

N, CHUNK = 60, 25  # three chunks: 25, 25 and 10 context tokens


def _ids(n: int = N, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (rows, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _eager_reconstruction(model, ids: torch.Tensor, repeat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Per layer `[q_heads, n]`: plain eager attention over context + repeat + chunk, max over the repetition's
    queries, then over the chunks."""
    n, most = ids.shape[1], None
    for start in range(0, n, chunk):
        sequence = torch.cat([ids, repeat, ids[:, start : start + chunk]], dim=-1)
        attentions = model(sequence, output_attentions=True).attentions  # [1, heads, L, L] per layer
        seen = torch.stack([a[0, :, n:, :n].amax(dim=1) for a in attentions])
        most = seen if most is None else torch.maximum(most, seen)
    return list(most)


@torch.no_grad()
def test_reconstruction_equals_eager_attention(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE).double()
    ids = _ids()
    needs = Needs(reconstruction=Reconstruction(REPEAT_PROMPT, CHUNK))
    observations = kvsieve.observe_prefill(model, ids, needs, tokenizer=tok).observations[0]
    model.set_attn_implementation("eager")
    expected = _eager_reconstruction(model, ids, repeat_prompt_ids(tok, REPEAT_PROMPT), CHUNK)
    for obs, want in zip(observations, expected, strict=True):
        torch.testing.assert_close(obs.stats.reconstructed, want, atol=1e-8, rtol=1e-6)  # eager: float32 softmax
        # the scorer: per kv-head, the max over its query heads
        grouped = want.unflatten(0, (obs.num_kv_heads, obs.group)).amax(dim=1)
        torch.testing.assert_close(KVzipScorer(chunk=CHUNK).score(obs), grouped)
    assert expected[0].std() > 1e-2 * expected[0].mean()  # entries score differently: a ranking to test


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_and_the_materialized_attention_agree(dtype):
    """The CPU path (flash kernel + log-sum-exp) against the one other devices take, on the same numbers."""
    generator = torch.Generator().manual_seed(3)
    query, keys, values = (torch.randn(2, 4, 30, 16, generator=generator).to(dtype) for _ in range(3))
    earlier_keys, earlier_values = (torch.randn(2, 4, 50, 16, generator=generator).to(dtype) for _ in range(2))
    keys, values = torch.cat([earlier_keys, keys], dim=2), torch.cat([earlier_values, values], dim=2)
    causal = torch.arange(80)[None, :] > torch.arange(50, 80)[:, None]
    ragged = causal | (torch.rand(2, 4, 1, 80, generator=generator) < 0.3)  # and keys hidden per (row, head)
    for hidden in (causal, ragged):
        fused, fused_seen = flash_attention(query, keys, values, 0.25, hidden, 50)
        plain, plain_seen = materialized_attention(query, keys, values, 0.25, hidden, 50)
        tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(fused, plain, **tolerance)
        torch.testing.assert_close(fused_seen.float(), plain_seen.float(), **tolerance)
        assert fused_seen.shape == (2, 4, 50) and fused.shape == (2, 4, 30, 16)
    assert bool((fused_seen == 0)[ragged[..., 0, :50]].all())  # hidden keys get nothing


@torch.no_grad()
def test_the_repeat_prompt_follows_the_chat_template(tok):
    plain = tok.decode(repeat_prompt_ids(tok, REPEAT_PROMPT)[0])
    assert plain == REPEAT_PROMPT + "\n"
    chat = copy.deepcopy(tok)
    turns = "{% for m in messages %}<u>{{ m['content'] | trim }}</u>{% endfor %}"
    opened = "{% if add_generation_prompt %}<a>{% endif %}"
    chat.chat_template = turns + opened
    assert tok.decode(repeat_prompt_ids(chat, REPEAT_PROMPT)[0]) == REPEAT_PROMPT + "</u><a>"


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@torch.no_grad()
def test_evicted_cache_equals_masked_full_cache(lm, tok, masked_reference, allocator):
    ids = _ids(100, seed=1)
    prefix, cont = ids[:, :80], ids[:, 80:]
    cache = kvsieve.compress(lm, prefix, f"kvzip:chunk={CHUNK}", 0.7, allocator=allocator, n_recent=8, tokenizer=tok)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    assert all(len(p) < 80 for heads in kept for p in heads)
    assert cache.get_seq_length() == 80  # the repetition left nothing behind
    with kvsieve.sieve_attention(lm):
        ours = lm(cont, past_key_values=cache).logits
    with masked_reference(lm, prefix, kept) as ref:
        expected = lm(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_a_batch_keeps_what_each_row_keeps_alone(lm, tok):
    ids = _ids(rows=2, seed=2)
    batch = kvsieve.compress(lm, ids, "kvzip+global", 0.6, tokenizer=tok)
    for row in range(2):
        alone = kvsieve.compress(lm, ids[row : row + 1], "kvzip+global", 0.6, tokenizer=tok)
        for layer in range(3):
            for mine, theirs in zip(batch.kept_positions(layer, row), alone.kept_positions(layer), strict=True):
                assert torch.equal(mine, theirs)


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_a_padded_batch_scores_and_keeps_what_each_row_does_alone(tok, side):
    model = tiny_llama(vocab_size=VOCAB_SIZE).double()
    short, long = _ids(45, seed=4), _ids(seed=5)
    pad = torch.zeros(1, N - 45, dtype=torch.long)
    padded = torch.cat([pad, short], dim=1) if side == "left" else torch.cat([short, pad], dim=1)
    real = torch.cat([torch.zeros_like(pad), torch.ones_like(short)], dim=1)
    real = real if side == "left" else real.flip(1)
    ids, mask = torch.cat([padded, long]), torch.cat([real, torch.ones_like(long)])
    needs = Needs(reconstruction=Reconstruction(REPEAT_PROMPT, CHUNK))
    batch = kvsieve.observe_prefill(model, ids, needs, attention_mask=mask, tokenizer=tok).observations
    for row, alone_ids in enumerate([short, long]):
        alone = kvsieve.observe_prefill(model, alone_ids, needs, tokenizer=tok).observations[0]
        for mine, theirs in zip(batch[row], alone, strict=True):
            torch.testing.assert_close(mine.stats.reconstructed, theirs.stats.reconstructed, atol=1e-10, rtol=1e-8)
    cache = kvsieve.compress(model, ids, "kvzip+global", 0.6, attention_mask=mask, tokenizer=tok)
    offset = N - 45 if side == "left" else 0
    for row, alone_ids in enumerate([short, long]):
        alone = kvsieve.compress(model, alone_ids, "kvzip+global", 0.6, tokenizer=tok)
        for layer in range(3):
            for mine, theirs in zip(cache.kept_positions(layer, row), alone.kept_positions(layer), strict=True):
                assert torch.equal(mine, theirs + (offset if row == 0 else 0))


@torch.no_grad()
def test_a_chunked_prefill_repeats_every_token_fed_after_what_the_cache_holds(tok, masked_reference, monkeypatch):
    """Replayed chunk by chunk on the masked float64 reference: each chunk sees what was kept before it, and each
    eviction ranks by the most attention the held entries got while the model repeated every token fed so far."""
    model = _sharpened(tiny_llama(vocab_size=VOCAB_SIZE).double())
    ids, chunk, max_tokens, spec = _ids(100, seed=6), 30, 40, "kvzip+global:chunk=20"
    scored, evict = [], BoundedGrowth.evict  # what the chunked prefill ranked by, eviction by eviction
    monkeypatch.setattr(BoundedGrowth, "evict", lambda self, cache, by: scored.append(by) or evict(self, cache, by))
    chunked = kvsieve.compress(model, ids, spec, max_tokens=max_tokens, chunk=chunk, n_recent=4, tokenizer=tok)
    monkeypatch.undo()
    growth = BoundedGrowth.of(kvsieve.make_policy(spec, n_recent=4), MaxTokens(max_tokens), chunk, model)
    repeat = repeat_prompt_ids(tok, REPEAT_PROMPT)
    cache = kvsieve.compress(model, ids[:, :chunk], spec, max_tokens=max_tokens, n_recent=4, tokenizer=tok)
    reference = masked_reference(model, ids[:, :chunk], _kept(cache))
    for start in range(chunk, 100, chunk):
        with kvsieve.sieve_attention(model):
            ours = model(ids[:, start : start + chunk], past_key_values=cache).logits
        with reference:
            reference.allow(_kept(cache))
            logits = model(ids[:, start : start + chunk], past_key_values=reference.cache).logits
        torch.testing.assert_close(ours, logits, atol=1e-10, rtol=0)
        fed = min(start + chunk, 100)
        expected = _reference_reconstruction(model, reference, _kept(cache), ids[:, :fed], repeat, 20)
        for layer, most in scored.pop(0).items():
            torch.testing.assert_close(most, expected[layer], atol=1e-10, rtol=1e-8)
        growth.evict(cache, expected)
    assert not scored
    assert chunked.mean_stored() == max_tokens and chunked.get_seq_length() == 100
    for mine, theirs in zip(_kept(chunked), _kept(cache), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@torch.no_grad()
def _sharpened(model):
    """`model` with queries and keys scaled up: a random tiny model attends almost uniformly, so what it repeats
    would hardly change which entries it attends most."""
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.mul_(6)
        layer.self_attn.k_proj.weight.mul_(6)
    return model


def _kept(cache) -> list[list[torch.Tensor]]:
    return [cache.kept_positions(layer) for layer in range(3)]


def _reference_reconstruction(model, reference, kept, fed: torch.Tensor, repeat: torch.Tensor, chunk: int) -> dict:
    """Per layer `[1, q_heads, n]`: the masked reference repeats `fed` after the entries `kept` (each piece on a copy
    of its cache, seeing itself and the kept entries), the most attention per position."""
    n = fed.shape[1]
    ahead = torch.arange(n, n + repeat.shape[1] + chunk)
    received = reference.most()
    for start in range(0, n, chunk):
        with reference:
            reference.allow([[torch.cat([head, ahead]) for head in layer] for layer in kept])
            piece = torch.cat([repeat, fed[:, start : start + chunk]], -1)
            model(piece, past_key_values=copy.deepcopy(reference.cache))
    return {layer: received[layer][None, :, :n] for layer in range(3)}


@torch.no_grad()
def test_generate_and_apply_hand_the_tokenizer_on(lm, tok):
    ids, options = _ids(), {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    cache = kvsieve.compress(lm, ids[:, :-1], "kvzip+global", 0.7, tokenizer=tok)
    with kvsieve.sieve_attention(lm):
        expected = lm.generate(ids, past_key_values=cache, **options)
    assert torch.equal(kvsieve.generate(lm, ids, "kvzip+global", 0.7, tokenizer=tok, **options), expected)
    with kvsieve.apply(lm, kvsieve.EvictionConfig(policy="kvzip+global", rate=0.7)) as handle:
        assert torch.equal(lm.generate(ids, tokenizer=tok, **options), expected)
    assert handle.last_cache.stored_lengths() == cache.stored_lengths()


@torch.no_grad()
def test_where_kvzip_is_not_defined_it_says_so(lm, tok):
    ids = _ids()
    with pytest.raises(PolicyError, match="needs its tokenizer"):
        kvsieve.compress(lm, ids, "kvzip", 0.5)
    for bounded in ({"buffer": 16}, {"buffer": 16, "chunk": 16}):
        with pytest.raises(PolicyError, match="not defined for re-scoring during generation"):
            kvsieve.compress(lm, ids, "kvzip", max_tokens=40, tokenizer=tok, **bounded)
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        kvsieve.make_policy("kvzip:chunk=0")
    with pytest.raises(ValueError, match="two ways"):
        _ = KVzipScorer(chunk=8).needs | KVzipScorer(chunk=16).needs
