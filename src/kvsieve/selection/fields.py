"""The parameters a component does not leave at their defaults: what a spec names and a checkpoint records."""

from __future__ import annotations

import dataclasses


def changed_fields(obj: object) -> dict[str, object]:
    """Every init field of a dataclass whose value differs from its default (empty for anything else)."""
    if not dataclasses.is_dataclass(obj):
        return {}
    fields = (f for f in dataclasses.fields(obj) if f.init)
    return {f.name: getattr(obj, f.name) for f in fields if getattr(obj, f.name) != f.default}
