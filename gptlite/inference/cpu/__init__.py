"""The CPU backend of eager decoding, one part that wraps a plain model from outside: the decode view of a model
(`decode.packed_for_cpu`), its linear kernels (`linears`) chosen by measuring (`choices`), its one-call attention and
block steps (`blocks`), the modules it calls directly (`direct`), and gptlite's own compiled kernels (`native`, built
from matvec.cpp on the user's machine; the one module that calls their operators)."""
