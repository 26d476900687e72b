"""The metric of the generation tasks `benchmarks/lm_eval_tasks.py` writes (lm-eval loads it with `!function`)."""

from __future__ import annotations

from kvsieve.harness.eval.answers import string_match


def contains_answers(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's `process_results` for one document: `match` is 1 when the output holds every expected
    answer, ignoring case (kvsieve's task scoring, RULER's `string_match_all`)."""
    return {"match": float(string_match(results[0], tuple(doc["answers"])) == 100.0)}
