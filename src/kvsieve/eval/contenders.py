"""What a task sweep compares: the full cache, kvsieve policies and (optionally) kvpress presses."""

from __future__ import annotations

from dataclasses import dataclass

from ..policy import Policy, PolicyError, make_policy, split_policies

FULL = "full"
KVPRESS_PREFIX = "kvpress:"


@dataclass(frozen=True)
class Contender:
    """One column of a sweep.

    Attributes:
        name: ``"full"``, a kvsieve policy's canonical spec, or ``"kvpress:<press>"``.
        library: ``"kvsieve"`` or ``"kvpress"``.
        policy: the kvsieve policy (None for the full cache and kvpress).
        press: the kvpress press name (None otherwise).
    """

    name: str
    library: str
    policy: Policy | None = None
    press: str | None = None

    @property
    def is_full(self) -> bool:
        return self.name == FULL


def parse_contenders(specs: str | list[str]) -> list[Contender]:
    """Contenders from policy specs (``"snapkv+adaptive:window=16,random,kvpress:snapkv"`` or a list).

    The full cache is always first, whether named or not; duplicates are refused.
    """
    items = split_policies(specs) if isinstance(specs, str) else list(specs)
    out = [Contender(FULL, "kvsieve")]
    for spec in items:
        if spec == FULL:
            continue
        if spec.startswith(KVPRESS_PREFIX):
            from ..compare.kvpress import KVPRESS_PRESSES

            press = spec.removeprefix(KVPRESS_PREFIX)
            if press not in KVPRESS_PRESSES:
                raise PolicyError(f"unknown kvpress press {press!r}; known: {', '.join(KVPRESS_PRESSES)}")
            out.append(Contender(spec, "kvpress", press=press))
        else:
            policy = make_policy(spec)
            out.append(Contender(policy.name, "kvsieve", policy=policy))
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise PolicyError(f"policies must be distinct, got {', '.join(names[1:])}")
    return out
