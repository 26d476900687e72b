"""Side-by-side runs of other KV-cache compression libraries (optional extra ``kvsieve[compare]``)."""

from .kvpress import (
    KVPRESS_PRESSES,
    STREAMING_PRESSES,
    PressedCache,
    PressStream,
    import_kvpress,
    kvpress_compress,
    kvpress_ratio,
    make_decoding_press,
    make_press,
)

__all__ = [
    "KVPRESS_PRESSES",
    "STREAMING_PRESSES",
    "PressStream",
    "PressedCache",
    "import_kvpress",
    "kvpress_compress",
    "kvpress_ratio",
    "make_decoding_press",
    "make_press",
]
