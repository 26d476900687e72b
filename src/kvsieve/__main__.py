"""The `kvsieve` command (and `python -m kvsieve`): the harness's command line, or which extra it needs."""

import sys


def main() -> None:
    """Run `kvsieve.harness.cli`; without the harness extra, say how to install it and exit with status 1."""
    try:
        from kvsieve.harness.cli import app
    except ImportError as error:
        if "harness extra" not in str(error):
            raise
        sys.exit(f"kvsieve: {error}")
    app()


if __name__ == "__main__":
    main()
