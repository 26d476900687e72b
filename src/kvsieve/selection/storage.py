"""How a policy's kept entries are stored: `Storage`, the spec keys `kv_bits`, `kv_group`, `kv_residual`, `kv_codec`.

Part of a policy (``"trimkv+global:kv_bits=4"``): which entries stay is the scorer's, allocator's and
projection's; how many bits each keeps is this. The codecs that store them are the runtime's
(`kvsieve.runtime.storage.codecs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import PolicyError

#: Bits per number a quantized cache may store; 16 means the model's own dtype (no quantization).
KV_BITS = (2, 4, 8, 16)
#: Channels that share one scale and minimum, unless the head dimension is smaller.
DEFAULT_GROUP = 32
#: The newest entries of every (row, kv-head) a quantized cache keeps in full precision (a policy's recent tail).
DEFAULT_RESIDUAL = 32


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Storage:
    """How kept entries are stored, with `kvsieve.compress`'s names: `kv_bits` (16: the model's dtype; 8, 4, 2),
    `kv_group` channels per scale (default 32, or the head dimension when smaller), the `kv_residual` newest
    entries of every (row, kv-head) kept in full precision (default 32) and `kv_codec`, the number format
    (default ``int``: min-max integers of `kv_bits`; ``fp8``: float8 e4m3). Checked when built; the codec
    name and the head dimension are checked when a model's codec is made (`kvsieve.runtime.storage.codecs`)."""

    kv_bits: int = 16
    kv_group: int | None = None
    kv_residual: int | None = None
    kv_codec: str | None = None

    def __post_init__(self) -> None:
        if not _whole(self.kv_bits) or self.kv_bits not in KV_BITS:
            raise PolicyError(f"kv_bits={self.kv_bits!r} is not supported; use one of {', '.join(map(str, KV_BITS))}")
        if self.kv_codec is not None and (not isinstance(self.kv_codec, str) or not self.kv_codec.isidentifier()):
            raise PolicyError(f"kv_codec must name a codec, such as 'fp8', got {self.kv_codec!r}")
        if not self.encoded and (self.kv_group is not None or self.kv_residual is not None):
            raise PolicyError(
                "kv_group and kv_residual apply to quantized entries: give them with kv_bits=8, 4 or 2 or a kv_codec"
            )
        if self.kv_group is not None and (not _whole(self.kv_group) or self.kv_group < 1):
            raise PolicyError(f"kv_group must be a whole number >= 1, got {self.kv_group!r}")
        if self.kv_residual is not None and (not _whole(self.kv_residual) or self.kv_residual < 0):
            raise PolicyError(f"kv_residual must be a whole number >= 0, got {self.kv_residual!r}")

    @property
    def encoded(self) -> bool:
        """Whether the entries are stored in another format than the model computed them in."""
        return self.kv_bits != 16 or self.kv_codec is not None

    @property
    def codec_name(self) -> str:
        """The registered codec that stores the entries: ``full``, ``int`` (fewer `kv_bits`) or `kv_codec`."""
        return self.kv_codec or ("int" if self.kv_bits != 16 else "full")

    def parameters(self) -> dict[str, int | str]:
        """The keys that differ from full precision, by name (as a spec writes them)."""
        defaults = dataclasses.asdict(FULL_STORAGE)
        return {key: value for key, value in dataclasses.asdict(self).items() if value != defaults[key]}

    def merged(self, given: Mapping[str, int | str | None], said: str) -> Storage:
        """This storage with the keys `given` set (a None or 16 `kv_bits` sets nothing); a key `said` (a policy)
        sets already to another value is an error that names both."""
        given = {key: value for key, value in given.items() if value is not None and (key, value) != ("kv_bits", 16)}
        own = self.parameters()
        for key, value in given.items():
            if key in own and own[key] != value:
                raise PolicyError(f"policy {said!r} says {key}={own[key]} but {key}={value} is given: give it once")
        return dataclasses.replace(self, **given) if given else self


#: The keys a spec may give to say how the kept entries are stored.
STORAGE_KEYS = tuple(field.name for field in dataclasses.fields(Storage))


def storage_value(key: str, text: str) -> int | str:
    """A storage key's value as a spec writes it: a whole number, or for `kv_codec` a name."""
    if key == "kv_codec":
        return text
    try:
        return int(text)
    except ValueError:
        raise PolicyError(f"parameter {key}={text!r} is not a valid int") from None


#: Entries as the model computed them.
FULL_STORAGE = Storage()
