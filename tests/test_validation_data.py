"""The validation text gates are chosen on: held-back essays only, and none of what perplexity is reported on."""

from __future__ import annotations

import torch

from kvsieve.harness.data import essay_split, essay_texts, sample_documents, validation_documents
from tokenizer import tiny_tokenizer


def test_validation_documents_are_later_windows_of_held_back_essays():
    tokenizer, n = tiny_tokenizer(), 1537
    train, heldout = essay_split()
    documents = validation_documents(tokenizer, n)
    names = {name.split("@")[0] for name, _ in documents}
    assert names and names <= set(heldout) and not names & set(train)
    reported = dict(sample_documents(tokenizer, len(names), n, names=sorted(names)))
    for name, ids in documents:
        essay, k = name.split("@")
        full = tokenizer(essay_texts([essay])[essay], return_tensors="pt").input_ids
        assert ids.shape == (1, n) and ids[0, 0] == tokenizer.bos_token_id
        start = 1 + int(k) * (n - 1)  # past the BOS and k windows' bodies
        assert int(k) >= 1 and torch.equal(ids[0, 1:], full[0, start : start + n - 1])
        assert start >= reported[essay].shape[1], "a validation window overlaps the text perplexity is reported on"
