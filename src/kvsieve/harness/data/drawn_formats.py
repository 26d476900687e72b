"""Needle formats drawn anew for every sample (the ``procedural`` suite, for training alone).

The ``varied`` suite writes a fact six fixed ways; gates trained on it may still learn those six sentences.
Here each sample's needles follow one of `SKELETONS`, its nouns and adjective drawn from `wonderwords`'
lists, so no two samples share a format and what the gates can learn is that a specific fact is kept,
not how one is worded. Words of the held-out formats' needles are never drawn (`DrawnFormats.excluded`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from .haystack import wonderwords_list
from .needle_format import NeedleFormat, content_words

#: (name, needle sentence, preamble, question, answer prefix: the sentence up to its value). Slots ``{n1}`` (the
#: thing the key names, ``{N1}`` capitalised), ``{n2}`` (what the value is) and ``{adj}`` are filled per sample;
#: ``{key}``, ``{value}`` and ``{query}`` are the needle's, as in every `NeedleFormat`.
SKELETONS: tuple[tuple[str, str, str, str, str], ...] = (
    ("filed", "The {adj} {n1} {key} is filed under {n2} {value}.",
     "The following text files a {n2} under a name. Take note of it for the question after.\n",
     "Under what {n2} is the {adj} {n1} {query} filed?", "The {adj} {n1} {query} is filed under {n2}"),
    ("belongs", "{N1} {key} belongs to {n2} {value}.",
     "A {n2} is given in the following text. Take note of it for the question after.\n",
     "To what {n2} does {n1} {query} belong?", "{N1} {query} belongs to {n2}"),
    ("for", "For the {n1} {key}, the {adj} {n2} is {value}.",
     "The following text states a {adj} {n2}. Take note of it for the question after.\n",
     "What is the {adj} {n2} for the {n1} {query}?", "For the {n1} {query}, the {adj} {n2} is"),
    ("reads", "The {n2} of {n1} {key} reads {value}.",
     "A {n2} is quoted in the following text. Take note of it for the question after.\n",
     "What does the {n2} of {n1} {query} read?", "The {n2} of {n1} {query} reads"),
    ("carries", "The {adj} {n1} named {key} carries {n2} {value}.",
     "The following text names a {n2}. Take note of it for the question after.\n",
     "What {n2} does the {adj} {n1} named {query} carry?", "The {adj} {n1} named {query} carries {n2}"),
)  # fmt: skip
#: Lengths of the drawn words, in letters: short enough for a sentence, long enough to name something.
WORD_LETTERS = range(4, 10)


@dataclass(frozen=True)
class DrawnFormats:
    """A `FormatSource` that draws a new `NeedleFormat` for every sample: a skeleton, two nouns and an adjective.

    `excluded` are words never drawn (those of the held-out formats' needles); a skeleton that holds one is refused.
    """

    excluded: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        clashes = {name: held for name, sentence, *_ in SKELETONS if (held := content_words(sentence) & self.excluded)}
        if clashes:
            raise ValueError(f"drawn needle skeletons hold excluded words: {clashes}")

    def drawn(self, rng: random.Random) -> NeedleFormat:
        name, *templates = rng.choice(SKELETONS)
        nouns, adjectives = _words("nounlist", self.excluded), _words("adjectivelist", self.excluded)
        n1, n2 = rng.sample(nouns, 2)
        slots = {"n1": n1, "N1": n1.capitalize(), "n2": n2, "adj": rng.choice(adjectives)}
        slots |= {field: f"{{{field}}}" for field in ("key", "value", "query")}
        return NeedleFormat(f"drawn-{name}", *(template.format(**slots) for template in templates))


@lru_cache(maxsize=4)
def _words(listed: str, excluded: frozenset[str]) -> tuple[str, ...]:
    return tuple(w for w in wonderwords_list(listed) if len(w) in WORD_LETTERS and w not in excluded)
