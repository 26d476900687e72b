"""Gates taught by KVzip (as Fast KVzip does, arXiv 2601.17668): KVzip's keep decision as the training target.

For each training sequence, KVzip under one global budget (``kvzip+global``: the model repeats the
sequence, each entry keeps the most attention a repetition query gave it, one top-k over every layer
and head) decides which entries a cache of `capacity` entries per (layer, kv-head) keeps. The gates
are trained so that each entry's survival at the next step, `beta_i^(n - i)`, predicts that decision
(binary cross-entropy over the entries a policy may evict: the sinks and the recent tail are kept
anyway), the score the ``trimkv`` scorer ranks by. The model runs forward only; the gates read each
entry's key (RoPE undone) and value, as they do when they score a cache.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...modeling.gates import RetentionGates, retention_scores
from ...runtime.observing.prefill import observe_prefill
from ...selection.budget import MaxTokens
from ...selection.observation import Needs, Observation
from ...selection.policy import Policy
from ...selection.protection import protected_mask
from ...selection.scorers.trimkv import entry_log_beta
from ...selection.spec import make_policy

#: The teacher: KVzip's scores under one global budget (the paper's setting).
KVZIP_TEACHER = "kvzip+global"


def check_capacity(capacity: int) -> None:
    """KVzip's decision at `capacity` must leave something to decide beyond the entries it always keeps."""
    teacher = make_policy(KVZIP_TEACHER)
    protected = teacher.n_sink + teacher.n_recent
    if capacity <= protected:
        raise ValueError(
            f"capacity {capacity} leaves KVzip nothing to decide: {KVZIP_TEACHER} always keeps {protected} entries "
            f"of a head (the sinks and the recent tail); train the kvzip target with a capacity above {protected}"
        )


def kvzip_keep(observations: list[Observation], teacher: Policy, capacity: int) -> list[torch.Tensor]:
    """Per observed layer, bool `[kv_heads, n]`: the entries `teacher` keeps at `capacity` entries per head."""
    kept = teacher.select(observations, MaxTokens(capacity))
    masks = []
    for obs, heads in zip(observations, kept, strict=True):
        mask = torch.zeros(obs.num_kv_heads, obs.length, dtype=torch.bool, device=obs.keys.device)
        for head, index in enumerate(heads):
            mask[head, index] = True
        masks.append(mask)
    return masks


def log_survival(gates: RetentionGates, obs: Observation) -> torch.Tensor:
    """`[kv_heads, n]` `(n - i) * log beta_i`: the log-probability that entry `i` survives to the next step (the
    ``trimkv`` score of a prefill, with gradients to the gates)."""
    return retention_scores(entry_log_beta(gates, obs), obs.positions, obs.length)


#: Which evictable entries KVzip's keep decision teaches: every one; the kept ones alone (raised, none pushed
#: down); or the half whose retention moves the full cache's output least (`indifferent_entries`).
KEEP_ENTRIES = ("all", "kept", "indifferent")


def keep_loss(log_p: torch.Tensor, keep: torch.Tensor, kept_only: bool = False) -> torch.Tensor:
    """Binary cross-entropy of survival probabilities `exp(log_p)` against the keep decision, from the log.

    `kept_only`: the mean `-log p` of the kept entries alone (nothing is pushed down)."""
    if kept_only:
        return -log_p[keep].mean()
    log_p = log_p.clamp(max=-1e-6)  # a probability of exactly 1 would make log(1 - p) infinite
    log_not = torch.log(-torch.expm1(log_p))
    return -torch.where(keep, log_p, log_not).mean()


def indifferent_entries(sensitivity: list[torch.Tensor], scored: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, bool `[kv_heads, n]`: the `scored` entries whose `sensitivity` (how much the output term moves
    with their `log beta`) is at most the median over every layer's scored entries."""
    cut = _masked(sensitivity, scored).median()
    return [mask & (size <= cut) for size, mask in zip(sensitivity, scored, strict=True)]


def _masked(per_layer: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """Every layer's entries under its mask, in one flat tensor."""
    return torch.cat([x[mask] for x, mask in zip(per_layer, masks, strict=True)])


def kvzip_step(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    gates: RetentionGates,
    ids: torch.Tensor,
    capacity: int,
    entries: str = "all",
    sensitivity: dict[int, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One sequence: KVzip's keep decision at `capacity`, the gates' loss against it on `entries` (`KEEP_ENTRIES`;
    ``"indifferent"`` reads `sensitivity`, per layer `[kv_heads, n]`) with its graph, and the share of KVzip's
    kept entries the gates rank first (`recall`)."""
    if entries == "indifferent" and sensitivity is None:
        raise ValueError("the keep loss on the indifferent entries needs the output's sensitivity per layer")
    teacher = make_policy(KVZIP_TEACHER)
    with torch.no_grad():
        prefill = observe_prefill(model, ids, Needs(rotary=True) | teacher.needs, tokenizer=tokenizer)
    observations = prefill.observations[0]
    keep = kvzip_keep(observations, teacher, capacity)
    # the sinks and the recent tail are kept whatever the scores say: they teach nothing
    scored = [~protected_mask(obs, teacher.n_sink, teacher.n_recent) for obs in observations]
    log_p = [log_survival(gates, obs) for obs in observations]
    with torch.no_grad():  # of the entries KVzip keeps, the share the gates rank among as many of their best
        ranked, target = _masked(log_p, scored), _masked(keep, scored)
        recall = target[ranked.topk(int(target.sum())).indices].float().mean()
    if entries == "indifferent":
        scored = indifferent_entries([sensitivity[obs.layer_idx] for obs in observations], scored)
    log_p, target = _masked(log_p, scored), _masked(keep, scored)
    return {"loss": keep_loss(log_p, target, kept_only=entries == "kept"), "recall": recall}
