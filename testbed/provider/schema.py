"""What the tenant and the provider exchange: hints, plans, and the fabric snapshot.

The tenant says what it knows about its job (:class:`Hints`, every field optional); the
provider, which alone sees the fabric (:class:`FabricSnapshot`: inventory plus live
telemetry), answers with an offload :class:`Plan` per job. A :class:`Policy` is the pluggable
decision: jobs and snapshot in, plans out. These are plain pydantic models so that the HTTP
service, the typed client, the experiment runner and the tests share one definition and one
validation (a bad request is a 422 naming the field, before any state changes).
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from testbed.collectives.algorithms import algorithm_names
from testbed.collectives.spec import communication_model
from testbed.topologies.base import LinkImpairment

#: Version of the hints schema; a tenant sending another major version is refused (4xx).
HINTS_VERSION = 1

Tolerance = Literal["exact", "lossy", "lossy_ef"]
#: what may carry a job's ring (``Communication.transport``): TCP, or the UET-like transport
Transport = Literal["tcp", "uet"]


def _with_tcp(transports: tuple) -> tuple:
    if "tcp" not in transports:
        raise ValueError("every job's workers run TCP (the tenant's own ring); list the "
                         "transports they run besides it, e.g. ['tcp', 'uet']")
    return tuple(dict.fromkeys(transports))


def _registered(algo: str) -> str:
    if algo not in algorithm_names():
        raise ValueError(f"{algo!r} is not a registered algorithm: one of {algorithm_names()}")
    return algo


#: an algorithm of the registry (testbed.collectives.algorithms), plug-ins included
PlanAlgo = Annotated[str, AfterValidator(_registered)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hints(_Strict):
    """What a tenant may say about its job. Everything is optional: no hints still runs.

    ``collective_bytes``: bytes allreduced per iteration (sum over the iteration's
    collectives). ``iteration_s``/``compute_s``: iteration period or compute time between
    collectives. ``tolerance``: ``"exact"`` (no lossy compression or trimming), ``"lossy"``
    (within ``error_budget``, relative L2 error of one allreduce), ``"lossy_ef"`` (lossy with
    error feedback, the tenant keeps the residual). ``priority``: larger first. ``deadline_s``:
    wanted job completion time from arrival. ``transports``: what the job's workers can carry
    their ring over: TCP always; ``"uet"`` as well when they run the UET-like transport (one
    rank per host): the job tolerates **trimming**, and the provider may plan its ring over
    UET with trimming on the switch ports its packets cross (a cut packet is NACKed and resent
    within a round trip, so the sum stays exact: any tolerance allows it).
    """

    version: int = HINTS_VERSION
    collective_bytes: int | None = Field(default=None, gt=0)
    iterations: int | None = Field(default=None, gt=0)
    iteration_s: float | None = Field(default=None, gt=0)
    compute_s: float | None = Field(default=None, ge=0)
    tolerance: Tolerance | None = None
    error_budget: float | None = Field(default=None, gt=0, le=1)
    priority: int = Field(default=0, ge=0, le=7)
    deadline_s: float | None = Field(default=None, gt=0)
    transports: Annotated[tuple[Transport, ...], AfterValidator(_with_tcp)] = ("tcp",)


def check_hints(hints: dict | None) -> Hints:
    """``hints`` as :class:`Hints`; ``ValueError`` naming each bad hint (``field: why; ...``),
    for front ends that check a tenant's hints before anything is built."""
    try:
        return Hints(**(hints or {}))
    except ValidationError as e:
        raise ValueError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                   for x in e.errors())) from None


class MeasuredHints(_Strict):
    """What a running job's tenant measured of it (e.g. its launcher, from its first
    iterations), to replace those of its :class:`Hints`: only figures of the job itself, not
    its tolerance or priority, which its admission settled."""

    collective_bytes: int | None = Field(default=None, gt=0)
    iterations: int | None = Field(default=None, gt=0)
    iteration_s: float | None = Field(default=None, gt=0)
    compute_s: float | None = Field(default=None, ge=0)
    #: what the provider's log says of the change
    reason: str = Field(default="hints measured by the tenant", min_length=1, max_length=200)


class JobRequest(_Strict):
    """A tenant's job as the provider sees it on admission: its hosts and optional hints."""

    job: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    hosts: list[str] = Field(min_length=2, max_length=32)
    #: who the job belongs to, for quotas (None: the job is a tenant of its own)
    tenant: str | None = Field(default=None, min_length=1, max_length=64,
                               pattern=r"^[A-Za-z0-9_.-]+$")
    hints: Hints = Hints()
    lease_s: float = Field(default=30.0, gt=0, le=3600)


class Plan(communication_model(_Strict)):
    """The provider's offload decision for one job, applied by the workers at an iteration
    boundary. ``tree``/``slots``/``mode`` map onto ``CollectiveSpec.placement``; ``slots`` is
    per switch of ``tree``; ``compressor``/``compressor_params`` onto the spec's fields;
    ``trim_head_bits`` None means no trimming. ``predicted_comm_s``: the model's communication
    time per iteration. ``reason``: why this plan (logged with every change)."""

    job: str
    algo: PlanAlgo = "ring"  # narrowed: checked against the registry on arrival
    tree: Literal["single", "auto"] | list[str] | None = None
    mode: Literal["static", "shared"] = "static"
    slots: int = Field(default=0, ge=0)
    trim_head_bits: int | None = Field(default=None, ge=1, le=32)
    predicted_comm_s: float | None = None
    reason: str = ""


class SwitchState(_Strict):
    """One programmable switch: aggregator memory configured and allocated, per job, and the
    entries of its shared pool (one round of 256 int32 lanes each: the jobs in shared mode
    take them round by round, the rest go to their host fallbacks)."""

    name: str
    memory_bytes: int = Field(ge=0)
    pool_entries: int = Field(default=0, ge=0)
    allocated_bytes: dict[str, int] = Field(default_factory=dict)
    programmable: bool = True


class LinkState(_Strict):
    """One directed link: its rate, and live telemetry (utilisation 0..1, queue, drops;
    ``bytes``: bytes carried in that direction since its counters started, of which
    utilisation is the recent rate; ``drop_rate``: the share of its packets its egress queue
    dropped since the previous snapshot (a full queue: congestion); ``impairment``: the loss,
    duplication and reordering the engines' ``impair`` stages apply to it now. The policies'
    model prices both as loss: a TCP flow through them stalls, a UET flow through trimming
    ports has its packets cut instead of dropped)."""

    src: str
    dst: str
    rate_mbps: float = Field(gt=0)
    utilisation: float = Field(default=0.0, ge=0)
    queue_bytes: int = Field(default=0, ge=0)
    drops: int = Field(default=0, ge=0)
    trims: int = Field(default=0, ge=0)
    bytes: int = Field(default=0, ge=0)
    drop_rate: float = Field(default=0.0, ge=0, le=1)
    impairment: LinkImpairment | None = None


class FabricSnapshot(_Strict):
    """What the provider sees at one instant: topology name, switches, links, and when."""

    topology: str
    time_s: float = 0.0
    switches: list[SwitchState] = Field(default_factory=list)
    links: list[LinkState] = Field(default_factory=list)
    hosts: list[str] = Field(default_factory=list)


class Policy(Protocol):
    """A pluggable offload policy: one small class each (``tenant_only``, ``provider_only``,
    ``cooperative``, ``oracle``). ``plan`` sees every admitted job and the snapshot and returns
    a plan for each job (re-planning the running ones is allowed: the workers apply a changed
    plan at their next iteration boundary)."""

    name: str

    def plan(self, jobs: list[JobRequest], snapshot: FabricSnapshot) -> dict[str, Plan]:
        """Return one plan per job of ``jobs``."""
        ...
