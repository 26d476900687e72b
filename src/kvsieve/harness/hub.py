"""The one place a model name may leave this machine: a Hugging Face id the local Hugging Face cache lacks.

`check_hub_id` runs before `transformers` is asked for such an id, so that where it cannot be downloaded
(`HF_HUB_OFFLINE`, or the Hub's host does not resolve) the load fails at once, instead of after the half
minute or more of retries `huggingface_hub` spends on an unreachable host.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class HubUnreachableError(FileNotFoundError):
    """A Hugging Face id that is neither cached here nor downloadable now."""


def is_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds the model's `config.json`."""
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


def hub_resolves() -> bool:
    """Whether the Hub's host name resolves (behind a proxy: assumed, the proxy resolves it)."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return False
    return True


def check_hub_id(name: str) -> None:
    """A clear error, at once, for an id that is not cached here and cannot be downloaded now."""
    if is_cached(name):
        return
    if is_offline_mode():
        raise HubUnreachableError(
            f"{name!r} is no local folder, not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
        )
    if not hub_resolves():
        raise HubUnreachableError(
            f"{name!r}: no local folder, not in the Hugging Face cache, and the Hub "
            f"({urlparse(constants.ENDPOINT).hostname}) cannot be reached from here"
        )
