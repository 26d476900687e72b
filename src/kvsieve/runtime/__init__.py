"""The runtime layer, folder by folder from the bottom up: `storage` (the cache), `attention`, `observing` (what
scorers read, recorded), `eviction` (while a cache grows) and `api` (the entry points).

It runs the model and holds the cache; it asks the selection layer which entries to keep.
Nothing here imports the harness. Importing it checks the installed `transformers` first
(`compat.SUPPORTED`), so an unsupported release fails here with the range, not deep in a cache class.
"""

from .compat import check_transformers_version

check_transformers_version()
