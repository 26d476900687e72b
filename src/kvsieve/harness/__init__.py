"""The research harness: model loading, data, evaluation, comparisons, reports, gate training and the CLI.

It builds on the library (`kvsieve.selection`, `kvsieve.runtime`); `import kvsieve` never loads it. Its
packages come with the `harness` extra; without them, importing it says which to install.
"""

from importlib.util import find_spec

#: The modules the harness imports beyond the library's own dependencies (the `harness` extra).
HARNESS_MODULES = ("numpy", "pandas", "matplotlib", "typer", "rich", "pyarrow", "wonderwords", "gguf", "accelerate")


def install_hint(extra: str) -> str:
    """How to install one of kvsieve's extras (kvsieve is installed from its checkout or a wheel, not PyPI)."""
    return f'pip install -e ".[{extra}]" in the checkout, or pip install "<the kvsieve wheel>[{extra}]"'


def missing_modules() -> list[str]:
    """The harness's modules that are not installed."""
    return [name for name in HARNESS_MODULES if find_spec(name) is None]


if missing := missing_modules():
    raise ImportError(
        f"kvsieve's harness (the command line, load_model, data, evaluation, reports) needs the harness extra; "
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: {install_hint('harness')}"
    )
