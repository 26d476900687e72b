"""Task sweeps: contenders x rates x samples x modes, one prefill per (sample, mode), resumable.

For every sample and mode the context is prefilled once with sieve attention (observed); every
kvsieve (policy, rate) then evicts from that prefill, as in the perplexity protocol ("prefill
once, sieve many"). kvpress presses compress during their own prefill, so they re-prefill for
every configuration, as kvpress does. The kvsieve configurations of a sample are answered
together: one batch whose rows are the different evictions of the one prefill, one greedy
`generate` and one teacher-forced pass for all of them. Each row also carries the routing
diagnostics of its survival mask.

A cell is a sample in one mode (`SweepCell`): the runner does it where a model replica lives
(`harness.runners`), and its rows are appended to a JSONL file when it is done; a sweep restarted
on the same file skips the rows it already holds, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...selection.budget import check_rate
from ...selection.observation import Needs
from ..data.sample import EncodedSample, TaskSample, encode
from ..progress import ProgressCallback
from ..runners import Runner
from .answers import judge
from .contenders import parse_contenders
from .gate_records import gates_made_by
from .logged_cells import run_logged
from .methods import CacheMethod, Case, Configuration, build, passes
from .respond import Response
from .results_log import ResultsLog
from .routing import diagnose

#: Question-agnostic: compress the context before the question is seen. Question-aware: after.
MODES = ("agnostic", "aware")

#: kvsieve configurations of a sample answered together as one batch (one prefill, many evictions).
SWEEP_ROWS_PER_PASS = 16


def check_modes(modes: Sequence[str]) -> list[str]:
    """The modes, each one of `MODES`, or a clear error."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
    if not modes:
        raise ValueError(f"no mode given; modes are {', '.join(MODES)}")
    return list(modes)


def sample_key(sample: TaskSample) -> str:
    """A short stable id of a sample's text (resuming matches rows by it)."""
    digest = hashlib.sha1(f"{sample.task}\0{sample.context}\0{sample.question}".encode()).hexdigest()
    return f"{sample.task}#{sample.index}:{digest[:10]}"


def row_key(row: dict[str, Any]) -> tuple[str, str, str, float]:
    return row["sample"], row["mode"], row["policy"], float(row["rate"])


def split_prompt(encoded: EncodedSample, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(prefilled, prompt)`: what is prefilled and compressed, and the whole prompt.

    Agnostic: the context alone is prefilled. Aware: the context and all but the last question
    token (one token is left for `generate` to feed).
    """
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], dim=-1)
    if mode == "agnostic":
        return encoded.context_ids, prompt
    return prompt[:, :-1], prompt


def sample_header(encoded: EncodedSample, mode: str) -> dict[str, Any]:
    """The columns every row of a sample in one mode starts with."""
    sample = encoded.sample
    return {
        "sample": sample_key(sample),
        "suite": sample.suite,
        "task": sample.task,
        "index": sample.index,
        "mode": mode,
        "context_tokens": encoded.context_length,
        "evidence_tokens": int(encoded.evidence_positions.numel()),
        "evidence_spans": len(encoded.evidence_spans),
        "candidates": len(encoded.candidate_ids),
    }


def _configurations(methods: Sequence[CacheMethod], rates: Sequence[float]) -> list[Configuration]:
    return [(m, rate) for m in methods for rate in ([0.0] if m.is_full else rates)]


def sample_case(encoded: EncodedSample, mode: str, needs: Needs, tokenizer: Any) -> Case:
    """The case a sample is in one mode: what is prefilled and compressed (see `split_prompt`), its
    evidence spans and its tokenizer (which gives its sentences)."""
    prefilled, _ = split_prompt(encoded, mode)
    sample = encoded.sample
    return Case(prefilled, encoded.context_length, sample.index, needs, encoded.evidence_spans, tokenizer)


def prefill_needs(methods: Sequence[CacheMethod], diagnostics: bool) -> Needs:
    """What the shared prefill must record so every method (and the diagnostics) can read it."""
    needs = Needs(window=1) if diagnostics else Needs()
    return functools.reduce(operator.or_, (m.needs for m in methods), needs)


@dataclass(frozen=True)
class SurvivalCell:
    """One sample under one configuration, for its eviction map."""

    sample: TaskSample
    method: CacheMethod
    rate: float
    mode: str = "agnostic"
    chat: bool | None = None


@torch.no_grad()
def sample_survival(model: torch.nn.Module, tokenizer: Any, cell: SurvivalCell) -> tuple[torch.Tensor, torch.Tensor]:
    """`(survival [layers, kv_heads, n_context], evidence positions)` of the cell, on the CPU (a `Work`)."""
    encoded = encode(cell.sample, tokenizer, cell.chat).to(model.device)
    case = sample_case(encoded, cell.mode, prefill_needs([cell.method], diagnostics=False), tokenizer)
    survival = build(model, case, [(cell.method, cell.rate)]).survival[0]
    return survival.cpu(), encoded.evidence_positions.cpu()


def answer_row(encoded: EncodedSample, response: Response, tokenizer: Any) -> dict[str, Any]:
    """The columns of a row that say how the model answered: its output, the verdict, the gold answer's statistics."""
    output = tokenizer.decode(response.tokens, skip_special_tokens=True).strip()
    verdict = judge(output, encoded.sample)
    return {
        "output": output,
        "score": verdict.score,
        "correct": verdict.correct,
        "abstained": verdict.abstained,
        "hallucinated": verdict.hallucinated,
        "gold_logprob": response.gold_logprob,
        "gold_rank": response.gold_rank,
    }


def _run_configurations(
    model: torch.nn.Module,
    tokenizer: Any,
    encoded: EncodedSample,
    mode: str,
    case: Case,
    todo: Sequence[Configuration],
    diagnostics: bool,
) -> list[dict[str, Any]]:
    """Build, answer and diagnose several configurations of one sample together; one row each."""
    _, prompt = split_prompt(encoded, mode)
    start = time.perf_counter()
    compressed = build(model, case, todo)
    gold, max_new = encoded.gold_ids, encoded.sample.max_new_tokens
    responses = compressed.answer(model, prompt, gold, max_new, rank_index=encoded.gold_content_index)
    seconds = (time.perf_counter() - start) / len(todo)
    full_bytes = case.prefill(model).cache.nbytes()
    rows = []
    for (method, rate), response, kv_bytes, survival in zip(
        todo, responses, compressed.kv_bytes, compressed.survival, strict=True
    ):
        row: dict[str, Any] = {
            "library": method.library,
            "policy": method.name,
            "rate": rate,
            "kv_bytes": int(kv_bytes),
            "kv_bytes_full": int(full_bytes),
            "kept_entries": int(survival.sum()),
            "seconds": seconds,
            **answer_row(encoded, response, tokenizer),
        }
        if diagnostics:
            observations = case.prefill(model).observations[0]
            row |= diagnose(observations, survival, encoded.evidence_positions).summary()
        rows.append(row)
    return rows


@dataclass(frozen=True)
class SweepCell:
    """A sample in one mode and the configurations (method name, rate) it still needs: one prefill, many evictions."""

    sample: TaskSample
    mode: str
    todo: tuple[tuple[str, float], ...]

    @property
    def size(self) -> int:
        return len(self.todo)


@dataclass(frozen=True)
class SweepWork:
    """One cell of a sweep: prefill the case once, build, answer and diagnose its configurations; a row each."""

    methods: dict[str, CacheMethod]
    needs: Needs
    chat: bool | None
    diagnostics: bool
    reprefill: bool
    rows_per_pass: int

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: SweepCell) -> list[dict[str, Any]]:
        encoded = encode(cell.sample, tokenizer, self.chat).to(model.device)
        case = sample_case(encoded, cell.mode, self.needs, tokenizer)
        todo = [(self.methods[name], rate) for name, rate in cell.todo]
        shared = 1 if self.reprefill else sum(c.builder.shares_prefill for c, _ in todo)  # configurations sharing it
        header = sample_header(encoded, cell.mode)
        rows = []
        for batch in passes(todo, 1 if self.reprefill else self.rows_per_pass):
            case = case.fresh() if self.reprefill else case
            made = _run_configurations(model, tokenizer, encoded, cell.mode, case, batch, self.diagnostics)
            for (method, _), row in zip(batch, made, strict=True):
                # wall time of a configuration: its share of the prefill it evicts from (kvpress prefills itself)
                share = case.prefill_seconds / shared if method.builder.shares_prefill else 0.0
                timing = {"prefill_seconds": case.prefill_seconds}
                rows.append(header | timing | row | {"wall_seconds": row["seconds"] + share})
        return rows


def run_sweep(
    runner: Runner,
    samples: Sequence[TaskSample],
    policies: str | Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str] = ("agnostic",),
    *,
    results: str | Path | None = None,
    chat: bool | None = None,
    diagnostics: bool = True,
    reprefill: bool = False,
    rows_per_pass: int = SWEEP_ROWS_PER_PASS,
    progress: ProgressCallback | None = None,
) -> pd.DataFrame:
    """Run every (contender, rate) on every sample in every mode; one row each (see module doc).

    Args:
        runner: where the cells run (`runners.LocalRunner(model, tokenizer)`, or a `RayRunner`).
        policies: kvsieve policy specs and ``kvpress:<press>`` names; the full cache is always included.
        rates: eviction rates in [0, 1) (the full cache runs once, as rate 0).
        modes: ``"agnostic"`` and/or ``"aware"``.
        results: a JSONL file; rows it already holds are not run again, new rows are appended. When the
            sweep ends, every row is also written beside it as a Parquet table (`results_table`).
        chat: wrap prompts in the tokenizer's chat template (default: when it has one).
        diagnostics: add the routing diagnostics (GER, evidence recall, head consensus) to each row.
        reprefill: prefill again for every configuration and answer one configuration at a time,
            as a library without "prefill once, sieve many" must (for timing; the rows are the same).
        rows_per_pass: kvsieve configurations of a sample answered together as one batch.

    Returns:
        Every row of the sweep (old and new) as a DataFrame.
    """
    methods = parse_contenders(list(policies) if not isinstance(policies, str) else policies)
    rates = [check_rate(r) for r in rates]
    modes = check_modes(modes)
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    log = ResultsLog(results, row_key, gates_made_by(runner, {m.name: m for m in methods}))
    grid = [(m.name, r) for m, r in _configurations(methods, rates)]
    cells = []
    for sample in samples:
        key = sample_key(sample)
        for mode in modes:
            todo = tuple((name, r) for name, r in grid if (key, mode, name, r) not in log)
            if todo:
                cells.append(SweepCell(sample, mode, todo))
    needs = prefill_needs(methods, diagnostics)
    work = SweepWork({m.name: m for m in methods}, needs, chat, diagnostics, reprefill, rows_per_pass)
    run_logged(runner, work, cells, log, len(samples) * len(modes) * len(grid), progress)
    return pd.DataFrame(log.rows)
