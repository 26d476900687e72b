"""Task sweeps: contenders x rates x samples x modes, one prefill per (sample, mode), resumable.

For every sample and mode the context is prefilled once with sieve attention (observed); every
kvsieve (policy, rate) then evicts from that prefill, as in the perplexity protocol ("prefill
once, sieve many"). kvpress presses compress during their own prefill, so they re-prefill for
every configuration, as kvpress does. Each configuration's answer is generated greedily and the
gold answer teacher-forced; each row also carries the routing diagnostics of its survival mask.

Rows are appended to a JSONL file as they are made; a sweep restarted on the same file skips
the rows it already holds, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import Cache

from ..apply import question_protection
from ..data.sample import EncodedSample, TaskSample, encode
from ..observe import DEFAULT_WINDOW, Prefill, observe_prefill
from ..policy import DEFAULT_N_SINK, DEFAULT_SLIDING_WINDOW, check_rate
from .answers import judge
from .contenders import Contender, parse_contenders
from .perplexity import per_document_policy
from .respond import Response, respond
from .routing import diagnose, survival_from_cache

#: Question-agnostic: compress the context before the question is seen. Question-aware: after.
MODES = ("agnostic", "aware")

#: Called after each configuration with (done, total).
Progress = Callable[[int, int], None]


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
    """One configuration's cache, ready to answer from.

    Attributes:
        cache: the cache to continue from.
        kv_bytes: bytes of keys and values the cache really holds.
        survival: `[layers, kv_heads, n_context]` bool, the context entries decoding can still attend to.
        decoding: what must be active while decoding from it (kvpress's masking; else nothing).
        max_feed: the most tokens one forward may feed (see `PressedCache.max_feed`).
    """

    cache: Cache
    kv_bytes: int
    survival: torch.Tensor
    decoding: AbstractContextManager = field(default_factory=nullcontext)
    max_feed: int | None = None


def compress_configuration(
    model: torch.nn.Module, encoded: EncodedSample, mode: str, prefill: Prefill, contender: Contender, rate: float
) -> Compressed:
    """Compress one sample for one (contender, rate): kvsieve evicts from `prefill`, kvpress re-prefills."""
    n_context = encoded.context_length
    if contender.library == "kvpress":
        from ..compare.kvpress import kvpress_compress

        prefilled, _ = split_prompt(encoded, mode)
        n_protected = DEFAULT_N_SINK + DEFAULT_SLIDING_WINDOW + (prefilled.shape[1] - n_context)
        pressed = kvpress_compress(model, prefilled, contender.press, rate, n_protected=n_protected)
        visible = pressed.visible[..., :n_context]
        return Compressed(pressed.cache, pressed.kv_bytes, visible, pressed.decoding(model), pressed.max_feed)
    if contender.is_full:
        cache = prefill.cache.copy()
    else:
        policy = per_document_policy(contender.policy, encoded.sample.index)
        protect = None
        if mode == "aware":
            n_question = encoded.question_ids.shape[1] - 1
            protect = question_protection(n_context, n_question, policy.sliding_window)
        cache = prefill.cache.keep(policy.keep_indices(prefill.observations, rate, protect))
    return Compressed(cache, cache.nbytes(), survival_from_cache(cache, n_context))


def observe_options(contenders: Sequence[Contender]) -> dict[str, Any]:
    """How the shared prefill must be observed so every kvsieve contender can score from it."""
    policies = [c.policy for c in contenders if c.policy is not None]
    return {
        "window": max([p.observation_window for p in policies], default=DEFAULT_WINDOW),
        "accumulate": any(p.needs_accumulated for p in policies),
    }


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
    prefill = observe_prefill(model, prefilled, **observe_options([contender]))
    compressed = compress_configuration(model, encoded, mode, prefill, contender, rate)
    return compressed.survival, encoded.evidence_positions


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


def _run_configuration(
    model: torch.nn.Module,
    tokenizer: Any,
    encoded: EncodedSample,
    mode: str,
    prefill: Prefill,
    contender: Contender,
    rate: float,
    diagnostics: bool,
) -> dict[str, Any]:
    _, prompt = split_prompt(encoded, mode)
    start = time.perf_counter()
    compressed = compress_configuration(model, encoded, mode, prefill, contender, rate)
    with compressed.decoding:
        response = respond(
            model,
            compressed.cache,
            prompt,
            encoded.gold_ids,
            encoded.sample.max_new_tokens,
            rank_index=encoded.gold_content_index,
            max_feed=compressed.max_feed,
        )
    row: dict[str, Any] = {
        "library": contender.library,
        "policy": contender.name,
        "rate": rate,
        "kv_bytes": int(compressed.kv_bytes),
        "kv_bytes_full": int(prefill.cache.nbytes()),
        "kept_entries": int(compressed.survival.sum()),
        "seconds": time.perf_counter() - start,
        **_answer_row(encoded, response, tokenizer),
    }
    if diagnostics:
        row |= diagnose(prefill.observations, compressed.survival, encoded.evidence_positions).summary()
    return row


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
        reprefill: prefill again for every configuration instead of once per (sample, mode), as a
            library without "prefill once, sieve many" must (for timing; the rows are the same).

    Returns:
        Every row of the sweep (old and new) as a DataFrame.
    """
    contenders = parse_contenders(list(policies) if not isinstance(policies, str) else policies)
    rates = [check_rate(r) for r in rates]
    modes = check_modes(modes)
    path = Path(results) if results is not None else None
    rows = read_rows(path) if path else []
    if path and path.exists() and not path.read_bytes().endswith(b"\n") and path.stat().st_size:
        with path.open("a") as f:  # an interrupted write left half a line: new rows start on a line of their own
            f.write("\n")
    done = {row_key(r) for r in rows}
    configurations = _configurations(contenders, rates)
    observe = observe_options(contenders)
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
            tick = time.perf_counter()
            prefill = observe_prefill(model, prefilled, **observe)
            prefill_seconds = time.perf_counter() - tick
            shared = 1 if reprefill else sum(c.library == "kvsieve" for c, _ in todo)  # sharing this prefill
            for i, (contender, rate) in enumerate(todo):
                if reprefill and i:
                    tick = time.perf_counter()
                    prefill = observe_prefill(model, prefilled, **observe)
                    prefill_seconds = time.perf_counter() - tick
                row = {
                    "sample": key,
                    "suite": sample.suite,
                    "task": sample.task,
                    "index": sample.index,
                    "mode": mode,
                    "context_tokens": encoded.context_length,
                    "evidence_tokens": int(encoded.evidence_positions.numel()),
                    "prefill_seconds": prefill_seconds,
                    **_run_configuration(model, tokenizer, encoded, mode, prefill, contender, rate, diagnostics),
                }
                # wall time of this configuration: kvsieve's share of the prefill; kvpress prefills on its own
                row["wall_seconds"] = row["seconds"] + (
                    prefill_seconds / shared if contender.library == "kvsieve" else 0
                )
                rows.append(row)
                if path:
                    with path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                finished += 1
                if progress:
                    progress(finished, total)
    return pd.DataFrame(rows)
