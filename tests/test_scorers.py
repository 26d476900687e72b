"""Every scorer's formula against an independent reference computed from the plain transformers model.

The references use only the model itself: eager attention probabilities (`output_attentions`),
keys and values from a plain `DynamicCache`, the layer's `o_proj` module and `rotary_emb`, and
pre-RoPE queries captured with a forward hook. None of them calls a kvsieve helper.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvsieve
from conftest import tiny_llama
from kvsieve.modeling.rotary import unrotate
from kvsieve.selection.observation import LayerFacts
from specs import SCORER_SPECS

N = 64  # context length of every reference prefill
SHARPEN = 6.0  # q_proj and k_proj weights are scaled by this: random init gives near-uniform attention


@pytest.fixture
def model():
    """`tiny_llama()` with sharper attention (logits scaled by SHARPEN**2), so wrong formulas show in the scores."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    return model


def _observations(model, ids, window: int, accumulate: bool = False, **needs) -> list[kvsieve.Observation]:
    """The observations of the reference prefill's only sequence (`needs`: output_projection, rotary)."""
    needs = kvsieve.Needs(window=window, accumulated=accumulate, **needs)
    return kvsieve.observe_prefill(model, ids[:, :N], needs).observations[0]


def _eager_attentions(model, ids) -> list[torch.Tensor]:
    """Per layer `[heads, q, k]` attention probabilities of the plain eager model."""
    model.set_attn_implementation("eager")
    attentions = model(ids[:, :N], output_attentions=True).attentions
    return [a[0].float() for a in attentions]


def _dense_cache(model, ids) -> DynamicCache:
    """A plain `DynamicCache` filled by an SDPA forward: keys (after RoPE) and values `[1, kv_heads, n, d]`."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    model(ids[:, :N], past_key_values=cache)
    return cache


def _group_sum(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum `[heads, ...]` over query heads h*group .. (h+1)*group-1 for each kv-head h."""
    group = per_query_head.shape[0] // kv_heads
    return torch.stack([per_query_head[h * group : (h + 1) * group].sum(0) for h in range(kv_heads)])


def _scores(spec: str, obs: kvsieve.Observation) -> torch.Tensor:
    return kvsieve.make_policy(spec).scorer.score(obs)


@torch.no_grad()
def test_snapkv_matches_pooled_eager_window_attention(model, ids):
    """snapkv = window-mean eager attention, avg-pooled over keys, averaged over each kv-head's query heads."""
    w, kernel = 8, 5
    observations = _observations(model, ids, window=w)
    attentions = _eager_attentions(model, ids)
    kv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv
    for obs, attn in zip(observations, attentions, strict=True):
        window_mean = attn[:, -w:].mean(dim=1)  # [heads, n]
        pooled = F.avg_pool1d(window_mean[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
        expected = _group_sum(pooled, kv) / group
        got = _scores(f"snapkv:window={w},kernel={kernel}", obs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_tova_is_last_row_mean_over_all_heads(model, ids):
    """tova = the last query's eager attention averaged over all query heads, identical for every kv-head."""
    observations = _observations(model, ids, window=8)
    attentions = _eager_attentions(model, ids)
    kv = model.config.num_key_value_heads
    for obs, attn in zip(observations, attentions, strict=True):
        expected = attn[:, -1].mean(dim=0).expand(kv, -1)
        torch.testing.assert_close(_scores("tova", obs), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_window_queries_and_keykey(model, ids):
    """window = eager window attention summed over the group; keykey = last keys as causal stand-in queries."""
    w = 8
    observations = _observations(model, ids, window=w)
    attentions = _eager_attentions(model, ids)
    cache = _dense_cache(model, ids)
    kv = model.config.num_key_value_heads
    scale = (model.config.hidden_size // model.config.num_attention_heads) ** -0.5
    positions = torch.arange(N)
    for layer, (obs, attn) in enumerate(zip(observations, attentions, strict=True)):
        expected = _group_sum(attn[:, -w:].mean(dim=1), kv)
        torch.testing.assert_close(_scores(f"window:window={w}", obs), expected, atol=1e-5, rtol=1e-4)

        keys = cache.layers[layer].keys[0].float()  # [kv, n, d]
        stand_ins = keys[:, -w:]
        logits = stand_ins @ keys.transpose(1, 2) * scale  # [kv, w, n]
        future = positions[None, :] > positions[-w:, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
        expected_kk = probs.mean(dim=1)
        got_kk = _scores(f"window:window={w},keykey=true", obs)
        torch.testing.assert_close(got_kk, expected_kk, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_importance_h2o_vatp_against_eager_column_sums(model, ids):
    """importance, h2o and vatp from the eager attention's column sums (and value L1 norms for vatp)."""
    observations = _observations(model, ids, window=8, accumulate=True)
    attentions = _eager_attentions(model, ids)
    cache = _dense_cache(model, ids)
    kv = model.config.num_key_value_heads
    seeing = N - torch.arange(N, dtype=torch.float32)
    n_recent = 16  # round(0.25 * 64)
    for layer, (obs, attn) in enumerate(zip(observations, attentions, strict=True)):
        raw = _group_sum(attn.sum(dim=1), kv)  # [kv, n]
        torch.testing.assert_close(_scores("importance:normalize=false", obs), raw, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(_scores("importance", obs), raw / seeing, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(_scores("h2o:recent=0.0", obs), raw, atol=1e-4, rtol=1e-4)

        h2o = _scores("h2o:recent=0.25", obs)
        ranking = h2o.argsort(dim=-1, descending=True)
        newest_first = torch.arange(N - 1, N - 1 - n_recent, -1).expand(kv, -1)
        assert torch.equal(ranking[:, :n_recent], newest_first)
        torch.testing.assert_close(h2o[:, : N - n_recent], raw[:, : N - n_recent], atol=1e-4, rtol=1e-4)

        values = cache.layers[layer].values[0].float()  # [kv, n, d]
        expected_vatp = raw / seeing * values.abs().sum(dim=-1)
        torch.testing.assert_close(_scores("vatp", obs), expected_vatp, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_keydiff_is_minus_cosine_to_mean_normalised_key(model, ids):
    """keydiff = -cos(k_j, mean of the head's L2-normalised keys), keys from a plain DynamicCache."""
    observations = _observations(model, ids, window=8)
    cache = _dense_cache(model, ids)
    for layer, obs in enumerate(observations):
        keys = cache.layers[layer].keys[0].float()  # [kv, n, d]
        unit = keys / keys.norm(dim=-1, keepdim=True)
        anchor = unit.mean(dim=1, keepdim=True)
        cosine = (keys * anchor).sum(-1) / (keys.norm(dim=-1) * anchor.norm(dim=-1))
        torch.testing.assert_close(_scores("keydiff", obs), -cosine, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_caote_matches_brute_force_removal(model, ids):
    """caote = mean over the last 4 queries of ||o - o without key j||, renormalising the eager softmax."""
    w = 4
    observations = _observations(model, ids, window=w)
    attentions = _eager_attentions(model, ids)
    cache = _dense_cache(model, ids)
    kv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv
    for layer, (obs, attn) in enumerate(zip(observations, attentions, strict=True)):
        values = cache.layers[layer].values[0].float().repeat_interleave(group, dim=0)  # [heads, n, d]
        probs = attn[:, -w:]  # [heads, w, n]; keys after a query already have probability 0
        output = probs @ values
        change = torch.zeros(probs.shape)  # [heads, w, n]
        keep = 1.0 - torch.eye(N)  # row j: every key but j
        for i in range(w):
            visible = N - w + i + 1  # keys the query cannot see change nothing
            without = probs[:, i, None, :visible] * keep[None, :visible, :visible]  # [heads, removed j, n]
            without = without / without.sum(dim=-1, keepdim=True)
            recomputed = without @ values[:, :visible]  # [heads, removed j, d]
            change[:, i, :visible] = (output[:, i, None] - recomputed).norm(dim=-1)
        expected = _group_sum(change.mean(dim=1), kv)
        torch.testing.assert_close(_scores(f"caote:window={w}", obs), expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_critical_matches_brute_force_output_projection(model, ids):
    """critical = sum over the group of window attention times ||o_proj(v_j in head h's slot)||_1."""
    w = 8
    observations = _observations(model, ids, window=w, output_projection=True)
    attentions = _eager_attentions(model, ids)
    cache = _dense_cache(model, ids)
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv
    for layer, (obs, attn) in enumerate(zip(observations, attentions, strict=True)):
        o_proj = model.model.layers[layer].self_attn.o_proj
        values = cache.layers[layer].values[0].float()  # [kv, n, d]
        dim = values.shape[-1]
        norms = torch.empty(heads, N)
        for h in range(heads):
            z = torch.zeros(N, heads * dim)  # row j: v_j in head h's slot, zeros elsewhere
            z[:, h * dim : (h + 1) * dim] = values[h // group]
            norms[h] = o_proj(z).abs().sum(dim=-1)
        expected = _group_sum(attn[:, -w:].mean(dim=1) * norms, kv)
        torch.testing.assert_close(_scores(f"critical:window={w}", obs), expected, atol=1e-5, rtol=1e-4)


def _rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`[d, d]` matrix R with R q = q * cos + rotate_half(q) * sin, for one position."""
    d = cos.numel()
    partner = torch.zeros(d, d)
    partner[: d // 2, d // 2 :] = -torch.eye(d // 2)
    partner[d // 2 :, : d // 2] = torch.eye(d // 2)
    return torch.diag(cos) + torch.diag(sin) @ partner


@torch.no_grad()
def test_expected_unrotation_and_full_reference(model, ids):
    """expected: un-rotated window queries equal captured pre-RoPE queries; scores match an explicit-RoPE reference."""
    w, future = 8, 16
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    group, dim = heads // kv, model.config.hidden_size // heads
    scale = dim**-0.5
    observations = _observations(model, ids, window=w, rotary=True)

    captured: dict[int, torch.Tensor] = {}
    handles = [
        layer.self_attn.q_proj.register_forward_hook(
            lambda _m, _i, out, idx=idx: captured.__setitem__(idx, out.reshape(1, out.shape[1], heads, dim))
        )
        for idx, layer in enumerate(model.model.layers)
    ]
    try:
        cache = _dense_cache(model, ids)
    finally:
        for handle in handles:
            handle.remove()

    probe = torch.zeros(1, dtype=torch.float32)
    last = N - 1
    cos, sin = model.model.rotary_emb(probe, torch.arange(last + 1, last + 1 + future)[None])
    rotation = torch.stack([_rope_matrix(c, s) for c, s in zip(cos[0], sin[0], strict=True)]).mean(dim=0)

    for layer, obs in enumerate(observations):
        pre_rope = captured[layer][0, -w:].transpose(0, 1).float()  # [heads, w, d]
        queries, query_positions = obs.queries(w)
        unrotated = unrotate(queries, *obs.rotary(query_positions))
        torch.testing.assert_close(unrotated, pre_rope, atol=1e-5, rtol=1e-4)

        keys = cache.layers[layer].keys[0].float().repeat_interleave(group, dim=0)  # [heads, n, d]
        values = cache.layers[layer].values[0].float()
        probs = torch.empty(heads, N)
        for h in range(heads):
            mean = pre_rope[h].mean(dim=0)
            centered = pre_rope[h] - mean
            cov = centered.T @ centered / w
            mean_r, cov_r = rotation @ mean, rotation @ cov @ rotation.T
            logits = scale * keys[h] @ mean_r + 0.5 * scale**2 * ((keys[h] @ cov_r) * keys[h]).sum(-1)
            probs[h] = torch.softmax(logits, dim=-1)
        expected = _group_sum(probs, kv) / group * values.norm(dim=-1)
        got = _scores(f"expected:window={w},future={future}", obs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def group4_observations() -> list[kvsieve.Observation]:
    """Observations of a group-4 model (8 heads, 2 kv-heads; 6 heads would not divide hidden_size 64), recording
    what every scorer of `SCORER_SPECS` needs."""
    model = tiny_llama(heads=8, kv_heads=2)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    needs = functools.reduce(operator.or_, (kvsieve.make_policy(spec).needs for spec in SCORER_SPECS))
    assert needs.accumulated and needs.output_projection and needs.rotary and needs.gates == ("untrained",)
    return kvsieve.observe_prefill(model, ids, needs).observations[0]


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(SCORER_SPECS))
def test_every_scorer_finite_with_shape(name, group4_observations):
    """Every registered scorer gives finite `[kv_heads, n]` scores on a group-4 model observed with every need."""
    scorer = kvsieve.make_policy(name).scorer
    for obs in group4_observations:
        assert obs.group == 4
        scores = scorer.score(obs)
        assert scores.shape == (2, 120)
        assert torch.isfinite(scores).all()


@pytest.fixture(scope="module")
def evicted():
    """A tiny model and a cache compressed by snapkv+adaptive at rate 0.8: its kv-heads keep different counts."""
    model = tiny_llama(seed=4)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(6))
    cache = kvsieve.compress(model, ids, "snapkv+adaptive", 0.8)
    assert any(len(set(layer)) > 1 for layer in cache.stored_lengths()), "expected a ragged cache"
    return model, cache


def _single_head_observation(cache: kvsieve.SievedCache, layer: int, head: int, group: int, scaling: float):
    """An Observation holding only the real entries that one kv-head of an evicted cache keeps, built by hand."""
    keys, values, positions = cache.layers[layer].segments.segment(0, head)
    facts = LayerFacts(scaling=scaling, q_heads=group)
    return kvsieve.Observation(layer, len(cache.layers), keys[None], values[None], positions[None], None, facts)


@pytest.mark.parametrize("spec", ["knorm", "keydiff", "streaming", "window:keykey=true"])
@torch.no_grad()
def test_scorers_on_an_evicted_cache_score_each_head_on_its_own_entries(evicted, spec):
    """observe_cache: `[kv_heads, n_max]` scores equal, on each head's entries, the scorer on that head alone."""
    model, cache = evicted
    kv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv
    scaling = (model.config.hidden_size // model.config.num_attention_heads) ** -0.5
    observations = kvsieve.observe_cache(model, cache)
    assert len(observations) == len(cache.layers)
    scorer = kvsieve.make_policy(spec).scorer
    for layer, (obs, lengths) in enumerate(zip(observations, cache.stored_lengths(), strict=True)):
        scores = scorer.score(obs)
        assert scores.shape == (kv, max(lengths))
        for head in range(kv):
            valid = obs.valid_mask[head]
            assert valid.tolist() == [i < lengths[head] for i in range(max(lengths))]
            assert torch.isfinite(scores[head][valid]).all()
            alone = scorer.score(_single_head_observation(cache, layer, head, group, scaling))
            assert alone.shape == (1, lengths[head])
            torch.testing.assert_close(scores[head][valid], alone[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("spec", "match"),
    [("snapkv", "window=32 needs the last 32 prefill queries; 0 were recorded"), ("importance", "Needs.accumulated")],
)
def test_scorers_needing_prefill_statistics_refuse_an_evicted_cache(evicted, spec, match):
    """An observation of an evicted cache has no recorded queries or accumulated attention: a clear error."""
    model, cache = evicted
    for obs in kvsieve.observe_cache(model, cache):
        with pytest.raises(ValueError, match=match):
            kvsieve.make_policy(spec).scorer.score(obs)


@torch.no_grad()
def test_random_scores_follow_positions_not_padding(evicted):
    """Random scores are a function of (seed, layer, head, position): re-scoring a ragged cache keeps them."""
    model, cache = evicted
    prefill = kvsieve.observe_prefill(model, torch.zeros(1, 120, dtype=torch.long), kvsieve.Needs()).observations[0]
    scorer = kvsieve.make_policy("random:seed=3").scorer
    for full, obs in zip(prefill, kvsieve.observe_cache(model, cache), strict=True):
        before = scorer.score(full)  # every position 0..119 of every head
        after = scorer.score(obs)
        for head in range(obs.num_kv_heads):
            valid = obs.valid_mask[head]
            torch.testing.assert_close(after[head][valid], before[head][obs.positions[head][valid]])
