"""Evaluation: perplexity degradation (DESIGN §4) and its statistics."""

from .perplexity import PplResult, run_ppl
from .stats import bootstrap_delta_ci, pooled_delta_pct

__all__ = ["PplResult", "bootstrap_delta_ci", "pooled_delta_pct", "run_ppl"]
