"""The ``testbed`` process-group backend: an unmodified PyTorch script's collectives through
the testbed's algorithms.

``register()`` makes ``torch.distributed.init_process_group("testbed")`` build a
:class:`TestbedProcessGroup` (a process group written in Python, PyTorch's
``Backend.register_backend``). It holds a gloo process group over the same store and the
rank's testbed communicator (:class:`testbed.torch.TestbedComm`: ring, hd or a plug-in
algorithm over TCP, ina / nic through the aggregating switch, a compressor on the ring or THC
on INA), and routes

* ``allreduce`` of float32 with SUM or AVG (DDP's buckets, a hand-written ``all_reduce``)
  through the testbed's algorithm;
* ``allreduce`` of the other dtypes and ops an algorithm cannot sum (float16, bfloat16,
  int32, int64; MAX, MIN, PRODUCT) where a testbed algorithm can do them, else to gloo, each
  call's route named in the trace (``note``): a TCP algorithm's job runs them on the ring of
  its hosts in the tensor's own dtype (every hop combines and rounds to that dtype, as NCCL's
  ring does: float16 sums rounded at each hop, maxima exact); an in-network job (ina, nic)
  sums float16 and bfloat16 as float32 in the switch, as SwitchML converts them, and rounds
  the sum once; its MAX, MIN, PRODUCT and integer sums go to gloo (a switch that sums cannot
  take a maximum);
* ``reduce_scatter_tensor`` (SUM, AVG) and ``all_gather_into_tensor`` of float32 (FSDP's
  gradient reduce-scatter and parameter all-gather) through it too when the algorithm runs
  them itself (ring, hd, a plug-in that declares them; uncompressed), and on the ring of the
  job's hosts otherwise (a TCP job: other dtypes, MAX, MIN, PRODUCT, a compressed ring's
  float32, as for allreduce above);
* ``all_to_all_single`` with equal parts, any dtype, in any algorithm's job but the UET-like
  transport's, through the testbed's all-to-all over TCP connections of its own
  (:mod:`testbed.collectives.alltoall`: large parts by pairwise exchange, every host link
  carrying one message at a time; gloo posts every pair's part at once, which TCP shares
  unfairly behind FIFO switch queues);
* everything else (what no algorithm here does, broadcast, the list forms of allgather and
  reduce_scatter, unequal all_to_all, send/recv, barrier) to gloo, over the same emulated
  links: an exact answer from an algorithm that can give it, never a wrong one from one that
  cannot;
* every collective of a subgroup (``new_group`` inheriting this backend) to gloo too: the
  testbed's communicator spans the world's hosts.

Every collective is traced (:data:`TRACE_COLUMNS`: op, dtype, bytes, path ``testbed:<algo>``,
:data:`ALL_TO_ALL_PATH` or ``gloo``, start and end, ``note``: why it did not take the job's
algorithm, and ``plan``: the plan it ran under), one JSON line per call in ``$TESTBED_TRACE``
when set.

A job the launcher re-plans while it runs (``job["replan"]``, a provider's new plan) moves to
the new plan at a collective boundary every rank agrees on (:class:`Replans`).

The rank's job (hosts, addresses, the algorithm and, for INA, the switch's registration)
comes from the file ``$TESTBED_JOB`` that ``testbed launch`` writes
(:mod:`testbed.launch`). Needs the optional extra ``[torch]``.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from testbed.atomic import write_json
from testbed.torch import TestbedComm, TorchJob

BACKEND = "testbed"
#: One trace row per collective call.
TRACE_COLUMNS = ("rank", "seq", "op", "dtype", "bytes", "path", "start_s", "end_s", "note",
                 "plan")
#: The path of an all-to-all on the testbed: its pairwise TCP exchange in every job, the
#: in-network ones included (``testbed:<algo>`` said INA where none was involved).
ALL_TO_ALL_PATH = "testbed:pairwise"
#: Whether this process built its world group's testbed communicator already.
_WORLD_TAKEN = False
#: What the ring runs in a tensor's own dtype: the reduction's name -> how a hop combines.
_RING_COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum,
                 "min": torch.minimum, "product": torch.mul}
#: The dtypes the ring carries as they are; numpy has no bfloat16: it travels as its bits.
_RING_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
_BITS = {torch.bfloat16: torch.int16}


def _op_name(op) -> str:
    """``dist.ReduceOp`` -> its lower-case name (``sum``, ``max``...)."""
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


class _Done(dist._Work):
    """A collective that finished before it was returned (the testbed's run synchronously)."""

    def __init__(self, result):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self._future


class Replans:
    """A launched job's plan changes, applied by every rank at the same collective (the
    launcher's side: :class:`testbed.launch.JobPlans`).

    The launcher registers a new plan (INA under a job id of its own, so the old registration
    keeps serving the collectives still running on it) and writes it to ``plan.json`` in the
    job's ``folder``. The *full* collectives (allreduce, reduce_scatter, allgather,
    all_to_all, barrier: those whose result on every rank needs every rank's part) are
    numbered alike on every rank. Rank 0 reads ``plan.json`` at the start of each and, before
    it contributes to the one numbered ``s``, writes ``switch<k>.json``: plan ``e`` from
    collective ``s + 1``. No rank can finish collective ``s`` without rank 0's part, so every
    rank finds that file before it starts ``s + 1``: each looks for its next switch file at
    the start of every full collective (a failed ``open`` while there is none) and switches
    exactly there, then writes ``ack<rank>`` with the plan it runs, which tells the launcher
    when the old plan's registration can go."""

    def __init__(self, folder: str | Path, rank: int):
        self.folder, self.rank = Path(folder), rank
        self.full = 0  # full collectives started
        self.switches = 0  # switch files applied
        self.epoch = 0  # the launcher's plan in force
        self.next: dict | None = None  # the next switch, read but not reached yet
        self._plan_stamp = None

    def boundary(self) -> dict | None:
        """Called at the start of every full collective: the job (``job.json``'s form) to
        switch to before it, else None."""
        self.full += 1
        if self.rank == 0 and self.next is None:
            self._decide()
        if self.next is None:
            try:
                self.next = json.loads((self.folder / f"switch{self.switches + 1}.json")
                                       .read_text())
            except FileNotFoundError:
                return None
        if self.next["at"] > self.full:
            return None
        if self.next["at"] < self.full:  # a rank missed its boundary: it would desynchronise
            raise RuntimeError(f"rank {self.rank}: plan {self.next['epoch']} applies from "
                               f"collective {self.next['at']}, read at {self.full}")
        switch, self.next = self.next, None
        self.switches += 1
        self.epoch = switch["epoch"]
        return switch["job"]

    def _decide(self) -> None:
        """Rank 0: schedule the launcher's newest plan, if newer than the one in force, from
        the next full collective."""
        path = self.folder / "plan.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        if (st.st_mtime_ns, st.st_size) == self._plan_stamp:
            return
        self._plan_stamp = (st.st_mtime_ns, st.st_size)
        plan = json.loads(path.read_text())
        if plan["epoch"] > self.epoch:
            write_json(self.folder / f"switch{self.switches + 1}.json",
                                  {"epoch": plan["epoch"], "at": self.full + 1,
                                   "job": plan["job"]})

    def ack(self) -> None:
        """Tell the launcher this rank runs plan :attr:`epoch` now."""
        write_json(self.folder / f"ack{self.rank}", {"epoch": self.epoch,
                                                                "at": self.full})


class TestbedProcessGroup(dist.ProcessGroup):
    """A rank's process group: float32 SUM/AVG allreduce through the testbed's algorithm,
    other dtypes and reductions where a testbed algorithm can do them, every other collective
    through gloo (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        # undefined methods fall to the C++ default, which dispatches to this backend
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self.gloo)
        with open(os.environ["TESTBED_JOB"]) as f:
            job = json.load(f)
        self.tj = TorchJob(**job["torch"])
        # The testbed communicator spans the job's hosts: only the world group gets it (once
        # per process: a second one would bind the same ports). A subgroup (new_group with
        # this backend) runs its collectives on gloo, over the same links: exact, traced.
        global _WORLD_TAKEN
        world = size == len(job["ranks"]) and not _WORLD_TAKEN
        self.comm = TestbedComm(job, self.tj, rank) if size > 1 and world else None
        _WORLD_TAKEN = _WORLD_TAKEN or world
        self.replans = Replans(job["replan"], rank) \
            if job.get("replan") and self.comm is not None else None
        self._retired: TestbedComm | None = None  # the plan before the one in force
        self.seq = 0
        path = os.environ.get("TESTBED_TRACE")
        self._trace = open(path, "a") if path else None  # noqa: SIM115 - closed in shutdown

    def getBackendName(self) -> str:
        return BACKEND

    def _record(self, op: str, tensors, path: str, t0: float, note: str | None = None) -> None:
        self.seq += 1
        if self._trace is None:
            return
        row = {"rank": self._rank, "seq": self.seq, "op": op,
               "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
               "bytes": int(sum(t.numel() * t.element_size() for t in tensors)),
               "path": path, "start_s": t0, "end_s": time.time(), "note": note,
               "plan": self.replans.epoch if self.replans is not None else 0}
        self._trace.write(json.dumps(row) + "\n")
        self._trace.flush()

    def _full(self) -> None:
        """At the start of a full collective of the world (see :class:`Replans`): move to
        the launcher's new plan when this is the collective it applies from."""
        if self.replans is None:
            return
        job = self.replans.boundary()
        if job is None:
            return
        tj = TorchJob(**job["torch"])
        # the communicator before the one retired now: no peer can still be reading from it;
        # closed first, for the new plan may take its ports (a provider's job id used again)
        if self._retired is not None:
            self._retired.close()
            self._retired = None
        new = TestbedComm(job, tj, self._rank)
        new.take_all_to_all(self.comm)
        self._retired, self.comm, self.tj = self.comm, new, tj
        self.replans.ack()

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        self._full()
        t0 = time.time()
        op = _op_name(opts.reduceOp)
        if len(tensors) != 1:
            route, note = "gloo", None if self.comm is None else "a list of tensors: gloo's"
        else:
            route, note = self._route("allreduce", tensors[0], op)
        if route == "gloo":
            work = self.gloo.allreduce(tensors, opts)
            work.wait()
            self._record("allreduce", tensors, "gloo", t0, note)
            return work
        if route == "ring":
            return self._on_ring("allreduce", tensors[0], tensors[0], op, t0, note)
        # float32 through the job's algorithm (route "upcast": a 16-bit float summed as one)
        return self._testbed("allreduce", lambda x, out: self.comm.allreduce(x, out, 0),
                             tensors[0], tensors[0], op == "avg", t0, note)

    def _route(self, op: str, tensor, reduction: str | None) -> tuple[str, str | None]:
        """Where ``op`` (allreduce, reduce_scatter, allgather) of ``tensor`` combined by
        ``reduction`` (None: an allgather) runs, and why when it is not the job's algorithm:
        ``algo`` (float32 sums, shards through an algorithm that runs them), ``upcast`` (an
        in-network job's 16-bit float sums, as float32), ``ring`` (the ring of a TCP job's
        hosts, in the tensor's dtype) or ``gloo`` (see the module docstring)."""
        if self.comm is None:
            return "gloo", None  # a subgroup, or a single rank
        dtype, algo = tensor.dtype, self.tj.algo
        name = str(dtype).removeprefix("torch.")
        what = f"{reduction} of {name}" if op == "allreduce" else \
            f"{op} ({reduction}) of {name}" if reduction else f"{op} of {name}"
        if op == "reduce_scatter" and tensor.numel() % self._size:
            return "gloo", f"{what}: unequal shards, gloo's"
        sums = reduction in (None, "sum", "avg")
        if dtype == torch.float32 and sums and (op == "allreduce"
                                                or op in self.comm.shard_ops()):
            return "algo", None
        if self.comm.client is not None:  # the switch (or SmartNIC) sums fixed point
            if op == "allreduce" and sums and dtype in (torch.float16, torch.bfloat16):
                return "upcast", f"{algo} sums float32: {what} summed as float32, rounded once"
            return "gloo", f"{algo} sums in the network: {what} over gloo"
        if dtype in _RING_DTYPES and (reduction is None or (
                reduction in _RING_COMBINE and (dtype.is_floating_point or reduction != "avg"))):
            if algo == "ring" and self.tj.compressor is None:
                return "ring", None
            return "ring", f"{algo} runs float32 sums: {what} on the ring"
        return "gloo", f"{what}: no testbed algorithm does it"

    def _on_ring(self, op: str, input, output, reduction: str | None, t0: float,
                 note: str | None):
        """``op`` on the ring of the job's hosts in the tensors' own dtype (a bfloat16 as
        its bits), every hop combined by ``reduction``, into ``output``; traced."""
        bits = _BITS.get(input.dtype)

        def flat_copy(t):  # a flat copy and its numpy view
            flat = t.detach().reshape(-1).clone()
            return flat, (flat.view(bits) if bits is not None else flat).numpy()

        combine = _combiner(_RING_COMBINE[reduction], input.dtype) if reduction else None
        result, buf = flat_copy(input)
        out = buf
        if op != "allreduce":
            result, out = flat_copy(output)
        self.comm.on_ring(op, buf, out, combine)
        if reduction == "avg":
            result /= self._size
        output.copy_(result.view(output.shape))
        self._record(op, [input], "testbed:ring", t0, note)
        return _Done([output])

    def _testbed(self, op: str, run, input, output, avg: bool, t0: float,
                 note: str | None = None):
        """``run(x, out)``, the testbed's algorithm, from ``input`` (flattened to float32)
        into ``output`` (divided by the group's size for AVG, cast back to its dtype),
        traced."""
        out = np.empty(output.numel(), dtype=np.float32)
        run(_flat(input), out)
        if avg:
            out /= self._size
        output.copy_(torch.from_numpy(out).view(output.shape))
        self._record(op, [input], f"testbed:{self.tj.algo}", t0, note)
        return _Done([output])


    # gloo's collectives, traced: every rank calls them in the same order, so waiting for
    # each is safe and times it
    def broadcast(self, tensors, opts):
        return self._gloo("broadcast", tensors, self.gloo.broadcast, tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self._full()
        return self._gloo("allgather", inputs, self.gloo.allgather, outputs, inputs, opts)

    def _allgather_base(self, output, input, opts):
        return self._sharded("allgather", output, input, None, opts,
                             self.gloo._allgather_base)

    def reduce_scatter(self, outputs, inputs, opts):
        self._full()
        return self._gloo("reduce_scatter", [t for ts in inputs for t in ts],
                          self.gloo.reduce_scatter, outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts):
        return self._sharded("reduce_scatter", output, input, _op_name(opts.reduceOp), opts,
                             self.gloo._reduce_scatter_base)

    def _sharded(self, op: str, output, input, reduction: str | None, opts, gloo_fn):
        """``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch's layouts for equal
        shards) where :meth:`_route` sends them."""
        self._full()
        t0 = time.time()
        route, note = self._route(op, input, reduction)
        if route == "algo":
            return self._testbed(op, partial(self.comm.sharded, op), input, output,
                                 reduction == "avg", t0)
        if route == "ring":
            return self._on_ring(op, input, output, reduction, t0, note)
        work = gloo_fn(output, input, opts)
        work.wait()
        self._record(op, [input], "gloo", t0, note)
        return work

    # what torch.distributed's all_gather_into_tensor / reduce_scatter_tensor call since 2.12
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts or dist.AllgatherOptions())

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        self._full()
        t0 = time.time()
        note = self._all_to_all_route(output, input, output_split_sizes, input_split_sizes)
        if note is not None:
            work = self.gloo.alltoall_base(output, input, output_split_sizes,
                                           input_split_sizes, opts)
            work.wait()
            self._record("all_to_all", [input], "gloo", t0, note or None)
            return work
        # any dtype: the parts travel as their bytes
        x = input.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out = np.empty_like(x)
        self.comm.all_to_all(x, out)
        output.view(-1).view(torch.uint8).copy_(torch.from_numpy(out))
        # the pairwise exchange over the job's TCP connections, whatever its algorithm
        self._record("all_to_all", [input], ALL_TO_ALL_PATH, t0)
        return _Done([output])

    def _all_to_all_route(self, output, input, output_splits, input_splits) -> str | None:
        """None when ``all_to_all_single`` runs on the testbed's all-to-all (the world of a
        job that has one, equal parts: :mod:`testbed.collectives.alltoall`), else why gloo
        runs it ("" for a subgroup or a single rank, as every gloo call of theirs)."""
        if self.comm is None:
            return ""
        if not self.comm.can_all_to_all():
            return ("no testbed all-to-all for this job (the UET-like transport, or an "
                    "in-network job of more than 64 ranks): gloo's")
        n = self._size
        equal = all(not s or len(set(s)) == 1 for s in (output_splits, input_splits))
        if (not equal or input.numel() % n or output.numel() != input.numel()
                or output.dtype != input.dtype or not output.is_contiguous()):
            return "all_to_all of unequal parts: gloo's"
        return None

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        self._full()
        return self._gloo("barrier", [], self.gloo.barrier, opts)

    # point to point: not waited for (a rank may isend before its peer posts the irecv)
    def send(self, tensors, dst: int, tag: int):
        self._record(f"send to {dst}", tensors, "gloo", time.time())
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        self._record(f"recv from {src}", tensors, "gloo", time.time())
        return self.gloo.recv(tensors, src, tag)

    def _gloo(self, op: str, traced, fn, *args):
        t0 = time.time()
        work = fn(*args)
        work.wait()
        self._record(op, traced, "gloo", t0)
        return work

    def shutdown(self) -> None:
        global _WORLD_TAKEN
        if self._retired is not None:
            self._retired.close()
            self._retired = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
            _WORLD_TAKEN = False  # a new world group may build its own
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _flat(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().float().numpy().reshape(-1), dtype=np.float32)


def _combiner(fn, dtype):
    """``combine(acc, piece)`` for the ring (numpy arrays; a bfloat16's as its int16 bits):
    ``acc = fn(acc, piece)`` in place, computed by torch in ``dtype`` and rounded to it."""
    bits = _BITS.get(dtype)

    def combine(acc: np.ndarray, piece: np.ndarray) -> None:
        a, b = torch.from_numpy(acc), torch.from_numpy(piece)
        if bits is not None:
            a, b = a.view(dtype), b.view(dtype)
        fn(a, b, out=a)
    return combine


def _create(store, rank: int, size: int, timeout: timedelta) -> TestbedProcessGroup:
    return TestbedProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("testbed")`` build a :class:`TestbedProcessGroup` (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
