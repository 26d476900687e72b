"""What differs between the `transformers` releases kvsieve supports, in one place.

kvsieve is tested on the oldest and the newest release of `SUPPORTED` (docs/design.md, "Supported
transformers"). Between them `transformers` changed three things kvsieve meets:

- the keyword that hands a forward or `generate` its cache: `past_key_values` up to 5.23, `cache`
  from 5.24 on (the old name warns there and goes in 5.40): `cache_argument` picks the model's own;
- what a cache layer's `get_mask_sizes` receives: the new tokens' cache positions up to 5.4, their
  number from 5.5 on: `query_length` reads either;
- the abstract `get_max_length` of a cache layer (5.14), which replaced `get_max_cache_shape`:
  kvsieve's layers define both.

Everything else kvsieve uses is public and unchanged across the range: `Cache` and
`CacheLayerMixin`, `DynamicSlidingWindowLayer`, `AttentionInterface`, the mask interface,
`set_attn_implementation`. The one private name it reads, the attention implementation a model runs
(`config._attn_implementation`, which transformers has no public getter for), is read here only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

#: The `transformers` releases kvsieve runs on (the range `pyproject.toml` pins).
OLDEST, NEWEST = "5.2.0", "5.24.0"
SUPPORTED = f">={OLDEST},<5.25"


class UnsupportedTransformersError(ImportError):
    """The installed `transformers` is outside the releases kvsieve supports."""


def check_transformers_version(installed: str | None = None) -> None:
    """A clear error unless `installed` (default: the installed `transformers`) is in `SUPPORTED`."""
    from packaging.specifiers import SpecifierSet  # a dependency of transformers

    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError as error:
            raise UnsupportedTransformersError(
                f"kvsieve needs transformers {SUPPORTED}, which is not installed: pip install 'transformers{SUPPORTED}'"
            ) from error
    if installed not in SpecifierSet(SUPPORTED, prereleases=True):
        raise UnsupportedTransformersError(
            f"kvsieve supports transformers {SUPPORTED} (tested on {OLDEST} and {NEWEST}); {installed} is installed: "
            f"pip install 'transformers{SUPPORTED}'"
        )


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward and `generate` take their cache by: `cache` (5.24+) or `past_key_values`."""
    return _cache_keyword(type(model))


def cache_argument(model: torch.nn.Module, cache: object) -> dict[str, Any]:
    """`{keyword: cache}` for `model(**inputs, **cache_argument(model, cache))` on every supported release."""
    return {cache_keyword(model): cache}


def passed_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache a caller passed to a forward or to `generate`, under either name (None if none)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def attention_implementation_of(model: torch.nn.Module) -> str | None:
    """The name of the attention implementation `model` runs (as `set_attn_implementation` sets it)."""
    return model.config._attn_implementation


def query_length(query: torch.Tensor | int) -> int:
    """The number of new tokens `get_mask_sizes` describes: given as their cache positions (up to 5.4) or a count."""
    return query.shape[0] if isinstance(query, torch.Tensor) else int(query)
