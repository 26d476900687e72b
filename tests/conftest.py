"""Shared fixtures: tiny random models built in code, and a full-cache masked reference."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvsieve.runtime.storage.codecs import EntryCodec
from tokenizer import VOCAB_SIZE, tiny_tokenizer

REFERENCE_ATTENTION = "kvsieve_test_masked_reference"
#: Sliding window of the tiny sliding-window models.
WINDOW = 16

#: Positions kept per kv-head: per layer, or for some layers by index.
Kept = list[list[torch.Tensor]] | dict[int, list[torch.Tensor]]


def tiny_llama(
    seed: int = 0, layers: int = 3, heads: int = 4, kv_heads: int = 2, vocab_size: int = 128
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16 * heads,  # head_dim 16 (transformers 5.5+ refuses a hidden size heads do not divide)
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


#: Tiny random models of the families kvsieve evicts: (config class, model class, what differs from the base).
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"num_key_value_heads": 2}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"num_key_value_heads": 2, "head_dim": 24}),  # q/k norms, own head_dim
    "mistral": (MistralConfig, MistralForCausalLM, {"num_key_value_heads": 2, "sliding_window": None}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"num_key_value_heads": 2, "pad_token_id": 0}),  # fused qkv projection
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {"num_key_value_heads": 2}),  # q/k norms over all heads
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, {"rotary_pct": 0.25}),  # partial rotary, `attention`, `dense`
    "granite": (GraniteConfig, GraniteForCausalLM, {"num_key_value_heads": 2, "attention_multiplier": 0.2}),
}


def tiny_family(name: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random model of one of `FAMILIES` (3 layers, hidden 64, 4 query heads, vocabulary 128)."""
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(seed)
    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3}
    config = config_class(**base, num_attention_heads=4, max_position_embeddings=1024, **extra)
    config._attn_implementation = "sdpa"
    return model_class(config).eval()


def tiny_gemma3(seed: int = 0, layer_types: tuple[str, ...] = ("sliding", "full") * 2) -> Gemma3ForCausalLM:
    """A random Gemma-3: sliding and full-attention layers, softmax scale `query_pre_attn_scalar ** -0.5` (not
    `head_dim ** -0.5`), no attention soft-capping."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        layer_types=[f"{kind}_attention" for kind in layer_types],
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_mistral(seed: int = 0) -> MistralForCausalLM:
    """A random Mistral with `sliding_window` set: in transformers 5.2 every layer is then a sliding one."""
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tok():
    """The tiny fast test tokenizer (`tests/tokenizer.py`)."""
    return tiny_tokenizer()


@pytest.fixture
def lm() -> LlamaForCausalLM:
    """A tiny random Llama with the test tokenizer's vocabulary."""
    return tiny_llama(vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model and its tokenizer saved to a folder, as the command line loads them."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(vocab_size=VOCAB_SIZE).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))


# allowed[layer][kv_head] -> bool over absolute key positions; None = plain causal attention
_ALLOWED: dict[int, list[torch.Tensor]] = {}
# received[layer] -> [q_heads, positions] float64: attention each key position received, while tallying
_RECEIVED: dict[int, torch.Tensor] = {}
TALLY = "tally"
# while set: received[layer] holds the most attention each key position got from any query instead of the sum
MOST = "most"
# the codec whose stored entries full-attention layers read (None: the entries as computed), and the positions
# below which every entry is read back stored (an eviction that quantized a residual)
_STORED: dict[str, object] = {"codec": None, "below": 0}
# merged[layer] -> (keys [kv_heads, m, d], values [kv_heads, m, d], bias [kv_heads, m]): m more columns per kv-head
_MERGED: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _masked_reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Full dense cache, float64, causal (within the window of a sliding layer), and per-(layer, kv-head)
    masking of dropped positions."""
    _, n_heads, q_len, _ = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    key_pos = torch.arange(kv_len, device=query.device)
    codec = _STORED["codec"]
    if codec is not None and kwargs.get("sliding_window") is None:  # what a quantized cache holds, read back
        # stored: older than the newest `residual` before this forward (or below `below`); the rest as computed
        stored = (key_pos < kv_len - q_len - codec.residual) | (key_pos < _STORED["below"])
        read_key, read_value = codec.decode(codec.encode(key, value), key.dtype)
        key = torch.where(stored[:, None], read_key, key)
        value = torch.where(stored[:, None], read_value, value)
    query_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    out = torch.empty_like(query)
    for h in range(n_heads):
        kv_h = h // group
        scores = (query[0, h].double() @ key[0, kv_h].double().T) * scaling
        allowed = key_pos[None, :] <= query_pos[:, None]
        if kwargs.get("sliding_window") is not None:
            allowed = allowed & (key_pos[None, :] > query_pos[:, None] - kwargs["sliding_window"])
        if module.layer_idx in _ALLOWED:
            allowed = allowed & _ALLOWED[module.layer_idx][kv_h][:kv_len].to(query.device)[None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        values = value[0, kv_h].double()
        if module.layer_idx in _MERGED:
            merged_key, merged_value, bias = (t[kv_h].double() for t in _MERGED[module.layer_idx])
            merged_score = (query[0, h].double() @ merged_key.T) * scaling + bias
            scores = torch.cat([scores, merged_score], -1)
            values = torch.cat([values, merged_value])
        probs = torch.softmax(scores, -1)
        if TALLY in _RECEIVED:
            _RECEIVED.setdefault(module.layer_idx, torch.zeros(n_heads, 4096, dtype=torch.float64))[h, :kv_len] += (
                probs.sum(0).cpu()
            )
        if MOST in _RECEIVED:
            held = _RECEIVED.setdefault(module.layer_idx, torch.zeros(n_heads, 4096, dtype=torch.float64))
            held[h, :kv_len] = torch.maximum(held[h, :kv_len], probs.amax(0).cpu())
        out[0, h] = (probs @ values).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(REFERENCE_ATTENTION, _masked_reference_attention)


def _by_layer(kept: Kept) -> Iterable[tuple[int, list[torch.Tensor]]]:
    return kept.items() if isinstance(kept, dict) else enumerate(kept)


class MaskedReference:
    """A plain transformers model with a full DynamicCache that masks, per layer and kv-head, dropped positions.

    `kept`: per layer (a list) or for some layers (a dict: the full-attention layers of a model with
    sliding-window ones), the positions each kv-head keeps; sliding layers keep the sliding mask.
    `codec`: full-attention layers read keys and values as a quantized `SievedCache` holds them
    (encoded and decoded again, in the model's dtype): every entry older than the newest
    `codec.residual` before the forward, and every one below position `stored_below` (a residual an
    eviction quantized); the forward's own tokens as computed. The prefix is prefilled from the
    entries as computed, as `kvsieve.compress` prefills. `merged`: per layer, each kv-head's merged entries (keys,
    values, logit biases; `kvsieve.selection.merge`), more columns every query sees.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        prefix: torch.Tensor,
        kept: Kept,
        codec: EntryCodec | None = None,
        stored_below: int = 0,
        merged: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.merged = merged or {}
        self.codec, self.stored_below = codec, stored_below
        self.prefix_len = prefix.shape[1]
        self.allowed = {}
        for layer, heads in _by_layer(kept):
            masks = []
            for positions in heads:
                allowed = torch.ones(4096, dtype=torch.bool)
                allowed[: self.prefix_len] = False
                allowed[positions.cpu()] = True
                masks.append(allowed)
            self.allowed[layer] = masks
        previous = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        self.cache = DynamicCache()
        with torch.no_grad():
            model(prefix, past_key_values=self.cache)
        model.set_attn_implementation(previous)

    @staticmethod
    def tally() -> dict[int, torch.Tensor]:
        """From now on, sum the attention every key position receives per layer (`[q_heads, positions]`)."""
        _RECEIVED.clear()
        _RECEIVED[TALLY] = torch.empty(0)
        return _RECEIVED

    @staticmethod
    def most() -> dict[int, torch.Tensor]:
        """From now on, keep the most attention any query gave every key position per layer (`[q_heads, positions]`)."""
        _RECEIVED.clear()
        _RECEIVED[MOST] = torch.empty(0)
        return _RECEIVED

    def allow(self, kept: Kept) -> None:
        """From now on, every (layer, kv-head) sees exactly the positions `kept[layer][kv_head]`."""
        for layer, heads in _by_layer(kept):
            for head, positions in enumerate(heads):
                allowed = torch.zeros(4096, dtype=torch.bool)
                allowed[positions.cpu()] = True
                self.allowed[layer][head] = allowed
        _ALLOWED.update(self.allowed)

    def __enter__(self) -> MaskedReference:
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(REFERENCE_ATTENTION)
        _ALLOWED.clear()
        _ALLOWED.update(self.allowed)
        _STORED["codec"], _STORED["below"] = self.codec, self.stored_below
        _MERGED.clear()
        _MERGED.update(self.merged)
        return self

    def __exit__(self, *exc: object) -> None:
        _ALLOWED.clear()
        _MERGED.clear()
        _STORED["codec"], _STORED["below"] = None, 0
        self.model.set_attn_implementation(self._previous)


@pytest.fixture
def masked_reference() -> Iterator[type[MaskedReference]]:
    yield MaskedReference
    _ALLOWED.clear()
    _RECEIVED.clear()
