"""Plain-Python twins of the data-path stages (one module per stage, same name).

Written independently of the Numba kernels (dicts, ``struct``/numpy records, Python ints)
so the tests compare two implementations of the same behaviour, packet by packet.
"""
