"""`kvsieve` command line: perplexity and task sweeps, reports, eviction maps, the demo, the list of policies."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.markup import escape
from rich.table import Table

from ..modeling.gates import Horizons
from ..runtime.api.compress import compress
from ..runtime.attention.sieve import sieve_attention
from ..runtime.compat import cache_argument
from ..runtime.eviction.growth import DEFAULT_BUFFER
from ..runtime.observing.prefill import observe_prefill
from ..selection.allocators import ALLOCATORS
from ..selection.budget import check_count, check_rate
from ..selection.merge import MERGES
from ..selection.projection import PROJECTIONS
from ..selection.protection import PROTECTION_DEFAULTS
from ..selection.scorers import SCORERS
from ..selection.spec import make_policy, make_projection, parse_merge, split_policies
from . import install_hint
from .data import essay_split, essay_texts, sample_documents
from .data.sample import TaskSample
from .data.suites import resolve_tasks, task_samples
from .eval import run_ppl
from .eval.allocation import budget_allocation
from .eval.analysis import accuracy_by_rate
from .eval.contenders import kvsieve_method, parse_contenders, with_kv_bits
from .eval.contract_diagnostic import (
    ATTENTION_MASS,
    DIAGNOSTIC_TASKS,
    SCALARS,
    Contract,
    default_scalars,
    diagnostic_methods,
    run_diagnostic,
)
from .eval.diagnostic_tables import worked_case
from .eval.methods import CacheMethod, KvsievePolicy
from .eval.results_log import StaleRowsError
from .eval.streaming import (
    BUCKET,
    DOC_TOKENS,
    SOURCES,
    STREAM_POLICIES,
    STREAM_ROWS_PER_PASS,
    plan_streaming,
    streaming_documents,
)
from .eval.sweep import SurvivalCell, check_modes, run_sweep, sample_key, sample_survival
from .models import DEFAULT_MODEL, ModelChoice, ModelNotFoundError, load_model, torch_device, torch_dtype
from .progress import console, progress_bar
from .report import markdown_table, plot_ppl, plot_stream_ppl, ppl_markdown, ppl_table, stream_table
from .report.diagnostic_page import DIAGNOSTIC_FILE, DIAGNOSTIC_MANIFEST, WORKED_MAP, write_diagnostic_page
from .report.figures import plot_allocation, plot_eviction_map
from .report.html import MANIFEST_FILE, RESULTS_FILE, accuracy_pivot, write_report
from .runners import LocalRunner, Runner, run_once
from .training.data import corpus_training_data
from .training.ensemble import ensemble_gates
from .training.losses import SCOPES
from .training.soup import average_gates
from .training.train import TrainConfig, check_training, phase_data, train_gates

#: What the demo compares: our best policy first (the default model ships its gates), then heuristics and random.
DEMO_POLICIES = ("trimkv+global", "importance", "snapkv+adaptive", "random")
MODEL_HELP = "gemma3-270m (after `make gemma`), an HF id, a model dir or a .gguf (default: SmolLM2-135M)"

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def _split(text: str, cast: type) -> list:
    try:
        return [cast(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise typer.BadParameter(f"cannot read {text!r} as a comma-separated list: {err}") from None


def _parsed(hint: str, parse: Callable[[], Any]) -> Any:
    """Run a parser; its ValueError becomes a clean command-line error naming the option."""
    try:
        return parse()
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint=hint) from None


@contextmanager
def _resuming() -> Iterator[None]:
    """A results log in --out that holds rows made otherwise (`StaleRowsError`) is an error naming --out."""
    try:
        yield
    except StaleRowsError as err:
        raise typer.BadParameter(str(err), param_hint="--out") from None


DeviceOption = Annotated[str, typer.Option(help="where the model runs: cpu, cuda, cuda:1, mps")]
DtypeOption = Annotated[str, typer.Option(help="the model's dtype: float32, bfloat16, float16")]
KvBitsOption = Annotated[
    int | None,
    typer.Option(
        "--kv-bits", help="store every kvsieve policy's kept entries in 8, 4 or 2 bits (or kv_bits= in a policy)"
    ),
]


def loaded(choice: ModelChoice) -> tuple[Any, Any]:
    """`choice.load()`; a model or tokenizer that cannot be found or read is an error naming --model."""
    try:
        return choice.load()
    except ModelNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint="--model") from None


def parse_model(name: str | None, device: str, dtype: str) -> ModelChoice:
    """The model a command runs (`MODEL_HELP`), checked before anything loads (clear errors naming the option)."""
    return ModelChoice(
        name, _parsed("--device", lambda: torch_device(device)), _parsed("--dtype", lambda: torch_dtype(dtype))
    )


RayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="run on a Ray cluster: auto (on a node of a running one), host:port, or local (needs the ray extra)",
    ),
]
WorkersOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="model replicas on Ray (default: one per GPU for a CUDA model, else one per node); alone: --ray local",
    ),
]
CpusPerWorkerOption = Annotated[
    int | None, typer.Option(min=1, help="CPU cores (and torch threads) of each Ray replica (default: an even share)")
]


@contextmanager
def open_runner(
    choice: ModelChoice, ray: str | None, workers: int | None, cpus_per_worker: int | None
) -> Iterator[tuple[Runner, Any]]:
    """`(runner, tokenizer)`: the model loaded here, or replicas on Ray when --ray or --workers is given."""
    if ray is None and workers is None:
        if cpus_per_worker is not None:
            raise typer.BadParameter("only applies with --ray or --workers", param_hint="--cpus-per-worker")
        model, tokenizer = loaded(choice)
        yield LocalRunner(model, tokenizer), tokenizer
        return
    try:
        from .runners.ray_runner import LOCAL, RayRunner
    except ImportError:
        raise typer.BadParameter(f"Ray is not installed: {install_hint('ray')}", param_hint="--ray") from None
    runner = RayRunner(choice, ray or LOCAL, workers, cpus_per_worker)
    try:
        runner.start()
    except ConnectionError as err:
        raise typer.BadParameter(f"cannot reach a Ray cluster at {ray!r}: {err}", param_hint="--ray") from None
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--workers") from None
    try:
        yield runner, choice.load_tokenizer()
    finally:
        runner.stop()


def ppl_experiment(
    runner: Runner,
    tokenizer: Any,
    policies: list[str],
    rates: list[float],
    docs: int,
    prefix: int,
    continuation: int,
    seed: int,
    essays: list[str] | None = None,
) -> dict[str, Any]:
    """Sample documents (of `essays`, default all), run the protocol with a progress bar, print the table."""
    documents = sample_documents(tokenizer, docs, prefix + continuation + 1, seed=seed, names=essays)
    with progress_bar("prefill once, sieve many") as progress:
        result = run_ppl(runner, documents, policies, rates, prefix, continuation, progress=progress)
    report = result.to_json()
    console.print(ppl_table(report))
    return report


#: `kvsieve ppl` options of the perplexity-degradation protocol and of the streaming protocol, by flag.
RATE_OPTIONS = ("--rates",)
STREAM_OPTIONS = ("--max-tokens", "--buffer", "--doc-tokens", "--bucket", "--source", "--rows")
DEFAULT_RATES = "0.5,0.7,0.8,0.9"


def _check_ppl_mode(stream: bool, given: dict[str, object]) -> None:
    """Clear errors for options of the other protocol, and for --stream without budgets."""
    chosen = [flag for flag, value in given.items() if value is not None]
    if "--max-tokens" in chosen and "--rates" in chosen:
        raise typer.BadParameter(
            "--max-tokens (streaming budgets) and --rates (eviction rates) belong to different protocols; give one",
            param_hint="--max-tokens",
        )
    if stream and "--max-tokens" not in chosen:
        raise typer.BadParameter("--stream needs budgets: --max-tokens 512[,1024,...]", param_hint="--max-tokens")
    wrong = [f for f in chosen if f in (RATE_OPTIONS if stream else STREAM_OPTIONS)]
    if wrong:
        hint = "without --stream" if stream else "with --stream"
        raise typer.BadParameter(f"{', '.join(wrong)} only apply {hint}", param_hint=wrong[0])


def stream_experiment(
    runner: Runner,
    tokenizer: Any,
    policies: list[str],
    budgets: list[int],
    docs: int,
    seed: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Build the documents, check the plan (fails fast), run with a progress bar, print the table."""
    documents = _parsed(
        "--doc-tokens", lambda: streaming_documents(tokenizer, docs, options["doc_tokens"], options["source"], seed)
    )
    plan = _parsed(
        "--max-tokens",
        lambda: plan_streaming(
            runner,
            documents,
            policies,
            budgets,
            buffer=options["buffer"],
            bucket=options["bucket"],
            rows_per_pass=options["rows"],
        ),
    )
    with progress_bar("streaming perplexity") as progress:
        report = plan.run(runner, progress).to_json()
    console.print(stream_table(report))
    return report


@app.command()
def ppl(
    policies: Annotated[
        str | None,
        typer.Option(
            help="comma-separated specs scorer[+allocator][:k=v,...], e.g. snapkv+adaptive:window=16 "
            f"(default: importance,random; with --stream: {','.join(STREAM_POLICIES)}; kvpress:<press> too)"
        ),
    ] = None,
    rates: Annotated[str | None, typer.Option(help=f"eviction rates in [0, 1) (default {DEFAULT_RATES})")] = None,
    docs: Annotated[int, typer.Option(min=1, help="documents")] = 8,
    prefix: Annotated[int, typer.Option(min=64, help="prefilled tokens per document (rates)")] = 1024,
    continuation: Annotated[int, typer.Option(min=1, help="scored tokens per document (rates)")] = 512,
    seed: Annotated[int, typer.Option(help="document choice")] = 0,
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    kv_bits: KvBitsOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results here")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG path (default: next to --json)")] = None,
    stream: Annotated[
        bool, typer.Option("--stream", help="streaming perplexity: whole documents, bounded cache")
    ] = False,
    max_tokens: Annotated[
        str | None, typer.Option("--max-tokens", help="--stream budgets: entries per (layer, kv-head), e.g. 512,1024")
    ] = None,
    buffer: Annotated[int | None, typer.Option(min=1, help=f"--stream tokens per forward ({DEFAULT_BUFFER})")] = None,
    doc_tokens: Annotated[int | None, typer.Option(min=2, help=f"--stream tokens per document ({DOC_TOKENS})")] = None,
    bucket: Annotated[int | None, typer.Option(min=1, help=f"--stream position bucket width ({BUCKET})")] = None,
    source: Annotated[str | None, typer.Option(help=f"--stream documents: {', '.join(SOURCES)} (essays)")] = None,
    rows: Annotated[
        int | None, typer.Option(min=1, help=f"--stream documents per batch ({STREAM_ROWS_PER_PASS})")
    ] = None,
    ray: RayOption = None,
    workers: WorkersOption = None,
    cpus_per_worker: CpusPerWorkerOption = None,
) -> None:
    """Perplexity against the full cache per policy: rates after a prefill, or --stream at fixed budgets.

    The protocols: docs/protocols.md.
    """
    given = dict(zip(RATE_OPTIONS, (rates,), strict=True))
    given |= dict(zip(STREAM_OPTIONS, (max_tokens, buffer, doc_tokens, bucket, source, rows), strict=True))
    _check_ppl_mode(stream, given)
    choice = parse_model(model, device, dtype)
    if stream:
        options = {"buffer": buffer or DEFAULT_BUFFER, "doc_tokens": doc_tokens or DOC_TOKENS}
        options |= {"bucket": bucket or BUCKET, "source": source or SOURCES[0], "rows": rows or STREAM_ROWS_PER_PASS}
        budgets = _split(max_tokens, int)
        policy_list = with_kv_bits(split_policies(policies or ",".join(STREAM_POLICIES)), kv_bits)
        _parsed("--policies", lambda: parse_contenders(policy_list))
        _parsed("--max-tokens", lambda: [check_count("--max-tokens", b) for b in budgets])
        with open_runner(choice, ray, workers, cpus_per_worker) as (runner, tokenizer):
            report = stream_experiment(runner, tokenizer, policy_list, budgets, docs, seed, options)
    else:
        rate_list = _split(rates or DEFAULT_RATES, float)
        policy_list = with_kv_bits(split_policies(policies or "importance,random"), kv_bits)
        _parsed("--policies", lambda: [kvsieve_method(p) for p in policy_list])
        _parsed("--rates", lambda: [check_rate(r) for r in rate_list])
        with open_runner(choice, ray, workers, cpus_per_worker) as (runner, tokenizer):
            report = ppl_experiment(runner, tokenizer, policy_list, rate_list, docs, prefix, continuation, seed)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        plot = plot or json_path.with_suffix(".png")
    if plot:
        (plot_stream_ppl if stream else plot_ppl)(report, plot)
        console.print(f"wrote {plot}")


@app.command()
def policies() -> None:
    """List the scorers, the allocators, the projections, the merges and their parameters."""
    registries = (
        ("scorers", SCORERS),
        ("allocators (scorer+allocator)", ALLOCATORS),
        ("projections (:projection=NAME)", PROJECTIONS),
        ("merges of what a head evicts (:merge=NAME)", MERGES),
    )
    for title, registry in registries:
        console.rule(title)
        for name, cls in registry.items():
            params = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))
            doc = (cls.__doc__ or "").strip().splitlines()[0]
            console.print(f"[bold]{name}[/bold]({params})  {escape(doc)}")
    protection = ", ".join(f"{key}={value}" for key, value in PROTECTION_DEFAULTS.items())
    console.print(
        f"every policy also takes {protection} (protected entries), projection= (default: the one its gates' "
        "checkpoint records, else topk) and merge= (default: the one its gates' checkpoint records, else none)"
    )
    console.print("spec: scorer[+allocator][:key=value,...], e.g. snapkv+adaptive:window=16,safeguard=0.3")


def _generate(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> torch.Tensor:
    with sieve_attention(model):
        out = model.generate(
            ids, **cache_argument(model, cache), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, ids.shape[1] :]


def demo_tasks(model: Any, tokenizer: Any, folder: Path) -> list[str]:
    """The demo's task section: two tasks, question-agnostic and -aware, at rate 0.5; returns Markdown lines."""
    samples = task_samples("niah_single_2,base", tokenizer, length=1024, n=2, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULTS_FILE).unlink(missing_ok=True)  # a fresh run, not a resumed one
    with progress_bar("tasks: niah_single_2 and routing/base at 1k tokens") as progress:
        rows = run_sweep(
            LocalRunner(model, tokenizer),
            samples,
            ",".join(DEMO_POLICIES),
            [0.5],
            ("agnostic", "aware"),
            results=folder / RESULTS_FILE,
            progress=progress,
        )
    stats = accuracy_by_rate(rows)
    stats = stats[(stats["policy"] == "full") | (stats["rate"] > 0)]
    header = ["mode", "policy", "rate", "accuracy %", "gold log-prob", "GER", "KV MiB"]
    table = Table(*header, title=f"Tasks: {len(samples)} samples (niah_single_2, routing/base), 1k tokens")
    body = []
    for r in stats.itertuples():
        cells = [
            r.mode,
            r.policy,
            f"{r.rate:.0%}",
            f"{100 * r.accuracy:.0f}",
            f"{r.mean_gold_logprob:.2f}",
            f"{r.mean_ger:.2f}",
            f"{r.mean_kv_bytes / 2**20:.2f}",
        ]
        table.add_row(*cells)
        body.append(cells)
    console.print(table)
    page = write_report(folder)
    heading = "## Task accuracy (RULER-style needle and a routing probe)"
    return [heading, "", markdown_table(header, body), "", f"Full sweep report: [{page.name}](tasks/{page.name})", ""]


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="report folder")] = Path("reports/demo"),
    docs: Annotated[int, typer.Option(min=1)] = 3,
    prefix: Annotated[int, typer.Option(min=64)] = 512,
    continuation: Annotated[int, typer.Option(min=1)] = 256,
) -> None:
    """A short tour on the embedded default model: compress, generate, and a small perplexity table + report."""
    console.rule("kvsieve demo: SmolLM2-135M-Instruct (embedded GGUF), CPU")
    model, tokenizer = load_model()
    _, heldout = essay_split()  # essays the shipped gates never saw in training
    text = essay_texts()[heldout[0]]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :prefix]
    question = tokenizer("\n\nIn short, the essay says that", return_tensors="pt", add_special_tokens=False)
    full_ids = torch.cat([ids, question.input_ids], dim=-1)

    caches = {"full cache": observe_prefill(model, ids).cache}
    caches |= {policy: compress(model, ids, policy, rate=0.8) for policy in DEMO_POLICIES}
    sizes = {name: cache.nbytes() for name, cache in caches.items()}
    samples = {name: _generate(model, full_ids, cache, 24) for name, cache in caches.items()}
    lines = [
        f"context: {ids.shape[1]} tokens of the essay '{heldout[0]}', then a prompt; rate 0.8; greedy, 24 new tokens",
        "",
    ]
    for name, tokens in samples.items():
        answer = tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ")
        console.print(f"{name:>15}: {sizes[name] / 2**20:6.2f} MiB KV after prefill | {answer}")
        lines.append(f"- **{name}** ({sizes[name] / 2**20:.2f} MiB of KV after prefill): {answer}")

    task_lines = demo_tasks(model, tokenizer, out / "tasks")
    report = ppl_experiment(
        LocalRunner(model, tokenizer),
        tokenizer,
        list(DEMO_POLICIES),
        [0.5, 0.8, 0.9],
        docs,
        prefix,
        continuation,
        seed=0,
        essays=heldout,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "ppl.json").write_text(json.dumps(report, indent=2))
    plot_ppl(report, out / "ppl.png")
    markdown = "\n".join(
        [
            "# kvsieve demo",
            "",
            "## Generation from a compressed cache",
            "",
            *lines,
            "",
            *task_lines,
            "## Perplexity change against the full cache (held-back essays, which the shipped gates never saw)",
            "",
            ppl_markdown(report),
            "![delta% vs rate](ppl.png)",
            "",
        ]
    )
    (out / "report.md").write_text(markdown)
    console.print(f"wrote {out / 'report.md'}, {out / 'ppl.json'}, {out / 'ppl.png'}, {out / 'tasks' / 'report.html'}")


def _map_path(folder: Path, sample: TaskSample, mode: str, contender: CacheMethod, rate: float) -> Path:
    name = f"{sample.task}-{sample.index}-{mode}-{contender.name}-{rate:g}"
    return folder / (re.sub(r"[^A-Za-z0-9._+=-]", "_", name) + ".png")


def write_eviction_map(
    runner: Runner, sample: TaskSample, contender: CacheMethod, rate: float, mode: str, path: Path
) -> Path:
    survival, evidence = run_once(runner, sample_survival, SurvivalCell(sample, contender, rate, mode))
    title = f"{sample.task} #{sample.index}, {contender.name} at {rate:.0%} ({mode}); evidence marked"
    return plot_eviction_map(survival, evidence, path, title=title)


@app.command()
def sweep(
    tasks: Annotated[
        str, typer.Option(help="tasks or suites (ruler, routing, unseen, varied, procedural), comma-separated")
    ] = "ruler",
    policies: Annotated[
        str,
        typer.Option(
            help="kvsieve specs and kvpress:<press> names; <spec>@force=all/caote forces each sample's evidence "
            "in (the evidence-first oracle); the full cache is always run"
        ),
    ] = "snapkv,expected,importance,random",
    rates: Annotated[str, typer.Option(help="comma-separated eviction rates in [0, 1)")] = "0.5,0.75,0.9",
    samples: Annotated[int, typer.Option(min=1, help="samples per task")] = 10,
    length: Annotated[int, typer.Option(min=128, help="prompt tokens per sample")] = 2048,
    modes: Annotated[str, typer.Option(help="agnostic, aware, or agnostic,aware")] = "agnostic",
    seed: Annotated[int, typer.Option(help="sample generation")] = 0,
    out: Annotated[
        Path,
        typer.Option(help="results folder (results.jsonl, appended to: a rerun resumes; results.parquet when done)"),
    ] = Path("results/sweep"),
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    kv_bits: KvBitsOption = None,
    chat: Annotated[bool | None, typer.Option("--chat/--no-chat", help="chat template (default: if any)")] = None,
    maps: Annotated[bool, typer.Option(help="eviction maps of each task's first sample at the top rate")] = True,
    ray: RayOption = None,
    workers: WorkersOption = None,
    cpus_per_worker: CpusPerWorkerOption = None,
) -> None:
    """Task accuracy per policy and rate on RULER-style tasks and the routing suite, with routing diagnostics."""
    task_names = _parsed("--tasks", lambda: resolve_tasks(tasks))
    contenders = _parsed("--policies", lambda: parse_contenders(with_kv_bits(split_policies(policies), kv_bits)))
    rate_list = _parsed("--rates", lambda: [check_rate(r) for r in _split(rates, float)])
    mode_list = _parsed("--modes", lambda: check_modes([m.strip() for m in modes.split(",") if m.strip()]))
    choice = parse_model(model, device, dtype)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {**choice.describe(), "tasks": task_names, "policies": [c.name for c in contenders]}
    manifest |= {"rates": rate_list, "modes": mode_list, "samples": samples, "length": length, "seed": seed}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    with open_runner(choice, ray, workers, cpus_per_worker) as (runner, tokenizer):
        items = task_samples(task_names, tokenizer, length=length, n=samples, seed=seed, chat=chat)
        with progress_bar("sweep: prefill once per sample, sieve many") as progress, _resuming():
            rows = run_sweep(
                runner, items, [c.name for c in contenders], rate_list, mode_list,
                results=out / RESULTS_FILE, chat=chat, progress=progress,
            )  # fmt: skip
        if maps:
            write_task_maps(runner, items, contenders[1:], max(rate_list), mode_list[0], out / "maps")
    pivot = accuracy_pivot(accuracy_by_rate(rows))
    table = Table(*map(str, pivot.columns), title="Accuracy (%) by rate (rate 0 = full cache)")
    for line in pivot.itertuples(index=False):
        table.add_row(*(str(v) for v in line))
    console.print(table)
    console.print(f"wrote {out / RESULTS_FILE}; `kvsieve report {out}` makes the HTML page")


def write_task_maps(
    runner: Runner, items: list[TaskSample], contenders: list[CacheMethod], rate: float, mode: str, folder: Path
) -> None:
    """The eviction map of each task's first sample under each contender (those not already drawn)."""
    for task in dict.fromkeys(sample.task for sample in items):
        first = next(sample for sample in items if sample.task == task)
        for contender in contenders:
            path = _map_path(folder, first, mode, contender, rate)
            if not path.exists():
                write_eviction_map(runner, first, contender, rate, mode, path)


def write_worked_map(runner: Runner, items: list[TaskSample], rows: Any, contract: Contract, out: Path) -> Path | None:
    """The eviction map of the report's worked case (attention mass under `contract`), if there is one."""
    case = worked_case(rows)
    if case is None:
        return None
    failure = case[case["scalar"] & (case["policy"] == ATTENTION_MASS)].iloc[0]
    sample = next(s for s in items if sample_key(s) == failure["sample"])
    method = KvsievePolicy(contract.policy(ATTENTION_MASS))
    return write_eviction_map(runner, sample, method, failure["rate"], failure["mode"], out / WORKED_MAP)


def _default_scalars(model: torch.nn.Module, tokenizer: Any, cell: None) -> list[str]:
    """`default_scalars` as a `Work`: it reads the weights, which live where the runner's replicas do."""
    return default_scalars(model)


@app.command()
def diagnose(
    tasks: Annotated[
        str, typer.Option(help="tasks or suites (ruler, routing, unseen, varied, procedural), comma-separated")
    ] = DIAGNOSTIC_TASKS,
    scalars: Annotated[
        str | None, typer.Option(help="ranking scalars swapped into the contract (default: all; trimkv with gates)")
    ] = None,
    rates: Annotated[str, typer.Option(help="comma-separated eviction rates in [0, 1)")] = "0.5,0.75,0.9",
    contract: Annotated[str, typer.Option(help="the fixed rest of a policy: allocator[:parameters]")] = "uniform",
    samples: Annotated[int, typer.Option(min=1, help="samples per task")] = 5,
    length: Annotated[int, typer.Option(min=128, help="prompt tokens per sample")] = 1024,
    modes: Annotated[str, typer.Option(help="agnostic, aware, or agnostic,aware")] = "agnostic,aware",
    seed: Annotated[int, typer.Option(help="sample generation")] = 0,
    out: Annotated[Path, typer.Option(help="results folder (a rerun resumes)")] = Path("results/diagnostic"),
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    ray: RayOption = None,
    workers: WorkersOption = None,
    cpus_per_worker: CpusPerWorkerOption = None,
) -> None:
    """Why a policy fails: margins, failure modes and fixes under one fixed contract (arXiv 2605.08234)."""
    task_names = _parsed("--tasks", lambda: resolve_tasks(tasks))
    fixed = Contract(contract)
    scalar_list = [s.strip() for s in (scalars or ",".join(SCALARS)).split(",") if s.strip()]
    _parsed("--scalars", lambda: diagnostic_methods(scalar_list, fixed))
    rate_list = _parsed("--rates", lambda: [check_rate(r) for r in _split(rates, float)])
    mode_list = _parsed("--modes", lambda: check_modes([m.strip() for m in modes.split(",") if m.strip()]))
    choice = parse_model(model, device, dtype)
    with open_runner(choice, ray, workers, cpus_per_worker) as (runner, tokenizer):
        scalar_list = scalar_list if scalars else run_once(runner, _default_scalars, None)
        items = task_samples(task_names, tokenizer, length=length, n=samples, seed=seed)
        out.mkdir(parents=True, exist_ok=True)
        settings = {**choice.describe(), "tasks": task_names, "scalars": scalar_list, "rates": rate_list}
        settings |= {"modes": mode_list, "contract": contract, "samples": samples, "length": length, "seed": seed}
        (out / DIAGNOSTIC_MANIFEST).write_text(json.dumps(settings, indent=2))
        with progress_bar("diagnose: one prefill per case, every contract evicts from it") as progress, _resuming():
            rows = run_diagnostic(
                runner, items, scalar_list, rate_list, mode_list, contract=fixed,
                results=out / DIAGNOSTIC_FILE, progress=progress,
            )  # fmt: skip
        write_worked_map(runner, items, rows, fixed, out)
    console.print(f"wrote {write_diagnostic_page(out)}")


@app.command()
def report(
    folder: Annotated[Path, typer.Argument(help="a folder written by `kvsieve sweep` or `kvsieve diagnose`")],
) -> None:
    """Turn a sweep folder into one HTML page with the tables and figures (a diagnostic folder into diagnostic.md)."""
    try:
        page = write_diagnostic_page(folder) if (folder / DIAGNOSTIC_FILE).exists() else write_report(folder)
    except FileNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint="FOLDER") from None
    console.print(f"wrote {page}")


@app.command(name="map")
def eviction_map(
    task: Annotated[str, typer.Option(help="a RULER task or routing family")] = "niah_single_1",
    index: Annotated[int, typer.Option(min=0, help="which sample of the task")] = 0,
    policy: Annotated[str, typer.Option(help="a kvsieve spec or kvpress:<press>")] = "snapkv",
    rate: Annotated[float, typer.Option(help="eviction rate in [0, 1)")] = 0.9,
    length: Annotated[int, typer.Option(min=128)] = 2048,
    mode: Annotated[str, typer.Option(help="agnostic or aware")] = "agnostic",
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[Path, typer.Option(help="PNG path")] = Path("eviction_map.png"),
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    kv_bits: KvBitsOption = None,
) -> None:
    """The eviction map of one sample: which (layer, kv-head) keeps which context token, evidence marked."""
    names = _parsed("--task", lambda: resolve_tasks(task))
    contender = _parsed("--policy", lambda: parse_contenders(with_kv_bits([policy], kv_bits))[-1])
    _parsed("--rate", lambda: check_rate(rate))
    _parsed("--mode", lambda: check_modes([mode]))
    lm, tokenizer = loaded(parse_model(model, device, dtype))
    sample = task_samples(names, tokenizer, length=length, n=index + 1, seed=seed)[index]
    path = write_eviction_map(LocalRunner(lm, tokenizer), sample, contender, rate, mode, out)
    console.print(f"wrote {path}")


@app.command()
def allocation(
    policy: Annotated[str, typer.Option(help="a kvsieve spec; its allocator is shown beside uniform")] = (
        "trimkv+global"
    ),
    rate: Annotated[float, typer.Option(help="eviction rate in [0, 1)")] = 0.8,
    text: Annotated[Path | None, typer.Option(help="a text file (default: a held-back essay)")] = None,
    tokens: Annotated[int, typer.Option(min=16, help="prompt length (the text's first tokens)")] = 1024,
    out: Annotated[Path, typer.Option(help="PNG path (the numbers go to the same name .json)")] = Path(
        "allocation.png"
    ),
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
) -> None:
    """Where the budget goes: entries kept per (layer, kv-head) under the policy's allocator beside uniform."""
    _parsed("--policy", lambda: make_policy(policy))
    _parsed("--rate", lambda: check_rate(rate))
    lm, tokenizer = loaded(parse_model(model, device, dtype))
    if text is None:
        ids = sample_documents(tokenizer, 1, tokens, names=essay_split()[1])[0][1]
    else:
        if not text.is_file():
            raise typer.BadParameter(f"{text}: no such file", param_hint="--text")
        ids = tokenizer(text.read_text(), return_tensors="pt").input_ids[:, :tokens]
    found = _parsed("--policy", lambda: budget_allocation(lm, ids, policy, rate))
    path = plot_allocation(found, out)
    path.with_suffix(".json").write_text(json.dumps(found.to_json(), indent=2) + "\n")
    shares = sorted(zip(found.layer_shares(), found.layers, strict=True), reverse=True)[:3]
    most = ", ".join(f"L{layer} {share:.2f}x" for share, layer in shares)
    console.print(f"wrote {path} and {path.with_suffix('.json')}; layers given most beyond uniform: {most}")


def _deprecated_option(old: str, new: str) -> None:
    typer.echo(f"warning: {old} is deprecated and will be removed in kvsieve 0.4; use {new}", err=True)


def _lengths(text: str | None) -> tuple[int, ...]:
    """`--curriculum 1024,4096` as lengths (empty when not given)."""
    if text is None:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of sequence lengths, e.g. 1024,4096") from None


def _capacity_and_scope(capacity: str | None, scope: str | None, budget: int | None) -> tuple[int, str]:
    """`--capacity M` and `--scope`, with kvsieve 0.1's `--budget M` and `--capacity global|head` mapped onto them."""
    if capacity in SCOPES:
        _deprecated_option(f"--capacity {capacity} (the scope)", f"--scope {capacity}")
        capacity, scope = None, scope or capacity
    if budget is not None:
        _deprecated_option("--budget", "--capacity")
        if capacity is not None:
            raise typer.BadParameter("give --capacity only (--budget is its deprecated name)", param_hint="--budget")
        capacity = str(budget)
    try:
        entries = TrainConfig.capacity if capacity is None else int(capacity)
    except ValueError:
        raise typer.BadParameter(f"{capacity!r} is not a number of entries", param_hint="--capacity") from None
    return entries, scope or TrainConfig.scope


@app.command(
    name="lm-eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def lm_eval_command(ctx: typer.Context) -> None:
    """lm-evaluation-harness with the model type `kvsieve`: every argument goes to lm-eval, e.g.
    `kvsieve lm-eval --model kvsieve --model_args pretrained=smollm2-135m,policy=trimkv+global,rate=0.75 --tasks T`."""
    try:
        from .lmeval.command import run_lm_eval
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("lm_eval"):
            raise
        raise typer.BadParameter(f"lm-eval is not installed: {install_hint('lm-eval')}") from None
    run_lm_eval(ctx.args)


@app.command(name="train-gates")
def train_gates_command(
    out: Annotated[Path, typer.Option(help="checkpoint folder (a rerun with the same settings resumes there)")],
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = DEFAULT_MODEL,
    capacity: Annotated[
        str | None, typer.Option(help=f"M: entries per (layer, kv-head) [default: {TrainConfig.capacity}]")
    ] = None,
    scope: Annotated[
        str | None, typer.Option(help=f"where M applies: {', '.join(SCOPES)} [default: {TrainConfig.scope}]")
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="optimiser steps, one sequence each")] = TrainConfig.steps,
    seq_len: Annotated[int, typer.Option(min=2, help="tokens per sequence")] = TrainConfig.seq_len,
    lam: Annotated[float, typer.Option(min=0.0, help="weight of the capacity hinge")] = TrainConfig.lam,
    ntp: Annotated[bool, typer.Option(help="average the next-token loss into the KL")] = TrainConfig.ntp,
    lr: Annotated[float, typer.Option(min=0.0)] = TrainConfig.lr,
    width: Annotated[int, typer.Option(min=1, help="hidden units per (layer, kv-head)")] = TrainConfig.width,
    per_task: Annotated[int, typer.Option(min=0, help="training samples per task")] = TrainConfig.per_task,
    tasks: Annotated[
        str, typer.Option(help="tasks or suites of the samples (ruler, routing, varied, procedural; never unseen)")
    ] = TrainConfig.tasks,
    seed: Annotated[int, typer.Option()] = TrainConfig.seed,
    kl_tokens: Annotated[int, typer.Option(min=0, help="positions the loss reads per sequence (0: all)")] = (
        TrainConfig.kl_tokens
    ),
    teacher_dtype: Annotated[
        str | None, typer.Option(help="autocast the teacher's forward: bfloat16, float16 (default: the model's)")
    ] = TrainConfig.teacher_dtype,
    data: Annotated[
        Path | None, typer.Option(help="your corpus: a text file, a folder, or JSONL (default: bundled essays, tasks)")
    ] = None,
    target: Annotated[
        str, typer.Option(help="what the gates learn: kl (the full cache's output) or kvzip (KVzip's keep decision)")
    ] = TrainConfig.target,
    kvzip_weight: Annotated[
        float, typer.Option(help="with --target kl: the share of KVzip's keep decision in the objective, 0 to 1")
    ] = TrainConfig.kvzip_weight,
    kvzip_entries: Annotated[
        str,
        typer.Option(help="with --kvzip-weight: what KVzip's decision teaches: all, kept (raised alone), indifferent"),
    ] = TrainConfig.kvzip_entries,
    answer_weight: Annotated[
        float, typer.Option(help="with --target kl: weigh the output again where it predicts a sample's answer")
    ] = TrainConfig.answer_weight,
    curriculum: Annotated[
        str | None,
        typer.Option(help="sequence lengths in equal shares of the steps, e.g. 1024,4096 (--seq-len then unused)"),
    ] = None,
    horizon: Annotated[
        float,
        typer.Option(help="how far ahead trimkv reads the gates when compressing a prompt once (config.json; inf ok)"),
    ] = 0.0,
    bounded_horizon: Annotated[
        float | None,
        typer.Option(help="how far ahead it reads them in a cache held at a size as it grows (default: --horizon)"),
    ] = None,
    projection: Annotated[
        str | None,
        typer.Option(
            help="the projection a policy reading the gates picks with if it names none (config.json), "
            "e.g. sentence,best_tokens=0.1 (default: topk)"
        ),
    ] = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    budget: Annotated[int | None, typer.Option(hidden=True, help="deprecated: --capacity")] = None,
) -> None:
    """Train retention gates (TrimKV / DBTrimKV) for a model on this machine; the model itself is not changed."""
    horizons = _parsed("--horizon / --bounded-horizon", lambda: Horizons(horizon, bounded_horizon))
    picks = None if projection is None else _parsed("--projection", lambda: make_projection(projection))
    entries, where = _capacity_and_scope(capacity, scope, budget)
    settings = {"capacity": entries, "scope": where, "steps": steps, "seq_len": seq_len, "lam": lam, "ntp": ntp}
    settings |= {"lr": lr, "width": width, "per_task": per_task, "kl_tokens": kl_tokens, "seed": seed}
    settings |= {"teacher_dtype": teacher_dtype, "target": target, "kvzip_weight": kvzip_weight}
    settings |= {"kvzip_entries": kvzip_entries, "answer_weight": answer_weight, "tasks": tasks}
    settings |= {"curriculum": _parsed("--curriculum", lambda: _lengths(curriculum))}
    config = _parsed("train-gates", lambda: TrainConfig(**settings))
    name = DEFAULT_MODEL if model == "default" else model
    lm, tokenizer = loaded(parse_model(name, device, dtype))
    _parsed("train-gates", lambda: check_training(lm, tokenizer, config))
    if data is None:
        corpus = _parsed("--seq-len", lambda: phase_data(tokenizer, config, None))
    else:
        lengths = config.lengths
        corpus = _parsed("--data", lambda: [corpus_training_data(tokenizer, data, n, config.seed) for n in lengths])
    gates, record = train_gates(lm, tokenizer, config, out, name, data=corpus, horizons=horizons, projection=picks)
    console.print(f"trained {len(gates.shape.layers)} layers of gates in {record.seconds:.0f} s; wrote {out}")


@app.command(name="average-gates")
def average_gates_command(
    sources: Annotated[list[Path], typer.Argument(help="gate checkpoint folders of one model, trained from one seed")],
    out: Annotated[Path, typer.Option(help="where the averaged checkpoint goes")],
    weights: Annotated[str | None, typer.Option(help="one per checkpoint, summing to 1 (default: equal)")] = None,
) -> None:
    """Average retention-gate checkpoints parameter by parameter (a gate soup): one checkpoint between them."""
    shares = _split(weights, float) if weights else None
    _parsed("average-gates", lambda: average_gates(sources, shares, out))
    console.print(f"averaged {len(sources)} gate checkpoints ({weights or 'equal weights'}); wrote {out}")


@app.command(name="ensemble-gates")
def ensemble_gates_command(
    sources: Annotated[list[Path], typer.Argument(help="gate checkpoint folders of one model, e.g. one per seed")],
    out: Annotated[Path, typer.Option(help="where the ensemble's checkpoint goes")],
    weights: Annotated[str | None, typer.Option(help="one per checkpoint, summing to 1 (default: equal)")] = None,
    horizon: Annotated[
        float | None, typer.Option(help="how far ahead trimkv reads the ensemble once (default: the members')")
    ] = None,
    bounded_horizon: Annotated[
        float | None, typer.Option(help="how far ahead in a cache held at a size (default: --horizon)")
    ] = None,
    merge: Annotated[
        str | None,
        typer.Option(
            help="the merge a policy reading the ensemble folds evictions with if it names none (config.json), "
            "e.g. window,parts=4"
        ),
    ] = None,
) -> None:
    """Combine retention-gate checkpoints into one whose logit is the mean of theirs (an ensemble): one checkpoint."""
    shares = _split(weights, float) if weights else None
    if horizon is None and bounded_horizon is not None:
        raise typer.BadParameter("--bounded-horizon needs --horizon", param_hint="--bounded-horizon")
    horizons = None if horizon is None else _parsed("--horizon", lambda: Horizons(horizon, bounded_horizon))
    folds = _parsed("--merge", lambda: parse_merge(merge) if merge else None)
    _parsed("ensemble-gates", lambda: ensemble_gates(sources, shares, out, horizons, folds))
    console.print(f"combined {len(sources)} gate checkpoints ({weights or 'equal weights'}); wrote {out}")


if __name__ == "__main__":
    app()
