"""Evaluation: perplexity degradation, streaming perplexity and task sweeps (docs/protocols.md), routing diagnostics,
gold-answer margins and the fixed-contract diagnostic."""

from .answers import judge, string_match
from .contract_diagnostic import Contract, run_diagnostic
from .margins import Margin, margins
from .perplexity import PplResult, run_ppl
from .routing import RoutingDiagnostics, diagnose, global_eviction_ratio, survival_from_cache
from .stats import bootstrap_delta_ci, pooled_delta_pct
from .streaming import StreamResult, run_streaming, streaming_documents
from .sweep import MODES, run_sweep

__all__ = [
    "MODES",
    "Contract",
    "Margin",
    "PplResult",
    "RoutingDiagnostics",
    "StreamResult",
    "bootstrap_delta_ci",
    "diagnose",
    "global_eviction_ratio",
    "judge",
    "margins",
    "pooled_delta_pct",
    "run_diagnostic",
    "run_ppl",
    "run_streaming",
    "run_sweep",
    "streaming_documents",
    "string_match",
    "survival_from_cache",
]
