"""Sentence spans: a sentence number for every token, for `projection=sentence`."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

#: A sentence ends after a token whose decoded text (trailing spaces and tabs stripped) ends with one of these.
SENTENCE_ENDS = (".", "!", "?")


def ends_sentence(text: str) -> bool:
    """Whether a token decoded to `text` ends a sentence: it ends with ".", "!" or "?", or holds a newline."""
    return "\n" in text or text.rstrip(" \t").endswith(SENTENCE_ENDS)


def sentence_spans(tokenizer: PreTrainedTokenizerBase, input_ids: torch.Tensor) -> torch.LongTensor:
    """The sentence number of every token of `input_ids` (`[tokens]` or `[batch, tokens]`), counted from 0 per row.

    A sentence ends after a token whose decoded text ends with ".", "!" or "?" (trailing spaces and
    tabs aside) or contains a newline; the next token starts the next sentence. Each token is
    decoded on its own. Pass the result as `spans` to `kvsieve.compress` with `projection=sentence`.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim not in (1, 2) or input_ids.is_floating_point():
        raise ValueError("input_ids must be an integer tensor of shape [tokens] or [batch, tokens]")
    unique = input_ids.unique()
    texts = tokenizer.batch_decode([[token] for token in unique.tolist()])
    is_end = torch.tensor([ends_sentence(text) for text in texts], dtype=torch.long, device=input_ids.device)
    ends = is_end[torch.searchsorted(unique, input_ids)]
    return (ends.cumsum(dim=-1) - ends).long()
