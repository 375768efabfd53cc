"""Plain-Python twins of the collectives' Numba kernels (one module per kernel module)."""
