"""Numba kernels of the testbed (imported as ``testbed.kernels``).

Pure functions over numpy arrays, ``@njit(cache=True)``, each with a plain numpy twin of the
same name in ``testbed.kernels.reference.<module>``. Modules (import the one you need;
nothing is imported here so that ``import testbed.kernels`` stays cheap):

* ``wire``        - the wire format table (header dtype, offsets, enums).
* ``packets``     - parse/build Eth/IPv4/UDP/testbed frames, per frame and per batch.
* ``fixedpoint``  - SwitchML block floating point and ATP fixed-factor quantisation/aggregation.
* ``trimming``    - trimming-friendly payload layout (coarse head + exact tail) and trim_frame.
* ``compressors`` and ``memory`` - gradient compressors and error feedback.
* ``rng``         - the counter-based random numbers every stochastic kernel draws from.
* ``reductions``  - deterministic norms and max magnitude.
* ``parallel``    - when a kernel runs its prange form (``PAR_MIN``) and the decorator for it.
* ``checks``      - argument checks shared by the Python wrappers and the data-path stages.
* ``bench``       - ``testbed bench kernels``.
"""
