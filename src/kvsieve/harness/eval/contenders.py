"""What an evaluation compares, from policy specs: the full cache, kvsieve policies and kvpress presses."""

from __future__ import annotations

from ...selection.errors import PolicyError
from ...selection.spec import make_policy, split_policies
from .methods import FULL, KVPRESS_PREFIX, CacheMethod, FullCache, KvpressPress, KvsievePolicy


def parse_contenders(specs: str | list[str]) -> list[CacheMethod]:
    """Methods from policy specs (``"snapkv+adaptive:window=16,random,kvpress:snapkv"`` or a list).

    The full cache is always first, whether named or not; duplicates are refused.
    """
    items = split_policies(specs) if isinstance(specs, str) else list(specs)
    out: list[CacheMethod] = [FullCache()]
    for spec in items:
        if spec == FULL:
            continue
        if spec.startswith(KVPRESS_PREFIX):
            from ..compare.kvpress import KVPRESS_PRESSES

            press = spec.removeprefix(KVPRESS_PREFIX)
            if press not in KVPRESS_PRESSES:
                raise PolicyError(f"unknown kvpress press {press!r}; known: {', '.join(KVPRESS_PRESSES)}")
            out.append(KvpressPress(press))
        else:
            out.append(KvsievePolicy(make_policy(spec)))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise PolicyError(f"policies must be distinct, got {', '.join(names[1:])}")
    return out
