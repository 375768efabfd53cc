"""What a collective run is asked to do (:class:`CollectiveSpec`) and its validation.

Every bad field raises ``ValueError`` naming the field, the value and what is allowed, before
any process or packet is created.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing

import numpy as np

from testbed.collectives.algorithms import (
    BUILTINS,
    OPS,
    algorithm,
    algorithm_names,
    is_offloaded,
)
from testbed.collectives.transport import DEFAULT_TCP_CC
from testbed.collectives.uet import TRANSPORTS

#: The built-in algorithms (plug-ins add theirs: :func:`algorithm_names`).
ALGOS = tuple(BUILTINS)
#: the built-in algorithms that connect ranks over TCP (``tcp_cc`` applies to them); not
#: :func:`algorithm_names`, which imports the plug-ins: a plug-in may import this module
TCP_ALGOS = tuple(name for name, cls in BUILTINS.items() if cls.traffic == "tcp")
DTYPES = ("float32", "int32")

#: Elements per INA packet (SwitchML's client default, see kernels.wire).
INA_ELEMS = 256
#: Halving-doubling rounds whose larger message has at least this many bytes start with a
#: rendezvous (both ranks say they entered the round before either sends; see ``hd``), like
#: MPI's eager/rendezvous switch; smaller rounds send at once.
HD_RENDEZVOUS_BYTES = 64 << 10
#: Compressors ``algo="ina"`` implements: summable ones the switch adds as small integers.
INA_COMPRESSORS = ("thc",)
#: Default outstanding packets (slots) per INA worker.
DEFAULT_WINDOW = 64
#: Congestion responses of INA workers (``CollectiveSpec.ina_cc``): "delay", a window of
#: outstanding packets driven by the round trips (``inakernel.cc_sample``).
INA_CC = ("delay",)
#: Keys of ``CollectiveSpec.placement``.
PLACEMENT_KEYS = ("tree", "mode", "slots", "refused", "engine_death", "link_failure")
#: Members one aggregating switch takes (SwitchML's 32-bit bitmap): a job of more workers
#: needs a tree, each switch of which aggregates at most this many.
MAX_SWITCH_MEMBERS = 32


class FieldError(ValueError):
    """A bad value of one field of a spec: ``field`` names it (the message starts with
    ``Spec.field``; '' when no one field is at fault), ``job`` the job of a list it is about
    and ``reason`` the message without the job's name, so a schema above can say where in its
    own file the value came from."""

    def __init__(self, field: str, message: str, job: int | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.field, self.job, self.reason = field, job, message if reason is None else reason

    def __reduce__(self):  # picklable across the pool's and Dask's process boundaries
        return type(self), (self.field, str(self), self.job, self.reason)


@dataclasses.dataclass(kw_only=True)
class Communication:
    """How a job's data crosses the network: the one declaration of these settings.

    :class:`CollectiveSpec`, ``TrainingSpec`` and ``TorchJob`` inherit it; the experiment
    schema's jobs and the provider's ``Plan`` take their fields from it
    (:func:`communication_model`); :func:`communication_of` copies them from any of those
    onto another. What each kind of job accepts (an op's algorithms, a training job's
    ``trim``, a launch's ``auto``) stays with that job's validation.
    """

    algo: str = dataclasses.field(default="ring", metadata={
        "doc": "a registered algorithm (testbed.collectives.algorithms): ring, hd, rs, ina, "
               "nic or a plug-in's"})
    compressor: str | None = dataclasses.field(default=None, metadata={
        "doc": "a registered compressor (testbed.kernels.compressors), or none"})
    compressor_params: dict = dataclasses.field(default_factory=dict, metadata={
        "doc": "the compressor's parameters (e.g. ratio for topk, granularity for thc)"})
    error_feedback: bool = dataclasses.field(default=False, metadata={
        "doc": "add what compression dropped to the next iteration's input"})
    transport: str = dataclasses.field(default="tcp", metadata={
        "doc": "what carries a host algorithm's messages (ring, hd, rs): tcp, or uet (sprayed "
               "UDP packets a UET switch trims, NACKed and resent; one rank per host)"})


#: The fields of :class:`Communication`, in order.
COMMUNICATION = tuple(f.name for f in dataclasses.fields(Communication))


def communication_of(job) -> dict:
    """``job``'s communication settings (a dataclass or a pydantic model with the fields of
    :class:`Communication`) as keyword arguments, copied: ``CollectiveSpec(**communication_of(plan), ...)``."""
    return {name: copy.deepcopy(getattr(job, name)) for name in COMMUNICATION}


def communication_label(job) -> str:
    """algo[+compressor][+ef][@transport] of ``job``: the default name of a job in tables and
    plots (the transport only when it is not TCP)."""
    transport = getattr(job, "transport", "tcp")
    return (job.algo + (f"+{job.compressor}" if job.compressor else "")
            + ("+ef" if job.error_feedback else "")
            + (f"@{transport}" if transport != "tcp" else ""))


def communication_model(base: type) -> type:
    """A pydantic model on ``base`` whose fields are :class:`Communication`'s (types,
    defaults, descriptions): the schemas above (experiment files, the provider's API) build
    their jobs on it, so a setting is declared here only. A class on it may narrow a field
    (a launch's ``algo`` may be unset or ``auto``) by declaring it again."""
    from pydantic import Field, create_model  # the schemas' library, not the collectives'

    hints = typing.get_type_hints(Communication)
    fields = {}
    for f in dataclasses.fields(Communication):
        default = ({"default_factory": f.default_factory}
                   if f.default is dataclasses.MISSING else {"default": f.default})
        fields[f.name] = (hints[f.name], Field(**default, description=f.metadata["doc"]))
    return create_model(f"{base.__name__}Communication", __base__=base,
                        __module__=base.__module__, **fields)


@dataclasses.dataclass
class CollectiveSpec(Communication):
    """One collective to run on an emulated network.

    ``op``/``algo``: a registered algorithm that implements ``op`` (:mod:`~testbed.collectives.algorithms`). ``nbytes``: size of the whole array in bytes
    (nccl-tests convention: for allgather/reduce_scatter the full array, not a shard); it must
    be a multiple of the dtype size. ``workers``: number of worker hosts (default: every host of
    the net). ``servers``: reduction-server count for ``algo="rs"``: placed on the hosts after
    the workers when the net has enough of them, otherwise co-located on workers.
    ``window``: outstanding packets per INA worker (slot pool size). ``chunk_bytes``: TCP
    pipelining unit. ``compressor``: any compressor with ``algo="ring"`` (summable payloads
    reduce-scattered and allgathered in their wire type, the others allgathered:
    ``compress.scheme``); with ``algo="ina"`` one of :data:`INA_COMPRESSORS` (summed in the
    switch).
    ``loss``: seeded drop probability applied in the INA client on receive
    (client-side impairment when the switch has no impair stage). ``timeout_s``: a peer silent
    that long fails the run with :class:`CollectiveTimeout`. ``hosts``: host ranks of the
    workers (then servers) in rank order, default the first hosts of the net (jobs sharing a
    fabric take disjoint host sets). ``placement`` (``algo`` ina/nic): where the job is
    aggregated, ``{"tree": None | "single" | "auto" | [switches, root first], "mode": "static"
    | "shared", "slots": N, "refused": "fail" | "ring", "engine_death": "restart" | "fail",
    "link_failure": "replan" | "fail"}`` (see :data:`PLACEMENT_KEYS`; slots default
    ``window``; ``refused``: what a switch's admission refusal does; ``engine_death``: what a
    switch engine that dies mid-collective does, restarted and the collective run again, or
    an error naming it; ``link_failure``: what a link the job's tree rides does when it
    fails, the collective run again on a tree around it, or an error naming its ports).
    ``tcp_cc``: the TCP congestion control of the TCP algorithms' connections (ring, hd, rs
    and the torch hook; default :data:`~testbed.collectives.transport.DEFAULT_TCP_CC`, None:
    each host's default, which differs between machines); rows record the one used.
    ``ina_cc`` (``algo`` ina/nic): the workers' congestion response, one of :data:`INA_CC`
    ("delay": at most a delay-driven window of the ``window`` slots outstanding, so UDP INA
    shares a link with TCP jobs), or None: every slot always busy, no response (default).
    ``transport``: what carries the host algorithms' messages, "tcp" (the kernel's TCP with
    ``tcp_cc``) or "uet" (:mod:`testbed.collectives.uet`: sprayed UDP packets a UET switch
    trims, NACKed and retransmitted within a round trip; one rank per host).
    """

    op: str = "allreduce"
    nbytes: int = 8 << 20
    dtype: str = "float32"
    servers: int = 1
    workers: int | None = None
    window: int = DEFAULT_WINDOW
    chunk_bytes: int = 256 << 10
    loss: float = 0.0
    timeout_s: float = 60.0
    seed: int = 0
    repetitions: int = 1
    job_id: int = 1
    hosts: list[int] | None = None
    placement: dict = dataclasses.field(default_factory=dict)
    tcp_cc: str | None = DEFAULT_TCP_CC
    ina_cc: str | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return np.dtype(self.dtype).itemsize

    @property
    def count(self) -> int:
        """Number of elements in the whole array."""
        return self.nbytes // self.itemsize

    def validate(self, n_hosts: int | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field; ``n_hosts`` = hosts of the net."""
        if self.op not in OPS:
            raise FieldError("op", f"CollectiveSpec.op={self.op!r} is not one of {OPS}")
        if not isinstance(self.algo, str) or self.algo not in algorithm_names():
            raise FieldError("algo", f"CollectiveSpec.algo={self.algo!r} is not one of "
                             f"{algorithm_names()}")
        alg = algorithm(self.algo)  # a plug-in that cannot load raises PluginError here
        if self.op not in alg.ops:
            raise FieldError("algo", f"CollectiveSpec.algo={self.algo!r} does not implement "
                             f"op={self.op!r}; use one of {list(algorithm_names(self.op))}")
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"CollectiveSpec.dtype={self.dtype!r} is not one of {DTYPES}")
        if alg.offloaded and self.dtype != "float32":
            raise FieldError("dtype", f"CollectiveSpec.dtype={self.dtype!r}: algo={self.algo!r} "
                             "aggregates float32 in fixed point; use dtype='float32'")
        _int(self, "nbytes", 1)
        if self.nbytes % self.itemsize:
            raise FieldError("nbytes", f"CollectiveSpec.nbytes={self.nbytes} is not a multiple of the "
                             f"{self.dtype} size ({self.itemsize} B)")
        _int(self, "servers", 1)
        _int(self, "window", 1)
        if self.window > 4096:
            raise FieldError("window", f"CollectiveSpec.window={self.window} exceeds 4096 slots")
        _int(self, "chunk_bytes", 1024)
        _int(self, "repetitions", 1)
        _int(self, "seed", 0)
        _int(self, "job_id", 0)
        if self.job_id > 0xFFFF:
            raise FieldError("job_id", f"CollectiveSpec.job_id={self.job_id} must fit 16 bits")
        if not (isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise FieldError("timeout_s", f"CollectiveSpec.timeout_s={self.timeout_s!r} must be a positive "
                             "number of seconds")
        if not (isinstance(self.loss, int | float) and 0.0 <= self.loss < 0.5):
            raise FieldError("loss", f"CollectiveSpec.loss={self.loss!r} must be in [0, 0.5)")
        if self.loss and not alg.offloaded:
            raise FieldError("loss", f"CollectiveSpec.loss={self.loss}: client-side loss is only "
                             "emulated for algo 'ina'/'nic' (TCP algorithms need the switch's "
                             "impair stage)")
        if self.tcp_cc is not None and not (isinstance(self.tcp_cc, str)
                                            and re.fullmatch(r"[a-z][a-z0-9_]{0,15}", self.tcp_cc)):
            raise FieldError("tcp_cc", f"CollectiveSpec.tcp_cc={self.tcp_cc!r} must be the name of a TCP "
                             "congestion control (e.g. 'cubic', 'bbr', 'reno'; see "
                             "/proc/sys/net/ipv4/tcp_available_congestion_control) or None for "
                             "the host's default")
        if self.ina_cc is not None and (not isinstance(self.ina_cc, str)
                                        or self.ina_cc not in INA_CC):
            raise FieldError("ina_cc", f"CollectiveSpec.ina_cc={self.ina_cc!r} must be one of "
                             f"{INA_CC} or None (no congestion response)")
        if self.ina_cc is not None and not alg.offloaded:
            raise FieldError("ina_cc", f"CollectiveSpec.ina_cc={self.ina_cc!r} applies to "
                             f"in-network aggregation (algo 'ina' or 'nic'), not "
                             f"algo={self.algo!r}; TCP algorithms take tcp_cc")
        if self.transport not in TRANSPORTS:
            raise FieldError("transport", f"CollectiveSpec.transport={self.transport!r} must be "
                             f"one of {TRANSPORTS}")
        if self.transport != "tcp" and alg.traffic != "tcp":
            raise FieldError("transport", f"CollectiveSpec.transport={self.transport!r} carries "
                             "the host algorithms' messages (ring, hd, rs); "
                             f"algo={self.algo!r} sends its own packets: leave transport='tcp'")
        if not isinstance(self.compressor_params, dict):
            raise FieldError("compressor_params", "CollectiveSpec.compressor_params must be a dict")
        if self.compressor is not None and not isinstance(self.compressor, str):
            raise FieldError("compressor", f"CollectiveSpec.compressor={self.compressor!r} must be a name "
                             "or None")
        if self.compressor is not None and self.algo == "ina":
            if self.compressor not in INA_COMPRESSORS:
                raise FieldError("compressor", f"CollectiveSpec.compressor={self.compressor!r}: algo='ina' "
                                 "sums the payloads in the switch, so it takes only a summable "
                                 f"compressor it implements: one of {INA_COMPRESSORS} (or use "
                                 "algo='ring' for any compressor)")
            if self.error_feedback:
                raise FieldError("error_feedback", "CollectiveSpec.error_feedback=True is not implemented for "
                                 "algo='ina' with a compressor; use error_feedback=False")
        elif self.compressor is not None and (self.op != "allreduce" or self.algo != "ring"):
            raise FieldError("compressor", f"CollectiveSpec.compressor={self.compressor!r}: compression is "
                             "applied to allreduce with algo='ring' (ring of the "
                             "compressed payloads) or algo='ina' (compressor one of "
                             f"{INA_COMPRESSORS})")
        if self.compressor is not None and self.dtype != "float32":
            raise FieldError("dtype", f"CollectiveSpec.dtype={self.dtype!r}: compressors take float32")
        if self.compressor is not None:
            # here, not at the top: the pool process imports this module before it makes
            # Numba fork-safe; the compressor kernels must load after that
            from testbed.kernels.compressors import get_compressor

            try:
                get_compressor(self.compressor, **self.compressor_params)
            except ValueError as e:
                raise FieldError("compressor", f"CollectiveSpec.compressor / compressor_params: {e}") from None
        if self.error_feedback and self.compressor is None:
            raise FieldError("error_feedback", "CollectiveSpec.error_feedback=True needs a compressor")
        self._validate_placement()
        if self.hosts is not None:
            if (not isinstance(self.hosts, list | tuple) or not self.hosts or any(
                    isinstance(h, bool) or not isinstance(h, int | np.integer) or h < 0
                    for h in self.hosts) or len(set(self.hosts)) != len(self.hosts)):
                raise FieldError("hosts", f"CollectiveSpec.hosts={self.hosts!r} must be distinct host "
                                 "ranks (integers >= 0)")
            if n_hosts is not None and max(self.hosts) >= n_hosts:
                raise FieldError("hosts", f"CollectiveSpec.hosts: rank {max(self.hosts)} but the net has "
                                 f"{n_hosts} hosts")
        if self.workers is not None:
            _int(self, "workers", 2)
        if n_hosts is not None and self.hosts is not None:
            n_hosts = len(self.hosts)
        if n_hosts is not None:
            n = self.workers if self.workers is not None else n_hosts
            if n > n_hosts:
                raise FieldError("workers", f"CollectiveSpec.workers={n} but the net has {n_hosts} hosts")
            if n < 2:
                raise FieldError("workers", f"CollectiveSpec.workers: need at least 2 workers, "
                                 f"the net gives {n}")
            tree = (self.placement or {}).get("tree")
            if alg.offloaded and n > MAX_SWITCH_MEMBERS and tree in (None, "single"):
                raise FieldError("workers", f"CollectiveSpec.workers={n}: one aggregating switch "
                                 f"takes at most {MAX_SWITCH_MEMBERS} members (its 32-bit "
                                 "bitmap); give placement tree='auto' (or a list of switches): "
                                 "each switch of a tree aggregates at most that many")
            if self.algo == "rs" and self.servers > n_hosts:
                raise FieldError("servers", f"CollectiveSpec.servers={self.servers} exceeds the "
                                 f"{n_hosts} hosts of the net")
        if self.algo == "hd" and self.op in ("reduce_scatter", "allgather") and n_hosts:
            n = self.workers if self.workers is not None else n_hosts
            if n & (n - 1):
                raise FieldError("algo", f"CollectiveSpec.algo='hd' for op={self.op!r} needs a power "
                                 f"of two workers, got {n}; use algo='ring'")

    def _validate_placement(self) -> None:
        p = self.placement
        if not isinstance(p, dict):
            raise FieldError("placement", f"CollectiveSpec.placement={p!r} must be a dict with keys from "
                             f"{PLACEMENT_KEYS}")
        if not p:
            return
        if not is_offloaded(self.algo):
            raise FieldError("placement", f"CollectiveSpec.placement applies to in-network aggregation "
                             f"(algo 'ina' or 'nic'), not algo={self.algo!r}")
        bad = set(p) - set(PLACEMENT_KEYS)
        if bad:
            raise FieldError("placement", f"CollectiveSpec.placement: unknown keys {sorted(bad)}; use "
                             f"{PLACEMENT_KEYS}")
        tree = p.get("tree")
        if not (tree is None or tree in ("single", "auto") or (
                isinstance(tree, list | tuple) and tree and all(isinstance(t, str) for t in tree))):
            raise FieldError("placement", f"CollectiveSpec.placement.tree={tree!r} must be 'single', 'auto' "
                             "or a list of switch names (root first)")
        if p.get("mode", "static") not in ("static", "shared"):
            raise FieldError("placement", f"CollectiveSpec.placement.mode={p.get('mode')!r} must be "
                             "'static' or 'shared'")
        if p.get("refused", "fail") not in ("fail", "ring"):
            raise FieldError("placement", f"CollectiveSpec.placement.refused={p.get('refused')!r} must be "
                             "'fail' (an admission refusal is an error) or 'ring' (run the job "
                             "on the hosts instead)")
        if p.get("engine_death", "restart") not in ("restart", "fail"):
            raise FieldError("placement", f"CollectiveSpec.placement.engine_death="
                             f"{p.get('engine_death')!r} must be 'restart' (the switch's engine "
                             "is started again and the collective rerun) or 'fail' (an error "
                             "naming it)")
        if p.get("link_failure", "replan") not in ("replan", "fail"):
            raise FieldError("placement", f"CollectiveSpec.placement.link_failure="
                             f"{p.get('link_failure')!r} must be 'replan' (the collective is "
                             "run again on a tree around the failed link) or 'fail' (an error "
                             "naming it)")
        slots = p.get("slots", self.window)
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 4096:
            raise FieldError("placement", f"CollectiveSpec.placement.slots={slots!r} must be an integer "
                             "1..4096")

    @property
    def slots(self) -> int:
        """Aggregator slots per tree switch: ``placement.slots``, default ``window``."""
        return int(self.placement.get("slots", self.window)) if self.placement else self.window

    def to_json(self) -> dict:
        """Plain dict (JSON-serialisable) of the fields."""
        return dataclasses.asdict(self)


def _int(spec: CollectiveSpec, name: str, lo: int) -> None:
    v = getattr(spec, name)
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
        raise FieldError(name, f"CollectiveSpec.{name}={v!r} must be an integer >= {lo}")
