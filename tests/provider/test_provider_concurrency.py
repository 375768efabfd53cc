"""The provider API under concurrency (issue 35, item 4): many tenants at once admitting,
renewing, asking for plans (long polls too), releasing and sending malformed requests. No
request is answered 5xx or dropped, every refusal says why, and afterwards the state adds up:
the jobs listed are exactly those admitted and not released, no host belongs to two jobs,
switch memory is held by listed jobs only, and it is all free once they are gone."""

from __future__ import annotations

import random
import threading

import httpx

from testbed.provider.client import ProviderClient
from testbed.provider.service import Server, make_service
from testbed.topologies import Star

HOSTS = [f"tbh{i}" for i in range(1, 9)]
TENANTS = 12
STEPS = 60


def _tenant(k: int, url_sock: str, seen: dict, lock: threading.Lock) -> None:
    """One tenant's seeded random walk over the API; records what it saw."""
    rng = random.Random(1000 + k)
    mine: set[str] = set()
    transport = httpx.HTTPTransport(uds=url_sock)
    with httpx.Client(base_url="http://provider", transport=transport, timeout=30) as http:
        for step in range(STEPS):
            op = rng.choice(["admit", "admit", "renew", "plan", "next", "release", "bad",
                             "list"])
            job = f"t{k}-{rng.randrange(4)}"
            if op == "admit":
                hosts = rng.sample(HOSTS, rng.choice([2, 2, 3]))
                body = {"job": job, "hosts": hosts, "lease_s": 600,
                        "hints": {"collective_bytes": rng.choice([1 << 16, 1 << 20, 1 << 24]),
                                  "priority": rng.randrange(8)}}
                r = http.post("/v1/jobs", json=body)
            elif op == "renew":
                r = http.post(f"/v1/jobs/{job}/renew", params={"iteration": step})
            elif op == "plan":
                r = http.get(f"/v1/jobs/{job}/plan")
            elif op == "next":
                r = http.get(f"/v1/jobs/{job}/plan/next", params={"after": 0, "wait_s": 0.2})
            elif op == "release":
                r = http.delete(f"/v1/jobs/{job}")
            elif op == "list":
                r = http.get("/v1/jobs")
            else:
                r = http.post("/v1/jobs", content=bytes(rng.randrange(256) for _ in range(20)),
                              headers={"content-type": "application/json"})
            with lock:
                seen.setdefault(r.status_code, []).append((op, job, r.text[:200]))
            if r.status_code >= 400:
                assert r.json().get("detail"), (op, job, r.text)
            elif op == "admit":
                mine.add(job)
            elif op == "release":
                mine.discard(job)
    with lock:
        seen.setdefault("held", set()).update(mine)


def test_many_tenants_at_once_leave_a_state_that_adds_up(tmp_path):
    topo = Star(len(HOSTS), bw_mbps=100, switch="programmable", aggregator="tbs1")
    svc = make_service(topo, 1 << 20, policy="provider_only", reap_period_s=0.05)
    seen: dict = {}
    lock = threading.Lock()
    with Server(svc, socket_path=str(tmp_path / "provider.sock")) as srv:
        errors: list[BaseException] = []

        def guarded(k: int) -> None:
            try:
                _tenant(k, srv.socket_path, seen, lock)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        runners = [threading.Thread(target=guarded, args=(k,)) for k in range(TENANTS)]
        for t in runners:
            t.start()
        for t in runners:
            t.join(300)
        assert not errors, errors[:3]
        codes = {c for c in seen if isinstance(c, int)}
        assert codes and all(c < 500 for c in codes), {c: seen[c][:3] for c in codes
                                                       if c >= 500}
        assert {200, 201} <= codes and 409 in codes and 404 in codes  # it was contended
        with ProviderClient(srv.url) as pc:
            jobs = pc.jobs()
            assert set(jobs) == seen["held"]  # admitted and not released, no more, no less
            owners = [h for j in jobs.values() for h in j["hosts"]]
            assert len(owners) == len(set(owners)), jobs  # no host in two jobs
            allocated = pc.memory()["tbs1"]["allocated"]
            assert set(allocated) <= set(jobs)
            assert pc.memory()["tbs1"]["free"] == (1 << 20) - sum(allocated.values())
            for job in jobs:
                pc.release(job)
            assert pc.jobs() == {} and pc.memory()["tbs1"]["allocated"] == {}
            assert pc.memory()["tbs1"]["free"] == 1 << 20
        assert svc.last_error is None
