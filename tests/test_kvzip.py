"""KVzip (arXiv 2505.23416): the reconstruction pass against eager attention, real eviction against the masked
reference under every allocator, and the errors where the score is not defined."""

from __future__ import annotations

import copy

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.reconstruction import flash_attention, materialized_attention, repeat_prompt_ids
from kvsieve.selection.allocators import ALLOCATORS
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
    fused, fused_seen = flash_attention(query, keys, values, 0.25, 50)
    plain, plain_seen = materialized_attention(query, keys, values, 0.25, 50)
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(fused, plain, **tolerance)
    torch.testing.assert_close(fused_seen.float(), plain_seen.float(), **tolerance)
    assert fused_seen.shape == (2, 4, 50) and fused.shape == (2, 4, 30, 16)


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
    with pytest.raises(PolicyError, match="padded batches"):
        kvsieve.compress(lm, _ids(rows=2), "kvzip", 0.5, attention_mask=torch.tensor([[1] * N, [0] + [1] * (N - 1)]),
                         tokenizer=tok)  # fmt: skip
    for bounded in ({"chunk": 16}, {"buffer": 16}):
        with pytest.raises(PolicyError, match="not defined for a chunked prefill"):
            kvsieve.compress(lm, ids, "kvzip", max_tokens=40, tokenizer=tok, **bounded)
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        kvsieve.make_policy("kvzip:chunk=0")
    with pytest.raises(ValueError, match="two ways"):
        _ = KVzipScorer(chunk=8).needs | KVzipScorer(chunk=16).needs
