"""The routing probe suite: seven families of questions about invented facts hidden in essay filler.

After the attention-routing study of KV compression (arXiv 2603.01426): base fact retrieval,
knowledge manipulation, multi-presence, multi-entity, coreference (with abstention), long context
and multi-hop chains. Names, places and counterfactual answers are invented from syllables by a
seeded `random.Random`, and every word list is filtered against the essays, so a model cannot answer
from memory and no answer appears in the filler by chance. Filler is text of `essay_texts()`.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from typing import Any

from transformers import PreTrainedTokenizerBase

from .essays import essay_texts
from .sample import ABSTAIN_ANSWER, TaskSample, prompt_tokens, token_count

ROUTING_FAMILIES: tuple[str, ...] = (
    "base",
    "manipulation",
    "multi_presence",
    "multi_entity",
    "coreference",
    "long_context",
    "hops",
)

#: Where `long_context` puts its facts, as a fraction of the context (the early part of a long filler).
LONG_CONTEXT_DEPTH = (0.1, 0.3)

# ---------------------------------------------------------------------------------------------- words

_ONSETS = ("b", "br", "d", "dr", "f", "fl", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "r", "s", "sk", "st", "t")
_ONSETS += ("tr", "v", "z", "th", "sh", "qu", "h", "j", "w", "y")
_VOWELS = ("a", "e", "i", "o", "u", "au", "ei", "oa", "ai")
_CODAS = ("", "", "", "n", "r", "l", "s", "x", "m", "th", "rk", "nd", "sk")
_PLACE_ENDINGS = ("mor", "holm", "dale", "wick", "ford", "mere", "garth", "stead", "vik", "burg")
_PRONOUNS = {"she": ("She", "Her"), "he": ("He", "His")}

_JOBS = (
    "glassblower",
    "cartographer",
    "beekeeper",
    "falconer",
    "luthier",
    "cooper",
    "blacksmith",
    "potter",
    "weaver",
    "tanner",
    "stonemason",
    "bookbinder",
    "clockmaker",
    "shipwright",
    "saddler",
    "thatcher",
    "wheelwright",
    "locksmith",
    "perfumer",
    "milliner",
    "glazier",
    "farrier",
)
_PETS = (
    "tortoise",
    "parrot",
    "hedgehog",
    "lizard",
    "goat",
    "gecko",
    "rabbit",
    "hamster",
    "canary",
    "toad",
    "llama",
    "peacock",
    "iguana",
    "chinchilla",
    "salamander",
    "cockatoo",
    "newt",
)
_INSTRUMENTS = (
    "oboe",
    "bassoon",
    "cello",
    "harp",
    "banjo",
    "sitar",
    "tuba",
    "viola",
    "accordion",
    "zither",
    "mandolin",
    "ukulele",
    "harpsichord",
    "clarinet",
    "trombone",
    "xylophone",
    "lute",
    "dulcimer",
)
_COLOURS = (
    "teal",
    "amber",
    "crimson",
    "ochre",
    "indigo",
    "lavender",
    "turquoise",
    "magenta",
    "beige",
    "scarlet",
    "violet",
    "saffron",
    "cobalt",
    "mauve",
    "vermilion",
    "chartreuse",
)


@lru_cache(maxsize=1)
def _essay_vocabulary() -> frozenset[str]:
    """Every lowercase word of the essays (invented words and answers must avoid them)."""
    return frozenset(word for text in essay_texts().values() for word in re.findall(r"[a-z]+", text.lower()))


def _unseen(words: tuple[str, ...]) -> tuple[str, ...]:
    """The words that never occur in the essays."""
    vocabulary = _essay_vocabulary()
    kept = tuple(w for w in words if all(part not in vocabulary for part in w.lower().split()))
    if len(kept) < 6:
        raise RuntimeError(f"only {len(kept)} of {words} are absent from the essays; the word list needs more entries")
    return kept


def _syllables(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(count))


def _fresh(rng: random.Random, make: Callable[[random.Random], str], taken: set[str]) -> str:
    """A new invented string: no part of it occurs in the essays, and it does not overlap a name already used."""
    vocabulary = _essay_vocabulary()
    for _ in range(1000):
        word = make(rng)
        parts = word.lower().split()
        if any(len(p) < 3 or p in vocabulary for p in parts):
            continue
        if any(word in other or other in word for other in taken):
            continue
        taken.add(word)
        return word
    raise RuntimeError("could not invent a fresh word in 1000 tries")


def _person_name(rng: random.Random) -> str:
    first = _syllables(rng, 2) + rng.choice(_CODAS)
    last = _syllables(rng, rng.randint(1, 2)) + rng.choice(_CODAS[3:])
    return f"{first.capitalize()} {last.capitalize()}"


def _place_name(rng: random.Random) -> str:
    return (_syllables(rng, rng.randint(1, 2)) + rng.choice(_PLACE_ENDINGS)).capitalize()


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


# ------------------------------------------------------------------------------------------ relations


@dataclass(frozen=True)
class Relation:
    """A kind of fact: how it is stated, asked and answered.

    Templates use ``{subject}`` (a name, a pronoun or a noun phrase), ``{possessive}`` (its possessive form)
    and ``{value}``. `values` empty: the values are invented (places, or people when `person`).
    """

    name: str
    statement: str
    question: str
    prefix: str
    values: tuple[str, ...] = ()
    person: bool = False
    noun: str = ""

    def state(self, subject: str, possessive: str, value: str) -> str:
        return self.statement.format(subject=subject, possessive=possessive, value=value)

    def ask(self, subject: str, possessive: str) -> tuple[str, str]:
        """(question, answer prefix) about `subject`."""
        question = self.question.format(subject=subject, possessive=possessive)
        return question, _capitalize(self.prefix.format(subject=subject, possessive=possessive))


def _attribute(name: str, statement: str, question: str, prefix: str, values: tuple[str, ...] = ()) -> Relation:
    return Relation(name, statement, question, prefix, values)


def _kinship(noun: str) -> Relation:
    return Relation(
        noun.replace(" ", "_"),
        f"{{possessive}} {noun} is {{value}}.",
        f"Who is {{possessive}} {noun}?",
        f"{{possessive}} {noun} is",
        person=True,
        noun=noun,
    )


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in (
        _attribute(
            "job",
            "{subject} works as a {value}.",
            "What does {subject} do for a living?",
            "{subject} works as a",
            _JOBS,
        ),
        _attribute("city", "{subject} lives in {value}.", "Where does {subject} live?", "{subject} lives in"),
        _attribute(
            "birthplace", "{subject} was born in {value}.", "Where was {subject} born?", "{subject} was born in"
        ),
        _attribute(
            "pet", "{subject} keeps a pet {value}.", "What pet does {subject} keep?", "{subject} keeps a pet", _PETS
        ),
        _attribute(
            "instrument",
            "{subject} plays the {value}.",
            "Which instrument does {subject} play?",
            "{subject} plays the",
            _INSTRUMENTS,
        ),
        _attribute(
            "colour",
            "{possessive} favourite colour is {value}.",
            "What is {possessive} favourite colour?",
            "{possessive} favourite colour is",
            _COLOURS,
        ),
        _kinship("mentor"),
        _kinship("neighbour"),
        _kinship("oldest friend"),
    )
}
ATTRIBUTES: tuple[str, ...] = ("job", "city", "birthplace", "pet", "instrument", "colour")
#: Attributes whose templates name the subject plainly (usable at the end of a `hops` chain).
CHAIN_ENDS: tuple[str, ...] = ("job", "city", "birthplace", "pet", "instrument")
KINSHIPS: tuple[str, ...] = ("mentor", "neighbour", "oldest_friend")


@cache
def relation_values(name: str) -> tuple[str, ...]:
    """The fixed values of a relation, less any word that occurs in the essays (empty: values are invented)."""
    words = RELATIONS[name].values
    return _unseen(words) if words else ()


def _value(rng: random.Random, relation: Relation, taken: set[str], exclude: Collection[str] = ()) -> str:
    if relation.person:
        return _fresh(rng, _person_name, taken)
    values = [v for v in relation_values(relation.name) if v not in exclude]
    return rng.choice(values) if values else _fresh(rng, _place_name, taken)


def _named(name: str) -> tuple[str, str]:
    """(subject, possessive) forms of a name."""
    return name, f"{name}'s"


@dataclass(frozen=True)
class _CommonFact:
    """A piece of common knowledge, contradicted by `manipulation` ("In this world ...")."""

    subject: str
    wh: str
    common: str
    kind: str  # "place", "person" or "list"
    alternatives: tuple[str, ...] = ()


_COMMON_FACTS = (
    _CommonFact("the capital of France", "What", "Paris", "place"),
    _CommonFact("the capital of Japan", "What", "Tokyo", "place"),
    _CommonFact("the capital of Italy", "What", "Rome", "place"),
    _CommonFact("the capital of Egypt", "What", "Cairo", "place"),
    _CommonFact("the largest planet of the solar system", "What", "Jupiter", "place"),
    _CommonFact("the tallest mountain on Earth", "What", "Mount Everest", "place"),
    _CommonFact("the author of Hamlet", "Who", "William Shakespeare", "person"),
    _CommonFact("the inventor of the telephone", "Who", "Alexander Graham Bell", "person"),
    _CommonFact("the first person to walk on the Moon", "Who", "Neil Armstrong", "person"),
    _CommonFact("the painter of the Mona Lisa", "Who", "Leonardo da Vinci", "person"),
    _CommonFact("the colour of a clear daytime sky", "What", "blue", "list", _COLOURS),
    _CommonFact("the number of legs of a spider", "What", "eight", "list", ("three", "five", "eleven", "fourteen")),
)

_INTROS = (
    "{name} gave a short speech at the spring fair.",
    "Everyone in the valley has heard of {name}.",
    "{name} is a member of the {word} society.",
    "{name} arrived late to the meeting of the {word} council.",
    "Last winter {name} was elected to the {word} committee.",
)

# ----------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class _Block:
    """Sentences kept together in the context, placed at one depth; `evidence` flags the ones the answer needs."""

    sentences: tuple[str, ...]
    evidence: tuple[bool, ...]
    depth: float
    window: tuple[float, float]
    strict: bool = False


@dataclass(frozen=True)
class _Plan:
    """A sample before its filler: the fact blocks and the question.

    `candidates`: the values the distractor statements give the asked relation (bare, like `answers`).
    """

    blocks: tuple[_Block, ...]
    question: str
    answers: tuple[str, ...]
    answer_prefix: str
    abstain_ok: bool = False
    max_new_tokens: int = 16
    meta: dict[str, Any] = field(default_factory=dict)
    candidates: tuple[str, ...] = ()


def _spread_depths(
    rng: random.Random, k: int, low: float = 0.05, high: float = 0.95
) -> list[tuple[float, tuple[float, float]]]:
    """`k` seeded depths, one in each of `k` equal strata of `[low, high]`, in shuffled order, with their strata."""
    width = (high - low) / k
    strata = [(low + i * width, low + (i + 1) * width) for i in range(k)]
    rng.shuffle(strata)
    return [(rng.uniform(a, b), (a, b)) for a, b in strata]


def _single(sentence: str, depth: tuple[float, tuple[float, float]]) -> _Block:
    return _Block((sentence,), (True,), depth[0], depth[1])


def _distractor(sentence: str, depth: tuple[float, tuple[float, float]]) -> _Block:
    return _Block((sentence,), (False,), depth[0], depth[1])


def _plan_base(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    relation = RELATIONS[rng.choice(ATTRIBUTES)]
    name = _fresh(rng, _person_name, taken)
    value = _value(rng, relation, taken)
    question, prefix = relation.ask(*_named(name))
    block = _single(relation.state(*_named(name), value), _spread_depths(rng, 1)[0])
    meta = {"relation": relation.name, "entity": name, "distractors": 0, "hops": 1}
    return _Plan((block,), question, (value,), prefix, meta=meta)


def _plan_manipulation(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    fact = rng.choice(_COMMON_FACTS)
    if fact.kind == "list":
        value = rng.choice([v for v in fact.alternatives if v != fact.common])
    else:
        value = _fresh(rng, _person_name if fact.kind == "person" else _place_name, taken)
    sentence = f"In this world, {fact.subject} is {value}."
    question = f"In this world, {fact.wh.lower()} is {fact.subject}?"
    block = _single(sentence, _spread_depths(rng, 1)[0])
    meta = {"common_answer": fact.common, "subject": fact.subject, "distractors": 0, "hops": 1}
    return _Plan((block,), _capitalize(question), (value,), f"In this world, {fact.subject} is", meta=meta)


def _plan_multi_presence(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    name = _fresh(rng, _person_name, taken)
    relations = [RELATIONS[r] for r in rng.sample(ATTRIBUTES, rng.randint(3, 4))]
    asked = rng.randrange(len(relations))
    values = [_value(rng, r, taken) for r in relations]
    depths = _spread_depths(rng, len(relations))
    blocks = tuple(
        (_single if i == asked else _distractor)(r.state(*_named(name), v), d)
        for i, (r, v, d) in enumerate(zip(relations, values, depths, strict=True))
    )
    question, prefix = relations[asked].ask(*_named(name))
    meta = {"relation": relations[asked].name, "entity": name, "mentions": len(relations)}
    meta |= {"distractors": len(relations) - 1, "hops": 1}  # the other mentions distract
    return _Plan(blocks, question, (values[asked],), prefix, meta=meta)


def _plan_multi_entity(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    relation = RELATIONS[rng.choice(ATTRIBUTES)]
    names = [_fresh(rng, _person_name, taken) for _ in range(rng.randint(3, 5))]
    values: list[str] = []
    for _ in names:
        values.append(_value(rng, relation, taken, exclude=set(values)))
    asked = rng.randrange(len(names))
    depths = _spread_depths(rng, len(names))
    blocks = tuple(
        (_single if i == asked else _distractor)(relation.state(*_named(n), v), d)
        for i, (n, v, d) in enumerate(zip(names, values, depths, strict=True))
    )
    question, prefix = relation.ask(*_named(names[asked]))
    meta = {"relation": relation.name, "entity": names[asked], "distractors": len(names) - 1, "hops": 1}
    meta |= {"entities": names, "values": values}  # every person and value (`question_sets` asks about each)
    others = tuple(v for i, v in enumerate(values) if i != asked)  # the other people's values of the relation
    return _Plan(blocks, question, (values[asked],), prefix, meta=meta, candidates=others)


def _is_abstain(index: int, seed: int) -> bool:
    """Every third coreference sample (a seeded phase) asks what the context does not say."""
    return (index + random.Random(f"routing:abstain:{seed}").randrange(3)) % 3 == 0


def _plan_coreference(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    pronoun = rng.choice(sorted(_PRONOUNS))
    people = [(_fresh(rng, _person_name, taken), pronoun), (_fresh(rng, _person_name, taken), _other(pronoun))]
    relations = [rng.sample(ATTRIBUTES, 2), rng.sample(ATTRIBUTES, rng.randint(1, 2))]
    abstain = _is_abstain(index, seed)
    depths = _spread_depths(rng, 2)
    blocks, facts, values = [], [], set()
    for (name, pro), rels, depth in zip(people, relations, depths, strict=True):
        intro = rng.choice(_INTROS).format(name=name, word=_fresh(rng, _place_name, taken))
        said = [(RELATIONS[r], _value(rng, RELATIONS[r], taken, exclude=values)) for r in rels]
        values.update(v for _, v in said)  # the two people never share a value
        facts.append(said)
        sentences = (intro, *(r.state(*_PRONOUNS[pro], v) for r, v in said))
        blocks.append(_Block(sentences, (False,) * len(sentences), *depth))
    name = people[0][0]
    if abstain:
        used = {r for rels in relations for r in rels}
        relation = RELATIONS[rng.choice([r for r in ATTRIBUTES if r not in used])]
        answer, marked = ABSTAIN_ANSWER, (True,) * len(blocks[0].sentences)
    else:
        asked = rng.randrange(len(facts[0]))
        relation, answer = facts[0][asked]
        marked = tuple(i in (0, asked + 1) for i in range(len(blocks[0].sentences)))
    blocks[0] = replace(blocks[0], evidence=marked)
    question, _ = relation.ask(*_named(name))
    question = f'{question} If the text does not say, answer "{ABSTAIN_ANSWER}".'
    meta = {"relation": relation.name, "entity": name, "pronoun": pronoun, "abstain": abstain}
    meta |= {"distractors": 1, "hops": 1}
    return _Plan(tuple(blocks), question, (answer,), "Answer:", abstain, 24, meta)


def _other(pronoun: str) -> str:
    return "he" if pronoun == "she" else "she"


def _plan_long_context(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    asked_rel, other_rel = (RELATIONS[r] for r in rng.sample(ATTRIBUTES, 2))
    name, other = _fresh(rng, _person_name, taken), _fresh(rng, _person_name, taken)
    value = _value(rng, asked_rel, taken)
    window = (0.11, 0.28)  # inside LONG_CONTEXT_DEPTH with a margin: the blocks' ends must stay inside too
    asked = asked_rel.state(*_named(name), value)
    decoy = other_rel.state(*_named(other), _value(rng, other_rel, taken))
    blocks = [_Block((asked,), (True,), rng.uniform(*window), window, True)]
    blocks.append(_Block((decoy,), (False,), rng.uniform(*window), window, True))
    question, prefix = asked_rel.ask(*_named(name))
    meta = {"relation": asked_rel.name, "entity": name, "distractors": 1, "hops": 1}
    return _Plan(tuple(blocks), question, (value,), prefix, meta=meta)


def _plan_hops(rng: random.Random, index: int, seed: int) -> _Plan:
    taken: set[str] = set()
    hops = rng.choice((2, 3))
    kinships = [RELATIONS[r] for r in rng.sample(KINSHIPS, hops - 1)]
    end = RELATIONS[rng.choice(CHAIN_ENDS)]
    people = [_fresh(rng, _person_name, taken) for _ in range(hops)]
    values: list[str] = []
    for _ in people:
        values.append(_value(rng, end, taken, exclude=set(values)))
    chain = [k.state(*_named(a), b) for k, a, b in zip(kinships, people, people[1:], strict=False)]
    chain.append(end.state(*_named(people[-1]), values[-1]))
    # the earlier people of the chain have the asked attribute too (with other values): distractors
    decoys = [end.state(*_named(p), v) for p, v in zip(people[:-1], values[:-1], strict=True)]
    depths = _spread_depths(rng, len(chain) + len(decoys))
    blocks = [_single(s, d) for s, d in zip(chain, depths, strict=False)]
    blocks += [_distractor(s, d) for s, d in zip(decoys, depths[len(chain) :], strict=True)]
    phrase = f"{people[0]}'s {kinships[0].noun}"
    for kinship in kinships[1:]:
        phrase = f"the {kinship.noun} of {phrase}"
    question, prefix = end.ask(phrase, f"{phrase}'s")
    meta = {
        "relation": end.name,
        "entity": people[0],
        "hops": hops,
        "chain": (*(k.name for k in kinships), end.name),
        "distractors": len(decoys),
        "people": people,  # the chain's people, in order, and each one's value of the end relation
        "values": values,
    }
    # the decoys' values: what following the chain one hop (or two) too few answers
    return _Plan(
        tuple(blocks), question, (values[-1],), prefix, max_new_tokens=24, meta=meta, candidates=tuple(values[:-1])
    )


_PLANNERS: dict[str, Callable[[random.Random, int, int], _Plan]] = {
    "base": _plan_base,
    "manipulation": _plan_manipulation,
    "multi_presence": _plan_multi_presence,
    "multi_entity": _plan_multi_entity,
    "coreference": _plan_coreference,
    "long_context": _plan_long_context,
    "hops": _plan_hops,
}

# ---------------------------------------------------------------------------------------------- filler

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@lru_cache(maxsize=1)
def _essay_sentences() -> tuple[tuple[str, ...], ...]:
    """Each essay as clean sentences (single spaces, ASCII, no footnote marks or links)."""
    essays = []
    for text in essay_texts().values():
        flat = re.sub(r"\s+", " ", text).strip()
        pieces = re.split(r"(?<=[.!?])(?:\s+|(?=[A-Z]))", flat)
        keep = tuple(
            s.strip()
            for s in pieces
            if 20 <= len(s.strip()) <= 300 and s.isascii() and not re.search(r"[\[\]]|http|www\.|Thanks to", s)
        )
        essays.append(keep)
    return tuple(e for e in essays if e)


def _sentence_stream(rng: random.Random) -> Iterator[str]:
    """Essay sentences from a seeded start: a random essay at a random sentence, then the others in seeded order."""
    essays = _essay_sentences()
    order = rng.sample(range(len(essays)), len(essays))
    start = rng.randrange(len(essays[order[0]]))
    yield from essays[order[0]][start:]
    for i in order[1:]:
        yield from essays[i]
    yield from essays[order[0]][:start]


def _filler_words(rng: random.Random, tokenizer: PreTrainedTokenizerBase, min_tokens: int) -> tuple[list[str], int]:
    """Whitespace-split essay words, seeded, holding more than `min_tokens` tokens of `tokenizer`; and their tokens."""
    stream, sentences, chars, budget = _sentence_stream(rng), [], 0, 6 * min_tokens + 200
    while True:
        for sentence in stream:
            sentences.append(sentence)
            chars += len(sentence) + 1
            if chars >= budget:
                break
        text = " ".join(sentences)
        tokens = token_count(tokenizer, text)
        if tokens > min_tokens:
            return text.split(" "), tokens
        if chars < budget:
            raise ValueError(f"the essays hold fewer than {min_tokens} tokens; ask for a shorter length")
        budget *= 2


def _insertion_points(words: list[str], blocks: tuple[_Block, ...]) -> list[int]:
    """Where each block goes, as a word index of the filler, so that it starts near its depth of the final context.

    A block lies inside its window (start and end) when it fits there: at the sentence end nearest to its
    depth inside the window; when the window holds no sentence end, at the nearest word boundary if the
    block is `strict`, else at the nearest sentence end outside the window.
    """
    starts = [0]  # character offset of each word boundary in the filler joined by spaces
    for word in words:
        starts.append(starts[-1] + len(word) + 1)
    ends = [b for b in range(len(words) + 1) if b in (0, len(words)) or _SENTENCE_END.search(words[b - 1])]
    sizes = [len(" ".join(b.sentences)) + 1 for b in blocks]
    total = starts[-1] + sum(sizes)
    points, shift, previous = [0] * len(blocks), 0, 0
    order = sorted(range(len(blocks)), key=lambda i: (blocks[i].depth, i))
    for rank, i in enumerate(order):
        block = blocks[i]
        # a strict block leaves room for the blocks after it in the same window
        reserved = sum(sizes[j] for j in order[rank + 1 :] if block.strict and blocks[j].window == block.window)
        low = block.window[0] * total - shift
        high = max(low, block.window[1] * total - sizes[i] - reserved - shift)
        target = min(max(block.depth * total - shift, low), high)
        candidates = [b for b in ends if b >= previous]
        inside = [b for b in candidates if low <= starts[b] <= high]
        if inside or not block.strict:
            point = min(inside or candidates, key=lambda b: abs(starts[b] - target))
        else:
            point = max(previous, bisect.bisect_right(starts, target) - 1)
        points[i], shift, previous = point, shift + sizes[i], point
    return points


def _assemble(words: list[str], blocks: tuple[_Block, ...]) -> tuple[str, tuple[tuple[int, int], ...], list[float]]:
    """Filler words with the blocks inserted: (context, evidence spans, depth of each block's start)."""
    points = _insertion_points(words, blocks)
    pieces: list[tuple[str, bool, int]] = []  # (text, is evidence, block index or -1)
    previous = 0
    for i in sorted(range(len(blocks)), key=lambda i: (points[i], blocks[i].depth, i)):
        point = points[i]
        if point > previous:
            pieces.append((" ".join(words[previous:point]), False, -1))
            previous = point
        pieces += [(s, e, i) for s, e in zip(blocks[i].sentences, blocks[i].evidence, strict=True)]
    if previous < len(words):
        pieces.append((" ".join(words[previous:]), False, -1))
    context, spans, starts = "", [], [0] * len(blocks)
    seen: set[int] = set()
    for text, is_evidence, block in pieces:
        context += " " if context else ""
        if block >= 0 and block not in seen:
            seen.add(block)
            starts[block] = len(context)
        if is_evidence:
            spans.append((len(context), len(context) + len(text)))
        context += text
    return context, tuple(spans), [s / len(context) for s in starts]


# ----------------------------------------------------------------------------------------------- fitting


def _sample_with(plan: _Plan, family: str, index: int, words: list[str]) -> TaskSample:
    context, evidence, depths = _assemble(words, plan.blocks)
    evidence_depths = [start / len(context) for start, _ in evidence]
    answer = plan.answers[0]
    candidates = tuple(f" {c}" for c in plan.candidates)
    return TaskSample(
        task=family,
        suite="routing",
        index=index,
        context=context,
        question=plan.question,
        answers=plan.answers,
        gold=f" {answer}",
        candidates=candidates,
        evidence=evidence,
        answer_prefix=plan.answer_prefix,
        abstain_ok=plan.abstain_ok,
        max_new_tokens=plan.max_new_tokens,
        meta={
            "family": family,
            **plan.meta,
            "depth": min(evidence_depths),
            "evidence_depths": tuple(evidence_depths),
            "block_depths": tuple(depths),
            "filler_words": len(words),
        },
    )


def _fit_length(
    build: Callable[[int], TaskSample],
    tokens: Callable[[TaskSample], int],
    n_words: int,
    ends: list[int],
    length: int,
    words_per_token: float,
) -> TaskSample:
    """The longest filler prefix whose prompt fits in `length` tokens, cut at a sentence end if that still fills 90%.

    `build(k)` makes the sample with the first `k` filler words (the whole filler holds more than `length`
    tokens); `tokens` measures its prompt. The search starts from a guess made with `words_per_token` and
    brackets it by doubling steps before bisecting.
    """
    measured: dict[int, tuple[TaskSample, int]] = {}

    def size(k: int) -> int:
        if k not in measured:
            sample = build(k)
            measured[k] = (sample, tokens(sample))
        return measured[k][1]

    empty = size(0)
    if empty > length:
        raise ValueError(f"length {length} is too small: the facts and question alone take {empty} prompt tokens")
    low, high = 0, n_words  # size(low) <= length < size(high)
    guess = min(max(round((length - empty) * words_per_token), 1), n_words - 1)
    step = max(2, guess // 64)
    if size(guess) <= length:
        low = guess
        while low + step < high and size(low + step) <= length:
            low, step = low + step, 2 * step
        high = min(high, low + step)
    else:
        high = guess
        while high - step > low and size(high - step) > length:
            high, step = high - step, 2 * step
        low = max(low, high - step)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if size(middle) <= length else (low, middle)
    floor = 0.9 * length
    cut = max(b for b in ends if b <= low)
    best = cut if floor <= size(cut) <= length else low
    if not floor <= size(best) <= length:
        raise ValueError(
            f"could not fit a prompt in [{floor:.0f}, {length}] tokens (got {size(best)}); ask for a longer length"
        )
    return measured[best][0]


def routing_samples(
    family: str,
    tokenizer: PreTrainedTokenizerBase,
    length: int = 1024,
    n: int = 10,
    seed: int = 0,
    chat: bool | None = None,
) -> list[TaskSample]:
    """`n` samples of one routing family (arXiv 2603.01426), each prompt in `[0.9 * length, length]` tokens.

    The length is measured with `encode(sample, tokenizer, chat)` (context plus question). Facts depend
    only on `(family, seed, index)`; the filler (essay sentences from a seeded start) is cut to the length.
    """
    if family not in _PLANNERS:
        raise ValueError(f"unknown routing family {family!r}; known: {', '.join(ROUTING_FAMILIES)}")
    if length < 1 or n < 0:
        raise ValueError(f"length must be positive and n non-negative (got length={length}, n={n})")
    samples = []
    for index in range(n):
        plan = _PLANNERS[family](random.Random(f"routing:{family}:{seed}:{index}:facts"), index, seed)
        words, filler_tokens = _filler_words(
            random.Random(f"routing:{family}:{seed}:{index}:filler"), tokenizer, length
        )
        ends = [0, *(i + 1 for i, w in enumerate(words) if _SENTENCE_END.search(w))]
        sample = _fit_length(
            lambda k, plan=plan, index=index, words=words: _sample_with(plan, family, index, words[:k]),
            lambda s: prompt_tokens(s, tokenizer, chat),
            len(words),
            ends,
            length,
            len(words) / filler_tokens,
        )
        if family == "long_context":
            _check_early(sample)
        samples.append(replace(sample, meta={**sample.meta, "prompt_tokens": prompt_tokens(sample, tokenizer, chat)}))
    return samples


def _check_early(sample: TaskSample) -> None:
    """`long_context` facts must lie inside `LONG_CONTEXT_DEPTH` of the context."""
    low, high = LONG_CONTEXT_DEPTH
    size = len(sample.context)
    for start, end in sample.evidence:
        if not (low <= start / size and end / size <= high):
            raise ValueError(
                f"long_context#{sample.index}: the fact lies at {start / size:.2f}-{end / size:.2f} of the context, "
                f"outside {LONG_CONTEXT_DEPTH}; the length is too small for this family"
            )
