"""The `model_args` of lm-eval's ``kvsieve`` model type: read, checked and named before the model loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...runtime.api.config import EvictionConfig
from ...runtime.eviction.growth import DEFAULT_BUFFER
from ...selection.errors import PolicyError
from ...selection.spec import policy_keywords
from ..models import torch_device, torch_dtype

#: The policy that keeps every entry: the model type's own full-cache baseline.
FULL = "full"
#: Where a question-aware run takes a prompt's question to begin (its last occurrence).
QUESTION_MARKER = "Question:"


@dataclass(frozen=True)
class ModelArgs:
    """Everything `model_args` may say besides `pretrained` (see `KVSieveLM`)."""

    policy: str
    rate: float | None = None
    max_tokens: int | None = None
    max_bytes: int | None = None
    buffer: int = DEFAULT_BUFFER
    allocator: str | None = None
    kv_bits: int = 16
    kv_group: int | None = None
    kv_residual: int | None = None
    question_aware: bool = False
    question_marker: str = QUESTION_MARKER
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    max_batch_size: int | None = None  # lm-eval passes it; unused (batches are `batch_size` prompts)

    @classmethod
    def parse(cls, given: dict[str, Any]) -> ModelArgs:
        """`ModelArgs` from lm-eval's parsed `model_args`, or a `ValueError` that names the problem.

        lm-eval splits `model_args` at every comma, so a policy's parameters come as arguments of their own
        (``policy=trimkv+global,projection=sentence,best_tokens=0.1``): they join the policy's spec.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        params = {key: value for key, value in given.items() if key not in known and key in policy_keywords()}
        unknown = sorted(set(given) - known - set(params))
        if unknown:
            raise ValueError(
                f"model_args: unknown argument(s) {unknown}; kvsieve takes pretrained, {sorted(known)} and the "
                "policy's parameters (kvsieve policies)"
            )
        if given.get("policy") in (None, ""):
            raise ValueError(f"model_args needs policy= (a kvsieve policy such as trimkv+global, or {FULL})")
        given = {key: value for key, value in given.items() if key not in params}
        if params:
            if str(given["policy"]) == FULL:
                raise PolicyError(f"policy={FULL} keeps every entry: it takes no policy parameters {sorted(params)}")
            joined = ",".join(f"{key}={_text(value)}" for key, value in params.items())
            policy = str(given["policy"])
            given["policy"] = f"{policy}{',' if ':' in policy else ':'}{joined}"
        args = cls(**given)
        args.check()
        return args

    def check(self) -> None:
        """Every value is usable: the policy and budget (via `eviction_config`), dtype, device, batch size."""
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a whole number >= 1, got {self.batch_size!r}")
        if not isinstance(self.question_aware, bool):
            raise ValueError(f"question_aware must be true or false, got {self.question_aware!r}")
        if self.question_aware and not self.question_marker:
            raise ValueError("question_aware needs a non-empty question_marker")
        torch_dtype(str(self.dtype))
        torch_device(str(self.device))
        self.eviction_config()

    def eviction_config(self) -> EvictionConfig | None:
        """The policy and budget (None for the full cache)."""
        if str(self.policy) == FULL:
            given = (self.rate, self.max_tokens, self.max_bytes, self.allocator, self.kv_group, self.kv_residual)
            if any(v is not None for v in given):
                raise PolicyError(f"policy={FULL} keeps every entry: give no rate, size or allocator with it")
            if self.kv_bits != 16:
                raise PolicyError(
                    f"policy={FULL} keeps every entry as the model computed it; for quantization alone give a policy "
                    f"with rate=0 and kv_bits={self.kv_bits}"
                )
            return None
        return EvictionConfig(
            str(self.policy),
            rate=self.rate,
            max_tokens=self.max_tokens,
            max_bytes=self.max_bytes,
            buffer=self.buffer,
            allocator=self.allocator,
            kv_bits=self.kv_bits,
            kv_group=self.kv_group,
            kv_residual=self.kv_residual,
        )


def _text(value: object) -> str:
    """A parameter's value as a policy spec writes it (lm-eval has turned "true" into True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_lm_eval_options(model_args: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
    """`model_args` with lm-eval's `--device` / `--batch_size` where it does not say them itself.

    lm-eval passes its default device (``cuda:0``) on every machine; one this machine lacks is
    dropped (the CPU is used), while a `device` in `model_args` must exist.
    """
    extra = {k: v for k, v in (options or {}).items() if v is not None}
    if "device" in extra:
        try:
            torch_device(str(extra["device"]))
        except ValueError:
            del extra["device"]
    return extra | model_args
