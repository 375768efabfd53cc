"""Plain numpy reference twins of the Numba kernels (the anchors tests and benchmarks compare against)."""
