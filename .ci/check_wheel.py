"""The installed wheel against the editable install, on the default model's weights (`make wheel-check`).

`reference OUT`, in the editable install: converts the default model once (`kvsieve.load_model`), compresses
1,024 tokens of an essay with `trimkv+global` at rate 0.8, and writes the model folder, the ids and the kept
positions to OUT. `check REFERENCE`, in a clean environment holding the wheel and its core dependencies only:
loads the same weights with plain `transformers`, compresses the same ids, and fails unless the shipped gates
come from the installed package, the kept positions are the same, no harness package is installed, and the
`kvsieve` command names the extra it needs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

POLICY, RATE, TOKENS = "trimkv+global", 0.8, 1024
#: The `harness` extra's packages, less numpy (transformers needs it).
HARNESS_ONLY = ("pandas", "matplotlib", "typer", "rich", "pyarrow", "wonderwords", "gguf", "accelerate")


def required_by_others(name: str) -> bool:
    """Whether an installed distribution other than kvsieve requires `name` (transformers 5.24 requires typer)."""
    for dist in metadata.distributions():
        if dist.metadata["Name"].lower() == "kvsieve":
            continue
        for requirement in dist.requires or []:
            if ";" not in requirement and re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower() == name:
                return True
    return False


def kept_positions(model: torch.nn.Module, ids: torch.Tensor) -> list[list[list[int]]]:
    """Per full-attention layer and kv-head: the positions `POLICY` keeps at `RATE`."""
    import kvsieve

    cache = kvsieve.compress(model, ids, POLICY, rate=RATE)
    return [[p.tolist() for p in cache.kept_positions(layer)] for layer in cache.full_layers]


def reference(out: Path) -> None:
    import kvsieve
    from kvsieve.harness.data.essays import long_context
    from kvsieve.harness.models import model_folder

    model, tokenizer = kvsieve.load_model()
    ids = long_context(tokenizer, TOKENS)
    record = {"folder": str(model_folder(None)), "ids": ids.tolist(), "kept": kept_positions(model, ids)}
    out.write_text(json.dumps(record))
    print(f"check_wheel: reference written to {out}")


def check(reference_file: Path) -> None:
    from transformers import AutoModelForCausalLM

    import kvsieve
    from kvsieve.selection.checkpoint import shipped_gates_for

    record = json.loads(reference_file.read_text())
    installed = Path(kvsieve.__file__).resolve().parent
    assert "site-packages" in installed.parts, f"kvsieve imported from {installed}, not from the installed wheel"
    core = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in metadata.requires("kvsieve") if ";" not in r}
    assert core == {"torch", "transformers", "safetensors"}, f"the wheel's core dependencies: {sorted(core)}"
    present = [name for name in HARNESS_ONLY if importlib.util.find_spec(name) and not required_by_others(name)]
    assert not present, f"the core install pulled in harness packages: {present}"
    model = AutoModelForCausalLM.from_pretrained(record["folder"], dtype=torch.float32).eval()
    gates = shipped_gates_for(model)
    assert gates is not None and installed in gates.resolve().parents, f"shipped gates not found in {installed}"
    kept = kept_positions(model, torch.tensor(record["ids"]))
    assert kept == record["kept"], "the wheel keeps other entries than the editable install"
    command = subprocess.run(
        [str(Path(sys.executable).parent / "kvsieve"), "policies"], capture_output=True, text=True, check=False
    )
    assert command.returncode == 1 and "needs the harness extra" in command.stderr, command.stderr
    print(f"check_wheel: {installed} (gates {gates.name}) keeps what the editable install keeps; {command.stderr}")


if __name__ == "__main__":
    mode, path = sys.argv[1], Path(sys.argv[2])
    {"reference": reference, "check": check}[mode](path)
