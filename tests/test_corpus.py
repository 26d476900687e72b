"""A user's training corpus: text files, folders and JSONL become training sequences, split and hashed; bad data
is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvsieve.harness.cli import app
from kvsieve.harness.training.corpus import CorpusError, read_corpus
from kvsieve.harness.training.data import corpus_training_data
from kvsieve.selection.checkpoint import read_gates
from tokenizer import tiny_tokenizer

SEQ = 32
TEXT = "The quick brown fox jumps over the lazy dog. " * 12


def write_corpus(folder):
    (folder / "docs").mkdir(parents=True)
    for i in range(3):
        (folder / "docs" / f"essay{i}.txt").write_text(f"Essay {i}. {TEXT}")
    records = [{"text": f"Record {i}. {TEXT}"} for i in range(2)]
    records += [{"context": f"Alice lives in Paris {i}. {TEXT}", "question": "Where?", "answer": "Paris"}] * 3
    (folder / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return folder


def test_a_folder_of_texts_and_jsonl_becomes_split_hashed_sequences(tmp_path):
    tok = tiny_tokenizer()
    corpus = read_corpus(write_corpus(tmp_path))
    essays = [f"docs/essay{i}.txt" for i in range(3)]
    assert sorted(corpus.documents) == [*essays, "records.jsonl:1", "records.jsonl:2"]
    assert sorted(corpus.records) == ["records.jsonl:3", "records.jsonl:4", "records.jsonl:5"]
    data = corpus_training_data(tok, tmp_path, SEQ, seed=0)
    train, heldout = data.split["train"], data.split["heldout"]
    assert len(heldout) == 2 and not set(train) & set(heldout) and len(train) + len(heldout) == 8
    assert data.split["sha256"] == corpus.sha256 and len(corpus.sha256) == 64
    assert all(s.ndim == 2 and 0 < s.shape[1] <= SEQ for s in data.sequences)
    answer = tok("Paris", add_special_tokens=False).input_ids
    qa = [name for name in train if name in corpus.records]
    assert sum(s[0, -len(answer) :].tolist() == answer for s in data.sequences) == len(qa), "QA ends with the answer"
    # each sequence knows how many of its last tokens are the answer: a QA record's, none of a document's
    answers = [data.answer(i) for i in range(len(data.sequences))]
    assert sorted(set(answers)) == [0, len(answer)] and answers.count(len(answer)) == len(qa)
    assert all(s[0, -data.answer(i) :].tolist() == answer for i, s in enumerate(data.sequences) if data.answer(i))
    (tmp_path / "docs" / "essay0.txt").write_text(f"Essay 0, changed. {TEXT}")
    assert read_corpus(tmp_path).sha256 != corpus.sha256, "the hash follows the content"


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("", "the file is empty"),
        ("short text", "shorter than one training sequence of 32"),
        ('{"context": "c", "question": "q"}\n', "missing \\['answer'\\]"),
        ('{"txt": "a"}\n', "needs a 'text' field"),
        ('{"text": " "}\n', "the text is empty"),
        ("[1, 2]\n", "a record must be a JSON object"),
        ("{not json\n", "not a JSON object"),
    ],
)
def test_bad_data_is_refused_by_name(tmp_path, content, error):
    path = tmp_path / ("bad.jsonl" if content.strip().startswith(("{", "[")) else "bad.txt")
    path.write_text(content)
    with pytest.raises(CorpusError, match=error):
        corpus_training_data(tiny_tokenizer(), path, SEQ, seed=0)


def test_missing_paths_and_empty_folders(tmp_path):
    with pytest.raises(CorpusError, match="no such file or folder"):
        read_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no files"):
        read_corpus(tmp_path / "empty")


def test_train_gates_on_a_corpus_records_it(model_dir, tmp_path):
    out = tmp_path / "gates"
    args = ["train-gates", "--model", str(model_dir), "--out", str(out), "--steps", "2", "--seq-len", str(SEQ)]
    corpus = write_corpus(tmp_path / "corpus")
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "8", "--data", str(corpus)])
    assert result.exit_code == 0, result.output
    _, record = read_gates(out)
    assert record.data["sha256"] == read_corpus(corpus).sha256 and len(record.data["heldout"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "8", "--data", str(bad)])
    assert result.exit_code == 2 and "needs a 'text' field" in result.output
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "8", "--dtype", "int8"])
    assert result.exit_code == 2 and "unknown dtype 'int8'" in result.output
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "8", "--device", "gpu0"])
    assert result.exit_code == 2 and "unknown device 'gpu0'" in result.output
    if not torch.cuda.is_available():
        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "8", "--device", "cuda"])
        assert result.exit_code == 2 and "sees no CUDA GPU" in result.output
    assert torch.load(out / "train_state.pt", weights_only=True)["step"] == 2
