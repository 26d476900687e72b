"""`python -m kvsieve`: the command line (`kvsieve.harness.cli`)."""

from kvsieve.harness.cli import app

app()
