"""Run NVIDIA kvpress presses on the same samples as kvsieve's policies, so one table shows both.

kvpress (https://github.com/NVIDIA/kvpress) compresses a `DynamicCache` while the context is
prefilled: a press is a context manager that hooks every attention layer. As in kvpress's own
pipeline, the context alone is prefilled under the press, then the question is fed and the answer
decoded greedily from the compressed cache. Here the compressed cache is returned as a
`PressedCache` together with what the comparison needs: the bytes the cache really holds, which
(layer, kv-head, position) entries decoding can still see, and the wall time of the prefill.

Two kvpress behaviours matter for a fair comparison:

* Pruning presses keep the same number of entries in every head of a layer and physically shrink
  the cache. kvpress's pipeline then passes explicit `position_ids` so new tokens continue at the
  context's length; here the pruned layers report the context's logical length instead, so plain
  `model.generate(...)` and `model(...)` calls place new tokens correctly without extra arguments.
* AdaKV (arXiv 2407.11550) only *masks* entries (kvpress's patched attention replaces their keys
  by keys whose attention underflows to zero); the full cache stays allocated, and `kv_bytes`
  says so. So does KVzip (``kvzip``, arXiv 2505.23416), which masks after its own reconstruction
  pass, under one count for the whole cache (`global_ratio`); it loads the model's tokenizer from
  `model.config.name_or_path`, pointed for the press at a saved copy of the one given.

On a stream (streaming perplexity), `PressStream` runs kvpress's `DecodingPress` around a scorer
press: the cache is compressed to a fixed number of entries per head after every forward.

With `kv_bits` 4 or 2, the press compresses `transformers`' quantized cache, as kvpress supports
(`kvsieve.harness.compare.kvpress_quantized`).

Install the ``compare`` extra (kvpress and optimum-quanto pin ``transformers<5.3``: ``make setup-compare``).
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from ...modeling.architecture import attention_module, decoder_layers
from ...runtime.attention.sieve import attention_implementation
from ...runtime.compat import cache_argument, query_length
from ...selection.budget import check_count, check_rate, evicted_count
from ...selection.observation import DEFAULT_WINDOW
from ...selection.protection import DEFAULT_N_RECENT, DEFAULT_N_SINK
from ...selection.storage import DEFAULT_GROUP
from .. import install_hint
from ..cache_size import CacheSize
from .kvpress_quantized import cache_nbytes, check_kv_bits, mark_pruned, quantized_cache

#: The presses this adapter runs, by kvsieve name.
KVPRESS_PRESSES: tuple[str, ...] = (
    "random",
    "knorm",
    "snapkv",
    "streaming_llm",
    "tova",
    "observed_attention",
    "expected_attention",
    "adakv_expected_attention",
    "kvzip",
)

INSTALL_HINT = install_hint("compare")

#: The attention kvpress runs on: its AdaKV masking patches the registered SDPA function.
KVPRESS_ATTENTION = "sdpa"

#: Presses whose scores read the prefill's attention weights, which only eager attention returns.
EAGER_PRESSES = frozenset({"observed_attention"})
#: Presses that rank every (layer, kv-head, position) entry together, evicting `int(ratio * entries)` over the
#: whole cache (KVzip, arXiv 2505.23416), and mask what they evict after their own reconstruction pass.
GLOBAL_PRESSES = frozenset({"kvzip"})
#: Presses that load the model's tokenizer themselves (from `model.config.name_or_path`).
TOKENIZER_PRESSES = frozenset({"kvzip"})

# Integer dtype with the bit width of each float element size, to fingerprint rows exactly.
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def import_kvpress() -> ModuleType:
    """Import kvpress, or say how to install it."""
    try:
        import kvpress
    except ImportError as err:
        raise ImportError(f"kvpress is not installed; install the comparison extra: {INSTALL_HINT}") from err
    return kvpress


def kvpress_ratio(rate: float, n_context: int, n_protected: int) -> float:
    """kvpress's `compression_ratio` that evicts as many entries per head as kvsieve's `rate`.

    kvsieve's rate is the evicted share of the evictable entries (`n_context - n_protected`,
    round half up); kvpress keeps `int(n_context * (1 - ratio))` of all context entries. The
    returned ratio puts that product halfway between integers, so float rounding cannot change
    the kept count. kvpress keeps at least one entry per head, so a rate that would keep none
    (only possible with `n_protected=0`) keeps one there.
    """
    rate = check_rate(rate)
    if n_context < 1:
        raise ValueError(f"n_context must be >= 1, got {n_context}")
    if n_protected < 0:
        raise ValueError(f"n_protected must be >= 0, got {n_protected}")
    n_evictable = max(0, n_context - n_protected)
    keep = n_context - evicted_count(n_evictable, rate)
    if keep >= n_context:
        return 0.0
    return 1.0 - (keep + 0.5) / n_context


def global_ratio(rate: float, n_context: int, n_protected: int, n_heads: int) -> float:
    """kvpress's `compression_ratio` for a press that evicts `int(ratio * n_heads * n_context)` entries over all
    `n_heads` (layer, kv-head) pairs at once: as many as kvsieve's `rate` evicts from each head, in total."""
    rate = check_rate(rate)
    evicted = n_heads * evicted_count(max(0, n_context - n_protected), rate)
    return (evicted + 0.5) / (n_heads * n_context) if evicted else 0.0


def make_press(name: str, ratio: float) -> Any:
    """The kvpress press called `name` (one of `KVPRESS_PRESSES`) at `compression_ratio=ratio`, kvpress defaults."""
    if name not in KVPRESS_PRESSES:
        raise ValueError(f"unknown kvpress press {name!r}; known: {', '.join(KVPRESS_PRESSES)}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"kvpress compression ratio must be in [0, 1), got {ratio!r}")
    kvpress = import_kvpress()
    factories: dict[str, Callable[[float], Any]] = {
        "random": lambda r: kvpress.RandomPress(compression_ratio=r),
        "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
        "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "streaming_llm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
        "tova": lambda r: kvpress.TOVAPress(compression_ratio=r),
        "observed_attention": lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
        "expected_attention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "adakv_expected_attention": lambda r: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=r)),
        "kvzip": lambda r: kvpress.KVzipPress(compression_ratio=r),
    }
    return factories[name](float(ratio))


class PrunedLayer(DynamicLayer):
    """A `DynamicLayer` kvpress pruned: it stores fewer entries than the tokens it has seen.

    `get_seq_length` reports the tokens seen, so new tokens get their true positions (RoPE), and
    the mask is built over the stored entries shifted by the missing count: every stored context
    entry stays visible and new tokens stay causal among themselves.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n_missing: int) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.n_missing = n_missing

    def stored_length(self) -> int:
        return int(self.keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.stored_length() + self.n_missing

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        return self.stored_length() + query_length(query), self.n_missing


def _prune(cache: DynamicCache, n_context: int) -> None:
    """Every layer a press shortened becomes a `PrunedLayer` that counts the `n_context` tokens it has seen."""
    for layer_idx, layer in enumerate(cache.layers):
        n_missing = n_context - int(layer.keys.shape[-2])
        if n_missing:
            cache.layers[layer_idx] = PrunedLayer(layer.keys, layer.values, n_missing)


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """`[n, d]` float rows -> `[n]` int64: an exact, order-independent hash of each row's bits.

    Integer arithmetic on the raw bits has no rounding, so identical rows always get identical
    fingerprints wherever they sit. Weights below 2^20 times 32-bit values keep sums of up to
    4096 columns inside int64.
    """
    bits = rows.contiguous().view(_BITS_DTYPE[rows.element_size()]).long()
    if rows.element_size() == 8:
        bits = (bits >> 32) ^ (bits & 0xFFFFFFFF)
    weights = torch.randint(1, 1 << 20, (rows.shape[-1],), generator=torch.Generator().manual_seed(0))
    return (bits * weights.to(rows.device)).sum(-1)


def match_rows(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Indices `i` with `full[i] == kept` row by row (exact copies), for `[n, d]` and `[m, d]` tensors.

    Rows that are exact copies of each other (frequent among quantized entries) are interchangeable for
    attention: the copies kept are matched to the copies in the prefill in order. Raises `RuntimeError` if
    a kept row is no copy of a full row, or a row is kept more often than the prefill holds it.
    """
    full_fp, kept_fp = row_fingerprints(full), row_fingerprints(kept)
    ordered, order = full_fp.sort(stable=True)
    kept_sorted, kept_order = kept_fp.sort(stable=True)
    copy_rank = torch.arange(len(kept_sorted), device=kept.device) - torch.searchsorted(kept_sorted, kept_sorted)
    slot = (torch.searchsorted(ordered, kept_sorted) + copy_rank).clamp(max=len(ordered) - 1)
    index = torch.empty_like(slot)
    index[kept_order] = order[slot]
    if not torch.equal(full[index], kept) or index.unique().numel() != index.numel():
        raise RuntimeError(
            "could not locate the press's kept entries among the prefill's entries (the press changed them)"
        )
    return index


def visible_entries(
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    kept_keys: torch.Tensor,
    kept_values: torch.Tensor,
    masked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """bool `[kv_heads, n]`: the prefill's entries (`[1, kv_heads, n, d]`) still attended to after a press.

    A press that prunes returns a subset of the entries (found by exact matching); AdaKV returns
    every entry and lists the masked ones as (batch, head, position) indices.
    """
    _, n_heads, n, _ = full_keys.shape
    visible = torch.zeros(n_heads, n, dtype=torch.bool, device=full_keys.device)
    if kept_keys.shape[-2] == n and torch.equal(kept_keys, full_keys):
        visible[:] = True
    else:
        for h in range(n_heads):
            full_rows = torch.cat([full_keys[0, h], full_values[0, h]], dim=-1)
            kept_rows = torch.cat([kept_keys[0, h], kept_values[0, h]], dim=-1)
            visible[h, match_rows(full_rows, kept_rows)] = True
    return hide_masked(visible, masked)


def hide_masked(visible: torch.Tensor, masked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`visible` (bool `[kv_heads, n]`) with a masking press's (batch, head, position) indices set False."""
    if masked is not None:
        _, heads, positions = masked
        visible[heads.to(visible.device), positions.to(visible.device)] = False
    return visible


@contextlib.contextmanager
def _tokenizer_named(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> Iterator[None]:
    """For the block, `model.config.name_or_path` names a saved copy of `tokenizer` (KVzipPress loads its
    tokenizer from there); nothing changes without a tokenizer."""
    if tokenizer is None:
        yield
        return
    previous = model.config.name_or_path
    with tempfile.TemporaryDirectory(prefix="kvsieve-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        model.config.name_or_path = folder
        try:
            yield
        finally:
            model.config.name_or_path = previous


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, as kvpress hooks them."""
    return [attention_module(layer) for layer in decoder_layers(model)]


@contextlib.contextmanager
def _pressing(press: Any, model: torch.nn.Module) -> Iterator[None]:
    """`press(model)`, then take away the `rotary_emb` kvpress attaches to every attention module."""
    modules = _attention_modules(model)
    had_rotary = [hasattr(module, "rotary_emb") for module in modules]
    try:
        with press(model):
            yield
    finally:
        for module, had in zip(modules, had_rotary, strict=True):
            if not had and hasattr(module, "rotary_emb"):
                del module.rotary_emb


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PressedCache:
    """A context compressed by a kvpress press, and what it costs.

    Attributes:
        cache: continue from it with `model(...)` / `model.generate(...)` inside `decoding(model)`;
            pass a `copy.deepcopy` of it when it serves several continuations.
        kv_bytes: bytes of the keys and values the cache holds (masked entries included; codes, scales and
            shifts when quantized).
        visible: bool `[layers, kv_heads, n_context]`, the entries decoding can still attend to.
        seconds: wall time of the compressing prefill.
        masked_key_indices: per layer, AdaKV's masked (batch, head, position) indices (empty otherwise).
        max_feed: the most tokens one forward may feed while decoding (None: no limit). kvpress's
            AdaKV masking searches one "fake key" for all new queries, which fails once they
            outnumber half the head dimension; feeding in chunks of this size avoids it.
    """

    cache: Cache
    kv_bytes: int
    visible: torch.Tensor
    seconds: float
    masked_key_indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    max_feed: int | None = None

    @contextlib.contextmanager
    def decoding(self, model: torch.nn.Module) -> Iterator[None]:
        """While active, `model` runs kvpress's attention (SDPA) and, for AdaKV, masks the masked entries.

        The model's previous attention (e.g. kvsieve's "sieve") is restored on exit.
        """
        import_kvpress()  # the AdaKV masking lives in kvpress's patched attention functions
        modules = _attention_modules(model)
        with attention_implementation(model, KVPRESS_ATTENTION):
            try:
                for layer_idx, module in enumerate(modules):
                    module.masked_key_indices = self.masked_key_indices.get(layer_idx)
                yield
            finally:
                for module in modules:
                    module.masked_key_indices = None

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy `model.generate` of `input_ids` (context + new tokens) from a copy of the cache."""
        with self.decoding(model):
            return model.generate(
                input_ids,
                **cache_argument(model, copy.deepcopy(self.cache)),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )

    @torch.no_grad()
    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, q, vocab]` of the tokens after the context (teacher forced), from a copy of the cache."""
        with self.decoding(model):
            return model(input_ids=input_ids, **cache_argument(model, copy.deepcopy(self.cache))).logits


@torch.no_grad()
def kvpress_compress(
    model: torch.nn.Module,
    context_ids: torch.Tensor,
    press: str,
    rate: float,
    *,
    n_protected: int = DEFAULT_N_SINK + DEFAULT_N_RECENT,
    kv_bits: int = 16,
    kv_group: int = DEFAULT_GROUP,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PressedCache:
    """Prefill `context_ids` (`[1, n]`) under the kvpress press `press` at kvsieve's eviction `rate`.

    With `kv_bits` 4 or 2 the press compresses `transformers`' quantized cache (optimum-quanto, `kv_group`
    channels per scale and shift), which holds every kept entry quantized.

    The ratio given to kvpress evicts the same number of entries per head as kvsieve's policies do
    at `rate` with `n_protected` protected entries (kvsieve's sinks and recent tail by default; see
    `kvpress_ratio`); for a press that ranks the whole cache at once (`kvzip`), as many in total
    (`global_ratio`). The model runs on SDPA (eager for `observed_attention`) during the prefill
    and gets its previous attention back afterwards. `kvzip` asks the model to repeat the context
    and needs its `tokenizer`.
    """
    if not isinstance(context_ids, torch.Tensor) or context_ids.ndim != 2 or context_ids.shape[0] != 1:
        raise ValueError("context_ids must be a LongTensor of shape [1, tokens]")
    if press in TOKENIZER_PRESSES and tokenizer is None:
        raise ValueError(f"kvpress's {press} has the model repeat the context: pass the model's tokenizer")
    n_context = int(context_ids.shape[-1])
    check_kv_bits(kv_bits)
    modules = _attention_modules(model)
    if press in GLOBAL_PRESSES:
        ratio = global_ratio(rate, n_context, n_protected, len(modules) * model.config.num_key_value_heads)
    else:
        ratio = kvpress_ratio(rate, n_context, n_protected)
    pressed = make_press(press, ratio)
    visible: dict[int, torch.Tensor] = {}
    masked: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    bookkeeping = [0.0]
    compress = pressed.compress

    def recording_compress(
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kept_keys, kept_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        _synchronize(keys.device)
        start = time.perf_counter()
        indices = getattr(module, "masked_key_indices", None)
        if indices is not None:
            masked[module.layer_idx] = indices
        visible[module.layer_idx] = visible_entries(keys, values, kept_keys, kept_values, indices)
        _synchronize(keys.device)
        bookkeeping[0] += time.perf_counter() - start
        return kept_keys, kept_values

    pressed.compress = recording_compress
    cache = DynamicCache() if kv_bits == 16 else quantized_cache(model.config, kv_bits, kv_group)
    implementation = "eager" if press in EAGER_PRESSES else KVPRESS_ATTENTION
    named = tokenizer if press in TOKENIZER_PRESSES else None
    try:
        with attention_implementation(model, implementation), _tokenizer_named(model, named):
            _synchronize(context_ids.device)
            start = time.perf_counter()
            with _pressing(pressed, model):
                model.model(input_ids=context_ids, **cache_argument(model, cache))
            _synchronize(context_ids.device)
            seconds = time.perf_counter() - start - bookkeeping[0]
        if press in GLOBAL_PRESSES:  # it masks after its reconstruction, outside `compress`
            heads = model.config.num_key_value_heads
            for layer_idx, module in enumerate(modules):
                indices = getattr(module, "masked_key_indices", None)
                if indices is not None:
                    masked[layer_idx] = indices
                everything = torch.ones(heads, n_context, dtype=torch.bool, device=context_ids.device)
                visible[layer_idx] = hide_masked(everything, indices)
    finally:
        for module in modules:
            module.masked_key_indices = None  # kept in the PressedCache, applied only inside decoding()
    if len(visible) != len(cache.layers):
        raise RuntimeError(f"the press compressed {len(visible)} of {len(cache.layers)} layers")
    if kv_bits == 16:
        _prune(cache, n_context)
    else:
        mark_pruned(cache, n_context)
    return PressedCache(
        cache=cache,
        kv_bytes=cache_nbytes(cache),
        visible=torch.stack([visible[i] for i in range(len(cache.layers))]),
        seconds=seconds,
        masked_key_indices=masked,
        max_feed=modules[0].head_dim // 2 if masked else None,
    )


# ---------------------------------------------------------------- streaming: kvpress's DecodingPress

#: Scorer presses that run inside kvpress's `DecodingPress` on a stream (`make_decoding_press`).
STREAMING_PRESSES: tuple[str, ...] = ("random", "knorm", "snapkv", "streaming_llm", "tova")


def make_decoding_press(name: str, target_size: int, chunk: int, window: int = DEFAULT_WINDOW) -> Any:
    """kvpress's `DecodingPress` around the scorer press `name`, compressing to `target_size` after every forward.

    `compression_interval=1`: kvpress counts every forward after the first as one decoding step,
    whatever its length, so each forward of `chunk` tokens is followed by a compression of every
    layer back to `target_size` entries per head. SnapKV reads the last `window` queries of the
    chunk (kvsieve's snapkv window by default; kvpress requires a chunk longer than it).
    """
    if name not in STREAMING_PRESSES:
        raise ValueError(
            f"kvpress press {name!r} is not run on streams; streaming presses: {', '.join(STREAMING_PRESSES)}"
        )
    check_count("target_size", target_size)
    check_count("chunk", chunk)
    kvpress = import_kvpress()
    if name == "snapkv":
        if chunk <= window:
            raise ValueError(
                f"kvpress's snapkv scores the last {window} queries of a chunk; use chunks longer than that"
            )
        base = kvpress.SnapKVPress(compression_ratio=0.0, window_size=window)
    else:
        base = make_press(name, 0.0)
    return kvpress.DecodingPress(base_press=base, compression_interval=1, target_size=target_size)


class PressStream:
    """A stream of chunks through kvpress: a `DynamicCache` that `DecodingPress` holds at `target_size` per head.

    kvpress treats only the first forward as a prefill (`is_prefilling`), so the first chunk is kept
    whole; after every later forward each layer is compressed back to `target_size` entries per head
    right after its attention. A chunk therefore attends to at most `target_size + chunk` entries,
    as in a kvsieve bounded cache with `buffer=chunk`, but between forwards kvpress holds
    `target_size` where kvsieve holds up to `budget + buffer` (it evicts before the next forward).
    The pruned cache's length is its stored size, so every forward passes the true `position_ids`.
    Use it inside `running()`; a seeded generator makes `random` reproducible.
    """

    def __init__(self, model: torch.nn.Module, press: str, target_size: int, chunk: int, seed: int = 0) -> None:
        self.model = model
        self.press = make_decoding_press(press, target_size, chunk)
        self.cache = DynamicCache()
        self.seed = seed

    @contextlib.contextmanager
    def running(self) -> Iterator[PressStream]:
        """The model on SDPA under the press, with the global RNG (kvpress's random press) seeded and restored."""
        with (
            torch.random.fork_rng(devices=[]),
            attention_implementation(self.model, KVPRESS_ATTENTION),
            _pressing(self.press, self.model),
        ):
            torch.manual_seed(self.seed)
            yield self

    @torch.no_grad()
    def forward(self, chunk_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits `[rows, c, vocab]` of a chunk whose first token sits at position `start`."""
        positions = torch.arange(start, start + chunk_ids.shape[1], device=chunk_ids.device)
        positions = positions.expand(chunk_ids.shape[0], -1)
        out = self.model(
            input_ids=chunk_ids, position_ids=positions, **cache_argument(self.model, self.cache), use_cache=True
        )
        return out.logits

    def nbytes(self) -> int:
        """Bytes of the key and value tensors the cache holds (all rows)."""
        return cache_nbytes(self.cache)

    def allocated_nbytes(self) -> int:
        """Bytes of the storage behind those tensors (all rows)."""
        tensors = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def mean_stored(self) -> float:
        """Entries per (layer, kv-head) of one sequence, on average (kvpress keeps the same count in every head)."""
        lengths = [int(layer.keys.shape[-2]) for layer in self.cache.layers]
        return sum(lengths) / len(lengths) if lengths else 0.0

    def size(self) -> CacheSize:
        """What one sequence holds (every row holds the same)."""
        rows = int(self.cache.layers[0].keys.shape[0])
        return CacheSize(self.nbytes() // rows, self.allocated_nbytes() // rows, self.mean_stored())
