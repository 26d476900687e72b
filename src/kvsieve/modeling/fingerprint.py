"""A model's identity by its weights: what ties a retention-gate checkpoint to the model it was trained for."""

from __future__ import annotations

import hashlib
import weakref

import torch

_FINGERPRINTS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the model's weights (rounded to bfloat16, so float32 and bfloat16 copies agree), cached per model."""
    if model not in _FINGERPRINTS:
        digest = hashlib.blake2b(digest_size=16)
        for name, param in model.state_dict().items():
            digest.update(name.encode())
            digest.update(param.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
        _FINGERPRINTS[model] = digest.hexdigest()
    return _FINGERPRINTS[model]
