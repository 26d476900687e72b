"""Tables, plots and reports."""

from .figures import (
    plot_accuracy_vs_rate,
    plot_consensus_by_depth,
    plot_eviction_map,
    plot_hallucination_vs_ger,
    plot_recall_by_depth,
)
from .html import write_report
from .plots import plot_ppl, plot_stream_ppl
from .tables import markdown_table, ppl_markdown, ppl_table, stream_markdown, stream_table

__all__ = [
    "markdown_table",
    "plot_accuracy_vs_rate",
    "plot_consensus_by_depth",
    "plot_eviction_map",
    "plot_hallucination_vs_ger",
    "plot_ppl",
    "plot_recall_by_depth",
    "plot_stream_ppl",
    "ppl_markdown",
    "ppl_table",
    "stream_markdown",
    "stream_table",
    "write_report",
]
