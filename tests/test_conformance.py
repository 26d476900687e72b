"""Every registered scorer (and the query measures it declares), allocator, projection, budget and codec, and the
vLLM plugin's cache layout, against its protocol.

No type checker runs over the package, so these tests hold each implementation to the members its protocol
declares: every attribute present, every method with the protocol's parameter names in order; and the
codecs to their byte counts.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from kvsieve.runtime.storage.codecs import CODECS, FULL_PRECISION, EntryCodec, codec_for
from kvsieve.selection.allocators import ALLOCATORS, Allocator
from kvsieve.selection.budget import Budget, MaxBytes, MaxTokens, Rate
from kvsieve.selection.observation import Needs, QueryMeasure
from kvsieve.selection.projection import PROJECTIONS, Projection
from kvsieve.selection.scorers import SCORERS
from kvsieve.selection.scorers.base import Scorer
from kvsieve.selection.spec import make_policy
from kvsieve.selection.storage import Storage

PROTOCOL_NOISE = {"_is_protocol", "_is_runtime_protocol", "__protocol_attrs__", "__non_callable_proto_members__"}


def declared(protocol: type) -> dict[str, Any]:
    """The members `protocol` declares: annotated attributes (None) and methods or properties (their objects)."""
    members: dict[str, Any] = dict.fromkeys(getattr(protocol, "__annotations__", {}))
    for name, value in vars(protocol).items():
        if not name.startswith("_") and name not in PROTOCOL_NOISE and (callable(value) or isinstance(value, property)):
            members[name] = value
    return members


def parameters(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def assert_conforms(implementation: object, protocol: type) -> None:
    for name, member in declared(protocol).items():
        assert hasattr(implementation, name), f"{type(implementation).__name__} lacks {protocol.__name__}.{name}"
        if callable(member) and not isinstance(member, property):
            own = getattr(type(implementation), name)
            assert parameters(own) == parameters(member), (
                f"{type(implementation).__name__}.{name}{inspect.signature(own)} is not "
                f"{protocol.__name__}.{name}{inspect.signature(member)}"
            )


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_scorer_conforms(name):
    scorer = make_policy(name).scorer
    assert_conforms(scorer, Scorer)
    assert scorer.name == name and isinstance(scorer.needs, Needs) and isinstance(scorer.calibrated, bool)
    for measure in scorer.needs.window_measures:  # the inputs a scorer declares in its own file
        assert_conforms(measure, QueryMeasure)
        assert isinstance(measure.name, str) and isinstance(measure.reads_output, bool)


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_every_allocator_conforms(name):
    allocator = make_policy(f"random+{name}").allocator
    assert_conforms(allocator, Allocator)
    assert allocator.name == name


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_every_projection_conforms(name):
    projection = PROJECTIONS[name]()
    assert_conforms(projection, Projection)
    assert projection.name == name and isinstance(projection.needs_spans, bool)


@pytest.mark.parametrize("budget", [Rate(0.5), MaxTokens(64), MaxBytes(1 << 20)], ids=type)
def test_every_budget_conforms(budget):
    assert_conforms(budget, Budget)


#: A storage of every registered codec (integer codes at every width).
STORAGES = [Storage(), Storage(8), Storage(4), Storage(2), Storage(kv_codec="fp8")]


def test_every_registered_codec_is_checked():
    assert {storage.codec_name for storage in STORAGES} == set(CODECS)


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: f"{s.codec_name}{s.kv_bits}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_codec_conforms_and_stores_what_it_counts(storage, dtype):
    """`entry_bytes` is the bytes `encode` really makes per entry; `decode` gives back the shapes and dtype, exactly
    where the codec says it is lossless."""
    codec = codec_for(storage, head_dim=64)
    assert_conforms(codec, EntryCodec)
    keys, values = torch.randn(2, 3, 5, 64, dtype=dtype), torch.randn(2, 3, 5, 64, dtype=dtype)
    buffers = codec.encode(keys, values)
    stored = sum(b.shape[-1] * b.element_size() for b in buffers)
    assert codec.entry_bytes(64, dtype) == stored
    assert all(b.shape[:-1] == keys.shape[:-1] for b in buffers), "buffers are row-aligned, one row per entry"
    decoded = codec.decode(buffers, dtype)
    assert [d.shape for d in decoded] == [keys.shape, values.shape] and decoded[0].dtype == dtype
    assert (codec is FULL_PRECISION) == (storage == Storage())
    exact = torch.equal(decoded[0], keys) and torch.equal(decoded[1], values)
    assert codec.lossless == exact and (codec.residual == 0) == codec.lossless


def test_the_vllm_cpu_layout_conforms():
    from kvsieve.vllm.adapter import CacheLayout
    from kvsieve.vllm.layout import CPUCacheLayout

    assert_conforms(CPUCacheLayout(), CacheLayout)
