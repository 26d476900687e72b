"""A Hugging Face id that cannot be downloaded fails at once, before transformers spends its retries."""

from __future__ import annotations

import socket

import pytest
import transformers

import kvsieve
from kvsieve.harness import hub


@pytest.fixture
def no_download(monkeypatch):
    """transformers must not be asked for the model: the check refuses it first."""

    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to download")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_an_unreachable_hub_fails_at_once(monkeypatch, no_download):
    def no_dns(*args, **kwargs):
        raise socket.gaierror("Name or service not known")

    monkeypatch.setattr(hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    for name in hub.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(kvsieve.ModelNotFoundError, match=r"no-such-model.: .*the Hub \(.*\) cannot be reached"):
        kvsieve.load_model("someone/no-such-model")


def test_offline_mode_fails_at_once(monkeypatch, no_download):
    monkeypatch.setattr(hub, "is_offline_mode", lambda: True)
    with pytest.raises(kvsieve.ModelNotFoundError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        kvsieve.load_model("someone/no-such-model")


def test_a_cached_id_is_read_from_the_cache(monkeypatch, tmp_path):
    """An id the Hugging Face cache holds goes to transformers even offline (it reads the cache)."""
    monkeypatch.setattr(hub, "is_offline_mode", lambda: True)
    monkeypatch.setattr(hub, "try_to_load_from_cache", lambda repo, name: str(tmp_path / name))
    hub.check_hub_id("someone/cached-model")
