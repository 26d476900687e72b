"""The layers: kernels and modeling import no other, selection neither runtime nor harness, runtime never the
harness, and the vLLM plugin (a second runtime beside `runtime`) only kernels, modeling and selection; inside the
runtime, storage < attention < observing < eviction < api; and `import kvsieve` loads no harness module and none of
the harness's heavy dependencies."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvsieve

PACKAGE = Path(kvsieve.__file__).parent
#: Each layer and the kvsieve layers it may import.
ALLOWED = {
    "kernels": {"kernels"},
    "modeling": {"modeling"},
    "selection": {"modeling", "selection"},
    "runtime": {"kernels", "modeling", "selection", "runtime"},
    "vllm": {"kernels", "modeling", "selection", "vllm"},
    "harness": {"kernels", "modeling", "selection", "runtime", "harness"},
}
#: The runtime's folders from the bottom up: each imports only those before it (and the runtime's own modules).
RUNTIME_LEVELS = ("storage", "attention", "observing", "eviction", "api")
#: Loaded by the harness only: a user's `import kvsieve` must not load them.
HEAVY = ("rich", "pandas", "matplotlib", "gguf", "typer", "wonderwords")


def _kvsieve_imports(path: Path, type_checking: bool = True) -> set[str]:
    """Absolute names of the kvsieve modules a file imports anywhere (functions included).

    `type_checking=False` leaves out imports under `if TYPE_CHECKING:`.
    """
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    skipped = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                skipped |= {id(child) for child in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
    return {name for name in names if name.split(".")[0] == "kvsieve"}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


@pytest.mark.parametrize("layer", ALLOWED)
def test_each_layer_imports_only_itself_and_the_layers_below(layer):
    wrong = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in (PACKAGE / layer).rglob("*.py")
        for name in _kvsieve_imports(path)
        if _layer(name) not in ALLOWED[layer]
    }
    assert not wrong, sorted(wrong)


def test_no_runtime_folder_imports_one_above_it():
    runtime = PACKAGE / "runtime"
    assert sorted(p.name for p in runtime.iterdir() if (p / "__init__.py").is_file()) == sorted(RUNTIME_LEVELS)
    wrong = set()
    for level, folder in enumerate(RUNTIME_LEVELS):
        for path in (runtime / folder).rglob("*.py"):
            for name in _kvsieve_imports(path):
                parts = name.split(".")
                if parts[1] == "runtime" and len(parts) > 2 and parts[2] in RUNTIME_LEVELS[level + 1 :]:
                    wrong.add(f"{path.relative_to(PACKAGE)} imports {name}")
    top = [path for path in runtime.glob("*.py")]
    wrong |= {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in top
        for name in _kvsieve_imports(path)
        if name.split(".")[1:3][-1] in RUNTIME_LEVELS
    }
    assert not wrong, sorted(wrong)


def _harness_folder_imports() -> dict[str, set[str]]:
    """Each folder of the harness and the other harness folders its files import (function-level imports too)."""
    harness = PACKAGE / "harness"
    edges: dict[str, set[str]] = {}
    for path in harness.rglob("*.py"):
        parts = path.relative_to(harness).parts
        if len(parts) < 2:
            continue
        for name in _kvsieve_imports(path):
            target = name.split(".")[2:3]
            if target and target[0] != parts[0] and (harness / target[0]).is_dir():
                edges.setdefault(parts[0], set()).add(target[0])
    return edges


def test_no_harness_folder_imports_one_that_imports_it_back():
    edges = _harness_folder_imports()

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges.get(start, ())
        )

    circles = sorted(folder for folder in edges if reaches(folder, folder))
    assert edges and not circles, f"harness folders in an import circle: {circles} ({edges})"


def test_the_package_root_imports_the_harness_only_lazily():
    eager = _kvsieve_imports(PACKAGE / "__init__.py", type_checking=False)
    assert eager and all(_layer(name) in ("modeling", "selection", "runtime") for name in eager), sorted(eager)


def test_importing_kvsieve_loads_no_harness_module_nor_its_dependencies():
    """In a fresh interpreter, after torch and transformers: what `import kvsieve` adds, and that load_model is lazy.

    Measured against what transformers loads itself (its `huggingface_hub` -> `httpx` imports rich when rich is
    installed, as the harness's CLI makes it), so the test reads what kvsieve adds.
    """
    script = f"""
import json, sys, time
import torch, transformers
before = set(sys.modules)
start = time.perf_counter()
import kvsieve
seconds = time.perf_counter() - start
added = set(sys.modules) - before
heavy = sorted({{m.split(".")[0] for m in added}} & set({HEAVY!r}))
harness = sorted(m for m in added if m.startswith("kvsieve.harness"))
loader = kvsieve.load_model.__module__
print(json.dumps({{"heavy": heavy, "harness": harness, "seconds": seconds, "loader": loader}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["harness"] == [] and report["heavy"] == [], report
    assert report["loader"] == "kvsieve.harness.models", "kvsieve.load_model resolves to the harness's loader"


def test_the_command_line_runs_as_a_module():
    for module in ("kvsieve", "kvsieve.harness.cli"):
        done = subprocess.run(
            [sys.executable, "-m", module, "train-gates", "--help"], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0 and "--capacity" in done.stdout, (module, done.stderr[-2000:])
