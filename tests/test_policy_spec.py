"""One way to say a policy: a spec's storage keys work everywhere a spec is taken, and `kvsieve.generate` takes
every keyword `kvsieve.compress` takes."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve import PolicyError
from kvsieve.runtime.compat import cache_argument
from kvsieve.selection.storage import Storage

#: Greedy decoding that returns the scores of every step (they differ wherever the caches differ).
GEN = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "output_scores": True}


def _layout(cache: kvsieve.SievedCache) -> list[list[torch.Tensor]]:
    """Kept positions of every layer and kv-head of the cache's one sequence."""
    return [cache.kept_positions(layer) for layer in range(len(cache.layers))]


def _same_cache(a: kvsieve.SievedCache, b: kvsieve.SievedCache) -> bool:
    kept = all(
        torch.equal(x, y) for la, lb in zip(_layout(a), _layout(b), strict=True) for x, y in zip(la, lb, strict=True)
    )
    codecs = [layer.codec for layer in a.layers] == [layer.codec for layer in b.layers]
    return kept and codecs and a.nbytes() == b.nbytes()


def _scores(model: torch.nn.Module, ids: torch.Tensor, cache: kvsieve.SievedCache | None) -> torch.Tensor:
    """The scores of greedy decoding from `cache` (the prompt `ids` but its last token), under sieve attention."""
    with kvsieve.sieve_attention(model):
        mask = torch.ones_like(ids)  # as kvsieve.generate passes it (pad_token_id 0 is a token of `ids`)
        out = model.generate(
            ids, attention_mask=mask, **cache_argument(model, cache), return_dict_in_generate=True, **GEN
        )
    return torch.stack(out.scores)


def _generated_scores(model: torch.nn.Module, ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.stack(kvsieve.generate(model, ids, *args, return_dict_in_generate=True, **GEN, **kwargs).scores)


def test_a_spec_says_its_storage_and_writes_it_back():
    policy = kvsieve.make_policy("trimkv+global:kv_bits=4")
    assert policy.storage == Storage(4) and policy.name == "trimkv+global:kv_bits=4"
    spec = "snapkv+adaptive:window=16,kv_bits=2,kv_group=8,kv_residual=4"
    assert kvsieve.make_policy(spec).name == spec and kvsieve.make_policy(spec) == kvsieve.make_policy(spec)
    assert kvsieve.make_policy("snapkv", kv_bits=8) == kvsieve.make_policy("snapkv:kv_bits=8")
    assert kvsieve.make_policy(policy, kv_bits=4) is policy, "the value the policy says already"
    assert kvsieve.make_policy("snapkv:kv_bits=4", kv_group=8).storage == Storage(4, 8), "keys that add, not clash"
    assert kvsieve.make_policy("snapkv:kv_bits=4") != kvsieve.make_policy("snapkv")


@torch.no_grad()
def test_storage_in_the_spec_equals_the_keyword_everywhere(model, ids):
    spec = kvsieve.compress(model, ids, "snapkv:kv_bits=4", 0.5)
    keyword = kvsieve.compress(model, ids, "snapkv", 0.5, kv_bits=4)
    full = kvsieve.compress(model, ids, "snapkv", 0.5)
    assert _same_cache(spec, keyword) and not _same_cache(spec, full)
    assert spec.nbytes() < full.nbytes()
    assert _same_cache(kvsieve.compress(model, ids, kvsieve.make_policy("snapkv:kv_bits=4"), 0.5), keyword)
    assert _same_cache(kvsieve.compress(model, ids, "snapkv:kv_bits=4", 0.5, kv_bits=4), keyword), "agreeing is fine"
    bounded = {}
    for name, options in {
        "spec": {"policy": "snapkv:kv_bits=8"},
        "keyword": {"policy": "snapkv", "kv_bits": 8},
    }.items():
        bounded[name] = kvsieve.bounded_cache(model, max_tokens=40, buffer=8, **options)
        with kvsieve.sieve_attention(model):
            for chunk in ids.split(8, dim=-1):
                model(chunk, **cache_argument(model, bounded[name]))
    assert _same_cache(bounded["spec"], bounded["keyword"]) and bounded["spec"].layers[0].codec.bits == 8
    assert torch.equal(
        _generated_scores(model, ids, "snapkv:kv_bits=4", 0.5), _generated_scores(model, ids, "snapkv", 0.5, kv_bits=4)
    )
    caches = {}
    for name, config in {
        "spec": kvsieve.EvictionConfig("snapkv:kv_bits=4", rate=0.5),
        "keyword": kvsieve.EvictionConfig("snapkv", rate=0.5, kv_bits=4),
    }.items():
        with kvsieve.apply(model, config) as handle:
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
            caches[name] = handle.last_cache
    assert _same_cache(caches["spec"], caches["keyword"]) and caches["spec"].layers[0].codec.bits == 4


def test_a_storage_key_given_twice_with_two_values_names_both(model, ids):
    message = "policy 'snapkv:kv_bits=4' says kv_bits=4 but kv_bits=8 is given"
    with pytest.raises(PolicyError, match=message):
        kvsieve.make_policy("snapkv:kv_bits=4", kv_bits=8)
    with pytest.raises(PolicyError, match=message):
        kvsieve.compress(model, ids, "snapkv:kv_bits=4", 0.5, kv_bits=8)
    with pytest.raises(PolicyError, match=message):
        kvsieve.generate(model, ids, "snapkv:kv_bits=4", 0.5, kv_bits=8, max_new_tokens=2)
    with pytest.raises(PolicyError, match=message):
        kvsieve.bounded_cache(model, "snapkv:kv_bits=4", max_tokens=40, kv_bits=8)
    with pytest.raises(PolicyError, match=message):
        kvsieve.EvictionConfig("snapkv:kv_bits=4", rate=0.5, kv_bits=8)
    with pytest.raises(PolicyError, match="says kv_group=8 but kv_group=16 is given"):
        kvsieve.compress(model, ids, kvsieve.make_policy("snapkv:kv_bits=4,kv_group=8"), 0.5, kv_group=16)
    with pytest.raises(PolicyError, match="policy parameter kv_bits is given twice"):
        kvsieve.make_policy("snapkv:kv_bits=4,kv_bits=2")
    with pytest.raises(PolicyError, match="kv_bits=3 is not supported"):
        kvsieve.make_policy("snapkv:kv_bits=3")
    with pytest.raises(PolicyError, match="kv_group and kv_residual apply to quantized entries"):
        kvsieve.make_policy("snapkv:kv_group=8")


@torch.no_grad()
def test_the_harness_reads_a_spec_with_the_same_parser():
    from kvsieve.harness.eval.contenders import kvsieve_method

    method = kvsieve_method("snapkv+adaptive:window=16,kv_bits=4")
    assert method.policy == kvsieve.make_policy("snapkv+adaptive:window=16,kv_bits=4")
    assert method.name == "snapkv+adaptive:window=16,kv_bits=4" and method.builder.storage == Storage(4)
    with pytest.raises(PolicyError, match="says kv_bits=4 but kv_bits=2 is given"):
        kvsieve.make_policy(method.policy, kv_bits=2)


@torch.no_grad()
@pytest.mark.parametrize(
    ("options", "spec"),
    [
        ({"allocator": "adaptive"}, "snapkv+adaptive"),
        ({"window": 16}, "snapkv:window=16"),
        ({"n_recent": 8}, "snapkv:n_recent=8"),
        ({"protect_positions": [3, 40, 41]}, "snapkv"),
        ({"max_tokens": 48, "chunk": 32}, "snapkv"),
        ({"projection": "sentence", "spans": torch.arange(120) // 10}, "snapkv:projection=sentence"),
    ],
)
def test_generate_takes_every_keyword_compress_takes(model, ids, options, spec):
    """Policy parameters go to the policy, the rest of compress's keywords to the compression: generate's scores
    are those of decoding from `compress(input_ids[:, :-1], ...)`, and differ from the plain policy's."""
    budget = {} if "max_tokens" in options else {"rate": 0.8}
    generated = _generated_scores(model, ids, "snapkv", **budget, **options)
    compress_options = {k: v for k, v in options.items() if k in ("protect_positions", "max_tokens", "chunk")}
    if "spans" in options:
        compress_options["spans"] = options["spans"][:-1]
    cache = kvsieve.compress(model, ids[:, :-1], spec, **budget, **compress_options)
    assert torch.equal(generated, _scores(model, ids, cache)), "the compressed prompt, as compress makes it"
    plain = kvsieve.compress(model, ids[:, :-1], "snapkv", **budget)
    assert not torch.equal(generated, _scores(model, ids, plain)), "the keyword changed the cache"


def test_generate_refuses_a_name_it_does_not_know(model, ids):
    with pytest.raises(ValueError, match="windw"):
        kvsieve.generate(model, ids, "snapkv", 0.5, windw=16, max_new_tokens=2)
    with pytest.raises(PolicyError, match="unknown parameter 'window' for random"):
        kvsieve.generate(model, ids, "random", 0.5, window=16, max_new_tokens=2)
    cache = kvsieve.compress(model, ids[:, :-1], "snapkv", 0.5)
    with pytest.raises(PolicyError, match=r"with a cache, give only the new tokens.*\(got allocator, window\)"):
        kvsieve.generate(model, ids[:, -1:], cache=cache, allocator="adaptive", window=16, max_new_tokens=2)


@torch.no_grad()
def test_protect_positions_take_a_list_and_name_a_position_past_the_context(model, ids):
    as_list = kvsieve.compress(model, ids, "snapkv", 0.9, protect_positions=[3, 50])
    as_tensor = kvsieve.compress(model, ids, "snapkv", 0.9, protect_positions=torch.tensor([3, 50]))
    assert _same_cache(as_list, as_tensor)
    assert all(bool(torch.isin(torch.tensor([3, 50]), kept).all()) for layer in _layout(as_list) for kept in layer)
    assert not _same_cache(as_list, kvsieve.compress(model, ids, "snapkv", 0.9))
    question = kvsieve.compress(model, ids[:, :100], "snapkv", 0.5, question_ids=ids[:, 100:], protect_positions=[3])
    assert all(bool((kept == 3).any()) for layer in _layout(question) for kept in layer)
    past = "protect_positions holds position 1000, outside the context of 120 tokens"
    with pytest.raises(ValueError, match=past):
        kvsieve.compress(model, ids, "snapkv", 0.5, protect_positions=[1000])
    with pytest.raises(ValueError, match=past):
        kvsieve.generate(model, ids, "snapkv", 0.5, protect_positions=[5, 1000], max_new_tokens=2)
    with pytest.raises(ValueError, match="position -1, outside the context"):
        kvsieve.compress(model, ids, "snapkv", 0.5, protect_positions=[-1])
    for bad in ([1.5], torch.tensor([[3]]), "3", [True]):
        with pytest.raises(ValueError, match="protect_positions must be a list or 1-D tensor of token positions"):
            kvsieve.compress(model, ids, "snapkv", 0.5, protect_positions=bad)
