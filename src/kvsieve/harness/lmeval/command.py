"""`kvsieve lm-eval ARGS`: lm-evaluation-harness's own command line, with the model type ``kvsieve`` registered.

lm-eval 0.4 finds a model type by name only in its own table or once the module that registers it
is imported; it reads no entry-point group (the `lm_eval.models` entry point kvsieve declares is for
lm-eval's coming plugin registration, docs/lm_eval.md). This command imports
`kvsieve.harness.lmeval.model` and hands every argument, unchanged, to lm-eval's console entry
(`lm_eval.__main__.cli_evaluate`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import model  # noqa: F401  (registers the model type)


def run_lm_eval(args: Sequence[str]) -> None:
    """Run lm-eval's command line on `args` (as `lm-eval ARGS` would), the model type ``kvsieve`` known."""
    from lm_eval.__main__ import cli_evaluate

    previous = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = previous
