"""kvpress side by side: the same kept count as kvsieve, true bytes, and continuations equal to a masked full cache."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from transformers import DynamicCache, QuantizedCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from extras import require

require("kvpress", "compare")

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.compare import KVPRESS_PRESSES, import_kvpress, kvpress_compress, kvpress_ratio, make_press
from kvsieve.harness.compare.kvpress import PrunedLayer, global_ratio
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.attention.sieve import ATTENTION_NAME, register_sieve_attention, sieve_attention_forward
from kvsieve.selection.budget import uniform_keep
from tokenizer import VOCAB_SIZE

kvpress = import_kvpress()  # a plain import: kvpress wraps every registered attention function, harmlessly

N_CONTEXT = 100
N_PROTECTED = 33  # kvsieve's defaults: 1 sink + 32 recent tokens
HEAD_DIM = 16  # tiny_llama: hidden 64 over 4 query heads


def _ids(n: int = 106, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _kept_positions(visible: torch.Tensor) -> list[list[torch.Tensor]]:
    return [[head.nonzero().flatten() for head in layer] for layer in visible]


def _logits(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, past_key_values=cache).logits


def test_ratio_count_matches_kvsieve_formula_over_a_grid():
    """kvpress's own kept count at our ratio equals kvsieve's protected + uniform keep, for many lengths and rates."""
    from kvpress.utils import compute_n_kept

    for n in [34, 50, 99, 100, 101, 257, 1000, 4093, 8192]:
        for step in range(100):
            rate = step / 100
            expected = N_PROTECTED + uniform_keep(n - N_PROTECTED, rate)
            assert compute_n_kept(n, kvpress_ratio(rate, n, N_PROTECTED)) == expected, (n, rate)
    assert kvpress_ratio(0.5, 20, N_PROTECTED) == 0.0  # nothing evictable: nothing evicted
    with pytest.raises(ValueError, match="eviction rate"):
        kvpress_ratio(1.0, 100, 33)


@pytest.mark.parametrize("rate", [0.3, 0.8])
@torch.no_grad()
def test_kept_count_equals_kvsieve_compress(rate):
    """Both libraries hold the same number of entries per head at one rate (kvsieve counted by its cache)."""
    model, ctx = tiny_llama(), _ids()[:, :N_CONTEXT]
    model.set_attn_implementation("eager")  # neither sieve nor kvpress's SDPA: restoring it is visible
    sieved = kvsieve.compress(model, ctx, "knorm", rate)
    assert model.config._attn_implementation == "eager", "compress must give the previous attention back"
    counts = {n for layer in sieved.stored_lengths() for n in layer}
    assert len(counts) == 1
    pressed = kvpress_compress(model, ctx, "knorm", rate)
    assert model.config._attn_implementation == "eager", "kvpress_compress must give the previous attention back"
    assert {int(layer.keys.shape[-2]) for layer in pressed.cache.layers} == counts
    assert set(pressed.visible.sum(-1).flatten().tolist()) == counts
    with pressed.decoding(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager", "decoding() must give the previous attention back"


@pytest.mark.parametrize("press", ["knorm", "snapkv", "streaming_llm"])
@torch.no_grad()
def test_pruning_press_continuation_equals_masked_reference(masked_reference, press):
    """A pruned cache continues (teacher forced and generate) like a full float64 cache masking what it dropped."""
    model, ids = tiny_llama(seed=3), _ids(seed=2)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    pressed = kvpress_compress(model, ctx, press, 0.6)
    kept = _kept_positions(pressed.visible)
    n_kept = int(pressed.visible.sum())
    assert n_kept < pressed.visible.numel()
    assert pressed.kv_bytes == n_kept * 2 * HEAD_DIM * 4  # keys + values, float32
    assert pressed.kv_bytes == sum(t.nbytes for layer in pressed.cache.layers for t in (layer.keys, layer.values))
    gen = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    gen["output_logits"] = True
    with pressed.decoding(model):
        ours = _logits(model, copy.deepcopy(pressed.cache), question)
        ours_gen = model.generate(ids, past_key_values=copy.deepcopy(pressed.cache), **gen)
    with masked_reference(model, ctx, kept) as ref:
        expected = _logits(model, copy.deepcopy(ref.cache), question)
        expected_gen = model.generate(ids, past_key_values=ref.cache, **gen)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert torch.equal(ours_gen.sequences, expected_gen.sequences)
    torch.testing.assert_close(torch.stack(ours_gen.logits), torch.stack(expected_gen.logits), atol=1e-4, rtol=0)
    with masked_reference(model, ctx, [[torch.arange(N_CONTEXT)] * 2] * 3) as ref:
        unmasked = _logits(model, ref.cache, question)
    assert (unmasked - ours).abs().max() > 1e-3, "the press should change the continuation"


@torch.no_grad()
def test_positions_continue_like_kvpress_pipeline():
    """Plain forwards and the helpers give the logits of kvpress's own pipeline loop (explicit position_ids)."""
    model, ids = tiny_llama(seed=4), _ids(seed=5)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    press = make_press("knorm", kvpress_ratio(0.5, N_CONTEXT, N_PROTECTED))
    raw = DynamicCache()
    with press(model):
        model.model(input_ids=ctx, past_key_values=raw)
    positions = torch.arange(N_CONTEXT, ids.shape[-1])[None]
    expected = model(input_ids=question, past_key_values=copy.deepcopy(raw), position_ids=positions).logits
    wrong = model(input_ids=question, past_key_values=copy.deepcopy(raw)).logits  # positions from the stored length

    pressed = kvpress_compress(model, ctx, "knorm", 0.5)
    torch.testing.assert_close(pressed.forward(model, question), expected, atol=1e-5, rtol=0)
    assert (wrong - expected).abs().max() > 1e-3, "stored-length positions should differ"
    out = pressed.generate(model, ids, max_new_tokens=4)
    step = model(input_ids=question, past_key_values=(cache := copy.deepcopy(raw)), position_ids=positions)
    tokens = [int(step.logits[0, -1].argmax())]
    for i in range(3):
        nxt = torch.tensor([[tokens[-1]]])
        step = model(input_ids=nxt, past_key_values=cache, position_ids=torch.tensor([[ids.shape[-1] + i]]))
        tokens.append(int(step.logits[0, -1].argmax()))
    assert out[0, ids.shape[-1] :].tolist() == tokens


@torch.no_grad()
def test_knorm_visible_equals_lowest_key_norms():
    """knorm keeps, per (layer, kv-head), the entries whose keys have the smallest norms."""
    model, ctx = tiny_llama(seed=7), _ids(seed=9)[:, :N_CONTEXT]
    pressed = kvpress_compress(model, ctx, "knorm", 0.7)
    n_keep = N_PROTECTED + uniform_keep(N_CONTEXT - N_PROTECTED, 0.7)
    full = DynamicCache()
    model(ctx, past_key_values=full)
    for layer, visible in zip(full.layers, pressed.visible, strict=True):
        norms = layer.keys[0].double().norm(dim=-1)  # [kv_heads, n]
        expected = torch.zeros_like(visible)
        expected.scatter_(1, norms.argsort(dim=-1)[:, :n_keep], True)
        # the same set, up to a swap of near-equal norms at the boundary (ties broken either way)
        assert (visible.sum(-1) == n_keep).all()
        assert (visible != expected).sum() <= 2 * visible.shape[0]
        for head_norms, kept in zip(norms, visible, strict=True):
            assert head_norms[kept].max() <= head_norms[~kept].min() + 1e-6


@torch.no_grad()
def test_adakv_masks_ragged_heads_but_keeps_all_bytes(masked_reference):
    """AdaKV's per-head budgets are ragged, its cache keeps every entry's bytes, and decoding masks the rest."""
    model, ids = tiny_llama(seed=11), _ids(seed=12)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]  # 6 tokens: kvpress's fake keys exist for few queries
    pressed = kvpress_compress(model, ctx, "adakv_expected_attention", 0.5)
    per_head = pressed.visible.sum(-1)
    n_keep = N_PROTECTED + uniform_keep(N_CONTEXT - N_PROTECTED, 0.5)
    assert len(set(per_head.flatten().tolist())) > 1, "expected ragged per-head budgets"
    assert per_head.sum(-1).tolist() == [2 * n_keep] * 3  # same total as a uniform split, per layer
    full = DynamicCache()
    model(ctx, past_key_values=full)
    full_bytes = sum(t.nbytes for layer in full.layers for t in (layer.keys, layer.values))
    assert pressed.kv_bytes == full_bytes == 3 * 2 * N_CONTEXT * 2 * HEAD_DIM * 4
    with pressed.decoding(model):
        ours = _logits(model, copy.deepcopy(pressed.cache), question)
    with masked_reference(model, ctx, _kept_positions(pressed.visible)) as ref:
        expected = _logits(model, ref.cache, question)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    unmasked = _logits(model, copy.deepcopy(pressed.cache), question)  # outside decoding(): nothing masked
    assert (unmasked - ours).abs().max() > 1e-3


def test_global_ratio_evicts_as_many_entries_in_total():
    """kvpress's KVzip evicts int(ratio * entries) over the whole cache: as many as kvsieve's rate from every head."""
    for n in [34, 100, 257, 1536, 4093]:
        for heads in [1, 6, 90, 448]:
            for step in range(0, 100, 7):
                ratio = global_ratio(step / 100, n, N_PROTECTED, heads)
                expected = heads * (n - N_PROTECTED - uniform_keep(max(0, n - N_PROTECTED), step / 100))
                assert int(heads * n * ratio) == max(0, expected), (n, heads, step)


@torch.no_grad()
def test_kvzip_press_masks_across_the_cache_and_keeps_every_byte(masked_reference, tok):
    """kvpress's KVzip: ragged budgets over layers and heads, kvsieve's total count, the full cache's bytes, and
    decoding equal to the masked reference; the model's name_or_path is given back."""
    model = tiny_llama(seed=15, vocab_size=VOCAB_SIZE)
    ids = torch.randint(3, VOCAB_SIZE, (1, 106), generator=torch.Generator().manual_seed(16))
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    name = model.config.name_or_path
    pressed = kvpress_compress(model, ctx, "kvzip", 0.5, tokenizer=tok)
    assert model.config.name_or_path == name
    n_keep = N_PROTECTED + uniform_keep(N_CONTEXT - N_PROTECTED, 0.5)
    per_head = pressed.visible.sum(-1)
    assert int(per_head.sum()) == 3 * 2 * n_keep
    assert len(set(per_head.flatten().tolist())) > 1, "expected ragged budgets"
    assert pressed.visible[:, :, :4].all(), "kvpress's KVzip keeps its 4 sink entries"
    assert pressed.kv_bytes == 3 * 2 * N_CONTEXT * 2 * HEAD_DIM * 4  # masked: nothing is freed
    with pressed.decoding(model):
        ours = _logits(model, copy.deepcopy(pressed.cache), question)
    with masked_reference(model, ctx, _kept_positions(pressed.visible)) as ref:
        expected = _logits(model, ref.cache, question)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="kvzip has the model repeat the context: pass the model's tokenizer"):
        kvpress_compress(model, ctx, "kvzip", 0.5)


@torch.no_grad()
def test_kvsieve_still_works_after_kvpress(masked_reference):
    """With "sieve" wrapped by kvpress's attention patch and after an AdaKV press, kvsieve still decodes exactly."""
    model, fresh, ids = tiny_llama(seed=13), tiny_llama(seed=13), _ids(seed=14)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    register_sieve_attention()
    previous = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
    # what importing kvpress after kvsieve registered "sieve" does: wrap every registered attention function
    patched = kvpress.attention_patch.attention_patch(sieve_attention_forward)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args[1].shape[2])  # query length: proves the model went through kvpress's wrapper
        return patched(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = wrapped
    try:
        pressed = kvpress_compress(model, ctx, "adakv_expected_attention", 0.5)
        assert model.config._attn_implementation == "sdpa", "kvpress_compress must give the previous attention back"
        pressed.forward(model, question)
        assert model.config._attn_implementation == "sdpa", "decoding() must give the previous attention back"
        assert not calls, "kvpress runs on SDPA, not on sieve"
        cache = kvsieve.compress(model, ctx, "snapkv", 0.5)
        assert calls and set(calls) == {N_CONTEXT}, "the observed prefill went through the wrapped sieve"
        assert model.config._attn_implementation == "sdpa"
        fresh_cache = kvsieve.compress(fresh, ctx, "snapkv", 0.5)
        kept = [cache.kept_positions(layer) for layer in range(3)]
        for layer in range(3):
            for ours, theirs in zip(kept[layer], fresh_cache.kept_positions(layer), strict=True):
                assert torch.equal(ours, theirs)
        assert any(not torch.equal(heads[0], heads[1]) for heads in kept), "kv-heads should keep different entries"
        calls.clear()
        with kvsieve.sieve_attention(model):
            ours = _logits(model, cache, question)
        assert calls == [question.shape[-1]] * 3, "decoding went through the wrapped sieve"
        with kvsieve.sieve_attention(fresh):
            theirs = _logits(fresh, fresh_cache, question)
        with masked_reference(model, ctx, kept) as ref:
            expected = _logits(model, ref.cache, question)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours, theirs)
        # no AdaKV mask is left behind on plain SDPA decoding either
        assert model.config._attn_implementation == fresh.config._attn_implementation == "sdpa"
        mine, theirs = DynamicCache(), DynamicCache()
        model(ctx, past_key_values=mine)
        fresh(ctx, past_key_values=theirs)
        torch.testing.assert_close(_logits(model, mine, question), _logits(fresh, theirs, question))
    finally:
        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = previous


def test_unknown_press_lists_the_presses():
    with pytest.raises(ValueError, match="unknown kvpress press 'h2o'") as err:
        make_press("h2o", 0.5)
    assert all(name in str(err.value) for name in KVPRESS_PRESSES)
    with pytest.raises(ValueError, match="known: random, knorm"):
        kvpress_compress(tiny_llama(), _ids()[:, :N_CONTEXT], "nope", 0.5)


def test_every_press_is_built_with_the_ratio():
    for name in KVPRESS_PRESSES:
        assert make_press(name, 0.25).compression_ratio == 0.25


@pytest.mark.parametrize("press", KVPRESS_PRESSES)
@torch.no_grad()
def test_every_press_holds_kvsieves_count_and_decodes(press, tok):
    """Each press keeps kvsieve's count per head (AdaKV: per layer, KVzip: in all), decodes, and leaves the model
    as it was."""
    model, ids = tiny_llama(seed=21, vocab_size=VOCAB_SIZE), _ids(seed=22)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    n_keep = N_PROTECTED + uniform_keep(N_CONTEXT - N_PROTECTED, 0.4)
    pressed = kvpress_compress(model, ctx, press, 0.4, tokenizer=tok)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(layer.self_attn, "rotary_emb") for layer in model.model.layers)
    assert pressed.visible.shape == (3, 2, N_CONTEXT) and pressed.seconds > 0
    if press.startswith("adakv"):
        assert pressed.visible.sum((-1, -2)).tolist() == [2 * n_keep] * 3
    elif press == "kvzip":
        assert int(pressed.visible.sum()) == 3 * 2 * n_keep
    else:
        assert (pressed.visible.sum(-1) == n_keep).all()
    logits = pressed.forward(model, question)
    assert logits.shape == (1, question.shape[-1], VOCAB_SIZE) and bool(logits.isfinite().all())


def test_missing_kvpress_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # makes `import kvpress` raise ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[compare\]" in the checkout'):
        make_press("knorm", 0.5)


@pytest.mark.integration
@torch.no_grad()
def test_default_model_answers_like_kvpress_pipeline():
    """On SmolLM2, our prefill + plain `generate` answers exactly as kvpress's own pipeline does (over its quantized
    cache too)."""
    model, tokenizer = kvsieve.load_model()
    filler = "The grass is green and the sky is blue; the sun shines over the quiet hills. "
    context = filler * 3 + "The secret code is 4721. " + filler * 2
    question = "What is the secret code?"
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    inputs = pipe.preprocess(context, [question], answer_prefix="", max_context_length=10**6)
    ctx, q = inputs["context_ids"], inputs["questions_ids"][0]
    ratio = kvpress_ratio(0.6, ctx.shape[-1], N_PROTECTED)
    for name, bits in [("snapkv", 16), ("adakv_expected_attention", 16), ("snapkv", 4), ("knorm", 2)]:
        cache = None if bits == 16 else QuantizedCache("quanto", model.config, nbits=bits, q_group_size=32)
        press = make_press(name, ratio)
        expected = pipe(context, question=question, press=press, cache=cache, max_new_tokens=5)["answer"]
        pressed = kvpress_compress(model, ctx, name, 0.6, kv_bits=bits)
        out = pressed.generate(model, torch.cat([ctx, q], -1), max_new_tokens=5)
        ours = tokenizer.decode(out[0, ctx.shape[-1] + q.shape[-1] :], skip_special_tokens=True)
        assert ours == expected, (name, bits)


def _dequantized(pressed) -> DynamicCache:
    """The entries a quantized press's cache holds, read back into a pruned full-precision cache."""
    reference = DynamicCache()
    reference.layers = [
        PrunedLayer(
            layer._dequantize(layer._quantized_keys),
            layer._dequantize(layer._quantized_values),
            layer.n_missing,
        )
        for layer in pressed.cache.layers
    ]
    return reference


@pytest.mark.parametrize("bits", [4, 2])
@torch.no_grad()
def test_a_quantized_press_keeps_the_same_count_in_fewer_bytes_and_reads_its_codes(bits):
    """Over transformers' quantized cache: kvsieve's count per head, bytes of codes + scales + shifts, and logits
    (teacher forced and generated) equal to its own dequantized entries at their true positions."""
    model, ids = tiny_llama(seed=3), _ids(seed=2)
    ctx, question = ids[:, :N_CONTEXT], ids[:, N_CONTEXT:]
    plain = kvpress_compress(model, ctx, "snapkv", 0.6)
    pressed = kvpress_compress(model, ctx, "snapkv", 0.6, kv_bits=bits, kv_group=8)
    n_keep = int(plain.visible.sum(-1)[0, 0])
    assert (pressed.visible.sum(-1) == n_keep).all()
    assert [layer.get_seq_length() for layer in pressed.cache.layers] == [N_CONTEXT] * 3
    entry = 2 * (HEAD_DIM * bits // 8 + 2 * (HEAD_DIM // 8) * 4)  # key and value: codes, a scale and shift per 8
    assert pressed.kv_bytes == 3 * 2 * n_keep * entry < plain.kv_bytes
    ours = pressed.forward(model, question)
    assert torch.equal(pressed.forward(model, question), ours), "answering leaves the cache as it was"
    gen = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    gen["output_logits"] = True
    with pressed.decoding(model):
        ours_gen = model.generate(ids, past_key_values=copy.deepcopy(pressed.cache), **gen)
        expected = _logits(model, _dequantized(pressed), question)
        expected_gen = model.generate(ids, past_key_values=_dequantized(pressed), **gen)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(ours_gen.logits), torch.stack(expected_gen.logits), atol=1e-5, rtol=0)
    assert (ours - plain.forward(model, question)).abs().max() > 1e-4, "the codes are read, not the computed entries"


def test_a_press_spec_names_its_bits():
    from kvsieve.harness.eval.contenders import parse_contenders
    from kvsieve.selection.errors import PolicyError

    methods = parse_contenders("kvpress:snapkv:kv_bits=4,kvpress:snapkv,kvpress:knorm:kv_bits=2")
    assert [(m.name, m.kv_bits) for m in methods[1:]] == [
        ("kvpress:snapkv:kv_bits=4", 4),
        ("kvpress:snapkv", 16),
        ("kvpress:knorm:kv_bits=2", 2),
    ]
    for bad, message in [
        ("kvpress:snapkv:kv_bits=8", "stores 2 or 4 bits"),
        ("kvpress:snapkv:window=4", "one parameter, kv_bits=4 or kv_bits=2"),
        ("kvpress:snapkv:kv_bits=4,kv_group=8", "one parameter"),
    ]:
        with pytest.raises(PolicyError, match=message):
            parse_contenders(bad)
    with pytest.raises(ValueError, match="streams run on its full-precision cache"):
        methods[1].stream(tiny_llama(), 8, 4, 0)
    with pytest.raises(ValueError, match="kv_bits=8 nowhere here"):
        kvpress_compress(tiny_llama(), _ids()[:, :N_CONTEXT], "knorm", 0.5, kv_bits=8)


@torch.no_grad()
def test_the_perplexity_protocol_runs_a_quantized_press():
    from kvsieve.harness.eval import run_ppl

    model = tiny_llama(seed=5)
    documents = [(f"doc{i}", _ids(89, seed=10 + i)) for i in range(2)]
    spec = "kvpress:knorm:kv_bits=4"
    result = run_ppl(LocalRunner(model), documents, [spec, "knorm"], [0.5], 64, 24)
    for row, (_, ids) in enumerate(documents):
        pressed = kvpress_compress(model, ids[:, :64], "knorm", 0.5, kv_bits=4)
        logits = pressed.forward(model, ids[:, 64:88])[0]
        expected = torch.nn.functional.cross_entropy(logits, ids[0, 65:89], reduction="sum")
        assert result.nll[spec, 0.5][row] == pytest.approx(float(expected), rel=1e-5)
        assert result.kv_bytes[spec, 0.5][row] == pressed.kv_bytes < result.kv_bytes["knorm", 0.5][row]


def test_kept_copies_of_one_row_match_distinct_positions():
    """Exact copies (common among quantized entries) are interchangeable: each kept copy takes its own position."""
    from kvsieve.harness.compare.kvpress import match_rows

    full = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [5.0, 6.0], [1.0, 2.0]])
    index = match_rows(full, full[[4, 3, 0]])
    assert torch.equal(full[index], full[[4, 3, 0]]) and index.unique().numel() == 3
    assert set(index.tolist()) - {3} <= {0, 2, 4}
    with pytest.raises(RuntimeError, match="could not locate"):
        match_rows(full, torch.tensor([[1.0, 2.0]] * 4))  # more copies than the prefill holds
    with pytest.raises(RuntimeError, match="could not locate"):
        match_rows(full, torch.tensor([[7.0, 8.0]]))


def test_missing_optimum_quanto_says_how_to_install(monkeypatch):
    import transformers.cache_utils

    monkeypatch.setattr(transformers.cache_utils, "is_optimum_quanto_available", lambda: False)
    with pytest.raises(ImportError, match=r'needs optimum-quanto: pip install -e "\.\[compare\]" in the checkout'):
        kvpress_compress(tiny_llama(), _ids()[:, :N_CONTEXT], "knorm", 0.5, kv_bits=4)
