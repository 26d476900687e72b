"""Sieve attention (registered in `transformers`' attention interface) and the kernels it runs."""
