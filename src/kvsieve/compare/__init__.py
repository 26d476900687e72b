"""Side-by-side runs of other KV-cache compression libraries (optional extra ``kvsieve[compare]``)."""

from .kvpress import KVPRESS_PRESSES, PressedCache, import_kvpress, kvpress_compress, kvpress_ratio, make_press

__all__ = ["KVPRESS_PRESSES", "PressedCache", "import_kvpress", "kvpress_compress", "kvpress_ratio", "make_press"]
