"""Tests of an optional extra skip, with the install command as the reason, where the extra is absent."""

from __future__ import annotations

from importlib.util import find_spec
from types import ModuleType

import pytest


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or skip the calling test module with the command that installs `extra`."""
    return pytest.importorskip(module, reason=f'{module} is not installed: pip install -e ".[{extra}]" ({extra} extra)')


def needs(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip one test, with the command that installs `extra`, where `module` is not installed."""
    missing = find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f'{module} is not installed: pip install -e ".[{extra}]" ({extra} extra)')


#: kvpress side by side: the `compare` extra, in `make test-compare`'s environment (transformers 5.2).
needs_kvpress = needs("kvpress", "compare")
