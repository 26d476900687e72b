"""What differs between the supported transformers releases (`kvsieve.runtime.compat`), on the installed one.

CI runs this file on both ends of the range (`make test` on the newest, `make test-compare` on the oldest).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.compat import (
    NEWEST,
    OLDEST,
    SUPPORTED,
    UnsupportedTransformersError,
    attention_implementation_of,
    cache_argument,
    cache_keyword,
    check_transformers_version,
)
from kvsieve.runtime.storage.cache import SievedLayer
from tokenizer import VOCAB_SIZE, tiny_tokenizer

INSTALLED = Version(transformers.__version__)


@pytest.mark.parametrize("release", [OLDEST, "5.19.0", NEWEST, "5.24.1"])
def test_supported_releases_pass(release):
    check_transformers_version(release)


@pytest.mark.parametrize("release", ["4.57.6", "5.1.0", "5.25.0", "6.0.0"])
def test_other_releases_are_refused_with_the_range(release):
    with pytest.raises(UnsupportedTransformersError, match=rf"supports transformers {SUPPORTED}.*{release}"):
        check_transformers_version(release)


def test_import_kvsieve_refuses_an_unsupported_transformers():
    """`import kvsieve` says which range it needs, before any cache class is built."""
    script = textwrap.dedent("""
        import importlib.metadata as metadata
        real = metadata.version
        metadata.version = lambda name: "5.1.0" if name == "transformers" else real(name)
        try:
            import kvsieve
        except ImportError as error:
            print(type(error).__name__, error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.startswith("UnsupportedTransformersError") and SUPPORTED in out and "5.1.0 is installed" in out


def test_the_cache_keyword_is_the_installed_releases():
    model = tiny_llama()
    expected = "cache" if Version("5.24") <= INSTALLED else "past_key_values"
    assert cache_keyword(model) == expected
    assert cache_argument(model, None) == {expected: None}


def test_a_sieved_layer_is_a_complete_cache_layer():
    """Every abstract method of the installed `CacheLayerMixin` is defined (5.14 added `get_max_length`)."""
    layer = SievedLayer()
    assert layer.get_max_length() == -1 and layer.get_max_cache_shape() == -1
    layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    assert layer.get_mask_sizes(3) == layer.get_mask_sizes(torch.arange(5, 8)) == (8, 0)


def test_crop_by_a_negative_count_matches_transformers_dynamic_cache():
    """`crop(-n)` drops the last n tokens in every release (5.24's only form); `generate` rolls back with it."""
    model, ids = tiny_llama(), torch.randint(0, 128, (1, 12))
    sieved = kvsieve.compress(model, ids, "importance", rate=0.0)  # keeps everything, contiguous
    dynamic = DynamicCache(config=model.config)
    model(ids, **cache_argument(model, dynamic))
    sieved.crop(-3)
    dynamic.crop(-3)
    next_ids = torch.randint(0, 128, (1, 2))
    with kvsieve.sieve_attention(model):
        ours = model(next_ids, **cache_argument(model, sieved)).logits
    theirs = model(next_ids, **cache_argument(model, dynamic)).logits
    assert sieved.get_seq_length() == dynamic.get_seq_length() == 11
    torch.testing.assert_close(ours, theirs)


def test_kvsieve_calls_into_transformers_raise_no_warning():
    """compress, generate (both forms), apply, a bounded stream, chunked prefill, kvzip, quantized entries."""
    model, tok = tiny_llama(vocab_size=VOCAB_SIZE), tiny_tokenizer()
    ids = torch.randint(3, VOCAB_SIZE, (1, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = kvsieve.compress(model, ids[:, :-1], "snapkv", rate=0.5, kv_bits=4)
        with kvsieve.sieve_attention(model):
            model.generate(ids, **cache_argument(model, cache), max_new_tokens=3, do_sample=False)
        kvsieve.generate(model, ids, "importance", rate=0.5, max_new_tokens=3, do_sample=False)
        kvsieve.compress(model, ids, "kvzip+global", rate=0.5, tokenizer=tok)
        kvsieve.compress(model, ids, "h2o", max_tokens=40, chunk=16)
        with kvsieve.apply(model, kvsieve.EvictionConfig(policy="trimkv:gates=untrained", rate=0.5)):
            model.generate(ids, max_new_tokens=3, do_sample=False)
        stream = kvsieve.bounded_cache(model, "streaming", max_tokens=40, buffer=8)
        with kvsieve.sieve_attention(model):
            for chunk in ids.split(8, dim=-1):
                model(chunk, **cache_argument(model, stream))


def test_a_cache_fed_to_a_model_with_more_layers_names_both_counts():
    small, large = tiny_llama(layers=2), tiny_llama(layers=3)
    ids = torch.randint(0, 128, (1, 60))
    cache = kvsieve.compress(small, ids, "importance", rate=0.5)
    with pytest.raises(ValueError, match="filled by a model with 2 layers, but the model it is fed to has at least 3"):
        kvsieve.generate(large, ids[:, -1:], cache=cache, max_new_tokens=2)


def test_a_model_whose_attention_transformers_cannot_switch_is_refused(monkeypatch):
    """Where transformers' public `set_attn_implementation` leaves a model on its own attention (it logs that the
    model does not route attention through `AttentionInterface`), kvsieve refuses it by name."""
    model = tiny_llama()
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: None)
    with pytest.raises(kvsieve.UnhookableModelError, match="LlamaForCausalLM does not route attention through"):
        kvsieve.compress(model, torch.randint(0, 128, (1, 60)), "importance", rate=0.5)
    assert attention_implementation_of(model) == "sdpa"


def test_sieve_attention_switches_the_model_and_gives_its_own_back():
    model = tiny_llama()
    with kvsieve.sieve_attention(model):
        assert attention_implementation_of(model) == "sieve"
    assert attention_implementation_of(model) == "sdpa"
