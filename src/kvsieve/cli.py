"""`kvsieve` command line: perplexity sweeps, the demo, and the list of policies."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .allocators import ALLOCATORS
from .apply import compress
from .data import essay_texts, sample_documents
from .eval import run_ppl
from .eval.perplexity import Progress as ProgressCallback
from .models import load_model
from .observe import observe_prefill
from .policy import PolicyError, check_rate, make_policy, split_policies
from .report import plot_ppl, ppl_markdown, ppl_table
from .scorers import SCORERS

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


def _split(text: str, cast: type) -> list:
    try:
        return [cast(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise typer.BadParameter(f"cannot read {text!r} as a comma-separated list: {err}") from None


@contextmanager
def progress_bar(description: str) -> Iterator[ProgressCallback]:
    """A rich progress bar with an ETA, driven by `(done, total)` callbacks."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def ppl_experiment(
    model_name: str | None,
    policies: list[str],
    rates: list[float],
    docs: int,
    prefix: int,
    continuation: int,
    seed: int,
    model_and_tokenizer: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Load, sample documents, run the protocol with a progress bar, print the table; returns the JSON dict."""
    try:
        for p in policies:
            make_policy(p)
    except PolicyError as err:
        raise typer.BadParameter(str(err), param_hint="--policies") from None
    try:
        for r in rates:
            check_rate(r)
    except PolicyError as err:
        raise typer.BadParameter(str(err), param_hint="--rates") from None
    model, tokenizer = model_and_tokenizer or load_model(model_name)
    documents = sample_documents(tokenizer, docs, prefix + continuation + 1, seed=seed)
    with progress_bar("prefill once, sieve many") as progress:
        result = run_ppl(model, documents, policies, rates, prefix, continuation, progress=progress)
    report = result.to_json()
    console.print(ppl_table(report))
    return report


@app.command()
def ppl(
    policies: Annotated[
        str, typer.Option(help="comma-separated specs scorer[+allocator][:k=v,...], e.g. snapkv+adaptive:window=16")
    ] = "importance,random",
    rates: Annotated[str, typer.Option(help="comma-separated eviction rates in [0, 1)")] = "0.5,0.7,0.8,0.9",
    docs: Annotated[int, typer.Option(min=1, help="essay documents")] = 8,
    prefix: Annotated[int, typer.Option(min=64, help="prefilled tokens per document")] = 1024,
    continuation: Annotated[int, typer.Option(min=1, help="scored tokens per document")] = 512,
    seed: Annotated[int, typer.Option(help="document choice")] = 0,
    model: Annotated[str | None, typer.Option(help="HF id, model dir or .gguf (default: SmolLM2-135M)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the results here")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG path (default: next to --json)")] = None,
) -> None:
    """Perplexity change against the full cache per policy and rate (DESIGN §4 protocol)."""
    report = ppl_experiment(model, split_policies(policies), _split(rates, float), docs, prefix, continuation, seed)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        plot = plot or json_path.with_suffix(".png")
    if plot:
        plot_ppl(report, plot)
        console.print(f"wrote {plot}")


@app.command()
def policies() -> None:
    """List the scorers, the budget allocators and their parameters."""
    for title, registry in (("scorers", SCORERS), ("allocators (scorer+allocator)", ALLOCATORS)):
        console.rule(title)
        for name, cls in registry.items():
            params = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))
            doc = (cls.__doc__ or "").strip().splitlines()[0]
            console.print(f"[bold]{name}[/bold]({params})  {doc}")
    console.print("every policy also takes n_sink=1, sliding_window=32 (protected entries)")
    console.print("spec: scorer[+allocator][:key=value,...], e.g. snapkv+adaptive:window=16,safeguard=0.3")


def _generate(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int) -> torch.Tensor:
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :]


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
    text = essay_texts()["addiction"]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :prefix]
    question = tokenizer("\n\nIn short, the essay says that", return_tensors="pt", add_special_tokens=False)
    full_ids = torch.cat([ids, question.input_ids], dim=-1)

    caches = {"full cache": observe_prefill(model, ids).cache}
    caches |= {policy: compress(model, ids, policy, rate=0.8) for policy in ("importance", "snapkv+adaptive", "random")}
    sizes = {name: cache.nbytes() for name, cache in caches.items()}
    samples = {name: _generate(model, full_ids, cache, 24) for name, cache in caches.items()}
    lines = [
        f"context: {ids.shape[1]} tokens of the essay 'addiction', then a prompt; rate 0.8; greedy, 24 new tokens",
        "",
    ]
    for name, tokens in samples.items():
        answer = tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ")
        console.print(f"{name:>15}: {sizes[name] / 2**20:6.2f} MiB KV after prefill | {answer}")
        lines.append(f"- **{name}** ({sizes[name] / 2**20:.2f} MiB of KV after prefill): {answer}")

    report = ppl_experiment(
        None,
        ["importance", "snapkv+adaptive", "expected", "random"],
        [0.5, 0.8, 0.9],
        docs,
        prefix,
        continuation,
        seed=0,
        model_and_tokenizer=(model, tokenizer),
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
            "## Perplexity change against the full cache",
            "",
            ppl_markdown(report),
            "![delta% vs rate](ppl.png)",
            "",
        ]
    )
    (out / "report.md").write_text(markdown)
    console.print(f"wrote {out / 'report.md'}, {out / 'ppl.json'}, {out / 'ppl.png'}")


if __name__ == "__main__":
    app()
