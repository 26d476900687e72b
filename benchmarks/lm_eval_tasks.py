"""lm-evaluation-harness itself, on local tasks made by kvsieve's generators, every policy under real eviction.

The tasks are written as lm-eval YAML + JSONL (to `results/lm_eval_tasks/`) and run through
`lm_eval.simple_evaluate(model="kvsieve", ...)`, lm-eval's own entry point, which finds the model
type by name and computes accuracy and its standard error as it does for any model:

- `kvsieve_needle_mc` / `kvsieve_needle_gen`: RULER `niah_multikey_1` (about `--length` tokens): the
  gold value and the three distractor needles' values as choices (loglikelihood), or the answer
  generated (generate_until, correct when it holds the value);
- `kvsieve_routing_mc` / `kvsieve_routing_gen`: the routing suite's `multi_entity`, the same two forms;
- `kvsieve_essays_rolling`: held-back essays of `--doc-tokens` tokens, loglikelihood_rolling (word
  perplexity), through a bounded cache of `(1 - rate) x doc-tokens` entries per (layer, kv-head).

Prompts are the sweep's (`prompt_texts`: the chat template where the tokenizer has one); the
compression is question-agnostic (the prompt but its last token). Contenders: the full cache, then
`--policies` at every rate.

    python benchmarks/lm_eval_tasks.py [--samples 20] [--length 1024] [--rates 0.5,0.75,0.9]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager

import kvsieve
import kvsieve.harness.lmeval
from gates_provenance import default_gates, gates_note
from kvsieve.harness.data.essays import essay_split, sample_documents
from kvsieve.harness.data.sample import prompt_texts
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from results_io import RESULTS, Output

TASK_FILES = Path(__file__).parent / "lm_eval_task_files"
POLICIES = ("trimkv+global", "snapkv", "expected", "streaming")
#: (task form, generator task) -> lm-eval task name
TASKS = {("mc", "niah_multikey_1"): "kvsieve_needle_mc", ("gen", "niah_multikey_1"): "kvsieve_needle_gen"}
TASKS |= {("mc", "multi_entity"): "kvsieve_routing_mc", ("gen", "multi_entity"): "kvsieve_routing_gen"}
ROLLING = "kvsieve_essays_rolling"
BUFFER = 64
#: Prompts generated together (left-padded); loglikelihood groups by context whatever it is.
BATCH = 4

_HEADER = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
_MC = "output_type: multiple_choice\ntarget_delimiter: ''\ndoc_to_text: '{{prompt}}'\n"
_MC += "doc_to_choice: '{{choices}}'\ndoc_to_target: 0\nmetric_list:\n  - metric: acc\n    higher_is_better: true\n"
_GEN = "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{gold}}'\n"
_GEN += "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {tokens}\n  do_sample: false\n"
_GEN += "process_results: !function answers.contains_answers\nmetric_list:\n  - metric: match\n"
_GEN += "    aggregation: mean\n    higher_is_better: true\n"
_ROLLING = "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
_ROLLING += (
    "metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
)
_ROLLING += "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"


def _write_task(folder: Path, name: str, docs: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{name}.yaml").write_text(f"task: {name}\n" + _HEADER.format(data=data) + body)


def write_tasks(folder: Path, tokenizer, samples: int, length: int, doc_tokens: int) -> None:
    """Every task's YAML and JSONL (and the generation metric's module) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TASK_FILES / "answers.py", folder / "answers.py")
    for task in {task for _, task in TASKS}:
        docs = []
        for sample in task_samples(task, tokenizer, length=length, n=samples, seed=0):
            context, question = prompt_texts(sample, tokenizer)
            choices = [sample.gold, *sample.candidates[:3]]
            docs.append({"prompt": context + question, "choices": choices, "gold": sample.gold})
            docs[-1] |= {"answers": list(sample.answers), "max_new_tokens": sample.max_new_tokens}
        _write_task(folder, TASKS["mc", task], docs, _MC)
        tokens = max(doc["max_new_tokens"] for doc in docs)
        _write_task(folder, TASKS["gen", task], docs, _GEN.replace("{tokens}", str(tokens)))
    essays = sample_documents(tokenizer, 6, doc_tokens, names=essay_split()[1])
    texts = [{"text": tokenizer.decode(ids[0], skip_special_tokens=True)} for _, ids in essays]
    _write_task(folder, ROLLING, texts, _ROLLING)


def evaluate(folder: Path, model_args: dict, tasks: list[str]) -> dict:
    """lm-eval's results for `tasks` with the model type ``kvsieve`` and these model_args."""
    out = lm_eval.simple_evaluate(
        model="kvsieve",
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(folder)),
        device="cpu",
        bootstrap_iters=1000,
    )
    return out["results"]


def contenders(policies: list[str], rates: list[float], doc_tokens: int) -> list[tuple[str, float | None, dict, dict]]:
    """(policy, rate, model_args for the task forms, model_args for the rolling task) in run order."""
    rows = [("full", None, {"policy": "full", "batch_size": BATCH}, {"policy": "full"})]
    for rate in rates:
        size = round((1 - rate) * doc_tokens)
        task_args = {"rate": rate, "batch_size": BATCH}
        for policy in policies:
            rows.append((policy, rate, {"policy": policy, **task_args}, {"policy": policy, "max_tokens": size}))
    return rows


def measure(args: argparse.Namespace) -> dict:
    """Every contender on every task; lm-eval's numbers as it reports them."""
    model, tokenizer = kvsieve.load_model()
    folder = RESULTS / "lm_eval_tasks"
    write_tasks(folder, tokenizer, args.samples, args.length, args.doc_tokens)
    forms = list(TASKS.values())
    rows = []
    for policy, rate, task_args, rolling_args in contenders(args.policies, args.rates, args.doc_tokens):
        start = time.perf_counter()
        results = evaluate(folder, task_args, forms)
        results |= evaluate(folder, rolling_args | {"buffer": BUFFER}, [ROLLING])
        rows.append({"policy": policy, "rate": rate, "results": results, "seconds": time.perf_counter() - start})
        console.print(f"{policy} at {rate}: {time.perf_counter() - start:.0f} s")
    settings = {"samples": args.samples, "length": args.length, "doc_tokens": args.doc_tokens, "buffer": BUFFER}
    settings |= {"default_gates": default_gates(model)}
    return {"model": "smollm2-135m", "lm_eval": lm_eval.__version__, **settings, "rows": rows}


def _cell(results: dict, task: str, metric: str) -> str:
    value, stderr = results[task][f"{metric},none"], results[task].get(f"{metric}_stderr,none")
    if metric == "word_perplexity":
        return f"{value:.2f}"
    spread = f" ± {stderr:.2f}" if isinstance(stderr, float) and math.isfinite(stderr) else ""
    return f"{value:.2f}{spread}"


def markdown(report: dict) -> str:
    """One row per contender: accuracy ± stderr per task form, word perplexity of the rolling task."""
    header = ["policy", "rate", *TASKS.values(), f"{ROLLING} (word PPL)"]
    body = []
    for row in report["rows"]:
        results = row["results"]
        cells = [_cell(results, t, "acc" if t.endswith("_mc") else "match") for t in TASKS.values()]
        rate = "" if row["rate"] is None else f"{row['rate']:.2f}"
        body.append([row["policy"], rate, *cells, _cell(results, ROLLING, "word_perplexity")])
    note = (
        f"\nlm-eval {report['lm_eval']} on the default model; {report['samples']} samples per task at about "
        f"{report['length']} tokens; accuracy ± lm-eval's standard error. Rolling: 6 held-back essays of "
        f"{report['doc_tokens']} tokens through a bounded cache of (1 - rate) x {report['doc_tokens']} entries per "
        f"(layer, kv-head), buffer {report['buffer']}.{gates_note(report.get('default_gates'))}\n"
    )
    return markdown_table(header, body) + note


TABLE = Output("lm_eval_tasks", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.75, 0.9])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    args = parser.parse_args()
    report = measure(args)
    console.print(markdown(report))
    console.print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
