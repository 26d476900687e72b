"""A gate ensemble: gates trained from different seeds, their scoring logits averaged in one checkpoint (deep
ensembles, arXiv 1612.01474).

Gates trained alike from different seeds disagree most on what their training never showed (gate_ablation.py's
unseen needle formats move by seven answers of 60 between seeds). An ensemble scores an entry by the weighted mean
of its members' logits, `log beta = log sigmoid(sum_k w_k z_k)`, and that is one set of gates: each member's hidden
units sit side by side in a wider hidden layer, and the shared scoring projection holds each member's weights times
its share and the weighted mean of their biases. It loads, scores and allocates like any checkpoint, one pass;
what it keeps is measured in benchmarks/gate_ablation.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ...modeling.gates import GateShape, Horizons, RetentionGates
from ...selection.checkpoint import GateCheckpointError, save_gates
from ...selection.merge import Merge
from .combine import combined_record, read_members


def ensemble_gates(
    sources: Sequence[str | Path],
    weights: Sequence[float] | None,
    out: str | Path,
    horizons: Horizons | None = None,
    merge: Merge | None = None,
) -> Path:
    """Write to `out` the gates whose logit is the `weights`-weighted mean (None: equal weights) of those of the
    checkpoints in `sources` (one model, the same layers and heads), to be read at `horizons` (None: the members',
    which must then agree), recording `merge` for policies that name none (`RetentionGates.merge`)."""
    sources = [Path(source) for source in sources]
    members, weights = read_members(sources, weights, same_width=False)
    first = members[0][0]
    for source, (gates, _) in zip(sources[1:], members[1:], strict=True):
        if horizons is None and gates.horizons != first.horizons:
            raise GateCheckpointError(
                f"{source} is read at {gates.horizons}, {sources[0]} at {first.horizons}: name the horizons the "
                "ensemble is read at (--horizon, --bounded-horizon)"
            )
    shape = GateShape(
        first.shape.layers, first.shape.kv_heads, first.shape.head_dim, sum(g.shape.width for g, _ in members)
    )
    ensemble = RetentionGates(shape, horizons=horizons or first.horizons, merge=merge)
    with torch.no_grad():
        for layer in map(str, shape.layers):
            ensemble.hidden_weight[layer].copy_(torch.cat([g.hidden_weight[layer] for g, _ in members], dim=-1))
            ensemble.hidden_bias[layer].copy_(torch.cat([g.hidden_bias[layer] for g, _ in members], dim=-1))
        ensemble.scoring.weight.copy_(
            torch.cat([w * g.scoring.weight for w, (g, _) in zip(weights, members, strict=True)], dim=-1)
        )
        ensemble.scoring.bias.copy_(sum(w * g.scoring.bias for w, (g, _) in zip(weights, members, strict=True)))
    return save_gates(ensemble, combined_record(members, sources, weights, "ensemble"), out)
