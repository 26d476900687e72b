"""How a cache holds entries: `SievedCache` and its layers, ragged segments, codecs and the layout attention reads."""
