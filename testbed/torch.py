"""PyTorch over the emulated fabric: a DDP communication hook that allreduces every gradient
bucket with the testbed's collectives, and plain DDP over gloo as the baseline.

Needs the optional extra ``[torch]`` (``pip install -e '.[torch]'``: the CPU wheel
``torch==2.13.0``). Each rank is a fresh interpreter started inside its emulated host
(``python -m testbed.torch --job FILE --rank R testbed-node=<host>``, through Mininet's
``popen``), so every socket it opens, gloo's and the testbed's, lives in that host's network
namespace and every byte crosses the emulated links.

* ``comm = "gloo"``: ``DistributedDataParallel`` as is, over a gloo process group whose
  rendezvous is rank 0's emulated address (``tcp://10.0.0.1:PORT``, ``GLOO_SOCKET_IFNAME`` =
  the host's interface): PyTorch's own ring allreduce crosses the emulated links.
* ``comm = "testbed"``: the same DDP model with :func:`testbed_hook` registered
  (``register_comm_hook``): each bucket's flat float32 buffer goes through the collective of
  ``algo`` (ring or hd over TCP, ina / nic through the aggregating switch, a compressor on the
  ring or THC on INA, trim: an incast of trimmable packets to rank 0 and the ring's broadcast
  of the sum), in-process, from inside the host; the hook returns the average, as
  PyTorch's ``allreduce_hook`` does. DDP still needs a process group (it broadcasts the initial
  parameters over it), so gloo is set up in both modes; in this mode it carries no gradient.
  With ``verify``, the hook also allreduces a copy of each bucket with gloo and records the
  largest difference: the hooked allreduce checked against PyTorch's on every bucket.

:func:`run_ddp` runs a job (a small ``torch.nn`` MLP on the digits data set, each rank on its
own shard) and returns per-rank results (losses, held-out accuracy, times, the verification).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
import traceback

import numpy as np

from testbed.atomic import write_json
from testbed.cleanup import job_dir
from testbed.collectives import alltoall, compress, ring, trimmed
from testbed.collectives.algorithms import is_offloaded, peer_algorithm
from testbed.collectives.model import tcp_window_clamp
from testbed.collectives.ports import a2a_port, tcp_port
from testbed.collectives.runner import RUN_DIR, offload_job
from testbed.collectives.spec import CollectiveSpec, Communication, communication_of
from testbed.collectives.transport import CollectiveError, Comm
from testbed.collectives.trimmed import TrimmedGather
from testbed.collectives.uet import UetComm
from testbed.lifeline import follow_owner
from testbed.workloads.data import BatchSampler, load_dataset
from testbed.workloads.loop import digest
from testbed.workloads.spec import check_collective, check_communication, check_int

#: TCP port of gloo's rendezvous on rank 0 (plus the job id): outside the collectives' range.
GLOO_PORT = 29500
COMMS = ("gloo", "testbed")


@dataclasses.dataclass
class TorchJob(Communication):
    """A DDP training job: a ``hidden``-unit MLP on digits, ``iterations`` SGD steps of
    ``batch_size`` per rank at ``lr``; ``comm`` "gloo" (baseline) or "testbed" (the hook
    with ``algo``, ``compressor``...); ``verify``: compare every hooked bucket with gloo's
    allreduce; ``bucket_cap_mb``: DDP's bucket size (small values give several buckets);
    ``bits``/``idle_ms``: head bits per element and silence before a NACK of ``algo="trim"``;
    ``placement``: where INA aggregates (a provider's plan: tree, slots, mode)."""

    comm: str = "testbed"
    hidden: int = 64
    iterations: int = 150
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    eval_every: int = 25
    verify: bool = False
    bucket_cap_mb: float = 25.0
    bits: int = 1
    idle_ms: float = 20.0
    timeout_s: float = 60.0
    job_id: int = 1
    seed: int = 0
    #: INA's tree, slots and mode (``CollectiveSpec.placement``; empty: one switch, defaults)
    placement: dict = dataclasses.field(default_factory=dict)

    def collective(self, nbytes: int = 4) -> CollectiveSpec:
        """The testbed allreduce of one bucket of ``nbytes`` (``algo="trim"``: the broadcast
        of the sum that follows the incast)."""
        if self.algo == "trim":
            return CollectiveSpec(op="broadcast", algo="ring", nbytes=nbytes,
                                  timeout_s=self.timeout_s, seed=self.seed, job_id=self.job_id)
        return CollectiveSpec(op="allreduce", nbytes=nbytes, **communication_of(self),
                              timeout_s=self.timeout_s,
                              seed=self.seed, job_id=self.job_id,
                              placement=dict(self.placement))

    def validate(self, n: int) -> None:
        """``ValueError`` naming the first bad field."""
        if self.comm not in COMMS:
            raise ValueError(f"TorchJob.comm={self.comm!r} is not one of {COMMS}")
        check_communication(self)
        for name in ("iterations", "batch_size", "hidden", "eval_every"):
            check_int(self, name, 1)
        if self.comm == "testbed":
            check_collective(self, n)


# ---------------------------------------------------------------------------- inside a rank


class TestbedComm:
    """One rank's testbed collective, set up once and used for any bucket size: TCP
    connections to its algorithm's peers and its ring neighbours (a compressed allreduce and
    trim's broadcast run on the ring) on the deterministic ports, or the INA client of the
    registered job."""

    def __init__(self, job: dict, tj: TorchJob, rank: int):
        self.n = len(job["ranks"])
        self.rank = rank
        self.tj = tj
        self.spec = tj.collective()
        self.comm = None
        self.client = None
        self.gather = None
        self.calls = 0
        self.memory: dict[tuple[int, int], tuple] = {}
        self.steps: dict[int, int] = {}
        self.ranks = job["ranks"]
        self.bw_bps = job.get("bw_bps")
        self.a2a: Comm | None = None  # the all-to-all's own connections, made by its first call
        me = job["ranks"][rank]
        if is_offloaded(tj.algo):
            from testbed.collectives.ina import InaClient  # numba: INA jobs only

            self.client = InaClient(job, self.spec, rank)
            return
        if tj.algo == "trim":
            trimmed.warm()
            # the silence before a NACK is wall time: stretched with the network
            self.gather = TrimmedGather(job["ranks"], rank, tj.bits, tj.job_id, tj.seed,
                                        tj.timeout_s, tj.idle_ms / 1000.0
                                        * float(job.get("time_dilation", 1.0)),
                                        resend_trimmed=tj.transport == "uet")
        names = [r["host"] for r in job["ranks"]]
        if tj.transport == "uet" and tj.algo != "trim":  # trim: the gather is UET's
            self.comm = UetComm(rank, names, tj.timeout_s, job_id=tj.job_id,
                                time_dilation=float(job.get("time_dilation", 1.0)))
        else:
            self.comm = Comm(rank, names, tj.timeout_s, job_id=tj.job_id,
                             tcp_cc=self.spec.tcp_cc,
                             window_clamp=tcp_window_clamp(tj.algo, job.get("bw_bps")))
        self.comm.listen(me["ip"])
        peers = set(ring.ring_peers(rank, self.n))  # trim's broadcast, compressed rings
        if tj.algo != "trim":
            alg = peer_algorithm(tj.algo)
            for op in {"allreduce"} | set(self.shard_ops()):  # hd pairs differ per op
                peers.update(alg.peers(rank, self.n, op))
        self.comm.connect(sorted(peers), self._listeners(tcp_port))

    def allreduce(self, x: np.ndarray, out: np.ndarray, index: int) -> None:
        """Sum ``x`` over the ranks into ``out`` (bucket ``index``: its own compressor state
        and step counter)."""
        step = self.steps.get(index, 0)
        self.steps[index] = step + 1
        self.calls += 1  # every rank hooks the buckets in the same order
        if self.client is not None:
            self.client.allreduce(x, out)
        elif self.gather is not None:
            self.gather.reduce(x, out, self.calls)  # the sum, at rank 0
            ring.broadcast(self.comm, out, out, self.n, 64 << 10)
        elif self.tj.compressor is not None:
            key = (index, x.size)  # DDP may rebuild its buckets after the first step
            if key not in self.memory:
                self.memory[key] = compress.make(self.spec)
            comp, mem = self.memory[key]
            compress.allreduce(self.comm, x, out, self.n, comp, mem, step)
        else:
            fn = peer_algorithm(self.tj.algo).rank_function("allreduce")
            fn(self.comm, x, out, self.n, 64 << 10)

    def on_ring(self, op: str, x: np.ndarray, out: np.ndarray, combine=None) -> None:
        """``op`` on the ring of this job's hosts in the arrays' own dtype: an allreduce of
        ``x`` in place (``out`` is ``x``), a reduce_scatter into ``out`` (shard ``rank``), an
        allgather of ``x`` into ``out``. ``combine(acc, piece)`` folds a received piece into
        the local one at every hop (a sum rounded to float16 at each hop, as a framework's
        reduced-precision allreduce does; a maximum, exact in any dtype). Every TCP
        algorithm's communicator holds the ring's connections (trim's broadcast and the
        compressed allreduces run on it)."""
        if self.comm is None:
            raise ValueError(f"algorithm {self.tj.algo!r} has no ring of TCP connections")
        self.calls += 1
        chunk = max(1, (64 << 10) // x.itemsize)
        if op == "allreduce":
            ring.allreduce_inplace(self.comm, x, self.n, chunk, combine)
        elif op == "reduce_scatter":
            ring.reduce_scatter(self.comm, x, out, self.n, chunk, combine)
        else:
            ring.allgather(self.comm, x, out, self.n, chunk)

    def _listeners(self, port_of) -> dict[int, tuple[str, int]]:
        """Every rank's listening address under the port map ``port_of``."""
        return {p: (r["ip"], port_of(self.tj.job_id, p, p)) for p, r in enumerate(self.ranks)}

    def can_all_to_all(self) -> bool:
        """Whether :meth:`all_to_all` runs here: over TCP connections of its own in a job of
        at most 64 ranks (not over the UET-like transport), over a TCP job's own beyond."""
        if self.tj.transport == "uet":
            return False
        return alltoall.own_connections(self.n) or isinstance(self.comm, Comm)

    def all_to_all(self, x: np.ndarray, out: np.ndarray) -> None:
        """``alltoall.all_to_all`` of ``x`` (n equal parts, any dtype) into ``out`` over TCP
        connections to every rank, made by the first call (every rank makes it at the same
        point of the job): connections of its own with a small window
        (``alltoall.window_bytes``), or in a job of more than 64 ranks the job's own, the
        pairs its algorithm lacks added."""
        if not self.can_all_to_all():
            raise ValueError(f"algorithm {self.tj.algo!r} over {self.tj.transport!r} has no "
                             "TCP connection between every pair of ranks")
        others = [p for p in range(self.n) if p != self.rank]
        if alltoall.own_connections(self.n):
            if self.a2a is None:
                a2a = Comm(self.rank, [r["host"] for r in self.ranks], self.tj.timeout_s,
                           job_id=self.tj.job_id, tcp_cc=self.spec.tcp_cc,
                           window_clamp=alltoall.window_bytes(self.bw_bps), port_of=a2a_port)
                try:
                    a2a.listen(self.ranks[self.rank]["ip"])
                    a2a.connect(others, self._listeners(a2a_port))
                except BaseException:
                    a2a.close()
                    raise
                self.a2a = a2a
            comm = self.a2a
        else:
            comm = self.comm
            missing = sorted(set(others) - set(comm.socks))
            if missing:
                comm.connect(missing, self._listeners(tcp_port))
        self.calls += 1
        alltoall.all_to_all(comm, x, out, self.n, max(1, (64 << 10) // x.itemsize))

    def shard_ops(self) -> tuple[str, ...]:
        """The sharded collectives (reduce_scatter, allgather: FSDP's) this job's algorithm
        runs itself: a peer algorithm's, uncompressed; others go to gloo."""
        if self.tj.algo == "trim" or self.tj.compressor is not None or is_offloaded(self.tj.algo):
            return ()
        alg = peer_algorithm(self.tj.algo)
        return tuple(op for op in ("reduce_scatter", "allgather") if alg and op in alg.ops)

    def sharded(self, op: str, x: np.ndarray, out: np.ndarray) -> None:
        """``op`` (one of :meth:`shard_ops`) through the algorithm: reduce_scatter's ``out``
        is shard ``rank`` of the sum of every ``x``, allgather's the ranks' ``x`` in rank
        order (torch's layouts for equal shards)."""
        self.calls += 1
        peer_algorithm(self.tj.algo).rank_function(op)(self.comm, x, out, self.n, 64 << 10)

    def take_all_to_all(self, old: TestbedComm) -> None:
        """Take over ``old``'s all-to-all connections (a re-planned job's earlier plan): the
        all-to-all does not depend on the plan, and a second set for the new plan's job id
        would bind the same ports (``A2A_JOB_SLOTS`` blocks)."""
        self.a2a, old.a2a = old.a2a, None

    def close(self) -> None:
        """Close the sockets."""
        if self.a2a is not None:
            self.a2a.close()
        if self.comm is not None:
            self.comm.close()
        if self.client is not None:
            self.client.close()
        if self.gather is not None:
            self.gather.close()


@dataclasses.dataclass
class HookState:
    """State of :func:`testbed_hook`: the rank's communicator, the world size, whether to
    verify against gloo, and what the hook measured."""

    comm: TestbedComm
    world: int
    verify: bool = False
    comm_s: float = 0.0
    calls: int = 0
    max_diff: float = 0.0
    max_rel_diff: float = 0.0


def testbed_hook(state: HookState, bucket):
    """DDP communication hook: allreduce the bucket with the testbed's collective, return the
    average (a completed future, as a hook that communicates by itself must)."""
    # torch is the optional [torch] extra: only the ranks import it, so that the job's runner
    # and its validation work without it
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    x = np.ascontiguousarray(buf.detach().numpy(), dtype=np.float32)
    out = np.empty_like(x)
    t0 = time.monotonic()
    state.comm.allreduce(x, out, bucket.index())
    state.comm_s += time.monotonic() - t0
    state.calls += 1
    result = torch.from_numpy(out)
    if state.verify:
        ref = buf.detach().clone()
        dist.all_reduce(ref)  # gloo's sum of the same buckets
        diff = float((result - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        state.max_diff = max(state.max_diff, diff)
        state.max_rel_diff = max(state.max_rel_diff, diff / scale if scale else diff)
    fut = torch.futures.Future()
    fut.set_result(result.div_(state.world))
    return fut


def _rank_main(job: dict, rank: int) -> dict:
    """Train this rank's share of the job; return what it measured."""
    import torch  # the optional [torch] extra, in the ranks only (see testbed_hook)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    tj = TorchJob(**job["torch"])
    n = len(job["ranks"])
    me = job["ranks"][rank]
    os.environ["GLOO_SOCKET_IFNAME"] = me["intf"]
    torch.set_num_threads(1)
    torch.manual_seed(tj.seed)
    data = load_dataset("digits", seed=tj.seed)
    X, y = data.shard(rank, n)
    sampler = BatchSampler(len(y), tj.batch_size, np.random.default_rng([tj.seed, 7, rank]))
    master = job["ranks"][0]["ip"]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT + tj.job_id}",
                            rank=rank, world_size=n)
    model = torch.nn.Sequential(torch.nn.Linear(data.n_features, tj.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(tj.hidden, data.n_classes))
    ddp = DDP(model, bucket_cap_mb=tj.bucket_cap_mb)
    state = None
    comm = None
    if tj.comm == "testbed":
        comm = TestbedComm(job, tj, rank)
        state = HookState(comm, n, tj.verify)
        ddp.register_comm_hook(state, testbed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=tj.lr, momentum=tj.momentum)
    lossf = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(data.X_test), torch.from_numpy(data.y_test)
    losses, evals, times = [], [], []
    t_start = time.monotonic()
    try:
        for it in range(tj.iterations):
            t0 = time.monotonic()
            idx = sampler.next()
            opt.zero_grad()
            loss = lossf(ddp(torch.from_numpy(X[idx])), torch.from_numpy(y[idx]))
            loss.backward()  # DDP allreduces the buckets here (gloo, or the hook)
            opt.step()
            times.append(time.monotonic() - t0)
            losses.append(float(loss))
            if (it + 1) % tj.eval_every == 0 or it + 1 == tj.iterations:
                with torch.no_grad():
                    acc = float((model(Xt).argmax(dim=1) == yt).float().mean())
                evals.append((it, acc))
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        dist.barrier()  # nobody closes its sockets while a peer still needs them
    finally:
        if comm is not None:
            comm.close()
        dist.destroy_process_group()
    return {"rank": rank, "losses": losses, "evals": evals, "iter_s": times,
            "train_s": time.monotonic() - t_start, "final_accuracy": evals[-1][1],
            "digest": digest(params),
            "comm_s": state.comm_s if state else None,
            "hook_calls": state.calls if state else 0,
            "max_diff": state.max_diff if state else None,
            "max_rel_diff": state.max_rel_diff if state else None}


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: ``--job FILE --rank R``; writes ``rank<R>.json`` beside it."""
    ap = argparse.ArgumentParser(prog="python -m testbed.torch")
    ap.add_argument("--job", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("marker", nargs="*", help="testbed-node=<host> tag for cleanup")
    args = ap.parse_args(argv)
    follow_owner()
    with open(args.job) as f:
        job = json.load(f)
    try:
        res = _rank_main(job, args.rank)
    except Exception as e:  # noqa: BLE001 - reported to the runner through the result file

        res = {"rank": args.rank, "error": f"{type(e).__name__}: {e}\n"
               + traceback.format_exc(limit=6)}
    write_json(os.path.join(os.path.dirname(args.job), f"rank{args.rank}.json"), res)
    return 0 if "error" not in res else 2


# ---------------------------------------------------------------------------- the runner


def run_ddp(net, tj: TorchJob, workers: int | None = None) -> list[dict]:
    """Run ``tj`` on the first ``workers`` hosts of ``net`` (default all); one result dict per
    rank. Raises ``CollectiveError`` naming the rank that failed or timed out."""
    hosts = list(net.hosts)[:workers or len(net.hosts)]
    n = len(hosts)
    tj.validate(n)
    ranks = [{"host": h.name, "pid": int(h.pid), "ip": h.IP(), "intf": h.defaultIntf().name}
             for h in hosts]
    job = {"torch": dataclasses.asdict(tj), "n": n, "m": 0, "ranks": ranks,
           "time_dilation": float(getattr(net, "time_dilation", 1.0))}
    jobdir = job_dir(RUN_DIR, "torch", time.monotonic_ns())
    os.makedirs(jobdir, exist_ok=True)
    procs = []
    spec = tj.collective() if tj.comm == "testbed" else CollectiveSpec(algo="ring")
    try:
        with offload_job(net, spec, job, hosts):
            path = os.path.join(jobdir, "job.json")
            with open(path, "w") as f:
                json.dump(job, f)
            for r, h in enumerate(hosts):
                log = open(os.path.join(jobdir, f"rank{r}.log"), "wb")  # noqa: SIM115
                procs.append(h.popen([sys.executable, "-m", "testbed.torch", "--job", path,
                                      "--rank", str(r), f"testbed-node={h.name}"],
                                     stdout=log, stderr=log))  # mnexec -d: own session
                log.close()
            _wait(procs, net, 120 + tj.iterations * 2.0)
        out = []
        for r in range(n):
            f = os.path.join(jobdir, f"rank{r}.json")
            if not os.path.exists(f):
                with open(os.path.join(jobdir, f"rank{r}.log"), "rb") as lf:
                    tail = lf.read().decode(errors="replace")[-1500:]
                raise CollectiveError(f"torch rank {r} ({hosts[r].name}) exited "
                                      f"{procs[r].returncode} without a result:\n{tail}")
            with open(f) as fh:
                out.append(json.load(fh))
        bad = [f"rank {o['rank']} ({hosts[o['rank']].name}): {o['error']}" for o in out
               if "error" in o]
        if bad:
            raise CollectiveError("; ".join(bad))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(jobdir, ignore_errors=True)


def _wait(procs: list, net, limit_s: float) -> None:
    """Wait for every rank; fail fast when one failed (the others would only time out) or a
    data-path engine died."""
    deadline = time.monotonic() + limit_s
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            time.sleep(1.0)  # let the others write their own errors first
            return
        dead = getattr(net, "dead_engines", dict)()
        if dead:
            raise CollectiveError(f"data-path engine(s) {sorted(dead)} died during DDP")
        if time.monotonic() > deadline:
            raise CollectiveError(f"DDP job did not finish within {limit_s:.0f} s")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
