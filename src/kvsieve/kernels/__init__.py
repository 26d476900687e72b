"""Attention kernels over padded views of ragged entries, shared by kvsieve's two runtimes (`kvsieve.runtime` and
the vLLM plugin). Imports no other kvsieve layer."""
