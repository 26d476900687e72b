"""The eleven RULER tasks that need no downloaded data (arXiv 2404.06654), generated offline and seeded, two
needle tasks in formats of our own (`UNSEEN_TASKS`), which no training set of the gates uses, and six more
(`VARIED_TASKS`) for training alone.

Configurations follow RULER's ``scripts/synthetic.yaml`` and its generators: needle-in-a-haystack
variants (``niah_*``), variable tracking (``vt``: one chain of four hops, with a one-shot example),
common words extraction (``cwe``: 10 common words, 6/1 repeats under 4k tokens and 30/3 from 4k
on, with a one-shot example) and frequent words extraction (``fwe``: Zipf counts with alpha 2).
Every prompt is sized with the model's own tokenizer: `encode(sample, tokenizer, chat)` gives
between 90% and 100% of the requested `length` tokens (context plus question).
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from . import haystack as hs
from .drawn_formats import DrawnFormats
from .needle_format import FormatSource, NeedleFormat, content_words
from .sample import TaskSample, prompt_tokens, token_count

RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)

#: Lowest fraction of the requested length a prompt may have.
MIN_FILL = 0.9


_MEMORIZE = " Make sure to memorize it. I will quiz you about the {} afterwards.\n"
#: RULER's own needles ("One of the special magic numbers for ... is: ...").
RULER_FORMAT = NeedleFormat(
    "ruler",
    hs.NEEDLE.replace("{kind}", "{kinds}"),
    "A special magic {kind} is hidden within the following text." + _MEMORIZE.format("{kind}"),
    "What is the special magic {kind} for {query} mentioned in the provided text?",
    "The special magic {kind} for {query} mentioned in the provided text is",
    "Some special magic {kinds} are hidden within the following text." + _MEMORIZE.format("{kinds}"),
    "What are all the special magic {kinds} for {query} mentioned in the provided text?",
    "The special magic {kinds} for {query} mentioned in the provided text are",
)
#: Needle formats no training set of the gates uses (`UNSEEN_TASKS`): they tell "learned RULER's format"
#: from "learned what matters".
LEDGER_FORMAT = NeedleFormat(
    "ledger",
    "The ledger lists account {key} with a closing balance of {value}.",
    "An account balance is recorded somewhere in the following text. Remember it; you will be asked for it.\n",
    "What closing balance does the ledger list for account {query}?",
    "The closing balance of account {query} is",
)
LOCKER_FORMAT = NeedleFormat(
    "locker",
    "Locker {key} at the old station opens with the code {value}.",
    "A locker code appears somewhere in the following text. Keep it in mind; I will ask for the code later.\n",
    "Which code opens locker {query}?",
    "Locker {query} opens with the code",
)

#: Needle formats for training alone (`VARIED_TASKS`, the ``varied`` suite): a fact written six ways, so that gates
#: learn to keep a fact rather than RULER's sentence. None shares a word of four letters or more with the unseen
#: formats' needles.
VARIED_FORMATS: tuple[NeedleFormat, ...] = (
    NeedleFormat(
        "flight",
        "Flight {key} leaves from gate {value}.",
        "A departure gate is mentioned in the following text. Note it; a question about it follows.\n",
        "From which gate does flight {query} leave?",
        "Flight {query} leaves from gate",
    ),
    NeedleFormat(
        "recipe",
        "The recipe for {key} bread needs {value} grams of flour.",
        "A recipe is quoted in the following text. Read it carefully; you will be asked about it.\n",
        "How many grams of flour does the recipe for {query} bread need?",
        "The recipe for {query} bread needs",
    ),
    NeedleFormat(
        "extension",
        "You can reach {key} at extension {value}.",
        "A telephone extension is given in the following text. Track it; a question about it follows.\n",
        "At which extension can you reach {query}?",
        "You can reach {query} at extension",
    ),
    NeedleFormat(
        "census",
        "In the census, the village of {key} counted {value} residents.",
        "A census figure is reported in the following text. Mind it; it will be asked about.\n",
        "How many residents did the village of {query} count in the census?",
        "The village of {query} counted",
    ),
    NeedleFormat(
        "badge",
        "Employee {key} wears badge number {value}.",
        "A badge number appears in the following text. Retain it for the question at the end.\n",
        "What badge number does employee {query} wear?",
        "Employee {query} wears badge number",
    ),
    NeedleFormat(
        "clinic",
        "Doctor {key} sees patients in room {value}.",
        "A room number is stated in the following text. Note it down; it will be asked about.\n",
        "In which room does Doctor {query} see patients?",
        "Doctor {query} sees patients in room",
    ),
)


@dataclass(frozen=True)
class NiahConfig:
    """One needle-in-a-haystack variant (RULER's ``niah`` arguments) and how its needles are written."""

    haystack: str  # "noise", "essay" or "needle"
    key_type: str
    value_type: str
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1
    max_new_tokens: int = 24
    format: FormatSource = RULER_FORMAT

    @property
    def single(self) -> bool:
        """Whether a question asks for one value."""
        return self.n_queries * self.n_values == 1


NIAH_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids", max_new_tokens=48),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids", max_new_tokens=48),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", n_values=4, max_new_tokens=48),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", n_queries=4, max_new_tokens=48),
    # the unseen formats: several needles of one format, one asked (as niah_multikey_1)
    "niah_ledger": NiahConfig("essay", "words", "numbers", n_keys=4, format=LEDGER_FORMAT),
    "niah_locker": NiahConfig("noise", "numbers", "numbers", n_keys=4, format=LOCKER_FORMAT),
}
#: Needle tasks in formats no training set of the gates uses (the ``unseen`` suite; never in ``ruler``).
UNSEEN_TASKS: tuple[str, ...] = ("niah_ledger", "niah_locker")
#: The varied formats' tasks (the ``varied`` suite), for training: their haystacks, key kinds and needle counts vary.
VARIED_CONFIGS: dict[str, NiahConfig] = {
    f"niah_{fmt.name}": NiahConfig(haystack, keys, "numbers", n_keys=n_keys, format=fmt)
    for fmt, (haystack, keys, n_keys) in zip(
        VARIED_FORMATS,
        [("essay", "words", 4), ("essay", "words", 4), ("noise", "words", 4), ("essay", "words", 1),
         ("noise", "numbers", 4), ("essay", "numbers", 1)],
        strict=True,
    )
}  # fmt: skip
NIAH_CONFIGS |= VARIED_CONFIGS
VARIED_TASKS: tuple[str, ...] = tuple(VARIED_CONFIGS)
#: The words of four letters or more of the unseen formats' needles, which no training format may hold.
UNSEEN_NEEDLE_WORDS = frozenset().union(*(content_words(NIAH_CONFIGS[t].format.sentence) for t in UNSEEN_TASKS))
#: Needles in a format drawn anew for every sample (the ``procedural`` suite, for training alone), in the essay, noise
#: and needle haystacks, with word and number keys; no word of an unseen format's needle is ever drawn.
DRAWN_FORMATS = DrawnFormats(UNSEEN_NEEDLE_WORDS)
PROCEDURAL_CONFIGS: dict[str, NiahConfig] = {
    f"niah_procedural_{i}": NiahConfig(haystack, keys, "numbers", n_keys=n_keys, format=DRAWN_FORMATS)
    for i, (haystack, keys, n_keys) in enumerate(
        [("essay", "words", 4), ("noise", "words", 4), ("essay", "numbers", 1), ("noise", "numbers", 4),
         ("essay", "words", 1), ("needle", "words", 1)],
        start=1,
    )
}  # fmt: skip
NIAH_CONFIGS |= PROCEDURAL_CONFIGS
PROCEDURAL_TASKS: tuple[str, ...] = tuple(PROCEDURAL_CONFIGS)
#: The task suites built here, by name (`suites.SUITES` adds the routing probes).
RULER_SUITES: dict[str, tuple[str, ...]] = {
    "ruler": RULER_TASKS,
    "unseen": UNSEEN_TASKS,
    "varied": VARIED_TASKS,
    "procedural": PROCEDURAL_TASKS,
}
#: Every task's suite (`TaskSample.suite`).
SUITE_OF = {task: suite for suite, tasks in RULER_SUITES.items() for task in tasks}
#: RULER's needle depths for the essay haystack: 40 percentages spread evenly over [0, 100].
ESSAY_DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))

VT_HOPS = 4
VT_MAX_NEW_TOKENS = 32
VT_EXAMPLE_NOISE_LINES = 3
VT_PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text."

CWE_COMMON = 10
CWE_MAX_NEW_TOKENS = 64
#: (example words, example common repeats, example uncommon repeats, common repeats, uncommon repeats)
CWE_SHORT = (20, 3, 1, 6, 1)  # below CWE_LONG_FROM tokens
CWE_LONG = (40, 10, 3, 30, 3)
CWE_LONG_FROM = 4096
CWE_PREAMBLE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
CWE_QUESTION = f"Question: What are the {CWE_COMMON} most common words in the above list?"
CWE_PREFIX = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"

FWE_ALPHA = 2.0
FWE_WORD_LEN = 6
FWE_NOISE = "..."
FWE_MAX_NEW_TOKENS = 32
FWE_PREAMBLE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"

#: A piece of a context: its text and a tag naming it (`None` for plain filler).
Piece = tuple[str, str | None]


# ---------------------------------------------------------------- small pure helpers


def join_pieces(pieces: Sequence[Piece], sep: str, offset: int = 0) -> tuple[str, list[tuple[str, int, int]]]:
    """Join piece texts with `sep`; return the text and `(tag, start, end)` of every tagged piece (+ `offset`)."""
    spans, parts, at = [], [], offset
    for i, (text, tag) in enumerate(pieces):
        if i:
            at += len(sep)
        if tag is not None:
            spans.append((tag, at, at + len(text)))
        parts.append(text)
        at += len(text)
    return sep.join(parts), spans


def insert_at(units: Sequence[str], inserts: Sequence[Piece], fractions: Sequence[float]) -> list[Piece]:
    """Insert `inserts` (in order) among `units` before unit `int(f * len(units))` for sorted fractions `f`."""
    slots = sorted(min(int(f * len(units)), len(units)) for f in fractions)
    pieces: list[Piece] = []
    k = 0
    for i in range(len(units) + 1):
        while k < len(inserts) and slots[k] == i:
            pieces.append(inserts[k])
            k += 1
        if i < len(units):
            pieces.append((units[i], None))
    return pieces


def numbered(words: Sequence[str]) -> str:
    """RULER's numbered list: ``"1. w1 2. w2 ..."``."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta for `alpha > 1` (partial sum plus an Euler-Maclaurin tail)."""
    if alpha <= 1:
        raise ValueError(f"zeta needs alpha > 1, got {alpha}")
    partial = sum(k**-alpha for k in range(1, terms + 1))
    return partial + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms**-alpha


def zipf_counts(total: int, vocab_size: int, alpha: float) -> list[int]:
    """RULER's fwe counts: word of rank k appears `int(total * k^-alpha / zeta(alpha))` times."""
    z = zeta(alpha)
    return [int(total * k**-alpha / z) for k in range(1, vocab_size + 1)]


def english_list(items: Sequence[str]) -> str:
    """RULER's join of several queried keys: ``"a, b, and c"`` (one key stays as it is)."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _distinct(draw: Callable[[], str], n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


# ---------------------------------------------------------------- task builders
# Each builder draws everything random for one sample up front and returns `build(size)`,
# a deterministic function of the haystack size (units: essay words, noise lines, needle
# lines, distinct words, Zipf total), plus the smallest size it accepts.

Builder = Callable[[int], TaskSample]


def _sample(task: str, index: int, context: str, spans: list[tuple[str, int, int]], **fields: Any) -> TaskSample:
    meta = fields.pop("meta")
    meta["evidence_depths"] = [round(start / len(context), 4) for _, start, _ in spans]
    return TaskSample(
        task=task,
        suite=SUITE_OF[task],
        index=index,
        context=context,
        evidence=tuple((start, end) for _, start, end in spans),
        meta=meta,
        **fields,
    )


def _niah(task: str, index: int, rng: random.Random, length: int) -> tuple[Builder, int]:
    cfg = NIAH_CONFIGS[task]
    fmt = cfg.format.drawn(rng)
    n_keys = max(cfg.n_keys, cfg.n_queries)
    taken: set[str] = set()
    keys = _distinct(lambda: hs.random_item(rng, cfg.key_type), n_keys, taken)
    values = [_distinct(lambda: hs.random_item(rng, cfg.value_type), cfg.n_values, taken) for _ in keys]
    needles = [(k, v) for k in range(n_keys) for v in range(cfg.n_values)]
    rng.shuffle(needles)
    if cfg.haystack == "essay":
        fractions = [d / 100 for d in rng.sample(ESSAY_DEPTHS, len(needles))]
    else:
        fractions = [rng.random() for _ in needles]
    queried = rng.sample(range(n_keys), cfg.n_queries)
    distractor_seed = rng.getrandbits(63)

    single = cfg.single
    preamble, question, prefix = fmt.asks(single, cfg.value_type, english_list([keys[q] for q in queried]))
    answers = tuple(v for q in queried for v in values[q])
    inserts: list[Piece] = [(fmt.needle(keys[k], values[k][v], cfg.value_type), str(k)) for k, v in needles]
    relevant = {str(q) for q in queried}
    # values of the needles with keys that are not asked about (multikey: the other inserted needles)
    unasked = [v for k in range(n_keys) if k not in queried for v in values[k]]

    def units(size: int) -> tuple[list[str], list[str]]:
        """The haystack's units and the values of the distractor needles among them."""
        if cfg.haystack == "essay":
            return hs.essay_units(size), []
        if cfg.haystack == "noise":
            return hs.noise_units(size), []
        items = hs.needle_items(size, distractor_seed, cfg.key_type, cfg.value_type, frozenset(keys))
        return [fmt.needle(k, v, cfg.value_type) for k, v in items], [v for _, v in items]

    def competing(haystack_values: list[str]) -> tuple[str, ...]:
        """Every other value in the context, written as `gold` is (a single asked value only)."""
        if not single:
            return ()
        return tuple(f" {v}" for v in dict.fromkeys(unasked + haystack_values) if v not in answers)

    sep = hs.SENTENCE_SEP if cfg.haystack == "essay" else hs.LINE_SEP

    def build(size: int) -> TaskSample:
        haystack, haystack_values = units(size)
        text, spans = join_pieces(insert_at(haystack, inserts, fractions), sep, offset=len(preamble))
        context = preamble + text
        return _sample(
            task,
            index,
            context,
            [span for span in spans if span[0] in relevant],
            question=question,
            answer_prefix=prefix,
            answers=answers,
            gold=" " + ", ".join(answers),
            candidates=competing(haystack_values),
            max_new_tokens=cfg.max_new_tokens,
            meta={
                "haystack": cfg.haystack,
                "haystack_units": size,
                "keys": list(keys),
                "queries": [keys[q] for q in queried],
                "values": [list(v) for v in values],
                "needle_depths": [round(start / len(context), 4) for _, start, _ in spans],
                "needle_spans": [(start, end) for _, start, end in spans],
                "nominal_depths": sorted(fractions),
            },
        )

    return build, 0


def _vt_chain(rng: random.Random, letters: int, taken: set[str]) -> tuple[list[str], str]:
    names = _distinct(lambda: hs.random_letters(rng, letters), VT_HOPS + 1, taken)
    value = str(rng.randint(10000, 99999))
    while value in taken:
        value = str(rng.randint(10000, 99999))
    taken.add(value)
    return names, value


def _vt_statements(names: Sequence[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]


def _vt_question(value: str) -> tuple[str, str]:
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{VT_HOPS + 1} variables are assigned the value {value}, they are:"
    )
    return question, prefix


def _vt(task: str, index: int, rng: random.Random, length: int) -> tuple[Builder, int]:
    taken: set[str] = set()
    ex_names, ex_value = _vt_chain(rng, 3, taken)
    names, value = _vt_chain(rng, 5, taken)
    ex_fractions = sorted(rng.random() for _ in ex_names)
    fractions = sorted(rng.random() for _ in names)

    ex_pieces = insert_at(
        hs.noise_units(VT_EXAMPLE_NOISE_LINES), [(s, None) for s in _vt_statements(ex_names, ex_value)], ex_fractions
    )
    ex_question, ex_prefix = _vt_question(ex_value)
    example = (
        f"{VT_PREAMBLE}\n\n{hs.LINE_SEP.join(t for t, _ in ex_pieces)}\n{ex_question}\n{ex_prefix} {' '.join(ex_names)}"
    )
    head = f"{example}\n\n{VT_PREAMBLE}\n\n"
    question, prefix = _vt_question(value)
    inserts: list[Piece] = [(s, f"hop:{i}") for i, s in enumerate(_vt_statements(names, value))]

    def build(size: int) -> TaskSample:
        text, spans = join_pieces(insert_at(hs.noise_units(size), inserts, fractions), hs.LINE_SEP, offset=len(head))
        return _sample(
            task,
            index,
            head + text,
            spans,
            question=question,
            answer_prefix=prefix,
            answers=tuple(names),
            gold=" " + " ".join(names),
            max_new_tokens=VT_MAX_NEW_TOKENS,
            meta={
                "haystack": "noise",
                "haystack_units": size,
                "value": value,
                "chain": list(names),
                "icl_example": True,
            },
        )

    return build, 0


def _cwe(task: str, index: int, rng: random.Random, length: int) -> tuple[Builder, int]:
    n_ex, ex_common_rep, ex_rare_rep, common_rep, rare_rep = CWE_LONG if length >= CWE_LONG_FROM else CWE_SHORT
    pool = list(hs.common_words())
    rng.shuffle(pool)
    ex_words, words = pool[:n_ex], pool[n_ex:]
    ex_list = ex_words[:CWE_COMMON] * ex_common_rep + ex_words[CWE_COMMON:] * ex_rare_rep
    random.Random(rng.getrandbits(63)).shuffle(ex_list)
    example = f"{CWE_PREAMBLE}\n{numbered(ex_list)}\n{CWE_QUESTION} {CWE_PREFIX} {numbered(ex_words[:CWE_COMMON])}"
    head = f"{example}\n{CWE_PREAMBLE}\n"
    shuffle_seed = rng.getrandbits(63)
    common = words[:CWE_COMMON]

    def build(size: int) -> TaskSample:
        entries = common * common_rep + words[CWE_COMMON:size] * rare_rep
        random.Random(shuffle_seed).shuffle(entries)
        pieces = [(f"{i + 1}.", None) for i in range(len(entries))]
        pieces = [p for i, w in enumerate(entries) for p in (pieces[i], (w, w if w in common else None))]
        text, spans = join_pieces(pieces, " ", offset=len(head))
        return _sample(
            task,
            index,
            head + text,
            spans,
            question=CWE_QUESTION,
            answer_prefix=CWE_PREFIX,
            answers=tuple(common),
            gold=" " + numbered(common),
            max_new_tokens=CWE_MAX_NEW_TOKENS,
            meta={
                "haystack": "word_list",
                "haystack_units": size,
                "distinct_words": size,
                "common_repeats": common_rep,
                "uncommon_repeats": rare_rep,
                "icl_example": True,
            },
        )

    return build, CWE_COMMON


def _fwe(task: str, index: int, rng: random.Random, length: int) -> tuple[Builder, int]:
    vocab_size = max(5, length // 50)
    vocab = sorted(_distinct(lambda: hs.random_letters(rng, FWE_WORD_LEN, string.ascii_lowercase), vocab_size, set()))
    rng.shuffle(vocab)
    vocab[0] = FWE_NOISE  # the top rank is noise, as in RULER
    answers = tuple(vocab[1:4])
    shuffle_seed = rng.getrandbits(63)
    head = FWE_PREAMBLE + " "

    def build(size: int) -> TaskSample:
        counts = zipf_counts(size, vocab_size, FWE_ALPHA)
        entries = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(entries)
        text, spans = join_pieces([(w, w if w in answers else None) for w in entries], " ", offset=len(head))
        return _sample(
            task,
            index,
            head + text,
            spans,
            question=FWE_QUESTION,
            answer_prefix=FWE_PREFIX,
            answers=answers,
            gold=" " + ", ".join(answers),
            max_new_tokens=FWE_MAX_NEW_TOKENS,
            meta={
                "haystack": "coded_words",
                "haystack_units": size,
                "vocab_size": vocab_size,
                "alpha": FWE_ALPHA,
                "counts": dict(zip(vocab[:5], counts[:5], strict=True)),
            },
        )

    return build, 0


_BUILDERS: dict[str, Callable[[str, int, random.Random, int], tuple[Builder, int]]] = {
    **dict.fromkeys(NIAH_CONFIGS, _niah),
    "vt": _vt,
    "cwe": _cwe,
    "fwe": _fwe,
}


# ---------------------------------------------------------------- sizing and the public entry point


def _check_fwe(sample: TaskSample, length: int) -> None:
    counts = list(sample.meta["counts"].values())
    if counts[3] <= counts[4]:
        raise ValueError(
            f"fwe: length {length} is too small: the third most frequent word ({counts[3]} times) is not ahead of "
            f"the fourth ({counts[4]}); ask for a longer length"
        )


def _fit(
    build: Builder, lo: int, tokenizer: PreTrainedTokenizerBase, length: int, chat: bool | None, guess: int | None
) -> TaskSample:
    """The sample with the largest haystack whose prompt has at most `length` tokens; it must reach 90%."""
    sizes: dict[int, TaskSample] = {}
    tokens: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in tokens:
            try:
                sizes[size] = build(size)
            except ValueError:  # the haystack is exhausted (essays)
                tokens[size] = length + 1
                return False
            tokens[size] = prompt_tokens(sizes[size], tokenizer, chat)
        return tokens[size] <= length

    if not fits(lo):
        smallest = tokens[lo]
        raise ValueError(f"length {length} is too small: the prompt without haystack already has {smallest} tokens")
    size = hs.largest_fitting(fits, lo=lo, guess=guess)
    if tokens[size] < MIN_FILL * length:
        raise ValueError(
            f"could only reach {tokens[size]} of the {length} tokens asked for (at least {MIN_FILL:.0%}); "
            "the haystack is too short or too coarse for this length"
        )
    sample = sizes[size]
    sample.meta["length"] = tokens[size]
    return sample


def ruler_samples(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int = 2048,
    n: int = 10,
    seed: int = 0,
    chat: bool | None = None,
) -> list[TaskSample]:
    """`n` samples of a RULER task, each prompt between 90% and 100% of `length` tokens under `tokenizer`.

    Deterministic in (task, tokenizer, length, seed, chat); sample `i` draws its keys, values and
    depths from its own generator, so samples differ across indices and seeds. See `encode` for `chat`.
    """
    if task not in _BUILDERS:
        raise ValueError(f"unknown RULER task {task!r}; choose one of {tuple(SUITE_OF)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    samples: list[TaskSample] = []
    guess: int | None = None
    for index in range(n):
        rng = random.Random(f"kvsieve/ruler/{task}/{seed}/{index}")
        build, lo = _BUILDERS[task](task, index, rng, length)
        try:
            sample = _fit(build, lo, tokenizer, length, chat, guess)
        except ValueError as err:
            raise ValueError(f"{task}#{index}: {err}") from None
        if task == "fwe":
            _check_fwe(sample, length)
        guess = sample.meta["haystack_units"]
        sample.meta["target_length"] = length
        extra = token_count(tokenizer, sample.gold) + 8
        samples.append(replace(sample, max_new_tokens=max(sample.max_new_tokens, extra)))
    return samples
