"""A small byte-level BPE tokenizer trained in code, for tests that need text (no hub download)."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The grass is green. The sky is blue.",
    "One of the special magic numbers for apple is: 1234567. What is the special magic number?",
    "Question: Answer: the value of the variable VAR is 42. Memorize the words in the list.",
    "Alice lives in Paris and works as a baker. Bob was born in Oslo. Who is the mother of Carol?",
    "I don't know. The answer is not mentioned in the text. Here we go. There and back again.",
]
VOCAB_SIZE = 384


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (every string encodes), `<s>` as BOS added in front, `</s>` as EOS; `VOCAB_SIZE` ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
