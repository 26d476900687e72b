"""Where a protocol's cells run: in this process (`LocalRunner`) or on a Ray cluster (`ray_runner.RayRunner`).

A *cell* is the unit a protocol schedules: one case's prefill and every configuration built from it
(a sweep's sample in one mode, a diagnostic's case, a perplexity document, a stream of documents
through one configuration). `runner.map(work, cells)` runs the picklable `work` on each cell where
a model replica lives and gives the results back in the cells' order. Ray is imported only by
`ray_runner`, which nothing here imports.
"""

from .local import LocalRunner
from .protocol import Runner, Work, run_once

__all__ = ["LocalRunner", "Runner", "Work", "run_once"]
