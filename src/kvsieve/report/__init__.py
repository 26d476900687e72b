"""Tables, plots and reports."""

from .plots import plot_ppl
from .tables import ppl_markdown, ppl_table

__all__ = ["plot_ppl", "ppl_markdown", "ppl_table"]
