"""A launched job admitted to a provider that serves a running network.

``testbed up FILE --detach`` keeps a network; ``testbed provider serve --attach`` runs the
fabric manager beside it, as its own process, for every tenant of that network; ``testbed
launch --provider ADDRESS script.py`` runs a script's ranks in that network's hosts as one of
those tenants. :class:`ServedJob` is the tenant's side, for :func:`testbed.launch.launch`:

* **admission** with the job's hints (``POST /v1/jobs``): the provider's first plan, refused
  with its reason (409 hosts taken, 403 beyond a quota) before any rank starts;
* **switch registrations are the provider's**: an in-network plan runs on the registration
  the service made for it (``GET /v1/jobs/{job}``: job id, tree, ports), never on one the
  launcher makes, so the provider's memory accounting and the switches agree;
* **pushed plans**: a thread long-polls ``/plan/next``; each new plan goes to the running
  job at a collective boundary every rank agrees on (:class:`testbed.launch.JobPlans`);
* **the old plan's registration stays until every rank left it**: the lease is renewed with
  the plan version every rank runs (``renew?running=V``), and the service removes the
  registrations of older plans only then (a rank may be inside a collective of the old plan
  when the change comes);
* **hints without code**: a tenant that states no ``collective_bytes`` gets them derived
  from the job's first iterations (:class:`testbed.launch.HintsDeriver`) and sent to the
  service (``POST /v1/jobs/{job}/hints``), which re-plans on them;
* **the lease** is renewed every third of ``lease_s`` while the job runs; the job is
  released at the end (its registrations go with it). A launcher that dies stops renewing:
  its ranks end with it (they follow the launcher) and the lease runs out.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

from testbed.collectives.algorithms import is_offloaded

#: Seconds of one long poll for a plan change (the follower asks again at once after it).
FOLLOW_WAIT_S = 5.0
#: Seconds between two tries of what failed for now (a provider restarting, a registration
#: the service has not made yet).
RETRY_S = 0.5


class _Unregistered(ValueError):
    """An in-network plan the service has no registration for (yet)."""


class ServedJob:
    """Admit a job on ``workers`` (hosts of the attached network) with ``hints`` to the
    provider at ``address`` (None: the default socket) under the name ``name``; ``trace``:
    rank 0's trace file (to derive hints from when they state no ``collective_bytes``);
    ``job_id``: the id of plans that run on the hosts. ``ValueError`` when no provider
    answers or it refuses the job.

    A ``plans`` source for :func:`testbed.launch.run_script` (call it: the settings of a
    newly pushed plan, or None) with :meth:`registration` and :meth:`running`;
    :attr:`first` is the first plan's settings, :attr:`plan` the first plan, :attr:`errors`
    what went wrong on the way (a plan that could not be used, a renewal that failed)."""

    def __init__(self, address: str | None, name: str, workers: list, hints: dict | None,
                 trace: Path, time_dilation: float = 1.0, job_id: int = 1):
        from testbed.launch import HintsDeriver
        from testbed.provider.client import ProviderClient, ProviderRefused, ProviderUnreachable
        from testbed.provider.schema import Hints, JobRequest

        self.name = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:64] or "launch"  # the schema's
        self.job_id = job_id
        self.time_dilation = float(time_dilation)
        self.errors: list[str] = []
        self._waiting: tuple | None = None  # (version, plan, since): a plan not registered yet
        self._next_try = 0.0
        self._given: dict[int, tuple[object, int, dict | None]] = {}  # id(settings) -> ...
        self._pending: tuple[int, object] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.deriver = None if (hints or {}).get("collective_bytes") else \
            HintsDeriver(trace, time_dilation)
        self.client = ProviderClient(address)
        self.address = self.client.address
        req = JobRequest(job=self.name, hosts=[h.name for h in workers],
                         hints=Hints(**(hints or {})))
        try:
            self.client.admit(req)
            first = self.client.next_plan(self.name, after=0, wait_s=0.1)
        except ProviderUnreachable as e:
            self.client.close()
            raise ValueError(f"--provider: {e}; start one beside 'testbed up' with 'testbed "
                             "provider serve --attach'") from None
        except ProviderRefused as e:
            self.client.close()
            raise ValueError(f"--provider: the provider refused job {self.name!r}: "
                             f"{e.detail}") from None
        self.admitted = True
        try:
            self.version = self.running_version = first["version"]
            self.plan = first["plan"]
            self.first = self._settings(first["plan"], self.version, fallback=True)
            # from now on the service keeps an old plan's registration until the ranks left it
            self.client.renew(self.name, running=self.version)
            self.lease_s = float(self.client.job(self.name)["lease_s"])
        except BaseException:
            self.close()
            raise
        self._follower = ProviderClient(self.address, timeout=FOLLOW_WAIT_S + 10.0)
        for target in (self._follow, self._renew):
            t = threading.Thread(target=target, daemon=True, name=f"served-{target.__name__}")
            t.start()
            self._threads.append(t)

    # -- the plans source ---------------------------------------------------------------------
    def _settings(self, plan, version: int, fallback: bool = False):
        """The backend settings of ``plan`` (its ``version``), on the registration the
        service made for it; ``ValueError`` when it cannot run. ``fallback``: a first plan
        whose registration the switches refused runs the ring on the hosts instead."""
        from testbed.collectives.spec import communication_of
        from testbed.launch import backend_settings, plan_placement

        if plan.trim_head_bits is not None:
            raise ValueError(f"the provider planned trimming ({plan.reason}); a launched "
                             "script's allreduce does not trim")
        reg = None
        if is_offloaded(plan.algo):
            info = self.client.job(self.name)
            reg = info.get("registration")
            if reg is None or reg.get("version") != version:
                if reg is not None and reg.get("version", 0) > version and not fallback:
                    return None  # a newer plan replaced it: the follower brings that one
                why = info.get("registration_error") or "none was made"
                if not fallback:
                    raise _Unregistered(f"plan version {version} ({plan.algo}) has no switch "
                                        f"registration at the provider: {why}")
                self.errors.append(f"plan version {version} ({plan.algo}) has no switch "
                                   f"registration at the provider ({why}): the job runs the "
                                   "ring on its hosts while it waits for one")
                self._waiting = (version, plan, time.monotonic())
                plan, reg = None, None
        if plan is None:
            tj = backend_settings("ring", None, None, False, self.job_id)
        else:
            tj = backend_settings(**communication_of(plan), job_id=reg["job_id"] if reg
                                  else self.job_id, placement=plan_placement(plan))
        self._given[id(tj)] = (tj, version, reg)
        return tj

    def __call__(self):
        """The settings of the newest plan the provider pushed since the last call, or None
        (what the launcher polls while the job runs)."""
        if self.deriver is not None:
            hints = self.deriver.poll()
            if hints is not None:
                try:
                    self.client.measured(self.name, self.deriver.reason(hints), **hints)
                except Exception as e:  # noqa: BLE001 - the job goes on, on its plan
                    self.errors.append(f"the derived hints did not reach the provider: {e}")
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._waiting = (*pending, time.monotonic())
        if self._waiting is None or time.monotonic() < self._next_try:
            return None
        from testbed.workloads.runner import ADMISSION_WAIT_S

        version, plan, since = self._waiting
        try:
            tj = self._settings(plan, version)
        except _Unregistered:
            # the service registers it again at its next change (memory freed): asked again
            # a while, as a launcher asks a switch that refused a plan (JobPlans)
            if time.monotonic() - since < ADMISSION_WAIT_S * self.time_dilation:
                self._next_try = time.monotonic() + RETRY_S
                return None
            self._waiting = None
            raise
        self._waiting = None
        return tj

    def registration(self, tj) -> dict | None:
        """The service's switch registration of the plan ``tj`` (settings this object gave),
        None for a plan that runs on the hosts."""
        return self._given.get(id(tj), (None, 0, None))[2]

    def running(self, tj) -> None:
        """Every rank runs the plan ``tj``: the service may drop the older plans'
        registrations."""
        self.running_version = self._given[id(tj)][1]
        try:
            self.client.renew(self.name, running=self.running_version)
        except Exception as e:  # noqa: BLE001 - the renewal thread says it again
            self.errors.append(f"telling the provider plan {self.running_version} runs: {e}")

    # -- background ---------------------------------------------------------------------------
    def _note(self, text: str) -> None:
        if not self.errors or self.errors[-1] != text:  # a failure that repeats, once
            self.errors.append(text)

    def _follow(self) -> None:
        from testbed.provider.client import ProviderUnreachable

        while not self._stop.is_set():
            try:
                out = self._follower.next_plan(self.name, after=self.version,
                                               wait_s=FOLLOW_WAIT_S)
            except ProviderUnreachable as e:  # a provider restarting: asked again
                if not self._stop.wait(RETRY_S):
                    self._note(f"the provider did not answer for a while: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - kept for the launch's record
                if not self._stop.is_set():
                    self._note(f"following the provider's plans stopped: {e}")
                return
            if out["changed"]:
                with self._lock:
                    self.version = out["version"]
                    self._pending = (out["version"], out["plan"])

    def _renew(self) -> None:
        from testbed.provider.client import ProviderClient

        with ProviderClient(self.address) as pc:
            while not self._stop.wait(max(self.lease_s / 3, 0.1)):
                try:
                    pc.renew(self.name, running=self.running_version)
                except Exception as e:  # noqa: BLE001 - kept for the launch's record
                    self._note(f"renewing the lease failed: {e}")

    # -- the end ------------------------------------------------------------------------------
    def hints(self) -> dict:
        """The hints the provider plans the job with now."""
        return self.client.job(self.name)["hints"]

    def log(self) -> list[dict]:
        """The provider's plan changes of this job."""
        return [c for c in self.client.log() if c.get("job") == self.name]

    def close(self) -> None:
        """Stop following and renewing; release the job (its registrations go)."""
        self._stop.set()
        if self._threads:
            self._follower.close()  # ends the long poll in flight
        for t in self._threads:
            t.join(FOLLOW_WAIT_S + 1)
        if getattr(self, "admitted", False):
            self.admitted = False
            with contextlib.suppress(Exception):
                self.client.release(self.name)
        self.client.close()

    def __enter__(self) -> ServedJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
