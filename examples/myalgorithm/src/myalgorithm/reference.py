"""The numpy twin of ``bintree``: the same tree and chunk order, in one process."""

from __future__ import annotations

import numpy as np

from myalgorithm import children


def allreduce(inputs: list[np.ndarray], chunk: int) -> list[np.ndarray]:
    """Every rank's result of ``bintree`` over ``inputs`` (one array per rank), adding in the
    order the ranks do: a node's own values, then its children's partial sums in rank order."""
    n = len(inputs)
    partial = [x.copy() for x in inputs]
    for r in reversed(range(n)):  # children before parents
        for a in range(0, partial[r].size, chunk):
            for c in children(r, n):
                partial[r][a:a + chunk] += partial[c][a:a + chunk]
    return [partial[0].copy() for _ in range(n)]
