"""How a needle is written, introduced and asked about (`NeedleFormat`), and where a task's format comes from."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Protocol


class FormatSource(Protocol):
    """Where a needle task's format comes from: one fixed format, or a new one drawn for every sample."""

    def drawn(self, rng: random.Random) -> NeedleFormat:
        """The format of one sample; `rng` is the sample's own generator."""
        ...


@dataclass(frozen=True)
class NeedleFormat:
    """How a needle is written, introduced and asked about.

    Templates take ``{key}``, ``{value}`` (the needle), ``{kind}`` (the value type, singular: ``"number"``),
    ``{kinds}`` (plural) and ``{query}`` (the asked key, or RULER's ``"a, b, and c"`` for several). The
    ``*_many`` forms ask for several values at once; a format without them asks for one value only.
    """

    name: str
    sentence: str
    preamble: str
    question: str
    prefix: str
    preamble_many: str = ""
    question_many: str = ""
    prefix_many: str = ""

    def drawn(self, rng: random.Random) -> NeedleFormat:
        """Itself: a fixed format draws nothing (so `rng`, and every sample made with it, stays as it was)."""
        return self

    def asks(self, single: bool, kind: str, query: str) -> tuple[str, str, str]:
        """`(preamble, question, answer prefix)` asking for one value (`single`) or several."""
        if not single and not self.question_many:
            raise ValueError(f"needle format {self.name!r} asks for one value only")
        templates = (self.preamble, self.question, self.prefix) if single else (
            self.preamble_many, self.question_many, self.prefix_many
        )  # fmt: skip
        fields = {"kind": kind[:-1], "kinds": kind, "query": query}
        return tuple(template.format(**fields) for template in templates)  # type: ignore[return-value]

    def needle(self, key: str, value: str, value_type: str) -> str:
        return self.sentence.format(key=key, value=value, kind=value_type[:-1], kinds=value_type)


def content_words(template: str) -> set[str]:
    """The lowercased words of four letters or more of a template, its ``{fields}`` left out."""
    return {w.lower() for w in re.findall(r"[A-Za-z]{4,}", re.sub(r"\{\w+\}", " ", template))}
