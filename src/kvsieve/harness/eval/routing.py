"""Routing diagnostics of one compressed sample: survival, global eviction (GER), evidence recall, head consensus.

KV compression seen as a disturbance of attention routing (arXiv 2603.01426):

- survival `S_h(t) = 1` when kv-head `h` still stores the entry of context token `t`;
- `GlobalEvicted(t) = 1` when no head keeps `t` (per layer, or over every (layer, head) pair);
- `GER` = mean of `GlobalEvicted` over the answer-relevant (evidence) tokens;
- head consensus of a layer = `|{argmax_t A_h(t)}_h| / |H|`, distinct argmax tokens over heads
  divided by the number of heads (low = rigid: the heads all route to the same token), and the
  agreement = share of heads whose argmax is the layer's most common argmax.

Here `H` is always the query heads of one layer (never all (layer, head) pairs), and `A_h(t)` is the
attention that query head `h` pays to token `t` from the last query of the prefill. Every function
is pure: tensors in, tensors or floats out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ...runtime.storage.cache import SievedCache
from ...selection.observation import Observation

#: What `H` means in every consensus number this module produces.
CONSENSUS_SCOPE = "H = the query heads of one layer"

Scope = Literal["layer", "model"]
SCOPES: tuple[str, ...] = ("layer", "model")

EvidencePositions = torch.Tensor | Sequence[int]


def survival_from_cache(cache: SievedCache, n_context: int, row: int = 0) -> torch.Tensor:
    """`[layers, kv_heads, n_context]` bool: whether (layer, kv-head, position) is still stored for sequence `row`.

    The layers are the full-attention ones, which the policy evicts (as its observations; sliding-window
    layers keep their window whatever the policy). Stored entries at positions `>= n_context` (a question,
    generated tokens) are ignored.
    """
    if n_context < 0:
        raise ValueError(f"n_context must be >= 0, got {n_context}")
    if not cache.full_layers or cache.layers[cache.full_layers[0]].batch_size == 0:
        raise ValueError("the cache holds no full-attention entries: prefill it before asking which entries survive")
    kept = [cache.kept_positions(layer, row) for layer in cache.full_layers]
    heads = {len(per_head) for per_head in kept}
    if len(heads) != 1:
        raise ValueError(f"layers hold different numbers of kv-heads {sorted(heads)}; survival needs one number")
    survival = torch.zeros(len(kept), heads.pop(), n_context, dtype=torch.bool)
    for layer, per_head in enumerate(kept):
        for head, positions in enumerate(per_head):
            positions = positions.cpu()
            survival[layer, head, positions[(positions >= 0) & (positions < n_context)]] = True
    return survival


def _check_survival(survival: torch.Tensor) -> torch.Tensor:
    if not isinstance(survival, torch.Tensor) or survival.ndim != 3:
        shape = tuple(survival.shape) if isinstance(survival, torch.Tensor) else type(survival).__name__
        raise ValueError(f"survival must be a bool tensor [layers, kv_heads, n_context], got {shape}")
    return survival.bool()


def _check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; valid scopes: {', '.join(SCOPES)}")
    return scope


def evidence_index(evidence_positions: EvidencePositions, n_context: int) -> torch.Tensor:
    """The distinct evidence positions as a sorted LongTensor; ValueError if one lies outside `[0, n_context)`."""
    positions = torch.as_tensor(evidence_positions, dtype=torch.long).flatten().cpu().unique()
    outside = positions[(positions < 0) | (positions >= n_context)]
    if outside.numel():
        raise ValueError(
            f"evidence positions {outside.tolist()[:8]} lie outside the context of {n_context} tokens "
            "(evidence must be context positions)"
        )
    return positions


def global_evicted(survival: torch.Tensor, scope: Scope) -> torch.Tensor:
    """`GlobalEvicted(t)`: no head keeps token `t`.

    scope ``"layer"``: `[layers, n]`, no kv-head of that layer keeps `t`;
    ``"model"``: `[n]`, no (layer, kv-head) pair keeps `t`.
    """
    survival = _check_survival(survival)
    if _check_scope(scope) == "layer":
        return ~survival.any(dim=1)
    return ~survival.any(dim=(0, 1))


def global_eviction_ratio(
    survival: torch.Tensor, evidence_positions: EvidencePositions, scope: Scope = "layer"
) -> float:
    """GER: the share of evidence tokens that are globally evicted (arXiv 2603.01426).

    scope ``"layer"``: mean over layers and evidence tokens of the per-layer `GlobalEvicted`;
    ``"model"``: mean over evidence tokens of the model-wide `GlobalEvicted`.
    NaN when there is no evidence token (the ratio is undefined, not 0).
    """
    survival = _check_survival(survival)
    evidence = evidence_index(evidence_positions, survival.shape[-1])
    evicted = global_evicted(survival, scope)
    if evidence.numel() == 0:
        return math.nan
    return float(evicted[..., evidence].float().mean())


def evidence_recall(survival: torch.Tensor, evidence_positions: EvidencePositions) -> torch.Tensor:
    """`[layers, kv_heads]` share of the evidence tokens each head still stores (all NaN without evidence)."""
    survival = _check_survival(survival)
    evidence = evidence_index(evidence_positions, survival.shape[-1])
    if evidence.numel() == 0:
        return torch.full(survival.shape[:2], math.nan)
    return survival[..., evidence].float().mean(dim=-1)


def head_attention(observation: Observation) -> torch.Tensor:
    """`[q_heads, n]` `A_h(t)`: attention of each query head, from the last query of the prefill, to every token.

    The paper reads routing off the attention of the position that produces the next token;
    in the prefill that is the last query (the last context token, or the question's last token
    when compression is question-aware). Exact softmax probabilities, recomputed in float32.
    """
    return observation.window_attention(1)[:, -1, :]


def _argmax_counts(argmax: torch.Tensor) -> tuple[float, float]:
    heads = argmax.numel()
    _, counts = argmax.unique(return_counts=True)
    return counts.numel() / heads, int(counts.max()) / heads


def head_consensus(attention: torch.Tensor, survival_row: torch.Tensor | None, group: int) -> tuple[float, float]:
    """(consensus, agreement) of one layer over its query heads (arXiv 2603.01426).

    consensus = distinct argmax tokens over heads / number of heads (1 = every head routes to its
    own token, 1/|H| = all heads route to one token: rigid); agreement = share of heads whose
    argmax is the most common one. With `survival_row [kv_heads, n]` each query head takes its
    argmax over the entries its kv-head (`h // group`) kept, i.e. routing after compression; heads
    whose kv-head kept nothing have no argmax and are left out. Both are NaN when no head is left.
    Ties go to the earliest token.
    """
    if attention.ndim != 2:
        raise ValueError(f"attention must be [q_heads, n], got shape {tuple(attention.shape)}")
    if group < 1 or attention.shape[0] % group:
        raise ValueError(f"group={group} does not divide the {attention.shape[0]} query heads")
    scores = attention.float()
    if survival_row is not None:
        expected = (attention.shape[0] // group, attention.shape[1])
        if tuple(survival_row.shape) != expected:
            raise ValueError(
                f"survival row of shape {tuple(survival_row.shape)} does not fit attention of shape "
                f"{tuple(attention.shape)} with group={group}: expected {expected}"
            )
        kept = survival_row.bool().to(scores.device).repeat_interleave(group, dim=0)
        scores = scores.masked_fill(~kept, -math.inf)[kept.any(dim=1)]
    if scores.shape[0] == 0 or scores.shape[1] == 0:
        return math.nan, math.nan
    return _argmax_counts(scores.argmax(dim=1))


@dataclass(frozen=True)
class RoutingDiagnostics:
    """Routing diagnostics of one compressed sample (arXiv 2603.01426).

    Attributes:
        ger_layer: GER with per-layer global eviction (mean over layers and evidence tokens).
        ger_model: GER with model-wide global eviction (no (layer, kv-head) keeps the token).
        recall_mean: mean over (layer, kv-head) of the share of evidence tokens kept.
        recall: `[layers][kv_heads]` share of evidence tokens each head kept.
        consensus_full: per layer, head consensus of the full cache (argmax over all tokens).
        consensus: per layer, head consensus after compression (argmax over the kept entries).
        agreement: per layer, share of heads on the most common argmax after compression.
        evidence_tokens: number of distinct evidence tokens (0: GER and recall are NaN).
        scope: what `H` is in the consensus numbers.
    """

    ger_layer: float
    ger_model: float
    recall_mean: float
    recall: tuple[tuple[float, ...], ...]
    consensus_full: tuple[float, ...]
    consensus: tuple[float, ...]
    agreement: tuple[float, ...]
    evidence_tokens: int
    scope: str = CONSENSUS_SCOPE

    def summary(self) -> dict[str, float | int | str | list[float]]:
        """Flat JSON-able numbers (NaN stays NaN) plus per-layer lists, named as the sweep rows' columns."""
        return {
            "ger_layer": self.ger_layer,
            "ger_model": self.ger_model,
            "recall_mean": self.recall_mean,
            "consensus_full_mean": _nanmean(self.consensus_full),
            "consensus_mean": _nanmean(self.consensus),
            "agreement_mean": _nanmean(self.agreement),
            "evidence_tokens": self.evidence_tokens,
            "recall_by_layer": [_nanmean(row) for row in self.recall],
            "consensus_full_by_layer": list(self.consensus_full),
            "consensus_by_layer": list(self.consensus),
            "agreement_by_layer": list(self.agreement),
            "consensus_scope": self.scope,
        }


def _nanmean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def diagnose(
    observations: Sequence[Observation], survival: torch.Tensor, evidence_positions: EvidencePositions
) -> RoutingDiagnostics:
    """All routing diagnostics of one sample from its full-cache observations and its survival mask.

    `observations` come from the full prefill (before eviction); consensus after compression masks
    that attention to the kept entries. Only the first `n_context = survival.shape[-1]` tokens enter
    the argmax (pass `n_context` = the prefill length to include a question's tokens).
    """
    survival = _check_survival(survival)
    layers, kv_heads, n_context = survival.shape
    if len(observations) != layers:
        raise ValueError(
            f"survival of shape {tuple(survival.shape)} has {layers} layers, got {len(observations)} observations"
        )
    evidence = evidence_index(evidence_positions, n_context)
    consensus_full, consensus, agreement = [], [], []
    for obs, row in zip(observations, survival, strict=True):
        if obs.num_kv_heads != kv_heads or obs.length < n_context:
            raise ValueError(
                f"survival of shape {tuple(survival.shape)} does not fit layer {obs.layer_idx} "
                f"({obs.num_kv_heads} kv-heads, {obs.length} tokens)"
            )
        attention = head_attention(obs)[:, :n_context]
        consensus_full.append(head_consensus(attention, None, obs.group)[0])
        after, agree = head_consensus(attention, row, obs.group)
        consensus.append(after)
        agreement.append(agree)
    recall = evidence_recall(survival, evidence)
    return RoutingDiagnostics(
        ger_layer=global_eviction_ratio(survival, evidence, "layer"),
        ger_model=global_eviction_ratio(survival, evidence, "model"),
        recall_mean=float(recall.mean()),
        recall=tuple(tuple(float(v) for v in row) for row in recall),
        consensus_full=tuple(consensus_full),
        consensus=tuple(consensus),
        agreement=tuple(agreement),
        evidence_tokens=int(evidence.numel()),
    )
