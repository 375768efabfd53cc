"""Typed client of the fabric manager service (``testbed.provider.service``).

Tenant code inside an emulated host talks to the provider through the service's Unix socket
(default ``/run/testbed/provider.sock``, visible from every host)::

    from testbed.provider.client import ProviderClient
    from testbed.provider.schema import Hints, JobRequest

    with ProviderClient() as pc:
        plan = pc.admit(JobRequest(job="resnet", hosts=["tbh1", "tbh2"],
                                   hints=Hints(collective_bytes=4 << 20, tolerance="lossy_ef")))
        ...                       # each iteration boundary:
        plan = pc.plan("resnet")  # a changed plan applies from the next iteration
        pc.renew("resnet")        # within lease_s, or the provider reclaims the job
        pc.release("resnet")

Answers come back as the schema's models; a refusal raises :class:`ProviderRefused` with the
service's HTTP status and its explanation. This module imports only the schema and httpx, so
that it loads quickly in a tenant's process.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import httpx

from testbed.provider.schema import FabricSnapshot, JobRequest, MeasuredHints, Plan

#: The service's default address (see ``testbed.provider.service.DEFAULT_SOCKET``).
DEFAULT_ADDRESS = "unix:" + os.path.join(os.environ.get("TESTBED_RUN_DIR", "/run/testbed"),
                                         "provider.sock")


class ProviderRefused(RuntimeError):
    """The service answered with an error: ``status`` (HTTP code) and ``detail`` (why)."""

    def __init__(self, status: int, detail: str, body: Any = None):
        super().__init__(f"provider refused ({status}): {detail}")
        self.status = status
        self.detail = detail
        self.body = body


class ProviderUnreachable(RuntimeError):
    """No service answers at the address (the message says where it looked)."""


class ProviderClient:
    """Client of the service at ``address``: ``unix:PATH`` (default
    :data:`DEFAULT_ADDRESS`, or ``$TESTBED_PROVIDER``) or ``http://HOST:PORT``."""

    def __init__(self, address: str | None = None, timeout: float = 10.0):
        address = address or os.environ.get("TESTBED_PROVIDER") or DEFAULT_ADDRESS
        if address.startswith("unix:"):
            self.address = address
            transport = httpx.HTTPTransport(uds=address[len("unix:"):])
            base = "http://provider"
        elif address.startswith(("http://", "https://")):
            self.address, transport, base = address, None, address.rstrip("/")
        else:
            raise ValueError(f"provider address {address!r}: use 'unix:/path/to/socket' or "
                             "'http://host:port'")
        self._http = httpx.Client(base_url=base, transport=transport, timeout=timeout)

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, method: str, path: str, **kw) -> Any:
        """One request; the answer's JSON, or :class:`ProviderRefused`."""
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ProviderUnreachable(f"no provider service answers at {self.address} "
                                      f"({type(e).__name__}: {e}); is 'testbed provider serve' "
                                      "running?") from None
        if r.status_code >= 400:
            try:
                body = r.json()
                detail = body.get("detail", body) if isinstance(body, dict) else body
            except ValueError:
                body, detail = r.text, r.text
            raise ProviderRefused(r.status_code, str(detail), body)
        return r.json()

    # -- the API -----------------------------------------------------------------------------
    def health(self) -> dict:
        """Policy, job count, whether telemetry and switch configuration run."""
        return self._call("GET", "/v1/health")

    def inventory(self) -> FabricSnapshot:
        """The fabric: hosts, switches and their aggregator memory, links and rates."""
        return FabricSnapshot.model_validate(self._call("GET", "/v1/inventory"))

    def telemetry(self) -> FabricSnapshot:
        """The latest telemetry snapshot (use :meth:`telemetry_raw` for per-engine figures)."""
        return FabricSnapshot.model_validate(self.telemetry_raw()["snapshot"])

    def telemetry_raw(self) -> dict:
        """Snapshot, per-engine figures, collection period and errors, as JSON."""
        return self._call("GET", "/v1/telemetry")

    def memory(self) -> dict:
        """Per switch: configured, allocated per job, free bytes."""
        return self._call("GET", "/v1/memory")

    def tenants(self) -> dict[str, dict]:
        """Per tenant: its jobs, switch memory and trees per switch, and its quota."""
        return self._call("GET", "/v1/tenants")

    def jobs(self) -> dict[str, dict]:
        """Admitted jobs: hosts, hints, lease, current plan (as JSON)."""
        return self._call("GET", "/v1/jobs")

    def job(self, job: str) -> dict:
        """One job: lease, plan and its switch registration."""
        return self._call("GET", f"/v1/jobs/{job}")

    def admit(self, req: JobRequest) -> Plan:
        """Ask for admission; the job's first plan."""
        if not isinstance(req, JobRequest):
            raise TypeError(f"admit takes a JobRequest, got {type(req).__name__}")
        return Plan.model_validate(self._call("POST", "/v1/jobs", content=req.model_dump_json(),
                                              headers={"content-type": "application/json"}))

    def plan(self, job: str) -> Plan:
        """The job's current plan (poll it at iteration boundaries)."""
        return Plan.model_validate(self._call("GET", f"/v1/jobs/{job}/plan"))

    def renew(self, job: str, iteration: int | None = None, running: int | None = None
              ) -> float:
        """Extend the lease; seconds until it expires again. ``iteration``: the last one the
        job finished (plan changes are then scheduled from a later iteration). ``running``:
        the plan version every worker of the job runs now (the switches then let go of the
        registrations of older plans, which the service keeps for a job that reports it)."""
        params = {k: v for k, v in (("iteration", iteration), ("running", running))
                  if v is not None}
        return float(self._call("POST", f"/v1/jobs/{job}/renew", params=params)["expires_in_s"])

    def measured(self, job: str, reason: str | None = None, **figures) -> dict:
        """Tell the provider what was measured of the running job (``figures``:
        :class:`~testbed.provider.schema.MeasuredHints` fields such as ``collective_bytes``,
        ``iteration_s``); it re-plans on them. ``{"hints", "replanned", "version"}``."""
        body = MeasuredHints(**figures, **({"reason": reason} if reason else {}))
        return self._call("POST", f"/v1/jobs/{job}/hints", content=body.model_dump_json(),
                          headers={"content-type": "application/json"})

    def next_plan(self, job: str, after: int = 0, wait_s: float = 30.0) -> dict:
        """Wait (long poll, at most ``wait_s``) until the job's plan version exceeds ``after``:
        ``{"version", "changed", "plan": Plan, "applies_at": iteration or None}``."""
        out = self._call("GET", f"/v1/jobs/{job}/plan/next",
                         params={"after": after, "wait_s": wait_s}, timeout=wait_s + 10.0)
        return {**out, "plan": Plan.model_validate(out["plan"])}

    def release(self, job: str) -> None:
        """Give the job's resources back."""
        self._call("DELETE", f"/v1/jobs/{job}")

    def log(self, since: int = 0) -> list[dict]:
        """Plan changes from entry ``since`` on."""
        return self._call("GET", "/v1/log", params={"since": since})

    def dry_run(self, policy: str) -> dict[str, Plan]:
        """The plans ``policy`` would give the admitted jobs now (nothing changes)."""
        out = self._call("GET", "/v1/plan", params={"policy": policy})
        return {k: Plan.model_validate(v) for k, v in out["plans"].items()}

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> ProviderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PlanFollower:
    """The plans the provider pushes to one job, for a tenant's training loop.

    A background thread waits on the service (:meth:`ProviderClient.next_plan`, a long poll)
    and keeps every change with the iteration it applies from, so the loop never asks::

        plan = pc.admit(req)
        with PlanFollower(pc.address, req.job, plan) as follow:
            for it in range(iterations):
                plan = follow.plan_for(it)  # the plan in force at iteration it
                ...                         # the iteration under that plan
                follow.done(it)             # renews the lease, reports progress

    Every rank of a job may run its own follower: the service schedules a change
    :data:`~testbed.provider.manager.APPLY_AFTER_ITERATIONS` after the last iteration reported
    (by rank 0's :meth:`done`), so all ranks switch at the same boundary. A change the service
    sends without an iteration (nothing reported yet) applies at the next :meth:`plan_for`.
    :attr:`applied` lists ``(iteration, version)`` of each switch; :attr:`error` the
    follower's failure (a job the provider dropped: its lease ran out), if any.
    """

    def __init__(self, address: str | None, job: str, plan: Plan, version: int = 1,
                 report: bool = True, wait_s: float = 30.0):
        self.job, self.report, self.wait_s = job, report, wait_s
        self._client = ProviderClient(address, timeout=wait_s + 10.0)
        self._reporter = ProviderClient(address)
        self._pending: list[tuple[int | None, int, Plan]] = []
        self._current = (version, plan)
        self.applied: list[tuple[int, int]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._follow, args=(version,), daemon=True,
                                        name=f"plan-follower-{job}")
        self._thread.start()

    def _follow(self, version: int) -> None:
        while not self._stop.is_set():
            try:
                out = self._client.next_plan(self.job, after=version, wait_s=self.wait_s)
            except Exception as e:  # noqa: BLE001 - kept for the loop to see; close() ends here
                if not self._stop.is_set():
                    self.error = str(e)
                return
            if out["changed"]:
                version = out["version"]
                with self._lock:
                    self._pending.append((out["applies_at"], version, out["plan"]))

    def plan_for(self, iteration: int) -> Plan:
        """The plan in force at ``iteration`` (call with increasing iterations)."""
        with self._lock:
            due = [p for p in self._pending if p[0] is None or p[0] <= iteration]
            if due:
                self._pending = [p for p in self._pending if p not in due]
                _at, version, plan = due[-1]
                self._current = (version, plan)
                self.applied.append((iteration, version))
            return self._current[1]

    @property
    def version(self) -> int:
        """The version of the plan in force."""
        return self._current[0]

    def done(self, iteration: int) -> None:
        """``iteration`` is finished: renew the lease, reporting it (with ``report``)."""
        self._reporter.renew(self.job, iteration if self.report else None)

    def close(self) -> None:
        """Stop following (the long poll in flight is dropped)."""
        self._stop.set()
        self._client.close()  # ends the wait in flight (else it ends within wait_s)
        self._thread.join(timeout=1)
        self._reporter.close()

    def __enter__(self) -> PlanFollower:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
