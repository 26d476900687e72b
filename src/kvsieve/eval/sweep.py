"""Task sweeps: contenders x rates x samples x modes, one prefill per (sample, mode), resumable.

For every sample and mode the context is prefilled once with sieve attention (observed); every
kvsieve (policy, rate) then evicts from that prefill, as in the perplexity protocol ("prefill
once, sieve many"). kvpress presses compress during their own prefill, so they re-prefill for
every configuration, as kvpress does. The kvsieve configurations of a sample are answered
together: one batch whose rows are the different evictions of the one prefill, one greedy
`generate` and one teacher-forced pass for all of them. Each row also carries the routing
diagnostics of its survival mask.

Rows are appended to a JSONL file as they are made; a sweep restarted on the same file skips
the rows it already holds, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import Cache

from ..apply import Eviction, evictions, question_protection
from ..attention import sieve_attention
from ..budget import check_rate
from ..data.sample import EncodedSample, TaskSample, encode
from ..observe import Needs, Prefill, observe_prefill
from ..policy import DEFAULT_N_SINK, DEFAULT_SLIDING_WINDOW
from .answers import judge
from .contenders import Contender, parse_contenders
from .perplexity import per_document_policy
from .respond import Response, respond
from .routing import diagnose, survival_from_cache

#: Question-agnostic: compress the context before the question is seen. Question-aware: after.
MODES = ("agnostic", "aware")

#: Called after each configuration with (done, total).
Progress = Callable[[int, int], None]

#: kvsieve configurations of a sample answered together as one batch (one prefill, many evictions).
ROWS_PER_PASS = 16


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


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file (a partly written last line, from an interrupted sweep, is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def split_prompt(encoded: EncodedSample, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(prefilled, prompt)`: what is prefilled and compressed, and the whole prompt.

    Agnostic: the context alone is prefilled. Aware: the context and all but the last question
    token (one token is left for `generate` to feed).
    """
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], dim=-1)
    if mode == "agnostic":
        return encoded.context_ids, prompt
    return prompt[:, :-1], prompt


def _configurations(contenders: Sequence[Contender], rates: Sequence[float]) -> list[tuple[Contender, float]]:
    return [(c, rate) for c in contenders for rate in ([0.0] if c.is_full else rates)]


@dataclass
class Compressed:
    """Configurations' caches, ready to answer from: row `i` of `cache` is configuration `i`.

    Attributes:
        cache: the cache to continue from.
        kv_bytes: per row, bytes of keys and values the cache really holds.
        survival: per row, `[layers, kv_heads, n_context]` bool: the context entries decoding can still attend to.
        decoding: what must be active while decoding from it (sieve attention, or kvpress's masking).
        max_feed: the most tokens one forward may feed (see `PressedCache.max_feed`).
    """

    cache: Cache
    kv_bytes: list[int]
    survival: list[torch.Tensor]
    decoding: AbstractContextManager
    max_feed: int | None = None


def compress_configurations(
    model: torch.nn.Module,
    encoded: EncodedSample,
    mode: str,
    prefill: Prefill,
    todo: Sequence[tuple[Contender, float]],
) -> Compressed:
    """Compress one sample for several (contender, rate) pairs.

    kvsieve configurations become the rows of one batch evicted from `prefill`; a kvpress press
    re-prefills the sample on its own (one configuration at a time).
    """
    n_context = encoded.context_length
    if any(c.library == "kvpress" for c, _ in todo):
        if len(todo) != 1:
            raise ValueError("kvpress configurations are compressed one at a time")
        from ..compare.kvpress import kvpress_compress

        (contender, rate), (prefilled, _) = todo[0], split_prompt(encoded, mode)
        n_protected = DEFAULT_N_SINK + DEFAULT_SLIDING_WINDOW + (prefilled.shape[1] - n_context)
        pressed = kvpress_compress(model, prefilled, contender.press, rate, n_protected=n_protected)
        visible = pressed.visible[..., :n_context]
        return Compressed(pressed.cache, [pressed.kv_bytes], [visible], pressed.decoding(model), pressed.max_feed)
    plans = []
    for contender, rate in todo:
        if contender.is_full:
            plans.append(Eviction(None))
            continue
        policy = per_document_policy(contender.policy, encoded.sample.index)
        protect = None
        if mode == "aware":
            n_question = encoded.question_ids.shape[1] - 1
            protect = question_protection(n_context, n_question, policy.sliding_window)
        plans.append(Eviction(policy, rate, protect))
    cache = evictions(prefill, plans)
    rows = range(len(plans))
    return Compressed(
        cache,
        [cache.row_nbytes(row) for row in rows],
        [survival_from_cache(cache, n_context, row) for row in rows],
        sieve_attention(model),
    )


def prefill_needs(contenders: Sequence[Contender], diagnostics: bool) -> Needs:
    """What the shared prefill must record so every kvsieve contender (and the diagnostics) can read it."""
    needs = Needs(window=1) if diagnostics else Needs()
    return functools.reduce(operator.or_, (c.policy.needs for c in contenders if c.policy is not None), needs)


@torch.no_grad()
def sample_survival(
    model: torch.nn.Module,
    tokenizer: Any,
    sample: TaskSample,
    contender: Contender,
    rate: float,
    mode: str = "agnostic",
    chat: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(survival [layers, kv_heads, n_context], evidence positions)` of one sample under one configuration."""
    encoded = encode(sample, tokenizer, chat)
    prefilled, _ = split_prompt(encoded, mode)
    prefill = observe_prefill(model, prefilled, prefill_needs([contender], diagnostics=False))
    compressed = compress_configurations(model, encoded, mode, prefill, [(contender, rate)])
    return compressed.survival[0], encoded.evidence_positions


def _answer_row(encoded: EncodedSample, response: Response, tokenizer: Any) -> dict[str, Any]:
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
    prefill: Prefill,
    todo: Sequence[tuple[Contender, float]],
    diagnostics: bool,
) -> list[dict[str, Any]]:
    """Compress, answer and diagnose several configurations of one sample together; one row each."""
    _, prompt = split_prompt(encoded, mode)
    start = time.perf_counter()
    compressed = compress_configurations(model, encoded, mode, prefill, todo)
    with compressed.decoding:
        responses = respond(
            model,
            compressed.cache,
            prompt,
            encoded.gold_ids,
            encoded.sample.max_new_tokens,
            rank_index=encoded.gold_content_index,
            max_feed=compressed.max_feed,
        )
    seconds = (time.perf_counter() - start) / len(todo)
    rows = []
    for (contender, rate), response, kv_bytes, survival in zip(
        todo, responses, compressed.kv_bytes, compressed.survival, strict=True
    ):
        row: dict[str, Any] = {
            "library": contender.library,
            "policy": contender.name,
            "rate": rate,
            "kv_bytes": int(kv_bytes),
            "kv_bytes_full": int(prefill.cache.nbytes()),
            "kept_entries": int(survival.sum()),
            "seconds": seconds,
            **_answer_row(encoded, response, tokenizer),
        }
        if diagnostics:
            row |= diagnose(prefill.observations[0], survival, encoded.evidence_positions).summary()
        rows.append(row)
    return rows


def _batches(todo: Sequence[tuple[Contender, float]], rows_per_pass: int) -> list[list[tuple[Contender, float]]]:
    """kvsieve configurations in even passes of at most `rows_per_pass`; each kvpress configuration on its own.

    A batched cache is read padded to its widest row, so configurations go in order of rate and a
    pass holds caches of similar size.
    """
    kvsieve = sorted((t for t in todo if t[0].library == "kvsieve"), key=lambda t: t[1])
    size = math.ceil(len(kvsieve) / math.ceil(len(kvsieve) / rows_per_pass)) if kvsieve else 1
    groups = [kvsieve[i : i + size] for i in range(0, len(kvsieve), size)]
    return groups + [[t] for t in todo if t[0].library != "kvsieve"]


def run_sweep(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[TaskSample],
    policies: str | Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str] = ("agnostic",),
    *,
    results: str | Path | None = None,
    chat: bool | None = None,
    diagnostics: bool = True,
    reprefill: bool = False,
    rows_per_pass: int = ROWS_PER_PASS,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """Run every (contender, rate) on every sample in every mode; one row each (see module doc).

    Args:
        policies: kvsieve policy specs and ``kvpress:<press>`` names; the full cache is always included.
        rates: eviction rates in [0, 1) (the full cache runs once, as rate 0).
        modes: ``"agnostic"`` and/or ``"aware"``.
        results: a JSONL file; rows it already holds are not run again, new rows are appended.
        chat: wrap prompts in the tokenizer's chat template (default: when it has one).
        diagnostics: add the routing diagnostics (GER, evidence recall, head consensus) to each row.
        reprefill: prefill again for every configuration and answer one configuration at a time,
            as a library without "prefill once, sieve many" must (for timing; the rows are the same).
        rows_per_pass: kvsieve configurations of a sample answered together as one batch.

    Returns:
        Every row of the sweep (old and new) as a DataFrame.
    """
    contenders = parse_contenders(list(policies) if not isinstance(policies, str) else policies)
    rates = [check_rate(r) for r in rates]
    modes = check_modes(modes)
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    path = Path(results) if results is not None else None
    rows = read_rows(path) if path else []
    if path and path.exists() and not path.read_bytes().endswith(b"\n") and path.stat().st_size:
        with path.open("a") as f:  # an interrupted write left half a line: new rows start on a line of their own
            f.write("\n")
    done = {row_key(r) for r in rows}
    configurations = _configurations(contenders, rates)
    needs = prefill_needs(contenders, diagnostics)
    total = len(samples) * len(modes) * len(configurations)
    finished = sum(
        1 for s in samples for m in modes for c, r in configurations if (sample_key(s), m, c.name, r) in done
    )
    if progress:
        progress(finished, total)
    for sample in samples:
        key = sample_key(sample)
        encoded = None
        for mode in modes:
            todo = [(c, r) for c, r in configurations if (key, mode, c.name, r) not in done]
            if not todo:
                continue
            encoded = encoded or encode(sample, tokenizer, chat)
            prefilled, _ = split_prompt(encoded, mode)
            prefill, prefill_seconds = None, 0.0
            shared = 1 if reprefill else sum(c.library == "kvsieve" for c, _ in todo)  # sharing one prefill
            for batch in _batches(todo, 1 if reprefill else rows_per_pass):
                if prefill is None or reprefill:
                    tick = time.perf_counter()
                    prefill = observe_prefill(model, prefilled, needs)
                    prefill_seconds = time.perf_counter() - tick
                new_rows = _run_configurations(model, tokenizer, encoded, mode, prefill, batch, diagnostics)
                for row in new_rows:
                    row = {
                        "sample": key,
                        "suite": sample.suite,
                        "task": sample.task,
                        "index": sample.index,
                        "mode": mode,
                        "context_tokens": encoded.context_length,
                        "evidence_tokens": int(encoded.evidence_positions.numel()),
                        "prefill_seconds": prefill_seconds,
                        **row,
                    }
                    # wall time of this configuration: kvsieve's share of the prefill; kvpress prefills on its own
                    share = prefill_seconds / shared if row["library"] == "kvsieve" else 0.0
                    row["wall_seconds"] = row["seconds"] + share
                    rows.append(row)
                    if path:
                        with path.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                finished += len(new_rows)
                if progress:
                    progress(finished, total)
    return pd.DataFrame(rows)
