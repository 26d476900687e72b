"""Evaluation: perplexity degradation and task sweeps (DESIGN §4), routing diagnostics, analysis."""

from .answers import judge, string_match
from .perplexity import PplResult, run_ppl
from .routing import RoutingDiagnostics, diagnose, global_eviction_ratio, survival_from_cache
from .stats import bootstrap_delta_ci, pooled_delta_pct
from .sweep import MODES, run_sweep

__all__ = [
    "MODES",
    "PplResult",
    "RoutingDiagnostics",
    "bootstrap_delta_ci",
    "diagnose",
    "global_eviction_ratio",
    "judge",
    "pooled_delta_pct",
    "run_ppl",
    "run_sweep",
    "string_match",
    "survival_from_cache",
]
