"""The fixed-contract diagnostic (arXiv 2605.08234): why a policy fails, and when value-aware ranking helps.

A *contract* is everything of a policy but its ranking scalar (allocator, protection, window,
projection; a policy spec without its scorer, e.g. ``"uniform"`` or ``"global:projection=chunk"``).
For every case (a sample in one mode) the contract is held fixed and one decision changes at a time:

- the ranking scalar (`SCALARS`; attention mass, ``importance``, is the reference);
- the named contracts of the seed's fixes (`fix_methods`): evidence recovery (question-aware
  window attention, ``snapkv``), value-aware ranking (``vatp``; after evidence recovery, ``caote``),
  span-preserving projection (``projection=chunk``), the recommended pipeline (all three in
  sequence) and the evidence-first oracle (force the annotated evidence in, fill by attention mass).

Every configuration of a case is an eviction of one observed prefill (`methods.FROM_PREFILL`); each
row holds the answer's accuracy, its margin (`margins`), the routing diagnostics and, for a failure
(the full cache's margin > 0, this one's <= 0), its attribution (`attribution`), checked with
forced-slot variants of the same eviction (`forced`). Rows go to a resumable results log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...selection.budget import check_rate
from ...selection.checkpoint import shipped_gates_for
from ...selection.observation import Needs
from ...selection.policy import Policy
from ...selection.scorers import CAOTEScorer, ImportanceScorer
from ...selection.spec import make_policy
from ..data.sample import EncodedSample, TaskSample, encode
from ..progress import ProgressCallback
from ..runners import Runner
from .answers import judge
from .attribution import attribute, missed_evidence, routed, span_states
from .forced import ForcedSlots
from .gate_records import gates_made_by
from .logged_cells import run_logged
from .methods import FULL, CacheMethod, Case, Compressed, FullCache, KvsievePolicy, build
from .results_log import ResultsLog
from .routing import evidence_recall, global_eviction_ratio
from .sweep import check_modes, prefill_needs, row_key, sample_case, sample_header, sample_key, split_prompt

#: The reference scalar: accumulated attention mass.
ATTENTION_MASS = "importance"

#: The ranking scalars a diagnostic swaps by default (`default_scalars` adds trimkv where gates ship).
SCALARS: tuple[str, ...] = ("importance", "h2o", "snapkv", "vatp", "caote", "critical", "expected", "knorm", "random")

#: Tasks with annotated evidence spans; the multi-key needles and multi-entity / hops facts name competing answers.
DIAGNOSTIC_TASKS = "niah_single_2,niah_multikey_1,niah_multivalue,vt,multi_entity,hops"

#: Which kept entries make room for forced evidence in the attribution checks: the least output change.
SWAP_OUT = CAOTEScorer()

#: The named contracts of the seed's fixes: (label, scalar, projection or None for the contract's own, forced).
FIXES: tuple[tuple[str, str, str | None, bool], ...] = (
    ("attention mass", "importance", None, False),
    ("evidence: window attention", "snapkv", None, False),
    ("value: vatp", "vatp", None, False),
    ("span: chunks", "importance", "chunk", False),
    ("evidence -> value: caote", "caote", None, False),
    ("recommended: evidence -> value -> span", "caote", "chunk", False),
    ("oracle: evidence first", "importance", None, True),
)


#: Row columns: the margin with wholly evicted evidence spans forced in, and with partly kept spans completed.
MISSCORED, COMPLETED = "misscored_margin", "completed_margin"


def default_scalars(model: torch.nn.Module) -> list[str]:
    """`SCALARS`, and the learned ``trimkv`` when kvsieve ships retention gates for `model`."""
    return [*SCALARS, "trimkv"] if shipped_gates_for(model) is not None else list(SCALARS)


@dataclass(frozen=True)
class Contract:
    """Everything of a policy but its ranking scalar, as a policy spec without the scorer."""

    spec: str = "uniform"

    def policy(self, scalar: str, **params: object) -> Policy:
        """The contract with `scalar` as its ranking (and `params`, e.g. a projection, overriding its own)."""
        return make_policy(f"{scalar}+{self.spec}", **params)


def fix_methods(contract: Contract) -> list[tuple[str, CacheMethod]]:
    """The named contracts of `FIXES` under `contract`, labelled."""
    out: list[tuple[str, CacheMethod]] = []
    for label, scalar, projection, forced in FIXES:
        policy = contract.policy(scalar, **({"projection": projection} if projection else {}))
        method = ForcedSlots(policy, "all", ImportanceScorer()) if forced else KvsievePolicy(policy)
        out.append((label, method))
    return out


@dataclass(frozen=True)
class Entry:
    """A method of the diagnostic and its roles: a swapped scalar, and/or the named contract `fix` (or "")."""

    method: CacheMethod
    scalar: bool
    fix: str = ""


def diagnostic_methods(scalars: Sequence[str], contract: Contract) -> dict[str, Entry]:
    """Every method of a diagnostic by name, with its roles (a method can be a scalar and a fix at once)."""
    entries = {m.name: Entry(m, True) for m in (KvsievePolicy(contract.policy(s)) for s in scalars)}
    for label, method in fix_methods(contract):
        known = entries.get(method.name)
        entries[method.name] = Entry(method, known is not None and known.scalar, label)
    return entries


def _outputs(
    model: torch.nn.Module, tokenizer: Any, encoded: EncodedSample, prompt: torch.Tensor, compressed: Compressed
) -> list[dict[str, Any]]:
    """Every row's greedy answer and whether it is correct (the cache grows by the answer)."""
    gold, max_new = encoded.gold_ids, encoded.sample.max_new_tokens
    responses = compressed.answer(model, prompt, gold, max_new, rank_index=encoded.gold_content_index)
    outputs = [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in responses]
    return [{"output": output, "correct": judge(output, encoded.sample).correct} for output in outputs]


def _evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    encoded: EncodedSample,
    mode: str,
    case: Case,
    todo: Sequence[Any],
    answer: bool,
) -> tuple[Compressed, list[dict[str, Any]]]:
    """Build and score configurations of one case together (and answer, with `answer`); their caches, a row each."""
    _, prompt = split_prompt(encoded, mode)
    compressed = build(model, case, todo)
    found = compressed.margins(model, prompt, encoded, tokenizer)
    outputs = _outputs(model, tokenizer, encoded, prompt, compressed) if answer else [{}] * len(todo)
    rows = []
    for (method, rate), margin, output, kept, kv_bytes in zip(
        todo, found, outputs, compressed.survival, compressed.kv_bytes, strict=True
    ):
        rows.append(
            {
                "policy": method.name,
                "rate": rate,
                "kv_bytes": int(kv_bytes),
                "kept_entries": int(kept.sum()),
                "output": None,
                "correct": None,
                **output,
                "gold_logprob": margin.gold_logprob,
                "rival": margin.rival,
                "margin": margin.margin,
                "margin_kind": margin.kind,
                "ger_layer": global_eviction_ratio(kept, encoded.evidence_positions, "layer"),
                "recall_mean": float(evidence_recall(kept, encoded.evidence_positions).mean()),
            }
        )
    return compressed, rows


def _attribute_failures(
    model: torch.nn.Module,
    tokenizer: Any,
    encoded: EncodedSample,
    mode: str,
    case: Case,
    evaluated: Sequence[tuple[CacheMethod, float, dict[str, Any], torch.Tensor]],
    full_margin: float,
) -> None:
    """Add to every row its full-cache margin and, for a failure, the checks and the failure mode (module doc)."""
    routes = routed(case.prefill(model).observations[0], case.n_context)
    checks: list[tuple[CacheMethod, float]] = []
    owners: list[tuple[dict[str, Any], str]] = []
    for method, rate, row, survival in evaluated:
        evicted, partial = span_states(survival, case.evidence_spans)
        missed = missed_evidence(survival, routes, encoded.evidence_positions)
        row |= {"full_margin": full_margin, "missed": missed, "evicted_spans": evicted, "partial_spans": partial}
        row |= {MISSCORED: None, COMPLETED: None, "failure": ""}
        if full_margin <= 0 or row["margin"] > 0 or missed or not isinstance(method, KvsievePolicy):
            continue
        for forcing, wanted, column in (("evicted", evicted, MISSCORED), ("partial", partial, COMPLETED)):
            if wanted:
                checks.append((ForcedSlots(method.policy, forcing, SWAP_OUT), rate))
                owners.append((row, column))
    if checks:
        _, prompt = split_prompt(encoded, mode)
        found = build(model, case, checks).margins(model, prompt, encoded, tokenizer)
        for (row, column), margin in zip(owners, found, strict=True):
            row[column] = margin.margin
    for _, _, row, _ in evaluated:
        if full_margin > 0 and row["margin"] <= 0:
            row["failure"] = attribute(row["missed"], row[MISSCORED], row[COMPLETED])


def _case_rows(
    model: torch.nn.Module,
    tokenizer: Any,
    encoded: EncodedSample,
    mode: str,
    case: Case,
    todo: Sequence[tuple[CacheMethod, float]],
    full_margin: float | None,
    answer: bool,
) -> list[dict[str, Any]]:
    """The rows of configurations of one case (at one rate, or the full cache alone), attributed."""
    compressed, rows = _evaluate(model, tokenizer, encoded, mode, case, todo, answer)
    margin = rows[0]["margin"] if full_margin is None else full_margin
    evaluated = [(m, r, row, s) for (m, r), row, s in zip(todo, rows, compressed.survival, strict=True)]
    _attribute_failures(model, tokenizer, encoded, mode, case, evaluated, margin)
    return rows


@dataclass(frozen=True)
class DiagnosticCell:
    """A case (a sample in one mode), the configurations (name, rate) it still needs, and its full-cache margin
    when the log already holds it (None: the full cache runs first)."""

    sample: TaskSample
    mode: str
    todo: frozenset[tuple[str, float]]
    full_margin: float | None

    @property
    def size(self) -> int:
        return len(self.todo)


@dataclass(frozen=True)
class DiagnosticWork:
    """One case of the diagnostic: the full cache first, then rate by rate (answered fixes, then margin-only
    scalars)."""

    methods: dict[str, Entry]
    rates: tuple[float, ...]
    needs: Needs
    chat: bool | None

    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: DiagnosticCell) -> list[dict[str, Any]]:
        encoded = encode(cell.sample, tokenizer, self.chat).to(model.device)
        case = sample_case(encoded, cell.mode, self.needs, tokenizer)
        header, full, out = sample_header(encoded, cell.mode), FullCache(), []
        full_margin = cell.full_margin
        if full_margin is None:
            rows = _case_rows(model, tokenizer, encoded, cell.mode, case, [(full, 0.0)], None, True)
            out += [{**header, "scalar": False, "fix": "", **row} for row in rows]
            full_margin = rows[0]["margin"]
        for rate in self.rates:
            todo = [e for name, e in self.methods.items() if (name, rate) in cell.todo]
            for answer in (True, False):  # fixes are answered (accuracy); the other scalars need margins only
                group = [(e.method, rate) for e in todo if bool(e.fix) == answer]
                if group:
                    for row in _case_rows(model, tokenizer, encoded, cell.mode, case, group, full_margin, answer):
                        entry = self.methods[row["policy"]]
                        out.append({**header, "scalar": entry.scalar, "fix": entry.fix, **row})
        return out


def _full_margin(log: ResultsLog, key: str, mode: str) -> float | None:
    """The full cache's margin on a case, if the log holds it."""
    return next((r["margin"] for r in log.rows if row_key(r) == (key, mode, FULL, 0.0)), None)


def run_diagnostic(
    runner: Runner,
    samples: Sequence[TaskSample],
    scalars: Sequence[str] = SCALARS,
    rates: Sequence[float] = (0.5, 0.75, 0.9),
    modes: Sequence[str] = ("agnostic",),
    *,
    contract: Contract = Contract(),
    results: str | Path | None = None,
    chat: bool | None = None,
    progress: ProgressCallback | None = None,
) -> pd.DataFrame:
    """Run the diagnostic (module doc) on every sample, mode and rate; one row per configuration.

    Args:
        runner: where the cases run (`runners.LocalRunner(model, tokenizer)`, or a `RayRunner`).
        scalars: ranking scalars swapped into the contract (``importance`` is always included).
        rates: eviction rates in [0, 1). modes: ``"agnostic"`` and/or ``"aware"``.
        contract: what stays fixed. results: a JSONL file (a rerun resumes; a Parquet table beside it when
        done). chat: as `run_sweep`'s.
        progress: called after every case with (configurations done, total).
    """
    rates, modes = [check_rate(r) for r in rates], check_modes(modes)
    methods = diagnostic_methods(list(dict.fromkeys([ATTENTION_MASS, *scalars])), contract)
    needs = prefill_needs([e.method for e in methods.values()], diagnostics=True) | SWAP_OUT.needs
    log = ResultsLog(results, row_key, gates_made_by(runner, {n: e.method for n, e in methods.items()}))
    grid = [(FULL, 0.0)] + [(name, rate) for rate in rates for name in methods]
    cells = []
    for sample in samples:
        key = sample_key(sample)
        for mode in modes:
            todo = frozenset((n, r) for n, r in grid if (key, mode, n, r) not in log)
            if todo:
                cells.append(DiagnosticCell(sample, mode, todo, _full_margin(log, key, mode)))
    work = DiagnosticWork(methods, tuple(rates), needs, chat)
    run_logged(runner, work, cells, log, len(samples) * len(modes) * len(grid), progress)
    return pd.DataFrame(log.rows)
