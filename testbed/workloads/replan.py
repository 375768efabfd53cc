"""Plan changes of a running training job, applied at an iteration boundary every rank agrees on.

The provider may re-plan a running job (another job arrived or left, a link is congested);
the job then moves its gradient allreduce to the new plan (algorithm, compressor, INA tree
and slots) between two iterations, without stopping. The pieces, top to bottom:

* the **runner** (orchestrator, root network namespace) registers the new plan's INA job on
  its switches under a fresh job id (so the old registration keeps serving the iterations
  still running on it), then offers the plan to the pool over the job's *plan channel* (a
  socketpair, JSON lines): ``{"type": "plan", "epoch": e, "job": {...}}`` with the ranks'
  ports, member ids and aggregator. Tenant processes never touch a switch.
* the **pool** (:class:`Coordinator`) forwards the offer to rank 0.
* **rank 0** decides the boundary: at the start of its allreduce of iteration ``i`` it
  answers ``switch at i + 1``. The pool writes that decision into every other rank's control
  socket and only then lets rank 0 go on (``switch-ok``). No rank can finish the allreduce of
  iteration ``i`` before rank 0 contributed to it, so every rank has the decision in its
  socket before it reaches iteration ``i + 1``: each rank reads its socket (non-blocking) at
  the start of every allreduce and switches exactly there (:class:`Switcher`). The old
  communicator is closed only at the next switch or at the end, when no peer can still be
  reading from it.
* rank 0 reports each finished iteration (``progress``), which the pool passes on to the
  runner: a provider judges a job's hints by the bytes it sends per iteration.
* at ``i + 1`` every rank closes its old communicator and sets up the new one (ports through
  the pool, as at start-up). Once every rank reported its new port, every rank has finished
  iteration ``i`` on the old plan; the pool tells the runner (``switched``), which then
  removes the old plan's switch registration.

The pool checks the first allreduce under every applied plan against numpy with that plan's
own bound, besides its usual check iterations (``pool.py``).
"""

from __future__ import annotations

from testbed.collectives.worker import ControlLine
from testbed.workloads.spec import TrainingSpec

#: Plan changes one job can apply (each takes a check slot in the pool's shared memory).
MAX_SWITCHES = 8
#: Job id of a job's ``e``-th plan: its first job id plus ``e`` times this (16-bit ids; INA
#: ports and switch partitions follow the id, so the plans of one job never share them).
EPOCH_ID_STRIDE = 256


def epoch_job_id(job_id: int, epoch: int) -> int:
    """The job id the ``epoch``-th plan of job ``job_id`` runs under."""
    out = job_id + EPOCH_ID_STRIDE * epoch
    if out > 0xFFFF:
        raise ValueError(f"job_id {job_id} with {epoch} plan changes leaves the 16-bit id "
                         "space; give the job a smaller job_id")
    return out


class Switcher:
    """A rank's allreduce that moves to a new plan at the boundary rank 0 chose.

    ``connect(job, cspec)`` sets the communicator up (``worker.connect_rank`` with the rank's
    buffers) and returns ``(run, close)``. Call the object as ``allreduce(it)``;
    :attr:`applied` lists ``(iteration, epoch)`` of every switch, :attr:`epoch` the plan in
    force.
    """

    def __init__(self, rank: int, ctl: ControlLine, connect, job: dict, cspec,
                 iterations: int):
        self.rank, self.ctl, self.connect = rank, ctl, connect
        self.iterations = iterations
        self.run, self._close = connect(job, cspec)
        self.retired: list = []
        self.epoch = 0
        self.offer: dict | None = None
        self.switches: dict[int, dict] = {}
        self.applied: list[tuple[int, int]] = []

    def _take(self, m: dict) -> None:
        if m["type"] == "plan":
            self.offer = m  # the newest offer wins
        elif m["type"] == "switch":
            self.switches[int(m["at"])] = m
        else:
            raise RuntimeError(f"unexpected control message {m['type']!r} during training")

    def __call__(self, it: int) -> None:
        for m in self.ctl.ready():
            self._take(m)
        if self.rank == 0 and it > 0:  # the job's progress, for a provider checking hints
            self.ctl.send({"type": "progress", "iteration": it - 1})
        if self.rank == 0 and self.offer is not None and it + 1 < self.iterations:
            m, self.offer = self.offer, None
            m = {**m, "at": it + 1}
            self.ctl.send({"type": "switch", "epoch": m["epoch"], "at": it + 1})
            while True:  # the pool has told every other rank when it answers
                reply = self.ctl.recv()
                if reply["type"] == "switch-ok":
                    break
                self._take(reply)
            self.switches[it + 1] = m
        m = self.switches.pop(it, None)
        if m is not None:
            # Close the communicator retired at the previous switch, not the one in use
            # until now: a peer may still be reading this rank's last data of iteration
            # it - 1 from it, and closing a TCP socket with unread data resets the
            # connection (the peer's unread bytes are lost). Every rank has passed the
            # previous switch's iteration by now (it set its new communicator up with all).
            for close in self.retired:
                close()
            self.retired = [self._close]
            cspec = TrainingSpec(**m["job"]["train"]).collective()
            self.run, self._close = self.connect(m["job"], cspec)
            self.epoch = int(m["epoch"])
            self.applied.append((it, self.epoch))
        self.run(it)

    def close(self) -> None:
        """Close every communicator (at the end: every rank is done by then)."""
        for close in [*self.retired, self._close]:
            close()
        self.retired = []


class Coordinator:
    """The pool's side of plan changes: offers from the runner's plan channel to rank 0,
    rank 0's decision to every rank, the new communicators' ports, reports to the runner.

    :attr:`epochs`: ``(iteration, epoch, train spec dict)`` of the plan in force from each
    iteration on (the first from 0)."""

    def __init__(self, job: dict, ctls: dict, channel: ControlLine | None):
        self.job, self.ctls, self.channel = job, ctls, channel
        self.epochs: list[tuple[int, int, dict]] = [(0, 0, job["train"])]
        self.offers: dict[int, dict] = {}
        self.ports: dict[int, int] = {}
        self.switching: tuple[int, int, dict] | None = None

    def _tell_runner(self, msg: dict) -> None:
        if self.channel is not None:
            try:
                self.channel.send(msg)
            except OSError:  # the runner went away: the job still finishes on its plan
                self.channel = None

    def on_channel(self) -> bool:
        """Read the runner's messages; False once the channel closed."""
        msgs = self.channel.feed() if self.channel is not None else None
        if msgs is None:
            self.channel = None
            return False
        for m in msgs:
            if m.get("type") != "plan":
                continue
            job = {**self.job, **m["job"]}
            self.offers[int(m["epoch"])] = job
            self.ctls[0].send({"type": "plan", "epoch": int(m["epoch"]), "job": job})
        return True

    def on_message(self, rank: int, m: dict) -> None:
        """A rank's message other than the pool's own protocol (``switch``, ``port``)."""
        if m["type"] == "switch" and rank == 0:
            epoch, at = int(m["epoch"]), int(m["at"])
            job = self.offers.pop(epoch)
            if len(self.epochs) > MAX_SWITCHES:
                raise RuntimeError(f"more than {MAX_SWITCHES} plan changes in one job")
            for r, c in self.ctls.items():
                if r != 0:
                    c.send({"type": "switch", "epoch": epoch, "at": at, "job": job})
            self.ctls[0].send({"type": "switch-ok"})
            self.switching = (epoch, at, job)
            self.epochs.append((at, epoch, job["train"]))
            self._tell_runner({"type": "switching", "epoch": epoch, "at": at})
        elif m["type"] == "progress" and rank == 0:
            self._tell_runner(m)
        elif m["type"] == "port" and self.switching is not None:
            self.ports[rank] = int(m["port"])
            if len(self.ports) == len(self.ctls):
                epoch, at, job = self.switching
                addrs = {r: [job["ranks"][r]["ip"], p] for r, p in self.ports.items()}
                for c in self.ctls.values():
                    c.send({"type": "addrs", "addrs": addrs})
                self.ports, self.switching = {}, None
                self._tell_runner({"type": "switched", "epoch": epoch, "at": at})
        else:
            raise RuntimeError(f"rank {rank} sent an unexpected {m['type']!r} message")

    def spec_at(self, it: int) -> dict:
        """The train spec dict of the plan in force at iteration ``it``."""
        return [t for at, _e, t in self.epochs if at <= it][-1]

    def summary(self, iterations: int) -> list[dict]:
        """The plan changes applied within the ``iterations`` the job ran: epoch, iteration,
        the plan's communication."""
        out = []
        for at, epoch, t in self.epochs[1:]:
            if at >= iterations:
                continue  # decided, but the job stopped (target accuracy) before it
            out.append({"epoch": epoch, "at": at, "algo": t["algo"],
                        "compressor": t.get("compressor"), "job_id": t["job_id"],
                        "error_feedback": t.get("error_feedback", False),
                        "tree": (t.get("placement") or {}).get("tree")})
        return out
