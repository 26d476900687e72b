"""Streaming perplexity (docs/protocols.md): whole long documents through a cache held at a fixed budget.

Every document (16k tokens by default) is fed `buffer` tokens per forward, teacher forced,
through `kvsieve.bounded_cache(model, policy, max_tokens=B, buffer=buffer)`: before a forward would
take a sequence past B + buffer entries per (layer, kv-head) on average, the cache is evicted back
to B, so every chunk attends to at most B + buffer entries, exactly where token-by-token decoding
would evict when B is a multiple of the buffer. Every token's NLL is kept; PPL is pooled over all
tokens after the first B of every document, and per position bucket, with a bootstrap 95%
interval over documents. Documents of equal length are fed together as rows of one batch.

The full cache (nothing evicted) is fed only while the document fits the model's positions
(`max_position_embeddings`); its comparison with a bounded cache pools the tokens both scored
(positions B up to that limit). Bounded caches keep every token's true position, so past the
limit their queries use RoPE positions the model was not trained on; the buckets show the cost.

`kvpress:<press>` contenders run the same feeding through kvpress's `DecodingPress`
(`kvsieve.harness.compare.kvpress.PressStream`), at the same budgets and chunk.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ...runtime.eviction.growth import DEFAULT_BUFFER
from ...selection.budget import check_count
from ..data.essays import essay_texts
from ..data.haystack import LINE_SEP, needle_units
from ..progress import ProgressCallback
from ..runners import Runner, run_once
from .contenders import parse_contenders
from .methods import CacheMethod
from .stats import bootstrap_delta_ci, bootstrap_ppl_ci, pooled_delta_pct, pooled_ppl
from .streams import CacheSize, StreamTrace, run_stream

#: The protocol's budgets: entries per (layer, kv-head) on average.
STREAM_BUDGETS: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
#: The protocol's policies (the full cache always runs too).
STREAM_POLICIES: tuple[str, ...] = ("streaming", "h2o", "tova", "snapkv", "random")
#: Tokens per document.
DOC_TOKENS = 16384
#: Width of the position buckets PPL is also reported in.
BUCKET = 2048
#: Documents fed together as rows of one batch.
STREAM_ROWS_PER_PASS = 2
#: Where documents come from: whole essays joined, or RULER's needle-only haystack (seeded per document).
SOURCES: tuple[str, ...] = ("essays", "needles")


# ---------------------------------------------------------------- documents


def streaming_documents(
    tokenizer: PreTrainedTokenizerBase,
    n_docs: int,
    n_tokens: int = DOC_TOKENS,
    source: str = "essays",
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """`n_docs` documents of exactly `n_tokens` ids (`[1, n_tokens]` each) from `source` (one of `SOURCES`).

    `essays`: whole essays (all, or the given `names`) in an order drawn by `seed`, joined by blank
    lines until a document has `n_tokens` tokens (the rest of its last essay is dropped; the next
    document starts a new essay). `needles`: RULER's needle-only haystack (distractor needle lines),
    document `i` seeded by `seed + i`.
    """
    check_count("n_docs", n_docs)
    check_count("n_tokens", n_tokens)
    if source == "essays":
        return _essay_documents(tokenizer, n_docs, n_tokens, seed, names)
    if source == "needles":
        return [
            (f"needles-{seed + i}", _haystack_ids(tokenizer, lambda c, s=seed + i: needle_units(c, s), n_tokens))
            for i in range(n_docs)
        ]
    raise ValueError(f"unknown document source {source!r}; choose one of {', '.join(SOURCES)}")


def _essay_documents(
    tokenizer: PreTrainedTokenizerBase, n_docs: int, n_tokens: int, seed: int, names: Sequence[str] | None
) -> list[tuple[str, torch.Tensor]]:
    essays = list(essay_texts(names).items())
    random.Random(seed).shuffle(essays)
    docs: list[tuple[str, torch.Tensor]] = []
    group: list[tuple[str, str]] = []
    counted = 0  # tokens of the group's essays, each tokenized alone (the joined text is tokenized once it may fit)
    for name, text in essays:
        group.append((name, text))
        counted += len(tokenizer(text, add_special_tokens=False).input_ids)
        if counted < n_tokens:
            continue
        ids = tokenizer("\n\n".join(t for _, t in group), return_tensors="pt").input_ids
        if ids.shape[1] >= n_tokens:
            docs.append(("+".join(n for n, _ in group), ids[:, :n_tokens]))
            group, counted = [], 0
            if len(docs) == n_docs:
                return docs
    raise ValueError(
        f"the essays make only {len(docs)} documents of {n_tokens} tokens; ask for fewer documents or tokens"
    )


def _haystack_ids(tokenizer: PreTrainedTokenizerBase, units: Callable[[int], list[str]], n_tokens: int) -> torch.Tensor:
    """The first `n_tokens` ids of enough haystack lines."""
    count = 64
    while True:
        ids = tokenizer(LINE_SEP.join(units(count)), return_tensors="pt").input_ids
        if ids.shape[1] >= n_tokens:
            return ids[:, :n_tokens]
        count = math.ceil(count * 1.1 * n_tokens / ids.shape[1])


# ---------------------------------------------------------------- results


def _pooled(nll: np.ndarray, start: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per document: the NLL sum and the token count over positions >= `start` that were scored (and in `mask`)."""
    region = nll[:, start:]
    valid = ~np.isnan(region) if mask is None else ~np.isnan(region) & mask[:, start:]
    return np.where(valid, region, 0.0).sum(axis=1), valid.sum(axis=1).astype(np.float64)


@dataclass
class StreamRun:
    """One contender (`full`, a kvsieve policy or `kvpress:<press>`) at one budget, over every document."""

    name: str
    library: str
    budget: int | None
    nll: list[np.ndarray] = field(default_factory=list)
    peak: CacheSize = field(default_factory=CacheSize)
    seconds: float = 0.0
    tokens: int = 0

    def add(self, trace: StreamTrace) -> None:
        self.nll.extend(trace.nll)
        self.peak = self.peak.peak(trace.peak)
        self.seconds += trace.seconds
        self.tokens += trace.tokens

    @property
    def scored_from(self) -> int:
        """The first scored position: after the first `budget` tokens (the full cache scores from 1)."""
        return self.budget or 1


@dataclass
class StreamResult:
    """Per-token NLL of every (contender, budget) over the same documents, and what each cache held."""

    doc_names: list[str]
    doc_tokens: int
    buffer: int
    bucket: int
    context_limit: int
    runs: list[StreamRun] = field(default_factory=list)

    @property
    def full(self) -> StreamRun | None:
        return next((run for run in self.runs if run.budget is None), None)

    def buckets(self, run: StreamRun) -> list[dict[str, Any]]:
        """PPL per `bucket`-wide range of positions (every scored token, also those before the budget)."""
        nll, out = np.stack(run.nll), []
        for start in range(0, self.doc_tokens, self.bucket):
            sums, counts = _pooled(nll[:, : start + self.bucket], start)
            ppl = pooled_ppl(sums, counts) if counts.sum() else None
            out.append({"start": start, "end": min(start + self.bucket, self.doc_tokens), "ppl": ppl})
        return out

    def versus_full(self, run: StreamRun) -> dict[str, Any] | None:
        """PPL against the full cache's over the tokens both scored after `run`'s first `budget` (None if none)."""
        full = self.full
        if full is None or run is full:
            return None
        full_nll = np.stack(full.nll)
        both = ~np.isnan(full_nll)
        sums, counts = _pooled(np.stack(run.nll), run.scored_from, both)
        full_sums, _ = _pooled(full_nll, run.scored_from, both)
        if not counts.sum():
            return None
        lo, hi = bootstrap_delta_ci(sums, full_sums, counts)
        return {
            "positions": [run.scored_from, self.context_limit],
            "tokens": int(counts.sum()),
            "ppl": pooled_ppl(sums, counts),
            "full_ppl": pooled_ppl(full_sums, counts),
            "delta_pct": pooled_delta_pct(sums, full_sums, counts),
            "ci95": [lo, hi],
        }

    def row(self, run: StreamRun) -> dict[str, Any]:
        sums, counts = _pooled(np.stack(run.nll), run.scored_from)
        lo, hi = bootstrap_ppl_ci(sums, counts)
        return {
            "policy": run.name,
            "library": run.library,
            "budget": run.budget,
            "ppl": pooled_ppl(sums, counts),
            "ci95": [lo, hi],
            "tokens": int(counts.sum()),
            "doc_ppl": np.exp(sums / counts).tolist(),
            "vs_full": self.versus_full(run),
            "buckets": self.buckets(run),
            "peak_kv_bytes": run.peak.nbytes,
            "peak_allocated_bytes": run.peak.allocated,
            "peak_entries_per_head": run.peak.entries,
            "ms_per_token": 1000.0 * run.seconds / run.tokens,
            "seconds": run.seconds,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": "streaming perplexity (docs/protocols.md)",
            "docs": len(self.doc_names),
            "doc_tokens": self.doc_tokens,
            "buffer": self.buffer,
            "bucket": self.bucket,
            "context_limit": self.context_limit,
            "documents": self.doc_names,
            "notes": STREAM_NOTES,
            "rows": [self.row(run) for run in self.runs],
        }


#: What the numbers of `StreamResult.to_json()` mean.
STREAM_NOTES = {
    "ppl": "pooled over every token after the first `budget` of every document (full cache: every token it scored)",
    "ci95": "bootstrap 95% interval over documents",
    "vs_full": "against the full cache on the tokens both scored: positions budget..context_limit "
    "(the full cache is fed only up to the model's max_position_embeddings)",
    "positions": "bounded caches keep true positions: past context_limit the model sees RoPE positions it "
    "was not trained on",
    "peak_kv_bytes": "most bytes of keys and values one sequence held after any forward (kvsieve: budget + "
    "buffer entries per head before the next eviction; kvpress: target_size, it compresses right after each "
    "layer's attention)",
    "peak_allocated_bytes": "storage behind the cache after any forward, per sequence",
    "ms_per_token": "wall time of the forwards (evictions included) per token of one sequence; "
    "documents are fed as rows of a batch",
}


# ---------------------------------------------------------------- the protocol


def _check_documents(documents: Sequence[tuple[str, torch.Tensor]], largest_budget: int) -> torch.Tensor:
    """The documents as one `[docs, T]` batch; they must have one length, longer than the largest budget."""
    if not documents:
        raise ValueError("streaming perplexity needs at least one document")
    lengths = {name: int(ids.shape[-1]) for name, ids in documents}
    if any(ids.ndim != 2 or ids.shape[0] != 1 for _, ids in documents):
        raise ValueError("every document must be a LongTensor of shape [1, tokens]")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"documents must have one length (they are fed as rows of a batch), got {lengths}")
    length = next(iter(lengths.values()))
    if length <= largest_budget + 1:
        raise ValueError(f"documents have {length} tokens; the budget {largest_budget} leaves nothing to score")
    return torch.cat([ids for _, ids in documents])


def _check_budgets(budgets: Sequence[int]) -> list[int]:
    for budget in budgets:
        check_count("budget (max_tokens)", budget)
    if not budgets or len(set(budgets)) != len(budgets):
        raise ValueError(f"budgets must be distinct and at least one, got {list(budgets)}")
    return sorted(budgets)


def stream_trace(
    model: torch.nn.Module,
    ids: torch.Tensor,
    method: CacheMethod,
    budget: int | None,
    buffer: int = DEFAULT_BUFFER,
    fed: int | None = None,
    seed: int = 0,
) -> StreamTrace:
    """Feed the first `fed` tokens of `ids` (all by default) through `method`'s stream at `budget`, `buffer` a chunk."""
    return run_stream(ids, method.stream(model, budget, buffer, seed), buffer, fed)


def _preflight(
    model: torch.nn.Module, contenders: Sequence[CacheMethod], budget: int, buffer: int, ids: torch.Tensor
) -> None:
    """Fail in seconds, not hours: stream the start of the first document through every method at `budget`.

    Two forwards: one that holds every protected entry, and one `buffer` chunk that makes a bounded
    cache evict. A budget below a policy's protected entries raises the core's `PolicyError` here,
    a press that kvpress cannot run, kvpress's error.
    """
    for method in (m for m in contenders if not m.is_full):
        first = max(budget, method.protected) + buffer
        stream = method.stream(model, budget, buffer, seed=0)
        with stream.running():
            for start, end in ((0, first), (first, first + buffer)):
                if start < ids.shape[1]:  # documents shorter than the probe are fed whole
                    stream.forward(ids[:1, start:end], start)


@dataclass(frozen=True)
class Preflight:
    """`_preflight` where the model lives; gives back the model's `max_position_embeddings`."""

    contenders: list[CacheMethod]
    budget: int
    buffer: int

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, tokenizer: Any, ids: torch.Tensor) -> int:
        _preflight(model, self.contenders, self.budget, self.buffer, ids.to(model.device))
        return int(model.config.max_position_embeddings)


@dataclass(frozen=True)
class StreamCell:
    """Rows `rows` of the documents through one (contender, budget), `fed` tokens each (None: all)."""

    contender: CacheMethod
    budget: int | None
    rows: range
    fed: int | None
    chunks: int


@dataclass(frozen=True)
class StreamWork:
    """One cell of a streaming run: its documents (`ids`, every one of the run) fed through its stream."""

    ids: torch.Tensor
    buffer: int

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: StreamCell) -> StreamTrace:
        ids = self.ids[cell.rows.start : cell.rows.stop].to(model.device)
        return stream_trace(model, ids, cell.contender, cell.budget, self.buffer, cell.fed, cell.rows.start)


@dataclass(frozen=True)
class StreamPlan:
    """A checked streaming run: the documents as one batch and the (contender, budget) configurations in order."""

    doc_names: list[str]
    ids: torch.Tensor
    configurations: list[tuple[CacheMethod, int | None]]
    buffer: int
    bucket: int
    rows_per_pass: int
    context_limit: int

    def cells(self) -> list[StreamCell]:
        """Every configuration through every batch of documents, in order (the full cache up to the context limit)."""
        docs, rows, out = len(self.ids), self.rows_per_pass, []
        for contender, budget in self.configurations:
            fed = self.context_limit if contender.is_full else None  # the full cache: as far as positions go
            chunks = math.ceil((fed or self.ids.shape[1]) / self.buffer)
            out += [
                StreamCell(contender, budget, range(i, min(i + rows, docs)), fed, chunks) for i in range(0, docs, rows)
            ]
        return out

    def run(self, runner: Runner, progress: ProgressCallback | None = None) -> StreamResult:
        """Feed every batch of documents through every configuration; `progress` after every cell, in chunks."""
        cells = self.cells()
        total, done = sum(cell.chunks for cell in cells), 0
        result = StreamResult(self.doc_names, self.ids.shape[1], self.buffer, self.bucket, self.context_limit)
        runs: dict[tuple[str, int | None], StreamRun] = {}
        for cell, trace in zip(cells, runner.map(StreamWork(self.ids, self.buffer), cells), strict=True):
            key = (cell.contender.name, cell.budget)
            if key not in runs:
                runs[key] = StreamRun(cell.contender.name, cell.contender.library, cell.budget)
                result.runs.append(runs[key])
            runs[key].add(trace)
            done += cell.chunks
            if progress:
                progress(done, total)
        return result


def plan_streaming(
    runner: Runner,
    documents: Sequence[tuple[str, torch.Tensor]],
    policies: str | Sequence[str] = STREAM_POLICIES,
    budgets: Sequence[int] = STREAM_BUDGETS,
    *,
    buffer: int = DEFAULT_BUFFER,
    bucket: int = BUCKET,
    press_budgets: Sequence[int] | None = None,
    rows_per_pass: int = STREAM_ROWS_PER_PASS,
) -> StreamPlan:
    """Check a streaming run before it starts (a `ValueError`, or the core's `PolicyError`, names the problem).

    Args: as for `run_streaming`. Every policy evicts once at the smallest budget here (on the runner),
    so a budget below its protected entries fails in seconds.
    """
    check_count("buffer", buffer)
    check_count("bucket", bucket)
    check_count("rows_per_pass", rows_per_pass)
    contenders = parse_contenders(policies if isinstance(policies, str) else list(policies))
    budgets = _check_budgets(budgets)
    press_budgets = budgets if press_budgets is None else _check_budgets(press_budgets)
    ids = _check_documents(documents, max(budgets + press_budgets)).cpu()
    positions = run_once(runner, Preflight(contenders, min(budgets + press_budgets), buffer), ids)
    by_library = {"kvpress": press_budgets}
    configurations: list[tuple[CacheMethod, int | None]] = [(m, None) for m in contenders if m.is_full]
    for method in (m for m in contenders if not m.is_full):
        configurations += [(method, b) for b in by_library.get(method.library, budgets)]
    limit = min(ids.shape[1], positions)
    return StreamPlan([name for name, _ in documents], ids, configurations, buffer, bucket, rows_per_pass, limit)


def run_streaming(
    runner: Runner,
    documents: Sequence[tuple[str, torch.Tensor]],
    policies: str | Sequence[str] = STREAM_POLICIES,
    budgets: Sequence[int] = STREAM_BUDGETS,
    *,
    buffer: int = DEFAULT_BUFFER,
    bucket: int = BUCKET,
    press_budgets: Sequence[int] | None = None,
    rows_per_pass: int = STREAM_ROWS_PER_PASS,
    progress: ProgressCallback | None = None,
) -> StreamResult:
    """Run the streaming perplexity protocol: the full cache, then every (policy, budget), on the same documents.

    Args:
        runner: where the streams run (`runners.LocalRunner(model)`, or a `RayRunner`).
        documents: (name, ids `[1, T]`) of one length T, longer than every budget.
        policies: kvsieve specs and `kvpress:<press>` names (`STREAMING_PRESSES`); the full cache always runs.
        budgets: entries per (layer, kv-head) on average (`max_tokens`), for every kvsieve policy.
        buffer: tokens per forward, and how far a bounded cache grows past its budget before eviction.
        bucket: width of the position buckets PPL is also pooled in.
        press_budgets: budgets of the kvpress presses (default: `budgets`).
        rows_per_pass: documents fed together as rows of one batch.
        progress: called after every cell (a configuration through a batch of documents) with (done, total) chunks.
    """
    plan = plan_streaming(
        runner,
        documents,
        policies,
        budgets,
        buffer=buffer,
        bucket=bucket,
        press_budgets=press_budgets,
        rows_per_pass=rows_per_pass,
    )
    return plan.run(runner, progress)
