"""One table for many arrays (testbed.kernels.packed): the rebuilt arrays are the originals'
memory, for every dtype and dimension a table carries; what it cannot carry is refused; the
stages that pass their arrays in a table build it again when they replace an array."""

from __future__ import annotations

import numpy as np
import pytest
from numba import literal_unroll, njit

from testbed.kernels.packed import (
    DTYPE_CODES,
    MAX_DIMS,
    array_at,
    array_table,
    arrays_at,
    spec_of,
    spec_types,
)

#: every dtype at every dimension, in one spec (one compilation)
SPEC_ALL = " ".join(f"{c}:{d}" for c in DTYPE_CODES for d in range(1, MAX_DIMS + 1))


@njit(cache=True)
def _touch_all(table, shapes):
    """For each rebuilt array: copy its last element over its first, note its shape and
    return its last element as a float (what the test reads back from the originals)."""
    out = np.zeros(shapes.shape[0])
    k = 0
    for a in literal_unroll(arrays_at(table, SPEC_ALL)):
        flat = a.reshape(a.size)
        flat[0] = flat[a.size - 1]
        out[k] = flat[a.size - 1] * 1.0  # float() takes no bool in Numba
        for d in range(a.ndim):
            shapes[k, d] = a.shape[d]
        k += 1
    return out


@pytest.mark.parametrize("seed", range(3))
def test_rebuilt_arrays_are_the_originals_for_every_dtype_and_dimension(seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for dtype in DTYPE_CODES.values():
        for nd in range(1, MAX_DIMS + 1):
            shape = tuple(int(x) for x in rng.integers(1, 5, nd))
            a = (rng.random(shape) < 0.5) if dtype is np.bool_ else \
                rng.integers(0, 100, shape).astype(dtype)
            arrays.append(a)
    assert spec_of(arrays) == SPEC_ALL
    want_last = [float(a.reshape(-1)[-1]) for a in arrays]
    shapes = np.zeros((len(arrays), MAX_DIMS), np.int64)
    got = _touch_all(array_table(arrays, SPEC_ALL), shapes)
    assert got.tolist() == want_last  # read through the table
    for k, a in enumerate(arrays):
        assert a.reshape(-1)[0] == a.reshape(-1)[-1]  # written through it
        assert tuple(shapes[k, :a.ndim]) == a.shape


@njit(cache=True)
def _rows_after(table, first, count):
    """Through :func:`array_at`: the sum of the ``count`` 1-D ``uint8`` arrays of rows
    ``first..``, each one's first byte set to its length, and the 2-D ``int64`` array of the
    row after them summed."""
    total = 0
    for r in range(first, first + count):
        a = array_at(table, r, "u1:1")
        for v in a:
            total += v
        a[0] = a.size
    m = array_at(table, first + count, "i8:2")
    return total, m.sum()


def test_array_at_a_run_time_row_is_that_rows_array():
    """A fixed spec first, then a variable number of arrays read by their row (a node's
    ports' rings): each read and written through its own row, of its own size."""
    rng = np.random.default_rng(5)
    head = [np.zeros(3, np.int32), np.zeros((2, 2), np.float64)]
    rings = [rng.integers(0, 200, int(rng.integers(2, 9))).astype(np.uint8) for _ in range(5)]
    tail = rng.integers(-50, 50, (3, 4))
    table = array_table(head + rings + [tail])
    for first, count in ((2, 5), (3, 3), (6, 1)):
        want = sum(int(a.sum()) for a in rings[first - 2:first - 2 + count])
        got, _ = _rows_after(table, first, count)
        assert got == want
        for a in rings[first - 2:first - 2 + count]:
            assert a[0] == a.size  # written through its row
    assert _rows_after(table, 2, 5)[1] == int(tail.sum())


def test_what_a_table_cannot_carry_is_refused_naming_it():
    ok = np.zeros(4, np.int64)
    cases = [
        ([ok, np.zeros((4, 4), np.int32)[:, ::2]], "item 1 is not C-contiguous"),
        ([np.zeros(3, np.complex128)], r"item 0 \(complex128, 1-D\)"),
        ([np.zeros((1, 1, 1, 1), np.int8)], r"item 0 \(int8, 4-D\)"),
        ([np.int64(3)], "item 0 is a int64, not an array"),
    ]
    for arrays, message in cases:
        with pytest.raises(ValueError, match=message):
            array_table(arrays)
    with pytest.raises(ValueError, match="the kernel expects 'i8:2', the arrays are 'i8:1'"):
        array_table([ok], "i8:2")
    for bad in ("i8", "c16:1", "i8:0", f"i8:{MAX_DIMS + 1}"):
        with pytest.raises(ValueError, match="array spec item"):
            spec_types(bad)


def test_a_stage_that_replaces_an_array_builds_its_table_again():
    """The shape stage's table points at its arrays: a threshold array replaced between two
    bursts is the one the next burst meets (with the old table the kernel would read freed
    memory), and a burst of another batch gets that batch's table."""
    from testbed.datapath.batch import Batch
    from testbed.datapath.trim import ShapeStage
    from testbed.kernels.packets import PORT_HELD

    def burst(stage, batch, frames):
        batch.n = 0
        first = batch.alloc(frames)
        batch.length[first:first + frames] = 1000
        batch.out_port[first:first + frames] = 0
        stage.process(batch, 1_000_000)
        return int((batch.out_port[:frames] == PORT_HELD).sum())

    stage = ShapeStage(n_ports=2, rate_mbps=1.0, threshold_pkts=100, burst_bytes=0)
    batch = Batch(64)
    assert burst(stage, batch, 10) == 9  # 1 Mb/s: the first leaves, 9 wait in the queue
    first = stage.table(batch)
    assert stage.table(batch) is first  # kept while nothing changed
    stage.thr_pkts = np.full(2, 12, np.int64)  # a new array: 3 more frames fit
    assert stage.table(batch) is not first
    assert burst(stage, batch, 10) == 3
    other = Batch(64)
    assert stage.table(other)[0, 0] == other.buf.ctypes.data
