"""Quantized entries stacked on eviction: the codec, exactness on the dequantized entries, real bytes, byte budgets."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_gemma3, tiny_llama
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.storage.codecs import FULL_PRECISION, Quantized, make_codec
from kvsieve.runtime.storage.segments import BLOCK
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.storage import DEFAULT_RESIDUAL

GROUP = 8  # the tiny models' head dimension is 16
SPECS = ["snapkv", "snapkv+adaptive", "h2o+global", "trimkv+global:gates=untrained"]


def _codec(bits: int, residual: int = DEFAULT_RESIDUAL) -> Quantized:
    return Quantized(bits, GROUP, residual)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_round_trip_within_half_a_step_and_pack_losslessly(bits, dtype):
    codec = Quantized(bits, 16)
    gen = torch.Generator().manual_seed(bits)
    keys = (torch.randn(3, 2, 40, 64, generator=gen) * torch.linspace(0.1, 30, 64)).to(dtype)
    values = torch.randn(3, 2, 40, 64, generator=gen).to(dtype)
    encoded = codec.encode(keys, values)
    assert [t.dtype for t in encoded] == [torch.uint8, dtype, torch.uint8, dtype]
    assert [t.shape[-1] for t in encoded] == [64 * bits // 8, 8, 64 * bits // 8, 8]
    for original, decoded, params in zip((keys, values), codec.decode(encoded, dtype), encoded[1::2], strict=True):
        assert decoded.dtype == dtype and decoded.shape == original.shape
        step = params[..., :4].float().repeat_interleave(16, dim=-1)
        slack = original.float().abs() * (2**-7 if dtype == torch.bfloat16 else 1e-6) + 1e-6
        assert ((decoded.float() - original.float()).abs() <= step / 2 + slack).all()
    codes = torch.randint(0, 2**bits, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(codec._unpack(codec._pack(codes)), codes)


def test_a_constant_group_and_the_null_entry_decode_exactly():
    codec = Quantized(4, 8)
    flat = torch.full((2, 16), 3.25)
    keys, _ = codec.decode(codec.encode(flat, flat), torch.float32)
    assert torch.equal(keys, flat)
    zeros = tuple(torch.zeros(1, t.shape[-1], dtype=t.dtype) for t in codec.encode(flat[:1], flat[:1]))
    assert all(torch.equal(t, torch.zeros(1, 16)) for t in codec.decode(zeros, torch.float32))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bits", [8, 4, 2])
@torch.no_grad()
def test_decoding_equals_the_masked_reference_on_the_dequantized_entries(model, ids, masked_reference, spec, bits):
    """Entries older than the newest 8 (the residual, inside the protected tail) read back quantized."""
    options = {"n_recent": 8, "kv_bits": bits, "kv_group": GROUP, "kv_residual": 8}
    cache = kvsieve.compress(model, ids[:, :100], spec, 0.7, **options)
    assert all(layer.codec == _codec(bits, 8) for layer in cache.layers)
    assert all(layer.segments.residual.length == 8 for layer in cache.layers)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(100, 110)]
        rest = model(ids[:, 110:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept, codec=_codec(bits, 8)) as ref:  # fed as the cache was fed
        expected = [model(ids[:, t : t + 1], past_key_values=ref.cache).logits for t in range(100, 110)]
        expected = torch.cat([*expected, model(ids[:, 110:], past_key_values=ref.cache).logits], dim=1)
    torch.testing.assert_close(torch.cat([*steps, rest], dim=1), expected, atol=1e-4, rtol=0)
    with masked_reference(model, ids[:, :100], kept) as unquantized:
        assert (model(ids[:, 100:], past_key_values=unquantized.cache).logits - expected).abs().max() > 1e-4


@torch.no_grad()
def test_a_residual_the_policy_thins_is_quantized_into_the_body(model, ids, masked_reference):
    """Heads that keep different numbers of the newest 16 entries: the kept ones are quantized with the rest, and
    later tokens fill a new residual."""
    prefill = kvsieve.observe_prefill(model, ids[:, :100])
    whole, thinned = torch.arange(100), torch.cat([torch.arange(0, 84, 2), torch.arange(84, 100, 3)])
    cache = prefill.cache.keep([[[whole, thinned]] * 3], codec=_codec(4, 16))
    assert all(layer.segments.residual.length == 0 for layer in cache.layers)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        logits = torch.cat([model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(100, 120)], dim=1)
    assert all(layer.segments.residual.length == 16 for layer in cache.layers)
    with masked_reference(model, ids[:, :100], kept, codec=_codec(4, 16), stored_below=100) as ref:
        expected = torch.cat([model(ids[:, t : t + 1], past_key_values=ref.cache).logits for t in range(100, 120)], 1)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("residual", [0, 8])
@torch.no_grad()
def test_a_long_forward_reads_its_own_tokens_as_computed(model, ids, masked_reference, residual):
    """Feeding 40 tokens at once moves the residual and all but `residual` of them to the body; they read as computed
    in that forward, and quantized in the next."""
    options = {"kv_bits": 2, "kv_group": GROUP, "kv_residual": residual}
    cache = kvsieve.compress(model, ids[:, :60], "snapkv", 0.5, n_recent=8, **options)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        ours = model(ids[:, 60:100], past_key_values=cache).logits
        assert cache.layers[0].segments.body.lengths[0] == len(kept[0][0]) + 40 - residual
        after = model(ids[:, 100:101], past_key_values=cache).logits
    with masked_reference(model, ids[:, :60], kept, codec=_codec(2, residual)) as ref:
        expected = model(ids[:, 60:100], past_key_values=ref.cache).logits
        expected_after = model(ids[:, 100:101], past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(after, expected_after, atol=1e-4, rtol=0)


@torch.no_grad()
def test_sixteen_bits_is_the_full_precision_path_bit_for_bit(model, ids):
    plain = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.6)
    sixteen = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.6, kv_bits=16)
    assert all(layer.codec is FULL_PRECISION for layer in sixteen.layers)
    for ours, theirs in zip(plain.layers, sixteen.layers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours.segments.data, theirs.segments.data, strict=True))
    with kvsieve.sieve_attention(model):
        assert torch.equal(
            model(ids[:, 100:], past_key_values=plain).logits, model(ids[:, 100:], past_key_values=sixteen).logits
        )


@pytest.mark.parametrize("bits", [8, 4, 2])
@torch.no_grad()
def test_bytes_are_the_codes_scales_and_residual_and_storage_stays_within_two_percent(bits):
    """Right after compression and after 300 decode steps, a batch of two sequences (as for full precision)."""
    model = tiny_llama(seed=2, layers=2, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (2, 400), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    cache = kvsieve.compress(model, ids, "snapkv+global", 0.8, kv_bits=bits, kv_group=GROUP)
    entry = 2 * (16 * bits // 8 + 2 * (16 // GROUP) * 4)  # key and value: codes, then a scale and a minimum per group
    assert cache.layers[0].segments.entry_bytes() == entry == _codec(bits).entry_bytes(16, torch.float32)
    residual = 2 * 2 * len(cache.layers) * DEFAULT_RESIDUAL  # rows x kv-heads x layers x the newest 32, in float32
    null_entries = entry * len(cache.layers)
    blocks = entry * BLOCK * 2 * 2 * len(cache.layers)  # at most one block of room per (row, kv-head)

    def check() -> None:
        entries = sum(sum(map(sum, cache.stored_lengths(row))) for row in range(2))
        held = (entries - residual) * entry + residual * 2 * 16 * 4
        assert cache.nbytes() == held == sum(cache.row_nbytes(row) for row in range(2))
        assert held <= cache.allocated_nbytes() <= held + max(0.02 * held, blocks) + null_entries

    check()
    assert cache.allocated_nbytes() == cache.nbytes() + null_entries, "exactly sized right after compression"
    full = kvsieve.compress(model, ids, "snapkv+global", 0.8)
    quantized = full.nbytes() - residual * 2 * 16 * 4  # the same entries, all but the residual in `entry` bytes
    assert (cache.nbytes() - residual * 2 * 16 * 4) * (2 * 16 * 4) == quantized * entry
    with kvsieve.sieve_attention(model):
        for step in range(300):
            model(ids[:, -1:], past_key_values=cache, attention_mask=torch.cat([mask, torch.ones(2, step + 1)], -1))
    check()


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_a_byte_budget_counts_the_stored_bytes(model, ids, bits):
    """Entries count at their stored size; the residual's extra over that is set aside first."""
    group = None if bits == 16 else GROUP
    codec = make_codec(bits, group)
    cache = kvsieve.compress(model, ids[:, :120], "snapkv", max_bytes=40_000, kv_bits=bits, kv_group=group)
    residual = 3 * 2 * codec.residual_bytes(16, torch.float32)
    per_head = (40_000 - residual) // (3 * 2 * codec.entry_bytes(16, torch.float32))
    assert cache.stored_lengths() == [[min(per_head, 120)] * 2] * 3
    assert cache.nbytes() <= 40_000
    with pytest.raises(PolicyError, match="below one entry per" if bits == 16 else "residuals of quantized entries"):
        kvsieve.compress(model, ids[:, :120], "snapkv", max_bytes=6 * 30, kv_bits=bits, kv_group=group)


@pytest.mark.parametrize("bits", [8, 2])
@torch.no_grad()
def test_a_bounded_cache_rescores_the_entries_it_holds(model, ids, bits):
    """During generation the policy scores what the cache holds: the dequantized entries."""
    codec = _codec(bits)
    per_head = 40 * codec.entry_bytes(16, torch.float32) + codec.residual_bytes(16, torch.float32)
    cache = kvsieve.bounded_cache(model, "knorm", max_bytes=3 * 2 * per_head, buffer=8, kv_bits=bits, kv_group=GROUP)
    with kvsieve.sieve_attention(model):
        for start in range(0, 120, 8):
            model(ids[:, start : start + 8], past_key_values=cache)
            assert cache.mean_stored() <= 40 + 8
    observed = kvsieve.observe_cache(model, cache)
    segments = cache.layers[0].segments
    keys, _, _ = segments.segment(0, 1)
    assert torch.equal(observed[0].keys[1, : keys.shape[0]], keys), "the observation is what the cache reads back"
    body, body_values, _ = segments.body.segment(0, 1)
    assert torch.equal(keys[: body.shape[0]], body) and segments.residual.length == DEFAULT_RESIDUAL
    assert torch.equal(body, codec.decode(codec.encode(body, body_values), torch.float32)[0]), "the body holds codes"


@torch.no_grad()
def test_generate_apply_and_compress_quantize_alike(model, ids):
    config = kvsieve.EvictionConfig("snapkv", rate=0.5, kv_bits=4, kv_group=GROUP)
    gen = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with kvsieve.apply(model, config) as handle:
        applied = model.generate(ids[:, :80], **gen)
        assert handle.last_cache.layers[0].codec == _codec(4)
    direct = kvsieve.generate(model, ids[:, :80], "snapkv", 0.5, kv_bits=4, kv_group=GROUP, **gen)
    cache = kvsieve.compress(model, ids[:, :79], "snapkv", 0.5, kv_bits=4, kv_group=GROUP)
    with kvsieve.sieve_attention(model):
        manual = model.generate(ids[:, :80], past_key_values=cache, **gen)
    assert torch.equal(applied, direct) and torch.equal(direct, manual)
    with kvsieve.apply(model, config) as handle:
        model.generate(ids[:, :20], **gen)  # nothing evictable: every entry kept, still stored in 4 bits
        assert handle.last_cache.stored_lengths() == [[20 - 1 + 12] * 2] * 3
        assert handle.last_cache.layers[0].codec == _codec(4)


@torch.no_grad()
def test_padded_rows_equal_each_prompt_alone():
    model = tiny_llama(seed=4)
    gen = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 128, (1, 90), generator=gen), torch.randint(1, 128, (1, 60), generator=gen)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 30, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :30] = 0
    together = kvsieve.compress(model, batch, "snapkv", 0.5, attention_mask=mask, kv_bits=4, kv_group=GROUP)
    for row, alone_ids in enumerate((long, short)):
        alone = kvsieve.compress(model, alone_ids, "snapkv", 0.5, kv_bits=4, kv_group=GROUP)
        for layer in range(3):
            for head in range(2):
                ours, theirs = (
                    together.layers[layer].segments.segment(row, head),
                    alone.layers[layer].segments.segment(0, head),
                )
                torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=0)
                assert torch.equal(ours[2] - (30 if row else 0), theirs[2])


@torch.no_grad()
def test_sliding_windows_stay_in_the_models_dtype_and_count_first():
    model = tiny_gemma3(seed=1)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    cache = kvsieve.compress(model, ids, "snapkv", 0.5, kv_bits=4, kv_group=GROUP)
    assert [type(layer).__name__ for layer in cache.layers] == ["SlidingLayer", "SievedLayer"] * 2
    assert all(layer.codec == _codec(4) for layer in cache.layers if not layer.is_sliding)
    assert all(layer.keys.dtype == torch.float32 for layer in cache.layers if layer.is_sliding)
    # a byte budget pays for the windows (full precision) and the residuals first; entries count as stored
    codec = _codec(4)
    budget = cache.window_nbytes() + 2 * 2 * (
        60 * codec.entry_bytes(16, torch.float32) + codec.residual_bytes(16, torch.float32)
    )
    sized = kvsieve.compress(model, ids, "snapkv", max_bytes=budget, kv_bits=4, kv_group=GROUP)
    assert [sized.stored_lengths()[idx] for idx in sized.full_layers] == [[60, 60]] * 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_bits": 3}, "kv_bits=3 is not supported; use one of 2, 4, 8, 16"),
        ({"kv_bits": 4, "kv_group": 5}, "kv_group=5 does not divide the head dimension 16"),
        ({"kv_bits": 2, "kv_group": 2}, "must be a multiple of 4 for 2-bit codes"),
        ({"kv_group": 8}, "kv_group and kv_residual apply to quantized entries"),
        ({"kv_residual": 8}, "kv_group and kv_residual apply to quantized entries"),
        ({"kv_bits": 4, "kv_residual": -1}, "kv_residual must be a whole number >= 0"),
        ({"kv_bits": 4, "kv_group": 0}, "kv_group must be a whole number >= 1"),
    ],
)
def test_bad_storage_is_named_before_any_work(model, ids, options, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        kvsieve.compress(model, ids, "snapkv", 0.5, **options)
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        kvsieve.apply(model, kvsieve.EvictionConfig("snapkv", rate=0.5, **options))


def test_a_policy_spec_names_its_storage():
    from kvsieve.harness.eval.contenders import parse_contenders, with_kv_bits

    methods = parse_contenders("snapkv+adaptive:window=16,kv_bits=4,snapkv,h2o:kv_bits=2,kv_group=8,kvpress:knorm")
    assert [m.name for m in methods] == [
        "full",
        "snapkv+adaptive:window=16,kv_bits=4",
        "snapkv",
        "h2o:kv_bits=2,kv_group=8",
        "kvpress:knorm",
    ]
    assert [m.policy.storage.parameters() for m in methods[1:4]] == [{"kv_bits": 4}, {}, {"kv_bits": 2, "kv_group": 8}]
    assert methods[1].builder != methods[2].builder == methods[0].builder, "other storage, another build"
    assert with_kv_bits(["full", "snapkv", "tova:window=2", "kvpress:knorm"], 8) == [
        "full",
        "snapkv:kv_bits=8",
        "tova:window=2,kv_bits=8",
        "kvpress:knorm",
    ]
    for bad, message in [("snapkv:kv_bits=3", "kv_bits=3"), ("snapkv:kv_bits=4,kv_bits=2", "given twice")]:
        with pytest.raises(PolicyError, match=message):
            parse_contenders(bad)


@torch.no_grad()
def test_the_perplexity_protocol_reads_the_quantized_cache(model):
    from kvsieve.harness.eval import run_ppl

    gen = torch.Generator().manual_seed(5)
    documents = [(f"doc{i}", torch.randint(0, 128, (1, 89), generator=gen)) for i in range(2)]
    spec = f"snapkv:kv_bits=4,kv_group={GROUP}"
    result = run_ppl(LocalRunner(model), documents, [spec, "snapkv"], [0.5], 64, 24)
    for row, (_, ids) in enumerate(documents):
        cache = kvsieve.compress(model, ids[:, :64], "snapkv", 0.5, kv_bits=4, kv_group=GROUP)
        kv_bytes = cache.nbytes()
        with kvsieve.sieve_attention(model):
            logits = model(ids[:, 64:88], past_key_values=cache).logits[0]
        expected = torch.nn.functional.cross_entropy(logits, ids[0, 65:89], reduction="sum")
        assert result.nll[spec, 0.5][row] == pytest.approx(float(expected), rel=1e-5)
        assert result.kv_bytes[spec, 0.5][row] == kv_bytes < result.kv_bytes["snapkv", 0.5][row]
    assert result.nll[spec, 0.5] != result.nll["snapkv", 0.5]


@torch.no_grad()
def test_a_sweep_evicts_every_storage_from_one_prefill(lm, tok):
    from kvsieve.harness.eval import run_sweep
    from test_sweep import make_sample

    names = ["snapkv", f"snapkv:kv_bits=8,kv_group={GROUP}", f"snapkv:kv_bits=2,kv_group={GROUP}"]
    rows = run_sweep(LocalRunner(lm, tok), [make_sample(0)], names, [0.5], modes=("agnostic",))
    one = run_sweep(LocalRunner(lm, tok), [make_sample(0)], names, [0.5], modes=("agnostic",), rows_per_pass=1)
    assert rows["prefill_seconds"].nunique() == 1, "one prefill served every storage"
    by_policy = rows.set_index("policy")
    assert by_policy.loc[names, "kept_entries"].nunique() == 1, "the same entries, stored three ways"
    full_bytes, eight, two = (by_policy.loc[name, "kv_bytes"] for name in names)
    float_entry = 2 * 16 * 4
    residual = 3 * 2 * DEFAULT_RESIDUAL * float_entry  # layers x kv-heads x the newest 32, as computed
    for held, bits in ((eight, 8), (two, 2)):
        quantized = (full_bytes - residual) // float_entry * _codec(bits).entry_bytes(16, torch.float32)
        assert held == quantized + residual
    assert rows["gold_logprob"].to_numpy() == pytest.approx(one["gold_logprob"].to_numpy(), abs=1e-5)


@torch.no_grad()
def test_an_empty_bounded_cache_of_codes_sums_attention_from_its_first_chunk(model, ids):
    """Accumulating into a quantized layer whose body is still empty (every entry in the residual): each query pays
    one unit of attention per query head, so before any eviction the sums add up to the queries fed."""
    cache = kvsieve.bounded_cache(model, "h2o", max_tokens=40, buffer=8, kv_bits=8, kv_group=GROUP)
    with kvsieve.sieve_attention(model):
        for start in range(0, 120, 8):
            model(ids[:, start : start + 8], past_key_values=cache)
            assert cache.mean_stored() <= 40 + 8
            if start + 8 <= 40 + 8:  # nothing evicted yet
                for obs in kvsieve.observe_cache(model, cache):
                    totals = obs.stats.received.sum(dim=-1)
                    torch.testing.assert_close(totals, torch.full_like(totals, start + 8.0), atol=1e-4, rtol=0)
    assert cache.layers[0].segments.body.lengths[0] > 0, "entries moved to the body on the way"
