"""What an evaluation compares, from policy specs: the full cache, kvsieve policies and kvpress presses."""

from __future__ import annotations

import functools
import operator

from ...selection.errors import PolicyError
from ...selection.policy import Policy
from ...selection.scorers import SCORERS
from ...selection.spec import make_policy, split_policies
from .forced import FORCE_MARK, FORCINGS, ForcedSlots
from .methods import FULL, KVPRESS_PREFIX, CacheMethod, FullCache, KvpressPress, KvsievePolicy


def kvsieve_method(spec: str | Policy) -> KvsievePolicy:
    """A kvsieve policy from its spec, whose parameters may also say how its kept entries are stored:
    ``"trimkv+global:kv_bits=4"``, ``"snapkv:window=16,kv_bits=2,kv_residual=64"`` (`kvsieve.make_policy`)."""
    return KvsievePolicy(make_policy(spec))  # the head dimension is checked when a model stores them


def with_kv_bits(specs: list[str], kv_bits: int | None) -> list[str]:
    """Every kvsieve spec of `specs` with its entries stored in `kv_bits` (`--kv-bits`); kvpress and the full
    cache as they are."""
    if kv_bits is None:
        return specs
    out = []
    for spec in specs:
        if spec == FULL or spec.startswith(KVPRESS_PREFIX):
            out.append(spec)
        else:
            out.append(f"{spec}{',' if ':' in spec else ':'}kv_bits={kv_bits}")
    return out


def kvpress_method(spec: str) -> KvpressPress:
    """A kvpress press from ``kvpress:<press>``, or ``kvpress:<press>:kv_bits=4`` over its quantized cache."""
    from ..compare.kvpress import KVPRESS_PRESSES
    from ..compare.kvpress_quantized import check_kv_bits

    press, _, storage = spec.removeprefix(KVPRESS_PREFIX).partition(":")
    if press not in KVPRESS_PRESSES:
        raise PolicyError(f"unknown kvpress press {press!r}; known: {', '.join(KVPRESS_PRESSES)}")
    if not storage:
        return KvpressPress(press)
    key, _, value = storage.partition("=")
    if key != "kv_bits" or not value.isdigit():
        raise PolicyError(f"{spec}: a kvpress press takes one parameter, kv_bits=4 or kv_bits=2, got {storage!r}")
    try:
        check_kv_bits(int(value))
    except ValueError as err:
        raise PolicyError(f"{spec}: {err}") from None
    return KvpressPress(press, int(value))


def forced_method(spec: str) -> ForcedSlots:
    """A policy with each case's evidence forced in, from ``<policy>@force=<forcing>/<swap_out>`` (the name
    `ForcedSlots` gives itself): ``"trimkv+global@force=all/caote"`` is the evidence-first oracle of the default."""
    policy, _, rest = spec.partition(FORCE_MARK)
    forcing, _, swap_out = rest.partition("/")
    if forcing not in FORCINGS:
        raise PolicyError(f"{spec}: unknown forcing {forcing!r}; known: {', '.join(FORCINGS)}")
    if swap_out not in SCORERS:
        raise PolicyError(
            f"{spec}: after the forcing comes the scorer whose lowest kept entries make room "
            f"(e.g. @force={forcing}/caote), got {swap_out!r}; known: {', '.join(SCORERS)}"
        )
    return ForcedSlots(make_policy(policy), forcing, SCORERS[swap_out]())


def contender(spec: str | Policy) -> CacheMethod:
    """The method a spec names: the full cache, a kvpress press (``kvpress:...``), a kvsieve policy, or one
    with the evidence forced in (``...@force=all/caote``)."""
    if spec == FULL:
        return FullCache()
    if isinstance(spec, str) and spec.startswith(KVPRESS_PREFIX):
        return kvpress_method(spec)
    if isinstance(spec, str) and FORCE_MARK in spec:
        return forced_method(spec)
    return kvsieve_method(spec)


def parse_contenders(specs: str | list[str]) -> list[CacheMethod]:
    """Methods from policy specs (``"snapkv+adaptive:window=16,random,kvpress:snapkv"`` or a list).

    The full cache is always first, whether named or not; duplicates are refused, and so are methods
    whose needs one shared prefill cannot record together (two kvzip reconstructions).
    """
    items = split_policies(specs) if isinstance(specs, str) else list(specs)
    out: list[CacheMethod] = [FullCache(), *(contender(spec) for spec in items if spec != FULL)]
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise PolicyError(f"policies must be distinct, got {', '.join(names[1:])}")
    try:
        functools.reduce(operator.or_, (c.needs for c in out))
    except ValueError as err:
        raise PolicyError(f"these policies cannot share one prefill: {err}") from None
    return out
