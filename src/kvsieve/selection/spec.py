"""Policy specs: the canonical strings ``"scorer[+allocator][:key=value,...]"`` and the parser that builds a `Policy`.

A spec names a scorer (`kvsieve.selection.scorers`) and optionally an allocator
(`kvsieve.selection.allocators`, ``uniform`` by default); its parameters belong to the scorer, the
allocator, the protection (`n_sink`, `n_recent`), the projection (``projection=topk|chunk|sentence``
and the chosen projection's own parameters, e.g. `chunk_size`), the merge of what is evicted
(``merge=mean|window|output|none``: `kvsieve.selection.merge`) or the storage of the kept entries
(`kv_bits`, `kv_group`, `kv_residual`, `kv_codec`: `kvsieve.selection.storage`). `Policy.name` writes the spec back.
"""

from __future__ import annotations

import dataclasses

from .allocators import ALLOCATORS
from .deprecation import renamed_keywords
from .errors import PolicyError
from .merge import Merge, make_merge
from .policy import Policy
from .projection import PROJECTIONS, Projection, TopK
from .protection import PROTECTION_DEFAULTS
from .scorers import SCORERS
from .storage import STORAGE_KEYS, Storage, storage_value

#: Deprecated keywords `make_policy` (and everything that passes policy parameters on to it) still takes.
DEPRECATED_PARAMETERS = ("budget", "sliding_window")


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def _convert(value: str, like: object, key: str) -> object:
    """A spec text value as the type of the parameter's default."""
    try:
        if isinstance(like, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return type(like)(value)
    except ValueError:
        raise PolicyError(f"parameter {key}={value!r} is not a valid {type(like).__name__}") from None


def _text_parameters(text: str) -> dict[str, str]:
    """`key=value,...` as a dict of strings."""
    given: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise PolicyError(f"policy parameter {item!r} is not key=value")
        if key in given:
            raise PolicyError(f"policy parameter {key} is given twice")
        given[key] = value
    return given


def _projection(given: dict[str, object]) -> Projection | None:
    """The projection the parameters name, with its own parameters; None if they name none (`Policy.projection`).

    A parameter of another projection is an error unless it has that projection's default value.
    """
    choice = given.pop("projection", None)
    if choice is not None and not isinstance(choice, str):  # a Projection object
        return choice
    if choice is not None and choice not in PROJECTIONS:
        raise PolicyError(f"unknown projection {choice!r}; known: {', '.join(PROJECTIONS)}")
    own = {} if choice is None else _defaults(PROJECTIONS[choice])
    for key, value in given.items():
        if key in own:
            continue
        owners = [name for name, cls in PROJECTIONS.items() if key in _defaults(cls)]
        if value != _defaults(PROJECTIONS[owners[0]])[key]:
            named = "no projection" if choice is None else f"projection={choice}"
            raise PolicyError(f"{key} is a parameter of projection={' or '.join(owners)}; the policy names {named}")
    return None if choice is None else PROJECTIONS[choice](**{k: v for k, v in given.items() if k in own})


def make_projection(text: str) -> Projection:
    """A projection from ``"name[,key=value,...]"``, e.g. ``"sentence,best_tokens=0.1"`` (what follows ``projection=``
    in a policy spec), or a `PolicyError` that names the problem."""
    given: dict[str, object] = dict(_text_parameters(f"projection={text}"))
    defaults = {key: value for cls in PROJECTIONS.values() for key, value in _defaults(cls).items()}
    for key in given:
        if key != "projection" and key not in defaults:
            raise PolicyError(f"unknown projection parameter {key!r}; valid: {', '.join(defaults)}")
    converted = {
        key: value if key == "projection" else _convert(value, defaults[key], key) for key, value in given.items()
    }
    return _projection(converted)


#: The merge's parameters in a spec, with their defaults: `merge=` (none) and the `parts` of every merge.
MERGE_DEFAULTS: dict[str, object] = {"merge": "", "parts": 1}


def parse_merge(text: str) -> Merge | None:
    """A merge from ``"name[,key=value,...]"``, e.g. ``"window,parts=4"`` (what follows ``merge=`` in a policy spec),
    or a `PolicyError` that names the problem."""
    given: dict[str, object] = dict(_text_parameters(f"merge={text}"))
    name = given.pop("merge")
    for key in given:
        if key not in MERGE_DEFAULTS:
            valid = ", ".join(k for k in MERGE_DEFAULTS if k != "merge")
            raise PolicyError(f"unknown merge parameter {key!r}; valid: {valid}")
    return make_merge(name, **{key: _convert(value, MERGE_DEFAULTS[key], key) for key, value in given.items()})


def _names(spec: str, allocator: str | None) -> tuple[str, str, str]:
    """`(scorer, allocator, parameter text)` of a spec, checked against the registries."""
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"a policy is a name such as 'snapkv', got {spec!r}; known: {', '.join(SCORERS)}")
    head, _, text = spec.strip().partition(":")
    scorer_name, _, allocator_name = (part.strip() for part in head.partition("+"))
    if scorer_name not in SCORERS:
        raise PolicyError(f"unknown policy {scorer_name!r}; known: {', '.join(SCORERS)}")
    if allocator is not None and allocator_name and allocator != allocator_name:
        raise PolicyError(f"policy {spec!r} names allocator {allocator_name!r} but allocator={allocator!r}")
    allocator_name = allocator_name or allocator or "uniform"
    if allocator_name not in ALLOCATORS:
        raise PolicyError(f"unknown allocator {allocator_name!r}; known: {', '.join(ALLOCATORS)}")
    return scorer_name, allocator_name, text


def _parts(scorer_name: str, allocator_name: str) -> dict[str, dict[str, object]]:
    """The parameters of a policy's parts, with their defaults: scorer, allocator, protection, projection."""
    return {
        "scorer": _defaults(SCORERS[scorer_name]),
        "allocator": _defaults(ALLOCATORS[allocator_name]),
        "protection": dict(PROTECTION_DEFAULTS),
        "projection": {"projection": TopK.name} | {k: v for c in PROJECTIONS.values() for k, v in _defaults(c).items()},
        "merge": dict(MERGE_DEFAULTS),
    }


def policy_keywords() -> frozenset[str]:
    """Every keyword `make_policy` takes as a parameter of some policy: the fields of every scorer, allocator and
    projection, the protection, `projection`, the merge's, the storage keys and the deprecated names."""
    classes = [*SCORERS.values(), *ALLOCATORS.values(), *PROJECTIONS.values()]
    fields = {key for cls in classes for key in _defaults(cls)}
    return frozenset(
        {*fields, *PROTECTION_DEFAULTS, "projection", *MERGE_DEFAULTS, *STORAGE_KEYS, *DEPRECATED_PARAMETERS}
    )


def make_policy(spec: str | Policy, allocator: str | None = None, **params: object) -> Policy:
    """Build a policy from ``"scorer[+allocator][:key=value,...]"`` (or return a given `Policy`).

    Args:
        spec: e.g. ``"snapkv"``, ``"snapkv+adaptive:window=32"``, ``"importance+global:calibration=zscore"``,
            ``"trimkv+global:kv_bits=4"``.
        allocator: ``uniform``, ``pyramid``, ``adaptive`` or ``global``, if `spec` names none.
        params: override the spec's; keys are the scorer's and the allocator's fields plus `n_sink`,
            `n_recent`, `projection` (``topk``, ``chunk``, ``sentence``, or a `Projection`) and the
            projection's own (`chunk_size` for ``chunk``; `best_tokens` for ``chunk`` and ``sentence``), e.g.
            ``"snapkv+global:projection=chunk,chunk_size=16"``; none named: the one the checkpoint of the
            gates the scorer reads records, else ``topk`` (`Policy.projection`); `merge` (``mean``, ``window``,
            ``output``, or a `kvsieve.selection.merge.Merge`; `parts`: how many, one per group of similar keys): what
            each head evicts lives on as merged entries; none named: the one the checkpoint of the gates the scorer
            reads records, if any; ``none``: none.
            The deprecated `budget` (the allocator) and `sliding_window` (`n_recent`) still work, with a warning.
            The storage keys `kv_bits`, `kv_group`, `kv_residual`, `kv_codec` (`kvsieve.selection.storage.Storage`) may
            also be given with a `Policy`; one the spec (or the `Policy`) sets to another value is an error,
            and None (or `kv_bits=16`) sets nothing.
    """
    params = renamed_keywords(params, "make_policy", DEPRECATED_PARAMETERS)
    storage = {key: params.pop(key) for key in STORAGE_KEYS if key in params}
    if "allocator" in params:
        if allocator is not None:
            raise PolicyError("give the allocator once")
        allocator = params.pop("allocator")
    if isinstance(spec, Policy):
        if params or allocator is not None:
            raise PolicyError("parameters or an allocator cannot be given together with a Policy object")
        stored = spec.storage.merged(storage, spec.name)
        return spec if stored == spec.storage else dataclasses.replace(spec, storage=stored)
    scorer_name, allocator_name, text = _names(spec, allocator)
    parts = _parts(scorer_name, allocator_name)
    owner = {key: part for part, defaults in parts.items() for key in defaults}
    label = scorer_name if allocator_name == "uniform" else f"{scorer_name}+{allocator_name}"
    given: dict[str, object] = renamed_keywords(_text_parameters(text), f"policy {spec!r}", ("sliding_window",))
    said = {key: storage_value(key, given.pop(key)) for key in STORAGE_KEYS if key in given}
    for key in [*given, *params]:
        if key not in owner:
            raise PolicyError(f"unknown parameter {key!r} for {label}; valid: {', '.join([*owner, *STORAGE_KEYS])}")
    given = {key: _convert(value, parts[owner[key]][key], key) for key, value in given.items()} | params
    kwargs = {part: {k: v for k, v in given.items() if owner[k] == part} for part in parts}
    try:
        scorer = SCORERS[scorer_name](**kwargs["scorer"])
        allocator_obj = ALLOCATORS[allocator_name](**kwargs["allocator"])
    except (TypeError, ValueError) as err:
        raise PolicyError(f"{spec}: {err}") from None
    stored = Storage(**said).merged(storage, spec)
    projection = _projection(kwargs["projection"])
    merge = make_merge(kwargs["merge"].pop("merge", None), **kwargs["merge"])
    return Policy(scorer, allocator_obj, projection, **kwargs["protection"], storage=stored, merge=merge)


def split_policies(text: str) -> list[str]:
    """Split a comma-separated list of policy specs; `key=value` items belong to the spec before them (an
    item with an ``@``, a forced variant's ``<spec>@force=all/caote``, is a spec of its own).

    ``"snapkv+adaptive:window=16,kernel=7,random"`` -> ``["snapkv+adaptive:window=16,kernel=7", "random"]``.
    """
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and "@" not in part and specs:
            specs[-1] += f",{part}"
        else:
            specs.append(part)
    return specs


def known_policies() -> list[str]:
    return list(SCORERS)
