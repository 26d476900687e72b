"""A user's training corpus (`train-gates --data`): text files, a folder of them, or JSONL records.

- A text file (any suffix but ``.jsonl``) is one document.
- A folder holds text files and ``.jsonl`` files, read recursively in name order (hidden files skipped).
- A ``.jsonl`` file holds one record per line: ``{"text": ...}`` (a document), or
  ``{"context": ..., "question": ..., "answer": ...}`` (an evidence-bearing sample, as the task
  generators make: context, then question, then the gold answer, which the distillation loss sees).

Documents and records are split by a fixed shuffle into training and held-back parts (the last
quarter held back, as for the bundled essays), and the corpus is hashed (SHA-256 of every file's
path and bytes), so a checkpoint records exactly what it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..data.essays import HELDOUT_SHARE

#: The fields of a question-answer record.
QA_FIELDS = ("context", "question", "answer")


class CorpusError(ValueError):
    """Training data that yields no usable sequence, or a file or record that cannot be read."""


@dataclass(frozen=True)
class QARecord:
    """An evidence-bearing sample: a context, a question about it and its answer."""

    context: str
    question: str
    answer: str


@dataclass(frozen=True)
class Corpus:
    """What a corpus holds, by name (`file`, or `file:line` for JSONL records), and its hash."""

    documents: dict[str, str]
    records: dict[str, QARecord]
    sha256: str

    def split(self, seed: str = "kvsieve/corpus-split") -> tuple[list[str], list[str]]:
        """`(train, heldout)` names: a fixed shuffle of the sorted names, the last `HELDOUT_SHARE` held back."""
        names = sorted([*self.documents, *self.records])
        random.Random(seed).shuffle(names)
        cut = len(names) - round(HELDOUT_SHARE * len(names)) if len(names) > 1 else len(names)
        return sorted(names[:cut]), sorted(names[cut:])


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CorpusError(f"--data {path}: no such file or folder")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts))
    if not files:
        raise CorpusError(f"--data {path}: the folder holds no files")
    return files


def _record(name: str, line: str) -> str | QARecord:
    """One JSONL line: a document's text or a question-answer record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{name}: not a JSON object ({err.msg})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{name}: a record must be a JSON object with 'text' or {', '.join(QA_FIELDS)}")
    if isinstance(record.get("text"), str):
        if not record["text"].strip():
            raise CorpusError(f"{name}: the text is empty")
        return record["text"]
    missing = [field for field in QA_FIELDS if not isinstance(record.get(field), str) or not record[field].strip()]
    if missing:
        raise CorpusError(f"{name}: needs a 'text' field, or all of {', '.join(QA_FIELDS)} (missing {missing})")
    return QARecord(*(record[field] for field in QA_FIELDS))


def read_corpus(path: str | Path) -> Corpus:
    """Read `path` (a text file, a folder, or JSONL), with a clear error for empty or malformed content."""
    path = Path(path)
    documents: dict[str, str] = {}
    records: dict[str, QARecord] = {}
    digest = hashlib.sha256()
    for file in _files(path):
        name = str(file.relative_to(path)) if path.is_dir() else file.name
        data = file.read_bytes()
        digest.update(name.encode() + b"\0" + data)
        text = data.decode("utf-8", errors="replace")
        if not text.strip():
            raise CorpusError(f"{name}: the file is empty")
        if file.suffix != ".jsonl":
            documents[name] = text
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                item = _record(f"{name}:{number}", line)
                (documents if isinstance(item, str) else records)[f"{name}:{number}"] = item
    return Corpus(documents, records, digest.hexdigest())
