"""Answer a question from a (compressed) cache: the greedy answer and the gold answer's teacher-forced statistics.

A cache of several rows (different evictions of one prefill, `kvsieve.evictions`) answers for
every row in one batched pass: one teacher-forced forward and one `generate` call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Cache

from ...runtime.compat import cache_argument
from ...runtime.storage.cache import SievedCache
from .answers import gold_statistics


@dataclass(frozen=True)
class Response:
    """What the model did after the prompt.

    Attributes:
        tokens: `[new]` the greedy answer's token ids (up to and including the first EOS, or `max_new_tokens`).
        gold_logprob: log-probability of the gold answer's tokens, teacher-forced.
        gold_rank: rank of the gold answer's first content token among the vocabulary (1 = top).
    """

    tokens: torch.Tensor
    gold_logprob: float
    gold_rank: int


def fork(cache: Cache) -> Cache:
    """An independent copy of a cache."""
    return cache.copy() if isinstance(cache, SievedCache) else copy.deepcopy(cache)


def rows_of(cache: Cache) -> int:
    """The batch size a cache holds."""
    return cache.batch_size if isinstance(cache, SievedCache) else int(cache.layers[0].keys.shape[0])


def feed(model: torch.nn.Module, cache: Cache, ids: torch.Tensor, max_feed: int | None = None) -> torch.Tensor:
    """Feed `ids` (`[rows, n]`) after `cache`, at most `max_feed` tokens a forward; logits `[rows, n, vocab]`."""
    step = max_feed or max(1, ids.shape[1])
    chunks = [
        model(input_ids=ids[:, i : i + step], **cache_argument(model, cache), use_cache=True).logits
        for i in range(0, ids.shape[1], step)
    ]
    return torch.cat(chunks, dim=1) if chunks else torch.empty(ids.shape[0], 0)


@torch.no_grad()
def continuation_nll(
    model: torch.nn.Module, cache: Cache, ids: torch.Tensor, max_feed: int | None = None
) -> list[float]:
    """Per row of `cache`: the summed NLL of `ids[:, 1:]` when `ids[:, :-1]` is fed after it, teacher-forced."""
    rows = ids.expand(rows_of(cache), -1)
    logits = feed(model, cache, rows[:, :-1], max_feed)
    nll = F.cross_entropy(logits.float().transpose(1, 2), rows[:, 1:], reduction="none")
    return nll.sum(dim=1).tolist()


def _until_stop(tokens: torch.Tensor, stop: list[int]) -> torch.Tensor:
    """The tokens up to and including the first stop token (batched `generate` pads finished rows)."""
    hits = torch.isin(tokens, torch.tensor(stop, device=tokens.device)).nonzero().flatten()
    return tokens[: int(hits[0]) + 1] if hits.numel() else tokens


@torch.no_grad()
def respond(
    model: torch.nn.Module,
    cache: Cache,
    prompt_ids: torch.Tensor,
    gold_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    rank_index: int = 0,
    max_feed: int | None = None,
) -> list[Response]:
    """For every row of `cache`: teacher-force the gold answer on a copy, then generate greedily from the cache itself.

    Args:
        cache: holds a prefix of `prompt_ids` (its logical length) in each of its rows; the rest is fed.
        prompt_ids: `[1, n]` the whole prompt (context and question).
        gold_ids: `[1, g]` the gold answer.
        eos_token_id: where generation stops (default: the model's generation config).
        rank_index: which gold token's rank to report (see `gold_statistics`).
        max_feed: feed the rest of the prompt and the gold answer at most this many tokens a
            forward (kvpress's AdaKV needs it; exact either way).

    The prompt's tokens past the cache but the last are fed once, into `cache`; the gold answer is
    teacher-forced on a copy from there, and `generate` feeds the last prompt token and answers.
    """
    rows = rows_of(cache)
    prompt_ids = prompt_ids.expand(rows, -1)
    seen = cache.get_seq_length()
    tail = prompt_ids[:, seen:]
    if tail.shape[1] == 0:
        raise ValueError("the cache already holds the whole prompt; leave at least one prompt token to feed")
    # the prompt but its last token, fed once for both: the teacher-forced copy and `generate` go on from there
    feed(model, cache, tail[:, :-1], max_feed)
    tail = tail[:, -1:]
    forced = torch.cat([tail, gold_ids.expand(rows, -1)[:, :-1]], dim=-1)
    logits = feed(model, fork(cache), forced, max_feed)
    gold = [gold_statistics(logits[row], gold_ids[0], rank_index) for row in range(rows)]
    stop = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    stops = [stop] if isinstance(stop, int) else list(stop or [])
    out = model.generate(
        prompt_ids,
        attention_mask=torch.ones_like(prompt_ids),  # never inferred from a pad id that may occur in the prompt
        **cache_argument(model, cache),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=stops[0] if stops else 0,
    )
    answers = [_until_stop(tokens, stops) for tokens in out[:, prompt_ids.shape[1] :]]
    return [Response(tokens, logprob, rank) for tokens, (logprob, rank) in zip(answers, gold, strict=True)]
