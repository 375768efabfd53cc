"""Collective algorithms: one registered class each, like the compressors and the stages.

An :class:`Algorithm` declares what the rest of the testbed asks about an algorithm: its
``name``, the ``ops`` it implements, its ``traffic`` (``"tcp"``: ranks connect over TCP;
``"ina"``: UDP packets to an aggregator), whether it is ``offloaded`` (a switch or SmartNIC
aggregates it, so a run registers the job with them), whether a training job can use it
(``trains``). Every list of algorithm names (:data:`~testbed.collectives.spec.ALGOS`, the
experiment and provider schemas, training jobs, ``testbed.torch``) derives from this
registry (:func:`algorithm_names`).

A :class:`PeerAlgorithm` is one whose ranks exchange data among themselves over TCP. Besides
the declaration it carries the four things that run and predict it: the ranks each rank
connects to (:meth:`~PeerAlgorithm.peers`), the rank's function per op
(:meth:`~PeerAlgorithm.rank_function`), its alpha-beta time (:meth:`~PeerAlgorithm.alpha_beta`)
and its flow-model phases (:meth:`~PeerAlgorithm.phases`). The built-ins ``ring`` and ``hd``
are peer algorithms; so is every plug-in, declared by an installed distribution under the
entry-point group ``testbed.algorithms`` (``name = "module:Class"``; see docs/extending.md and
``examples/myalgorithm``). The reduction server (``rs``) and in-network aggregation
(``ina``, ``nic``) have run paths of their own in the runner (servers, switch registration).

Nothing here imports Mininet, Numba or the rank code: a schema can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from testbed.kernels.plugins import ALGORITHMS_GROUP, PluginError, plugins

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
TRANSPORTS = ("tcp", "ina")


class Algorithm:
    """A collective algorithm's declaration (class attributes; instances carry no state)."""

    #: the name experiments, specs and the command line use
    name: ClassVar[str] = ""
    #: one line for tables and ``--help``
    summary: ClassVar[str] = ""
    #: the ops it implements (a subset of :data:`OPS`)
    ops: ClassVar[tuple[str, ...]] = ("allreduce",)
    #: "tcp": ranks exchange messages over a Comm (TCP, or the UET-like transport a job's
    #: ``transport`` names; ``tcp_cc`` applies) or "ina" (testbed UDP packets to a switch).
    #: A plug-in written before this was named ``traffic`` may still set ``transport``.
    traffic: ClassVar[str] = "tcp"
    #: aggregated by a switch or SmartNIC: the run registers the job there (placement, slots)
    offloaded: ClassVar[bool] = False
    #: a training job may allreduce its gradients with it (one collective per iteration)
    trains: ClassVar[bool] = True

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "transport" in cls.__dict__:  # the attribute's name before it was ``traffic``
            cls.traffic = cls.__dict__["transport"]

    def __repr__(self) -> str:
        return f"<algorithm {self.name}: {', '.join(self.ops)} over {self.traffic}>"


class PeerAlgorithm(Algorithm):
    """An algorithm whose ranks exchange data among themselves over a Comm (``traffic="tcp"``).

    Subclass it, set the declaration attributes and implement the four methods; the pool runs
    ``rank_function(op)(comm, x, out, n, chunk)`` in every rank after connecting it to
    ``peers(rank, n, op)``, and both models predict it from the other two.
    """

    traffic: ClassVar[str] = "tcp"

    def peers(self, rank: int, n: int, op: str) -> list[int]:
        """The ranks ``rank`` of ``n`` exchanges data with in ``op`` (both directions: a
        connection serves both)."""
        raise NotImplementedError(f"algorithm {self.name!r} does not say its peers")

    def rank_function(self, op: str) -> Callable:
        """``fn(comm, x, out, n, chunk)``: one rank's part of ``op``. ``comm`` is the rank's
        :class:`~testbed.collectives.transport.Comm` (``comm.rank``; ``send(peer, array)``
        returns a future, ``recv(peer, array)`` fills ``array``), ``x`` its input, ``out``
        where the result goes (same shape and dtype; it may equal the input at entry),
        ``chunk`` the pipelining unit in elements."""
        raise NotImplementedError(f"algorithm {self.name!r} has no rank function for {op!r}")

    def alpha_beta(self, op: str, n: int, nbytes: float, a: float, t: float,
                   chunk_s: float) -> float:
        """Seconds of ``op`` on ``n`` ranks of one switch (the alpha-beta model): ``a`` the
        latency of one message, ``t`` the time to push all ``nbytes`` over one link at the
        protocol's goodput, ``chunk_s`` that of one pipelining chunk."""
        raise NotImplementedError(f"algorithm {self.name!r} has no alpha-beta model")

    def phases(self, op: str, n: int, count: int, chunk_el: int, rk) -> list:
        """The flow model's phases (:class:`~testbed.collectives.flowmodel.Phase`) of ``op``
        on ``n`` ranks moving ``count`` elements: ``rk.tcp(src, dst, elems)`` is the flow of
        ``elems`` elements from rank ``src`` to rank ``dst``; each phase's flows run at once,
        phases one after the other."""
        raise NotImplementedError(f"algorithm {self.name!r} has no flow-model phases")


class Ring(PeerAlgorithm):
    name = "ring"
    summary = "pipelined ring (reduce-scatter + allgather; a chain for broadcast), nccl's"
    ops = OPS

    def peers(self, rank, n, op):
        from testbed.collectives.ring import ring_peers

        return ring_peers(rank, n)

    def rank_function(self, op):
        from testbed.collectives import ring

        return getattr(ring, op)

    def alpha_beta(self, op, n, nbytes, a, t, chunk_s):
        if op == "allreduce":
            return 2 * (n - 1) * a + 2 * (n - 1) / n * t
        if op in ("reduce_scatter", "allgather"):
            return (n - 1) * a + (n - 1) / n * t
        # broadcast: pipelined chain; the last rank gets the first chunk after n-2 relays
        return (n - 1) * a + t + (n - 2) * chunk_s

    def phases(self, op, n, count, chunk_el, rk):
        from testbed.collectives.flowmodel import ring_phases

        return ring_phases(op, n, count, chunk_el, rk)


class HalvingDoubling(PeerAlgorithm):
    name = "hd"
    summary = "recursive halving-doubling (binomial tree for broadcast), MPICH's"
    ops = OPS

    def peers(self, rank, n, op):
        from testbed.collectives.hd import hd_peers

        return hd_peers(rank, n, op)

    def rank_function(self, op):
        from testbed.collectives import hd

        return getattr(hd, op)

    def alpha_beta(self, op, n, nbytes, a, t, chunk_s):
        from testbed.collectives.model import hd_time

        return hd_time(op, n, nbytes, a, t)

    def phases(self, op, n, count, chunk_el, rk):
        from testbed.collectives.flowmodel import hd_phases

        return hd_phases(op, n, count, rk)


class ReductionServer(Algorithm):
    name = "rs"
    summary = "reduction server: workers push shards to servers and get the sums back"
    trains = False  # its servers serve a fixed number of collectives, unknown to a training job


class InNetwork(Algorithm):
    name = "ina"
    summary = "in-network aggregation in a programmable switch (SwitchML-style slots)"
    traffic = "ina"
    offloaded = True


class SmartNic(Algorithm):
    name = "nic"
    summary = "aggregation in the workers' SmartNICs and switch (ATP-style fixed factor)"
    traffic = "ina"
    offloaded = True


#: The built-in algorithms, in the order tables list them.
BUILTINS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (Ring, HalvingDoubling, ReductionServer, InNetwork, SmartNic)}


def algorithm_names(op: str | None = None, *, traffic: str | None = None,
                    trains: bool | None = None, offloaded: bool | None = None) -> tuple[str, ...]:
    """Names of the registered algorithms (built-ins, then plug-ins by name), those that
    implement ``op`` and match the given ``traffic``/``trains``/``offloaded``."""
    names = tuple(BUILTINS) + tuple(sorted(plugins(ALGORITHMS_GROUP, BUILTINS)))
    if op is None and traffic is None and trains is None and offloaded is None:
        return names
    out = []
    for name in names:
        alg = algorithm(name)
        if ((op is None or op in alg.ops) and (traffic is None or alg.traffic == traffic)
                and (trains is None or alg.trains == trains)
                and (offloaded is None or alg.offloaded == offloaded)):
            out.append(name)
    return tuple(out)


_loaded: dict = {}  # built-in name or plug-in entry point -> its instance


def algorithm(name: str) -> Algorithm:
    """The algorithm called ``name`` (``ValueError`` naming the registered ones if none is;
    :class:`~testbed.kernels.plugins.PluginError` if its plug-in cannot be used)."""
    if not isinstance(name, str):
        raise ValueError(f"algorithm {name!r} must be a name, one of {algorithm_names()}")
    key: object = name
    found = plugins(ALGORITHMS_GROUP, BUILTINS)  # raises on a plug-in shadowing a built-in
    if name not in BUILTINS:
        if name not in found:
            raise ValueError(f"unknown algorithm {name!r}; registered: {algorithm_names()} "
                             f"(plug-ins: entry-point group {ALGORITHMS_GROUP})")
        key = found[name]  # an entry point: a refreshed registry may hold another one
    if key not in _loaded:
        if name in BUILTINS:
            _loaded[key] = BUILTINS[name]()
        else:
            cls = key.load(PeerAlgorithm)
            _check_plugin(cls, name, key.describe())
            _loaded[key] = cls()
    return _loaded[key]


def _check_plugin(cls: type, name: str, where: str) -> None:
    if cls.name != name:
        raise PluginError(f"{where}: the class says name = {cls.name!r}; the entry point's "
                          "name and the algorithm's name must be the same")
    bad = [op for op in getattr(cls, "ops", ()) if op not in OPS]
    if not cls.ops or bad:
        raise PluginError(f"{where}: ops {cls.ops!r} must be a non-empty tuple of {OPS}")
    if cls.traffic != "tcp" or cls.offloaded:
        raise PluginError(f"{where}: a plug-in algorithm runs among the ranks over TCP "
                          "(traffic 'tcp', offloaded False)")


def is_offloaded(name: str) -> bool:
    """Whether ``name`` is aggregated by a switch or SmartNIC (False for unknown names, which
    the validation reports)."""
    try:
        return algorithm(name).offloaded
    except ValueError:
        return False


def peer_algorithm(name: str) -> PeerAlgorithm | None:
    """The algorithm ``name`` if its ranks run it among themselves (ring, hd, plug-ins)."""
    alg = algorithm(name)
    return alg if isinstance(alg, PeerAlgorithm) else None


def check_nproc_per_host(k, algo: str | None) -> None:
    """``ValueError`` unless ``k`` ranks per host can run ``algo``: any count over plain gloo
    or a TCP algorithm (ranks that share a host get their own ports); one for in-network
    aggregation, whose switch counts one worker per host, and for the provider's plans."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"nproc_per_host={k!r} must be an integer >= 1")
    if k > 1 and algo is not None and (algo not in algorithm_names()
                                       or algorithm(algo).traffic != "tcp"):
        raise ValueError(f"nproc_per_host={k} with algo {algo!r}: in-network aggregation "
                         "(and a provider's plan, which may choose it) takes one worker per "
                         "host; use a TCP algorithm (ring, hd, ...), plain gloo, or one rank "
                         "per host")
