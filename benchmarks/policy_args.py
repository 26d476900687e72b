"""`--policies` as the needle benchmarks take it: kvsieve specs separated by semicolons, since a spec separates its
own parameters by commas (``"trimkv+global;trimkv+global:safeguard=0.5,horizon=inf"``)."""

from __future__ import annotations

import argparse


def policy_list(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The specs of a semicolon-separated `--policies`; the parser's usage error when it names none."""
    policies = [spec.strip() for spec in text.split(";") if spec.strip()]
    if not policies:
        parser.error("--policies names no policy")
    return policies
