"""The CPU backend of eager decoding: the fastest measured kernel per layer (`decode`) and gptlite's own compiled
kernels (`native`, built from matvec.cpp on the user's machine)."""
