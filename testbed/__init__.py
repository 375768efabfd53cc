"""Emulation testbed for offloading AI collectives to the network.

Layers (each imports only the ones below it)::

    testbed.experiment   declarative experiments, results, plots, pytest plugin
    testbed.collectives  worker-side allreduce & friends, alpha-beta model, reports
    testbed.topologies   Mininet topologies (folder topologies/)
    testbed.datapath     userspace programmable switch / SmartNIC engine
    testbed.kernels      Numba kernels + numpy reference twins (folder kernels/)
"""

__version__ = "0.1.0"

# Every name the testbed gives to a node, interface or process starts with this, so that
# `testbed cleanup` only ever touches what the testbed itself created.
PREFIX = "tb"
