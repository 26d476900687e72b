"""The fixed-contract diagnostic: forced slots, attribution, its rows against direct calls, its tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pandas as pd
import pytest
import torch

import kvsieve
from kvsieve.harness.data.sample import encode
from kvsieve.harness.eval.attribution import attribute, missed_evidence, routed, span_states
from kvsieve.harness.eval.contract_diagnostic import ATTENTION_MASS, Contract, diagnostic_methods, run_diagnostic
from kvsieve.harness.eval.diagnostic_tables import failure_mix, fixes, raises_margin
from kvsieve.harness.eval.forced import ForcedEviction, ForcedSlots, forced_tokens, swap_in
from kvsieve.harness.eval.margins import margins
from kvsieve.harness.eval.methods import Case, reseeded
from kvsieve.harness.eval.routing import survival_from_cache
from kvsieve.harness.eval.sweep import sample_key
from kvsieve.harness.runners import LocalRunner
from kvsieve.runtime.api.evictions import Eviction, evictions
from kvsieve.runtime.observing.prefill import observe_prefill
from kvsieve.selection.observation import Needs
from kvsieve.selection.scorers import CAOTEScorer, ImportanceScorer
from kvsieve.selection.spec import make_policy
from test_sweep import make_sample

# ---------------------------------------------------------------- forced slots


def test_forced_tokens_rules():
    spans = ((2, 5), (8, 10), (12, 14))
    kept = torch.tensor([0, 3, 8, 9, 20])  # span 1 in part, span 2 whole, span 3 evicted
    assert forced_tokens(kept, spans, "all").tolist() == [2, 4, 12, 13]
    assert forced_tokens(kept, spans, "partial").tolist() == [2, 4]
    assert forced_tokens(kept, spans, "evicted").tolist() == [12, 13]


def test_swap_in_drops_the_lowest_droppable_and_keeps_the_count():
    keep = torch.tensor([0, 1, 2, 3, 4])
    positions = torch.arange(10)
    droppable = torch.tensor([False, True, True, True, True] + [True] * 5)
    swap_out = torch.tensor([0.0, 5.0, 0.1, 3.0, 0.2, 0, 0, 0, 0, 0])  # entry 0 is lowest but protected
    out = swap_in(keep, positions, torch.tensor([7, 8]), droppable, swap_out)
    assert out.tolist() == [0, 1, 3, 7, 8]  # the two lowest droppable (2 and 4) made room
    # more to force than may leave: only as many come in as leave
    few = swap_in(keep, positions, torch.tensor([5, 6, 7, 8, 9]), droppable & (positions != 1), swap_out)
    assert len(few) == len(keep) and set(few.tolist()) >= {0, 1}


@dataclass(frozen=True)
class FixedKeep:
    """A hand-built eviction: exactly the given token positions evicted from given kv-heads of every layer."""

    evict: dict[int, list[int]]  # kv-head -> positions

    def kept_entries(self, observations, reserved=0, entry_bytes=None):
        out = []
        for obs in observations:
            layer = []
            for h in range(obs.num_kv_heads):
                gone = torch.tensor(self.evict.get(h, []), dtype=torch.long)
                layer.append((~torch.isin(obs.positions[h], gone)).nonzero().flatten())
            out.append(layer)
        return out

    def merged_entries(self, observations, kept):
        return None


@torch.no_grad()
def test_forced_eviction_keeps_each_heads_count_and_forces_the_spans(lm, tok):
    encoded = encode(make_sample(0), tok)
    spans = encoded.evidence_spans
    (start, end) = spans[0]
    policy = make_policy("snapkv")
    prefill = observe_prefill(lm, encoded.context_ids, policy.needs | CAOTEScorer().needs | ImportanceScorer.needs)
    base = Eviction(policy, 0.7)
    for forcing in ("all", "partial", "evicted"):
        plan = ForcedEviction(base, spans, forcing, CAOTEScorer())
        forced = plan.kept_entries(prefill.observations[0])
        before = base.kept_entries(prefill.observations[0])
        assert [[len(h) for h in layer] for layer in forced] == [[len(h) for h in layer] for layer in before]
    everything = ForcedEviction(base, spans, "all", CAOTEScorer()).kept_entries(prefill.observations[0])
    for layer in everything:
        for head in layer:
            assert torch.isin(torch.arange(start, end), head).all()
    # the oracle runs through the sweep's machinery: a cache whose survival holds the evidence everywhere
    cache = evictions(prefill, [ForcedEviction(base, spans, "all", ImportanceScorer())])
    assert survival_from_cache(cache, encoded.context_length)[..., start:end].all()


@torch.no_grad()
def test_partial_completes_half_a_span_and_evicted_leaves_it(lm, tok):
    """A cache where one head of every layer lost exactly half an evidence span: `partial` makes it whole."""
    encoded = encode(make_sample(0), tok)
    (start, end) = encoded.evidence_spans[0]
    half = list(range(start, (start + end) // 2))
    prefill = observe_prefill(lm, encoded.context_ids, CAOTEScorer().needs | ImportanceScorer.needs)
    broken = FixedKeep({0: [*half, 5, 6, 7]})  # head 0 also lost 3 filler tokens, so it has room to swap
    survival = survival_from_cache(evictions(prefill, [broken]), encoded.context_length)
    assert span_states(survival, encoded.evidence_spans) == (False, True)
    # not missed: the other kv-head of every layer still holds the half
    assert not missed_evidence(survival, torch.ones_like(survival[:, 0]), encoded.evidence_positions)
    policy = make_policy("importance")
    for forcing, whole in (("partial", True), ("evicted", False)):
        plan = ForcedEviction(Eviction(policy), encoded.evidence_spans, forcing, CAOTEScorer())
        plan = replace(plan, base=_Wrapped(broken, policy))
        kept = survival_from_cache(evictions(prefill, [plan]), encoded.context_length)
        assert bool(kept[:, 0, start:end].all()) == whole
        assert kept.sum() == survival.sum()  # same budget


@dataclass(frozen=True)
class _Wrapped:
    """A hand-built plan with a policy's protection, as `ForcedEviction.base` needs."""

    plan: FixedKeep
    policy: object
    protect_positions: torch.Tensor | None = None

    def kept_entries(self, observations, reserved=0, entry_bytes=None):
        return self.plan.kept_entries(observations, reserved)

    def merged_entries(self, observations, kept):
        return None


# ---------------------------------------------------------------- attribution


def test_missed_needs_every_head_of_a_routing_layer():
    survival = torch.ones(3, 2, 20, dtype=torch.bool)
    evidence = torch.tensor([10, 11])
    survival[1, :, 10] = False  # evicted by both heads of layer 1
    routes = torch.zeros(3, 20, dtype=torch.bool)
    assert not missed_evidence(survival, routes, evidence)  # layer 1 does not route it
    routes[1, 10] = True
    assert missed_evidence(survival, routes, evidence)
    survival[1, 0, 10] = True  # one head keeps it: not missed
    assert not missed_evidence(survival, routes, evidence)


def test_span_states_on_hand_built_survival():
    survival = torch.ones(2, 2, 20, dtype=torch.bool)
    spans = ((4, 8), (12, 14))
    assert span_states(survival, spans) == (False, False)
    survival[0, 1, 4:6] = False  # half a span in one head
    assert span_states(survival, spans) == (False, True)
    survival[1, 0, 12:14] = False  # a whole span in one head
    assert span_states(survival, spans) == (True, True)


def test_attribution_order():
    assert attribute(True, 3.0, 3.0) == "missed"
    assert attribute(False, 0.5, 3.0) == "mis-scored"
    assert attribute(False, -0.5, 0.2) == "broken"
    assert attribute(False, None, 0.2) == "broken"
    assert attribute(False, -1.0, None) == "unexplained"
    assert attribute(False, None, None) == "unexplained"


@torch.no_grad()
def test_routed_equals_eager_attention_of_the_last_query(lm, tok):
    ids = encode(make_sample(0), tok).context_ids
    prefill = observe_prefill(lm, ids, Needs(window=1))
    lm.config._attn_implementation = "eager"
    try:
        attentions = lm(ids, output_attentions=True).attentions
    finally:
        lm.config._attn_implementation = "sdpa"
    n = ids.shape[1]
    expected = torch.stack([a[0, :, -1, :].amax(dim=0) >= 1.0 / n for a in attentions])
    assert torch.equal(routed(prefill.observations[0], n), expected)


# ---------------------------------------------------------------- the diagnostic's rows


@torch.no_grad()
def test_diagnostic_rows_equal_direct_compress_and_margins(lm, tok, tmp_path):
    sample = replace(make_sample(1, "7654321"), candidates=(" 1234567", " 5555555"))
    path = tmp_path / "d.jsonl"
    rows = run_diagnostic(
        LocalRunner(lm, tok), [sample], ["snapkv", "random"], [0.6], ("agnostic", "aware"), results=path
    )
    methods = diagnostic_methods([ATTENTION_MASS, "snapkv", "random"], Contract())
    assert len(rows) == 2 * (1 + len(methods))
    encoded = encode(sample, tok)
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], -1)
    by = rows.set_index(["mode", "policy"])
    for policy in ("snapkv", "random", "importance"):
        row = by.loc["agnostic", policy]
        cache = kvsieve.compress(lm, encoded.context_ids, reseeded(make_policy(policy), sample.index), rate=0.6)
        with kvsieve.sieve_attention(lm):
            [margin] = margins(lm, cache, prompt, encoded, tokenizer=tok)
        assert row["margin"] == pytest.approx(margin.margin, abs=1e-4)
        assert row["kept_entries"] == sum(map(sum, cache.stored_lengths()))
        assert row["full_margin"] == by.loc["agnostic", "full"]["margin"]
    # every failure carries the check that explains it, and only failures are attributed
    for row in rows.itertuples():
        failing = row.full_margin > 0 and row.margin <= 0
        assert bool(row.failure) == failing
        if row.failure == "missed":
            assert row.missed
        elif row.failure == "mis-scored":
            assert not row.missed and row.misscored_margin > 0
        elif row.failure == "broken":
            assert not row.missed and row.completed_margin > 0
    # resuming: nothing left to do, nothing appended
    again = run_diagnostic(
        LocalRunner(lm, tok), [sample], ["snapkv", "random"], [0.6], ("agnostic", "aware"), results=path
    )
    assert len(again) == len(rows) and len(path.read_text().splitlines()) == len(rows)
    assert set(rows["sample"]) == {sample_key(sample)}


@torch.no_grad()
def test_misscored_check_is_the_forced_variant_margin(lm, tok):
    """The recorded mis-scoring check equals building the forced variant directly and scoring it."""
    sample = make_sample(0)
    rows = run_diagnostic(LocalRunner(lm, tok), [sample], ["knorm", "random"], [0.9], ("agnostic",))
    checked = rows[rows["misscored_margin"].notna()]
    encoded = encode(sample, tok)
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], -1)
    needs = CAOTEScorer().needs | make_policy("knorm").needs | make_policy("random").needs
    case = Case(encoded.context_ids, encoded.context_length, 0, needs, encoded.evidence_spans)
    prefill = case.prefill(lm)
    for row in checked.itertuples():
        method = ForcedSlots(make_policy(row.policy), "evicted", CAOTEScorer())
        cache = evictions(prefill, [method.eviction(case, row.rate)])
        with kvsieve.sieve_attention(lm):
            [margin] = margins(lm, cache, prompt, encoded, tokenizer=tok)
        assert row.misscored_margin == pytest.approx(margin.margin, abs=1e-4)


def test_tables_on_hand_built_rows():
    def row(sample, policy, margin, full, scalar=True, fix="", failure=""):
        head = {"sample": sample, "mode": "agnostic", "rate": 0.9, "policy": policy, "margin": margin}
        return head | {"full_margin": full, "scalar": scalar, "fix": fix, "failure": failure, "correct": margin > 0}

    rows = pd.DataFrame(
        [
            row("a", "importance", -1.0, 2.0, fix="attention mass", failure="missed"),
            row("a", "vatp", 1.0, 2.0, fix="value: vatp"),
            row("b", "importance", 0.5, 2.0, fix="attention mass"),
            row("b", "vatp", 0.2, 2.0, fix="value: vatp"),
            row("c", "importance", -3.0, -1.0, fix="attention mass"),
            row("c", "vatp", -2.0, -1.0, fix="value: vatp"),
            row("a", "importance@force=all/importance", 0.5, 2.0, scalar=False, fix="oracle: evidence first"),
        ]
    )
    [raised] = raises_margin(rows).to_dict("records")
    assert raised["policy"] == "vatp" and raised["positive"] == 0.5 and raised["n_positive"] == 2
    assert raised["non_positive"] == 1.0 and raised["n_non_positive"] == 1
    mix = failure_mix(rows).set_index("policy")
    assert mix.loc["importance", "failures"] == 1 and mix.loc["importance", "missed"] == 1
    assert mix.loc["importance", "oracle_repairs"] == 1 and mix.loc["vatp", "oracle_repairs"] == 0
    table = fixes(rows).set_index("contract")
    assert table.loc["value: vatp", "accuracy"] == pytest.approx(2 / 3)
    assert math.isclose(table.loc["attention mass", "margin"], (-1.0 + 0.5 - 3.0) / 3)


@torch.no_grad()
def test_evicting_exactly_the_evidence_is_missed_evidence(lm, tok):
    """A hand-built cache without the evidence (every head of every layer): attributed to missed evidence."""
    encoded = encode(make_sample(0), tok)
    evidence = encoded.evidence_positions
    prefill = observe_prefill(lm, encoded.context_ids, Needs(window=1))
    plan = FixedKeep({h: evidence.tolist() for h in range(lm.config.num_key_value_heads)})
    survival = survival_from_cache(evictions(prefill, [plan]), encoded.context_length)
    routes = routed(prefill.observations[0], encoded.context_length)
    assert routes[:, evidence].any()  # the full cache routes the evidence through some layer
    assert missed_evidence(survival, routes, evidence)
    assert span_states(survival, encoded.evidence_spans) == (True, False)
    assert attribute(missed_evidence(survival, routes, evidence), 1.0, 1.0) == "missed"
    # the same cache with the evidence back is not missed
    full = survival_from_cache(evictions(prefill, [FixedKeep({})]), encoded.context_length)
    assert not missed_evidence(full, routes, evidence)
