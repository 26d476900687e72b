"""Projections: chunk and sentence keep whole spans, exactly each head's count, and decode exactly."""

from __future__ import annotations

import pytest
import torch

import kvsieve
import test_growth
from kvsieve.selection.projection import PROJECTIONS, Chunks, Sentences, TopK, fit_spans, pick_spans, span_ids
from kvsieve.selection.protection import protected_mask
from kvsieve.selection.spans import ends_sentence, sentence_spans
from tokenizer import tiny_tokenizer


def _sentences(n: int, seed: int = 0) -> torch.Tensor:
    """Span ids of `n` token positions cut into "sentences" of 1 to 15 tokens."""
    lengths = torch.randint(1, 16, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.repeat_interleave(torch.arange(n), lengths)[:n]


def _check_whole(kept: torch.Tensor, evictable: torch.Tensor, spans: torch.Tensor) -> int:
    """How many spans are cut (some but not all of their evictable entries kept); `spans`: per entry."""
    is_kept = torch.zeros_like(evictable)
    is_kept[kept] = True
    cut = 0
    for span in spans[evictable].unique():
        inside = evictable & (spans == span)
        cut += 0 < int((is_kept & inside).sum()) < int(inside.sum())
    return cut


def _entry_spans(spec: str, obs: kvsieve.Observation, spans: torch.Tensor) -> torch.Tensor:
    return obs.positions // 8 if "chunk" in spec else span_ids(obs.positions, spans)


@pytest.mark.parametrize("allocator", ["uniform", "global", "adaptive"])
@pytest.mark.parametrize("projection", ["chunk", "sentence"])
@pytest.mark.parametrize("rate", [0.3, 0.7, 0.95])
@torch.no_grad()
def test_spans_keep_each_heads_count_whole_but_one(model, ids, allocator, projection, rate):
    """Same counts as topk per (layer, kv-head); protected entries kept; at most one span per head cut."""
    prefill = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=32))
    observations, spans = prefill.observations[0], _sentences(ids.shape[1])
    topk = kvsieve.make_policy(f"snapkv+{allocator}:n_recent=8")
    policy = kvsieve.make_policy(f"snapkv+{allocator}:n_recent=8,projection={projection}")
    expected = topk.select(observations, rate)
    got = policy.select(observations, rate, spans=spans)
    assert [[len(k) for k in layer] for layer in got] == [[len(k) for k in layer] for layer in expected]
    for obs, layer in zip(observations, got, strict=True):
        protected = protected_mask(obs, policy.n_sink, policy.n_recent)
        evictable = obs.valid_mask & ~protected
        entry_spans = _entry_spans(projection, obs, spans)
        for h, kept in enumerate(layer):
            assert torch.equal(kept, kept.sort().values.unique())
            assert set(protected[h].nonzero().flatten().tolist()) <= set(kept.tolist())
            assert _check_whole(kept, evictable[h], entry_spans[h]) <= 1


@pytest.mark.parametrize(
    ("spec", "topk_spec"),
    [("knorm+global:projection=chunk,chunk_size=5", "knorm+global"), ("keydiff:projection=sentence", "keydiff")],
)
@torch.no_grad()
def test_spans_on_an_evicted_ragged_cache(model, ids, spec, topk_spec):
    """Re-evicting a ragged cache: spans come from the entries' positions, counts still match topk's."""
    spans = _sentences(ids.shape[1], seed=3)
    cache = kvsieve.compress(model, ids, "random+adaptive", 0.5)
    observations = kvsieve.observe_cache(model, cache)
    assert len({n for layer in cache.stored_lengths() for n in layer}) > 1, "the heads are ragged"
    policy = kvsieve.make_policy(spec)
    topk = kvsieve.make_policy(topk_spec)
    got = policy.select(observations, 0.6, spans=spans)
    expected = topk.select(observations, 0.6)
    assert [[len(k) for k in layer] for layer in got] == [[len(k) for k in layer] for layer in expected]
    for obs, layer in zip(observations, got, strict=True):
        evictable = obs.valid_mask & ~protected_mask(obs, policy.n_sink, policy.n_recent)
        entry_spans = obs.positions // 5 if "chunk" in spec else span_ids(obs.positions, spans)
        for h, kept in enumerate(layer):
            assert bool(obs.valid_mask[h, kept].all())
            assert _check_whole(kept, evictable[h], entry_spans[h]) <= 1


def _one_head(
    scores: list[float], spans: list[int], count: int, protected: list[int] = (), best_tokens: float = 0.0
) -> list[int]:
    """Kept indices of one head with the given scores, span ids, count and protected entries."""
    n = len(scores)
    protect = torch.zeros(1, n, dtype=torch.bool)
    protect[0, list(protected)] = True
    kept = pick_spans(torch.tensor([scores]), protect, ~protect, [count], torch.tensor([spans]), best_tokens)
    return kept[0].tolist()


def test_a_high_entry_in_a_low_span_loses_to_a_uniformly_medium_span():
    scores = [10.0, 0.0, 0.0, 0.0] + [3.0] * 4 + [1.0] * 8  # span means: 2.5, 3, 1, 1
    spans = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert _one_head(scores, spans, 4) == [4, 5, 6, 7]
    assert torch.topk(torch.tensor(scores), 4).indices.sort().values.tolist() == [0, 4, 5, 6]
    # 6: span 1 whole, then nothing fits the 2 left: the best-ranked unused span (0) gives its 2 best entries
    scores[1] = 0.5
    assert _one_head(scores, spans, 6) == [0, 1, 4, 5, 6, 7]


def test_best_tokens_keeps_the_best_entries_first_then_spans_of_the_rest():
    scores = [10.0, 0.0, 0.0, 0.0] + [3.0] * 4 + [1.0] * 8
    spans = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # 3 of 16 one by one: 0, then 4 and 5 (equal scores: the earlier); span 1's rest (6, 7) has the best mean
    # of what is left; 1 more: spans 2 and 3 tie at mean 1, the earlier gives its best entry
    assert _one_head(scores, spans, 6, best_tokens=0.2) == [0, 4, 5, 6, 7, 8]
    assert _one_head(scores, spans, 6, best_tokens=0.0) == _one_head(scores, spans, 6)
    top = torch.tensor(scores).sort(descending=True, stable=True).indices[:2].sort().values.tolist()
    assert _one_head(scores, spans, 2, best_tokens=0.2) == top, "a count below the fraction: topk's entries"
    # 15 evictable, 1 one by one (4); span 1's rest (5-7) has the best mean
    assert _one_head(scores, spans, 4, protected=[0], best_tokens=0.1) == [0, 4, 5, 6, 7], "protected: not counted"


def test_spans_that_do_not_fit_are_skipped_and_ties_go_to_the_earlier_span():
    # spans of 6, 3, 2, 4 entries with means 5, 4, 3, 1; count 5: span 0 does not fit, spans 1 and 2 do
    scores = [5.0] * 6 + [4.0] * 3 + [3.0] * 2 + [1.0] * 4
    spans = [0] * 6 + [1] * 3 + [2] * 2 + [3] * 4
    assert _one_head(scores, spans, 5) == [6, 7, 8, 9, 10]
    assert _one_head([1.0] * 6, [0, 0, 1, 1, 2, 2], 2) == [0, 1]
    assert _one_head([1.0] * 6, [2, 2, 0, 0, 1, 1], 2) == [0, 1], "earlier = first entry, not smaller id"
    taken, left = fit_spans(torch.tensor([5, 3, 4, 1, 2, 1]), 9)
    assert taken.tolist() == [True, True, False, True, False, False] and left == 0


def test_protected_entries_are_kept_and_not_counted():
    # span 0 = entries 0-3 with entry 0 protected: its mean is over 1-3 only
    scores = [-100.0, 3.0, 3.0, 3.0] + [2.0] * 4
    kept = _one_head(scores, [0] * 4 + [1] * 4, 3, protected=[0, 7])
    assert kept == [0, 1, 2, 3, 7]


def test_non_finite_scores():
    inf = float("inf")
    scores = [-inf, 5.0, 5.0, 5.0] + [1.0] * 4 + [-inf] * 4 + [inf, -inf, 0.0, 0.0]
    spans = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4  # means -inf, 1, -inf, nan (ranks last)
    assert _one_head(scores, spans, 4) == [4, 5, 6, 7]
    assert _one_head(scores, spans, 6) == [1, 2, 4, 5, 6, 7], "the -inf span 0 is the first unused one"
    assert len(_one_head([-inf] * 16, spans, 9)) == 9
    with pytest.raises(ValueError, match="NaN"):
        _one_head([float("nan")] + [0.0] * 15, spans, 4)


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:projection=chunk",
        "knorm+global:projection=chunk,chunk_size=3",
        "snapkv:projection=sentence",
        "snapkv+global:projection=sentence,best_tokens=0.2",
    ],
)
@torch.no_grad()
def test_compressed_cache_equals_masked_full_cache(model, ids, masked_reference, spec):
    prefix, cont = ids[:, :90], ids[:, 90:]
    cache = kvsieve.compress(model, prefix, spec, rate=0.7, spans=_sentences(90))
    kept = [cache.kept_positions(layer) for layer in range(3)]
    topk = kvsieve.compress(model, prefix, spec.split(":")[0], rate=0.7)
    assert cache.stored_lengths() == topk.stored_lengths(), "the same count per head as topk"
    assert any(
        not torch.equal(a, b)
        for layer in range(3)
        for a, b in zip(kept[layer], topk.kept_positions(layer), strict=True)
    )
    with kvsieve.sieve_attention(model):
        ours = model(cont, past_key_values=cache).logits
    with masked_reference(model, prefix, kept) as ref:
        expected = model(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_compress_takes_spans_per_row_of_a_padded_batch(model, ids):
    """`[batch, tokens]` spans follow input_ids' columns (padding dropped): each row equals compressing it alone."""
    spans, first = _sentences(100), _sentences(120, seed=5)
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 20, dtype=torch.long), ids[:, :100]], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    batch_spans = torch.stack([first, torch.cat([torch.full((20,), 99), spans])])
    spec = "snapkv:projection=sentence"
    cache = kvsieve.compress(model, batch, spec, 0.6, attention_mask=mask, spans=batch_spans)
    alone = [
        kvsieve.compress(model, ids, spec, 0.6, spans=first),
        kvsieve.compress(model, ids[:, :100], spec, 0.6, spans=spans),
    ]
    for layer in range(3):
        for row, pad in enumerate([0, 20]):
            expected = alone[row].kept_positions(layer)
            for a, b in zip(cache.kept_positions(layer, row=row), expected, strict=True):
                assert torch.equal(a - pad, b)


@pytest.mark.parametrize("spec", ["snapkv:projection=chunk", "h2o+global:projection=chunk,chunk_size=4"])
def test_bounded_growth_with_chunks_equals_the_masked_reference(model, ids, masked_reference, spec):
    test_growth.test_every_step_stays_within_budget_and_equals_the_masked_reference(
        model, ids, masked_reference, spec, storage={}
    )


@torch.no_grad()
def test_bounded_growth_keeps_sentences_given_at_compress_time(model):
    """Every eviction during decoding cuts at most one sentence per head (no protection, so spans are all of it)."""
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    spans = _sentences(60, seed=1)
    spec = "knorm:projection=sentence,n_sink=0,n_recent=0"
    cache = kvsieve.compress(model, ids[:, :60], spec, max_tokens=30, buffer=8, spans=spans)
    evictions = 0
    for t in range(60, 100):
        before, held = [cache.kept_positions(layer) for layer in range(3)], cache.mean_stored()
        with kvsieve.sieve_attention(model):
            model(ids[:, t : t + 1], past_key_values=cache)
        after = [cache.kept_positions(layer) for layer in range(3)]
        if cache.mean_stored() > held:
            continue
        evictions += 1
        for old_heads, new_heads in zip(before, after, strict=True):
            for old, new in zip(old_heads, new_heads, strict=True):
                old_spans = span_ids(old, spans)
                kept = torch.isin(old, new).nonzero().flatten()
                assert _check_whole(kept, torch.ones_like(old, dtype=torch.bool), old_spans) <= 1
    assert evictions == 4, "at steps 9, 17, 25 and 33: once the cache would pass 30 + 8 entries per head"


@torch.no_grad()
def test_a_tokenizer_gives_the_sentences_when_no_spans_are(lm, tok):
    """compress(tokenizer=) and generate(tokenizer=) keep what they keep with spans=sentence_spans(...)."""
    model = lm
    text = " ".join(["The grass is green. Who is the mother of Carol? I don't know!"] * 6)
    ids = tok(text, return_tensors="pt").input_ids
    spec = "snapkv+global:projection=sentence,best_tokens=0.1"
    given = kvsieve.compress(model, ids, spec, 0.7, spans=sentence_spans(tok, ids))
    read = kvsieve.compress(model, ids, spec, 0.7, tokenizer=tok)
    for layer in range(3):
        for a, b in zip(read.kept_positions(layer), given.kept_positions(layer), strict=True):
            assert torch.equal(a, b)
    context = ids[:, :-1]  # generate compresses all but the prompt's last token
    out = kvsieve.generate(model, ids, spec, rate=0.7, max_new_tokens=4, do_sample=False, tokenizer=tok)
    expected = kvsieve.generate(
        model, ids, spec, rate=0.7, max_new_tokens=4, do_sample=False, spans=sentence_spans(tok, context)
    )
    assert torch.equal(out, expected)
    with kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.7, policy=spec)):
        applied = model.generate(ids, max_new_tokens=4, do_sample=False, tokenizer=tok)
    assert torch.equal(applied, expected)


def test_sentence_spans_number_sentences():
    tok = tiny_tokenizer()
    text = "The grass is green. Who is the mother of Carol? I don't know!\nHere we go"
    ids = tok(text, return_tensors="pt").input_ids
    spans = sentence_spans(tok, ids)
    assert spans.shape == ids.shape and spans.dtype == torch.long
    sentences = [tok.decode(ids[0][spans[0] == k]) for k in range(int(spans.max()) + 1)]
    assert sentences == ["<s>The grass is green.", " Who is the mother of Carol?", " I don't know!", "\n", "Here we go"]
    assert torch.equal(sentence_spans(tok, ids[0]), spans[0])
    texts = ["end. ", "a", ".\n", "x\ny", "?!", " .5"]
    assert [ends_sentence(t) for t in texts] == [True, False, True, True, True, False]


def test_policy_names_round_trip():
    for spec in [
        "snapkv:projection=chunk",
        "snapkv+global:projection=chunk,chunk_size=16",
        "importance+adaptive:n_sink=2,projection=sentence",
        "trimkv+global:projection=sentence,best_tokens=0.1",
        "trimkv+global:projection=topk",
        "snapkv",
    ]:
        policy = kvsieve.make_policy(spec)
        assert policy.name == spec and kvsieve.make_policy(policy.name).name == policy.name
    assert kvsieve.make_policy("snapkv:projection=topk,chunk_size=8").name == "snapkv:projection=topk"
    assert (
        kvsieve.make_policy("snapkv", projection="chunk", chunk_size=4).name == "snapkv:projection=chunk,chunk_size=4"
    )
    assert kvsieve.make_policy("snapkv").projection is None  # the gates' checkpoint's, else topk
    assert isinstance(kvsieve.make_policy("snapkv:projection=topk").projection, TopK)
    assert kvsieve.make_policy("snapkv:projection=chunk,chunk_size=3").projection == Chunks(3)
    assert isinstance(kvsieve.make_policy("snapkv:projection=sentence").projection, Sentences)
    assert list(PROJECTIONS) == ["topk", "chunk", "sentence"]


@torch.no_grad()
def test_projection_errors(model, ids):
    with pytest.raises(kvsieve.PolicyError, match="unknown projection 'span'; known: topk, chunk, sentence"):
        kvsieve.make_policy("snapkv:projection=span")
    with pytest.raises(kvsieve.PolicyError, match="chunk_size must be an integer >= 1"):
        kvsieve.make_policy("snapkv:projection=chunk,chunk_size=0")
    with pytest.raises(kvsieve.PolicyError, match="chunk_size is a parameter of projection=chunk"):
        kvsieve.make_policy("snapkv:chunk_size=4")
    with pytest.raises(kvsieve.PolicyError, match="best_tokens is a parameter of projection=chunk or sentence; the "):
        kvsieve.make_policy("snapkv:best_tokens=0.5")
    with pytest.raises(kvsieve.PolicyError, match="chunk_size is a parameter of projection=chunk; the policy names "):
        kvsieve.make_policy("snapkv:projection=sentence,chunk_size=4")
    with pytest.raises(kvsieve.PolicyError, match=r"best_tokens must be a number in \[0, 1\)"):
        kvsieve.make_policy("snapkv:projection=sentence,best_tokens=1")
    with pytest.raises(kvsieve.PolicyError, match="chunk_size='x' is not a valid int"):
        kvsieve.make_policy("snapkv:projection=chunk,chunk_size=x")
    sentence = "snapkv:projection=sentence"
    prefill = kvsieve.observe_prefill(model, ids)
    with pytest.raises(kvsieve.PolicyError, match="none were given: pass spans"):
        kvsieve.make_policy(sentence).select(prefill.observations[0], 0.5)
    with pytest.raises(kvsieve.PolicyError, match="none were given: pass spans"):
        kvsieve.compress(model, ids, sentence, 0.5)
    with pytest.raises(kvsieve.PolicyError, match="none were given: pass spans"):
        kvsieve.bounded_cache(model, sentence, max_tokens=40)
    applied = kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5, policy=sentence))
    with applied, pytest.raises(kvsieve.PolicyError, match=r"tokenizer= to .* \(under kvsieve.apply\) model.generate"):
        model.generate(ids, max_new_tokens=2)
    with pytest.raises(kvsieve.PolicyError, match="1-D integer tensor"):
        kvsieve.make_policy(sentence).select(prefill.observations[0], 0.5, spans=torch.zeros(120))
    with pytest.raises(kvsieve.PolicyError, match="spans must have shape"):
        kvsieve.compress(model, ids, sentence, 0.5, spans=torch.zeros(2, 120, dtype=torch.long))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :5] = 0
    spans = torch.zeros(60, dtype=torch.long)
    with pytest.raises(kvsieve.PolicyError, match="spans with a buffer take unpadded prompts"):
        kvsieve.compress(
            model, ids[:, :60].repeat(2, 1), sentence, max_tokens=40, buffer=8, attention_mask=mask, spans=spans
        )
