"""Tables, plots and reports."""

from .figures import plot_accuracy_vs_rate, plot_consensus_by_depth, plot_eviction_map, plot_hallucination_vs_ger
from .html import write_report
from .plots import plot_ppl
from .tables import ppl_markdown, ppl_table

__all__ = [
    "plot_accuracy_vs_rate",
    "plot_consensus_by_depth",
    "plot_eviction_map",
    "plot_hallucination_vs_ger",
    "plot_ppl",
    "ppl_markdown",
    "ppl_table",
    "write_report",
]
