"""Keywords renamed in kvsieve 0.2: the old names keep working through 0.3, with a `DeprecationWarning`."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping

from .errors import PolicyError

#: Old keyword -> the keyword that replaces it.
RENAMED = {
    "budget": "allocator",  # `budget` means how much is kept (a rate or a size), never the allocator
    "sliding_window": "n_recent",  # the protected recent tail, not sliding-window attention
    "eviction_rate": "rate",  # `EvictionConfig` takes the names `compress` takes
    "eviction_mode": "policy",
}


def renamed_keywords(params: Mapping[str, object], where: str, old_names: Collection[str]) -> dict[str, object]:
    """`params` with the deprecated `old_names` among them renamed, each with a `DeprecationWarning` naming the new one.

    Giving both a keyword and its old name is a `PolicyError`.
    """
    out = dict(params)
    for old in [key for key in out if key in old_names]:
        new = RENAMED[old]
        warnings.warn(
            f"{where}: {old}= is deprecated and will be removed in kvsieve 0.4; use {new}=",
            DeprecationWarning,
            stacklevel=4,
        )
        if new in out:
            raise PolicyError(f"{where}: give {new}= only ({old}= is its deprecated name)")
        out[new] = out.pop(old)
    return out
