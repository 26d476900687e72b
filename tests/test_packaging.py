"""What a wheel install needs: the core's dependencies, and the core working without the harness's packages."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points, requires
from pathlib import Path

import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.harness import HARNESS_MODULES


def requirement_names(extra: str | None) -> set[str]:
    """The distributions the installed kvsieve requires: of the core (`extra` None) or of one extra."""
    marker = None if extra is None else f'extra == "{extra}"'
    found = set()
    for requirement in requires("kvsieve"):
        _, _, condition = requirement.partition(";")
        if (condition.strip() or None) == marker:
            found.add(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower())
    return found


def test_the_core_depends_on_what_it_imports_and_the_harness_extra_on_the_rest():
    assert requirement_names(None) == {"torch", "transformers", "safetensors"}
    assert requirement_names("harness") == set(HARNESS_MODULES)
    (script,) = entry_points(group="console_scripts", name="kvsieve")
    assert script.value == "kvsieve.__main__:main"


BLOCKED_HARNESS = """
import importlib.machinery
import sys

BLOCKED = {blocked!r}


class NotInstalled(importlib.machinery.PathFinder):
    \"\"\"The path finder, blind to the blocked packages: to every import they are not installed.\"\"\"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)


sys.meta_path = [NotInstalled if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
sys.path.insert(0, {tests!r})
"""


def run_without_harness(script: str) -> str:
    """`script` in a fresh interpreter where the harness's packages (numpy aside: transformers needs it) are absent."""
    blocked = sorted(set(HARNESS_MODULES) - {"numpy"})
    prelude = BLOCKED_HARNESS.format(blocked=blocked, tests=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_core_compresses_and_generates_without_the_harness_packages():
    out = run_without_harness("""
        import torch
        import kvsieve
        from conftest import tiny_llama

        model, ids = tiny_llama(), torch.arange(100).remainder(128)[None]
        cache = kvsieve.compress(model, ids, "trimkv+global:gates=untrained", rate=0.5)
        mean_stored = cache.mean_stored()
        new = kvsieve.generate(model, ids[:, -1:], cache=cache, max_new_tokens=3, do_sample=False)
        print(mean_stored, new.shape[1], sorted(set(sys.modules) & set(BLOCKED)))
    """)
    mean_stored, new_tokens, loaded = out.split(maxsplit=2)
    here = kvsieve.compress(tiny_llama(), torch.arange(100).remainder(128)[None], "trimkv+global:gates=untrained", 0.5)
    assert float(mean_stored) == here.mean_stored() < 100 and new_tokens == "4" and loaded.strip() == "[]", out


def test_without_the_harness_its_entry_points_name_the_extra():
    out = run_without_harness("""
        import kvsieve
        from kvsieve.__main__ import main

        for attempt in (lambda: kvsieve.load_model(), lambda: __import__("kvsieve.harness.cli")):
            try:
                attempt()
            except ImportError as error:
                print("ImportError:", error)
        try:
            main()
        except SystemExit as stop:
            print("exit:", stop.code)
    """)
    lines = out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("ImportError") and lines[1].startswith("ImportError"), out
    assert all("harness extra" in line and 'pip install -e ".[harness]"' in line for line in lines), out
    assert lines[2].startswith("exit: kvsieve: kvsieve's harness"), out
