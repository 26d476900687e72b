"""The observed prefill: one full-cache forward that records what the policy's scorer `Needs`, per layer and sequence.

Sieve attention hands every layer's queries (and, when asked, the attention each key received) to a
`PrefillRecorder`; the result is a full `SievedCache` and one `Observation` per (sequence,
full-attention layer). One prefill serves every (policy, rate): it does not depend on the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...kernels.attention import observed_attention
from ...modeling.errors import UnhookableModelError
from ...modeling.rotary import Rotary, find_rotary
from ...selection.errors import PolicyError
from ...selection.observation import DEFAULT_WINDOW, LayerFacts, Needs, Observation, Statistics
from ..attention.sieve import sieve_attention
from ..compat import cache_argument
from ..inputs import check_input_ids, real_tokens
from ..storage.cache import SievedCache, SievedLayer
from ..storage.layout import RaggedLayout
from .facts import layer_facts, recorded_needs
from .reconstruction import reconstruct

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PrefillRecorder:
    """Collects what a scorer `Needs` measured from every layer of an observed prefill, per sequence.

    Args:
        needs: what to record.
        real: `[rows, n]` bool, the real (non-padding) tokens of every sequence.
    """

    def __init__(self, needs: Needs, real: torch.Tensor) -> None:
        self.measures = needs.window_measures
        self.accumulate = needs.accumulated
        self.real = real
        self.padded = not bool(real.all())
        self.query_weight = real.float() if self.padded else None
        self.counts = real.sum(dim=1)
        window = min(needs.window, int(self.counts.min()))
        # cache positions of each row's last `window` real tokens
        self.window_index = torch.stack([row.nonzero().flatten()[-window:] for row in real]) if window else None
        self.layers: dict[int, list[Statistics]] = {}

    def attend(
        self,
        layout: RaggedLayout,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """The layer's attention: fused SDPA, or with the accumulated attention when it is needed; recorded."""
        received = None
        if self.accumulate:
            out, received = observed_attention(query, key, value, attention_mask, scaling, self.query_weight)
        else:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
        self.record(layout.layer_idx, query, out.transpose(1, 2), received)
        return out

    def record(self, layer_idx: int, query: torch.Tensor, output: torch.Tensor, received: torch.Tensor | None) -> None:
        """Keep one layer's measures of the window queries (`query`, `output`: `[rows, q_heads, n, d]`) and the
        attention each real entry received, per row."""
        if layer_idx in self.layers:
            raise RuntimeError(f"layer {layer_idx} was observed twice in one prefill")
        rows = []
        for row in range(query.shape[0]):
            window, window_positions = {}, None
            if self.window_index is not None:
                index = self.window_index[row]
                ran = query[row : row + 1, :, index], output[row : row + 1, :, index]
                window = {measure.name: measure.measure(*ran)[0] for measure in self.measures}
                window_positions = torch.arange(int(self.counts[row]), device=query.device)[-index.shape[0] :]
            row_received = None
            if received is not None:
                row_received = received[row][:, self.real[row]] if self.padded else received[row]
            rows.append(Statistics(window=window, window_positions=window_positions, received=row_received))
        self.layers[layer_idx] = rows


@dataclass
class Prefill:
    """A full-cache prefill and its observations: one serves every (policy, rate) pair.

    Attributes:
        cache: the full cache (every token of every sequence, padding included).
        observations: `[row][j]` the observation of each sequence's real tokens in the `j`-th full-attention
            layer (`cache.full_layers[j]`; sliding-window layers are not observed).
        entries: per row, the stored index of each observed entry (None: the identity).
        last_logits: `[rows, vocab]` logits of each sequence's last real token.
    """

    cache: SievedCache
    observations: list[list[Observation]]
    entries: list[torch.Tensor | None]
    last_logits: torch.Tensor

    def stored(self, row: int, keep: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Keep indices over a row's observed entries, as indices of its stored entries."""
        entries = self.entries[row]
        if entries is None:
            return [list(layer) for layer in keep]
        return [[entries[index] for index in layer] for layer in keep]


def _last_logits(model: torch.nn.Module, call: Callable[..., torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """Logits `[rows, vocab]` of each row's last real token, computing the head only where needed."""
    last = torch.stack([row.nonzero().flatten()[-1] for row in real])
    columns, where = last.unique(return_inverse=True)
    logits = call(logits_to_keep=columns if columns.numel() > 1 else int(real.shape[1] - columns[0]))
    return logits[torch.arange(real.shape[0], device=logits.device), where]


@torch.no_grad()
def observe_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    needs: Needs | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Prefill:
    """Run one full-cache prefill with sieve attention and observe every layer of every sequence.

    Args:
        input_ids: `[rows, n]`; padded sequences (left or right) need `attention_mask`.
        needs: what to record besides the entries (default: the last `DEFAULT_WINDOW` queries), and what the
            merges the checkpoints of the gates it names record read (`recorded_needs`).
        attention_mask: `[rows, n]`, 1 for real tokens and 0 for padding.
        tokenizer: the model's, when `needs.reconstruction` asks the model to repeat its context
            (`kvsieve.runtime.observing.reconstruction`: a second pass over the context after the prefill).
    """
    needs = Needs(window=DEFAULT_WINDOW) if needs is None else needs
    if needs.window < 0:
        raise ValueError(f"the observation window must be >= 0, got {needs.window}")
    check_input_ids(model, input_ids)
    real = real_tokens(input_ids, attention_mask)
    if needs.reconstruction is not None and tokenizer is None:
        raise PolicyError(
            "kvzip asks the model to repeat the prompt after it, which needs its tokenizer: "
            "compress(model, ids, 'kvzip', rate=..., tokenizer=tokenizer), or tokenizer= to generate()"
        )
    facts = layer_facts(model, needs)
    needs = needs | recorded_needs(facts)
    recorder = PrefillRecorder(needs, real)
    cache = SievedCache.for_model(model)
    cache.recorder = recorder
    inputs = {"input_ids": input_ids, **cache_argument(model, cache), "use_cache": True}
    if recorder.padded:
        inputs |= {"attention_mask": real.long(), "position_ids": (real.long().cumsum(-1) - 1).clamp(min=0)}
    try:
        with sieve_attention(model):
            last_logits = _last_logits(model, lambda **extra: model(**inputs, **extra).logits, real)
    finally:
        cache.recorder = None
    num_layers, full = len(cache.layers), cache.full_layers
    if num_layers == 0 or sorted(recorder.layers) != full:
        raise UnhookableModelError(
            f"{type(model).__name__}: sieve attention saw {len(recorder.layers)} of {len(full)} full-attention "
            "layers; its attention does not go through the transformers attention interface"
        )
    if needs.reconstruction is not None:
        most = reconstruct(model, cache, input_ids, needs.reconstruction, tokenizer, real)
        for i in full:
            recorder.layers[i] = [
                replace(s, reconstructed=most[i][row][:, real[row]]) for row, s in enumerate(recorder.layers[i])
            ]
    rotary = find_rotary(model) if needs.rotary and full else None
    entries = [row.nonzero().flatten() if recorder.padded else None for row in real]
    observations = [
        [
            _prefill_observation(
                cache.layers[i], row, entries[row], i, num_layers, facts[i], recorder.layers[i][row], rotary
            )
            for i in full
        ]
        for row in range(input_ids.shape[0])
    ]
    return Prefill(cache=cache, observations=observations, entries=entries, last_logits=last_logits)


def _prefill_observation(
    layer: SievedLayer,
    row: int,
    entries: torch.Tensor | None,
    layer_idx: int,
    num_layers: int,
    facts: LayerFacts,
    stats: Statistics,
    rotary: Rotary | None,
) -> Observation:
    """The observation of one row's real tokens in a freshly prefilled (strided, unevicted) layer."""
    view = layer.segments.padded()
    keys, values = view.keys[row], view.values[row]
    if entries is not None:
        keys, values = keys[:, entries], values[:, entries]
    positions = torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
    return Observation(layer_idx, num_layers, keys, values, positions, None, facts, stats, rotary)
