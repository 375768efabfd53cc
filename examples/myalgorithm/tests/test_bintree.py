"""bintree against its numpy twin and the numpy sum, over real TCP sockets on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from myalgorithm import BinaryTree, allreduce, children, parent
from myalgorithm.reference import allreduce as reference

from testbed.collectives.algorithms import algorithm
from testbed.collectives.transport import Comm


def _run_on_loopback(inputs: list[np.ndarray], chunk: int) -> list[np.ndarray]:
    n = len(inputs)
    alg = BinaryTree()
    comms = [Comm(r, [f"r{k}" for k in range(n)], 10.0) for r in range(n)]
    ports = {r: ("127.0.0.1", c.listen("127.0.0.1")) for r, c in enumerate(comms)}
    outs = [np.empty_like(x) for x in inputs]
    errors = []

    def rank(r):
        try:
            comms[r].connect(alg.peers(r, n, "allreduce"), ports)
            allreduce(comms[r], inputs[r], outs[r], n, chunk)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in comms:
        c.close()
    assert not errors, errors
    return outs


@pytest.mark.parametrize("n, size, chunk", [(2, 1000, 64), (3, 4097, 1000), (5, 10, 3),
                                            (8, 50_000, 4096)])
def test_bintree_equals_its_twin_and_the_sum(n, size, chunk):
    rng = np.random.default_rng(n * size)
    inputs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    outs = _run_on_loopback(inputs, chunk)
    twin = reference(inputs, chunk)
    total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    for o, t in zip(outs, twin, strict=True):
        assert np.array_equal(o, t)  # same additions in the same order: bit for bit
        assert np.allclose(o, total, rtol=1e-5, atol=1e-5 * n)


def test_tree_shape_and_registry():
    n = 7
    assert [parent(r) for r in range(n)] == [None, 0, 0, 1, 1, 2, 2]
    assert sum(len(children(r, n)) for r in range(n)) == n - 1
    for r in range(n):  # every connection is known to both of its ends
        for p in BinaryTree().peers(r, n, "allreduce"):
            assert r in BinaryTree().peers(p, n, "allreduce")
    assert type(algorithm("bintree")) is BinaryTree  # found through the entry point
