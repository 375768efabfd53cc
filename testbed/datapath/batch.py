"""The packet batch that flows through a data-path program, and the stage interface.

The engine receives up to ``rx_burst`` frames from all ports into one :class:`Batch`, runs the
node's stages over it in order, then transmits every packet whose ``out_port`` is a port
index. Python touches the batch once per stage per burst; the per-packet work happens in
``@njit`` functions that take the batch's arrays.

Conventions every stage follows:

* ``out_port[i] == PORT_UNSET`` means no stage has decided yet. A stage decides by writing a
  port index, ``PORT_FLOOD`` (all ports but the ingress one), or ``PORT_DROP`` together with
  a :class:`~testbed.kernels.wire.DropReason` in ``reason[i]``. Ingress stages (impair-ingress, codec, aggregate,
  forward) skip packets that are already decided; egress stages (impair-egress, queue/trim)
  act on packets with ``out_port >= 0``.
* A stage may *emit* new packets (e.g. the aggregation result multicast) by appending at
  ``batch.n`` with :meth:`Batch.alloc` and filling ``out_port``; ``in_port`` is ``-1`` for
  generated packets. Stages later in the pipeline see them, earlier ones do not.
* A stage may *hold* packets (a rate-drained egress queue, a delay line): it copies them out,
  sets ``out_port[i] = PORT_HELD`` and re-emits them in a later call. It reports when it next
  needs to run via ``next_deadline_ns`` so the engine wakes even when no packet arrives.
"""

from __future__ import annotations

import mmap

import numpy as np

from testbed.kernels.packed import array_table
from testbed.kernels.packets import PORT_DROP, PORT_FLOOD, PORT_HELD, PORT_UNSET
from testbed.kernels.wire import FRAME_MAX, DropReason

__all__ = ["FRAME_MAX", "PORT_DROP", "PORT_FLOOD", "PORT_HELD", "PORT_UNSET", "Batch",
           "DropReason", "PackedStage", "Stage", "sparse_zeros"]


def sparse_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array whose memory is taken a 4 KiB page at a time as it is first written, for
    a large buffer that is mostly never used (a port's queue ring past its deepest queue).
    numpy backs an array of 4 MiB and more with transparent huge pages: the first write into
    each 2 MiB would then clear all of it, and a stage writing one frame into each of its
    ports' queues cleared a dozen of them per switch, inside the first collective."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))  # anonymous, zeroed on use
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is "always", not only on request
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count=count).reshape(shape)



class Batch:
    """Frames of one burst plus the per-packet decisions of the stages."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buf = np.zeros((capacity, FRAME_MAX), dtype=np.uint8)
        self.length = np.zeros(capacity, dtype=np.int32)
        self.in_port = np.full(capacity, -1, dtype=np.int16)
        self.out_port = np.full(capacity, PORT_UNSET, dtype=np.int16)
        self.reason = np.zeros(capacity, dtype=np.uint8)
        self.n = 0

    def reset(self) -> None:
        """Empty the batch for the next burst (only the used prefix is touched)."""
        n = self.n
        self.out_port[:n] = PORT_UNSET
        self.reason[:n] = 0
        self.in_port[:n] = -1
        self.n = 0

    def alloc(self, count: int) -> int:
        """Reserve ``count`` packet rows at the end; return the first index.

        Raises ``OverflowError`` when the batch is full: size ``capacity`` for the largest
        expansion (e.g. rx_burst × (1 + workers per job) for the aggregate program).
        """
        first = self.n
        if first + count > self.capacity:
            raise OverflowError(f"batch capacity {self.capacity} exceeded ({first}+{count})")
        self.n = first + count
        self.out_port[first : first + count] = PORT_UNSET
        self.in_port[first : first + count] = -1
        self.reason[first : first + count] = 0
        return first


class Stage:
    """Base class of a data-path program stage (forward, aggregate, trim, nic-codec, impair).

    Subclasses keep their tables/state in numpy arrays and do the per-packet work in
    ``@njit`` functions called from :meth:`process`.
    """

    #: name used in configs, counters and the control channel
    name = "stage"

    def process(self, batch: Batch, now_ns: int) -> None:
        """Act on the packets of ``batch`` (see the module docstring for the conventions)."""
        raise NotImplementedError

    def configure(self, **settings) -> None:
        """Change settings or tables at run time (from the control channel)."""
        raise ValueError(f"stage {self.name!r} takes no settings, got {sorted(settings)}")

    def counters(self) -> dict:
        """Counters readable while running and at the end (JSON-serialisable)."""
        return {}

    def next_deadline_ns(self) -> int | None:
        """Monotonic time (ns) at which this stage needs to run again, or None."""
        return None


class PackedStage(Stage):
    """A stage whose kernel takes the batch's arrays and its own as one table
    (:mod:`testbed.kernels.packed`: one argument for Numba to unbox per burst instead of
    dozens). ``batch_arrays`` and ``stage_arrays`` name them in the order of the kernel's
    ``spec``. :meth:`table` builds the table on the first burst, and again for another batch
    or once the stage replaced one of its arrays (any assignment to one of those attributes:
    the old table would point at the old array)."""

    batch_arrays: tuple[str, ...] = ()
    stage_arrays: tuple[str, ...] = ()
    spec = ""
    _table = None
    _table_batch = None

    def __setattr__(self, name: str, value) -> None:
        if name in self.stage_arrays:
            self.__dict__["_table"] = None
        object.__setattr__(self, name, value)

    def table(self, batch: Batch) -> np.ndarray:
        """The table of ``batch``'s arrays and this stage's, as they are now."""
        table = self._table
        if table is None or self._table_batch is not batch:
            table = self._table = array_table(
                [getattr(batch, a) for a in self.batch_arrays] +
                [getattr(self, a) for a in self.stage_arrays], self.spec)
            self._table_batch = batch
        return table
