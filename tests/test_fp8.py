"""Float8 (e4m3) entries through the one storage key `kv_codec`: exact on the dequantized entries, real bytes."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.runtime.storage.codecs import Float8, codec_for
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.storage import DEFAULT_RESIDUAL, Storage

GROUP = 8  # the tiny models' head dimension is 16
SPECS = ["snapkv", "h2o+global", "trimkv+global:gates=untrained"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_round_trip_within_e4m3_precision(dtype):
    """Three mantissa bits: within 1/16 of the number (plus the scale's and the dtype's rounding), or a subnormal's
    half step near zero; every group's largest number is kept to that precision, never clipped."""
    codec = Float8(16)
    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(3, 2, 40, 64, generator=gen) * torch.linspace(0.01, 300, 64)).to(dtype)
    values = torch.randn(3, 2, 40, 64, generator=gen).to(dtype)
    encoded = codec.encode(keys, values)
    assert [t.dtype for t in encoded] == [torch.uint8, dtype, torch.uint8, dtype]
    assert [t.shape[-1] for t in encoded] == [64, 4, 64, 4]
    for original, decoded, scales in zip((keys, values), codec.decode(encoded, dtype), encoded[1::2], strict=True):
        assert decoded.dtype == dtype and decoded.shape == original.shape
        scale = scales.float().repeat_interleave(16, dim=-1)
        relative = 2**-4 + (2**-7 if dtype == torch.bfloat16 else 1e-6)
        error = (decoded.float() - original.float()).abs()
        assert (error <= original.float().abs() * relative + scale * 2**-9).all()
        assert (error > 0).any(), "fp8 is lossy"


def test_zero_groups_and_the_null_entry_decode_to_zero():
    codec = Float8(8)
    zeros = torch.zeros(2, 16)
    assert all(torch.equal(t, zeros) for t in codec.decode(codec.encode(zeros, zeros), torch.float32))
    null = tuple(torch.zeros(1, t.shape[-1], dtype=t.dtype) for t in codec.encode(zeros[:1], zeros[:1]))
    assert all(torch.equal(t, torch.zeros(1, 16)) for t in codec.decode(null, torch.float32))


@pytest.mark.parametrize("spec", SPECS)
@torch.no_grad()
def test_decoding_equals_the_masked_reference_on_the_dequantized_entries(model, ids, masked_reference, spec):
    """Entries older than the newest 8 (the residual, inside the protected tail) read back as float8."""
    cache = kvsieve.compress(model, ids[:, :100], spec, 0.7, n_recent=8, kv_codec="fp8", kv_group=GROUP, kv_residual=8)
    codec = Float8(GROUP, 8)
    assert all(layer.codec == codec for layer in cache.layers)
    assert all(layer.segments.residual.length == 8 for layer in cache.layers)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(100, 110)]
        rest = model(ids[:, 110:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept, codec=codec) as ref:  # fed as the cache was fed
        expected = [model(ids[:, t : t + 1], past_key_values=ref.cache).logits for t in range(100, 110)]
        expected = torch.cat([*expected, model(ids[:, 110:], past_key_values=ref.cache).logits], dim=1)
    torch.testing.assert_close(torch.cat([*steps, rest], dim=1), expected, atol=1e-4, rtol=0)
    with masked_reference(model, ids[:, :100], kept) as unquantized:
        assert (model(ids[:, 100:], past_key_values=unquantized.cache).logits - expected).abs().max() > 1e-5


def test_a_policy_name_keeps_every_storage_key_that_differs_from_the_default():
    for spec in ("snapkv:kv_bits=4,kv_group=16", "snapkv:kv_residual=16,kv_codec=fp8", "snapkv:kv_bits=8,kv_codec=int"):
        policy = kvsieve.make_policy(spec)
        assert kvsieve.make_policy(policy.name) == policy and policy.name == spec


@torch.no_grad()
def test_the_spec_and_the_keyword_store_alike_and_the_name_says_it(model, ids):
    policy = kvsieve.make_policy("snapkv:kv_codec=fp8,kv_group=8")
    assert policy.name == "snapkv:kv_group=8,kv_codec=fp8" and policy.storage == Storage(kv_group=8, kv_codec="fp8")
    by_spec = kvsieve.compress(model, ids[:, :90], policy.name, 0.5)
    by_keyword = kvsieve.compress(model, ids[:, :90], "snapkv", 0.5, kv_codec="fp8", kv_group=8)
    for ours, theirs in zip(by_spec.layers, by_keyword.layers, strict=True):
        assert ours.codec == theirs.codec == Float8(8)
        assert all(torch.equal(a, b) for a, b in zip(ours.segments.body.data, theirs.segments.body.data, strict=True))


@torch.no_grad()
def test_bytes_are_the_codes_scales_and_residual_and_a_byte_budget_counts_them(model, ids):
    codec = codec_for(Storage(kv_codec="fp8", kv_group=GROUP), 16)
    entry = 2 * (16 + (16 // GROUP) * 4)  # key and value: a byte a number, then a float32 scale per group
    assert codec.entry_bytes(16, torch.float32) == entry
    assert codec.residual_bytes(16, torch.float32) == DEFAULT_RESIDUAL * (2 * 16 * 4 - entry)
    cache = kvsieve.compress(model, ids[:, :120], "snapkv", max_bytes=40_000, kv_codec="fp8", kv_group=GROUP)
    per_head = (40_000 - 3 * 2 * codec.residual_bytes(16, torch.float32)) // (3 * 2 * entry)
    assert cache.stored_lengths() == [[min(per_head, 120)] * 2] * 3
    held = sum(map(sum, cache.stored_lengths())) * entry + 3 * 2 * codec.residual_bytes(16, torch.float32)
    assert cache.nbytes() == held <= 40_000
    int8 = kvsieve.compress(model, ids[:, :120], "snapkv", max_bytes=40_000, kv_bits=8, kv_group=GROUP)
    assert sum(map(sum, cache.stored_lengths())) > sum(map(sum, int8.stored_lengths())), "no minimum: more fit"


@torch.no_grad()
def test_a_bounded_cache_stores_float8_while_it_grows(model, ids):
    cache = kvsieve.bounded_cache(model, "knorm", max_tokens=40, buffer=8, kv_codec="fp8", kv_group=GROUP)
    with kvsieve.sieve_attention(model):
        for start in range(0, 120, 8):
            model(ids[:, start : start + 8], past_key_values=cache)
            assert cache.mean_stored() <= 40 + 8
    segments = cache.layers[0].segments
    body, body_values, _ = segments.body.segment(0, 1)
    codec = Float8(GROUP)
    assert body.shape[0] > 0 and segments.residual.length == DEFAULT_RESIDUAL
    assert torch.equal(body, codec.decode(codec.encode(body, body_values), torch.float32)[0]), "the body holds fp8"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_codec": "fp8", "kv_bits": 4}, "kv_codec=fp8 stores 8 bits a number, not kv_bits=4"),
        ({"kv_codec": "fp6"}, "kv_codec='fp6' is not a codec; known: int, fp8"),
        ({"kv_codec": "fp8", "kv_group": 5}, "kv_group=5 does not divide the head dimension 16"),
        ({"kv_codec": 8}, "kv_codec must name a codec"),
        ({"kv_codec": "full", "kv_group": 8}, "kv_codec='full' is not a codec; known: int, fp8"),
        ({"kv_codec": "int"}, "kv_codec=int stores kv_bits=8, 4 or 2 per number: give kv_bits"),
    ],
)
def test_bad_float8_storage_is_named_before_any_work(model, ids, options, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        kvsieve.compress(model, ids, "snapkv", 0.5, **options)
