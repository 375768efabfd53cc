"""The fabric manager service over real HTTP (uvicorn on a Unix socket, httpx clients).

The contract: every endpoint answers the schema's models; a refusal is a 4xx whose JSON body
names the problem and leaves the state exactly as it was (1 000 malformed requests prove it);
a job whose lease runs out is reclaimed, its memory free again. With a running network:
tenant code inside an emulated host reaches the service and cannot reach a switch's control
channel, and the service (not the tenant) registers and removes the job on the switch.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import httpx
import pytest

from testbed.provider.client import ProviderClient, ProviderRefused, ProviderUnreachable
from testbed.provider.policies import plan_memory
from testbed.provider.schema import FabricSnapshot, Hints, JobRequest, Plan
from testbed.provider.service import Server, Telemetry, make_service
from testbed.topologies import Star

MEMORY = 1 << 20  # aggregator bytes per programmable switch: room for several INA jobs


def _topo(n: int = 6) -> Star:
    return Star(n, bw_mbps=100, switch="programmable", aggregator="tbs1")


@pytest.fixture
def served(tmp_path):
    """A provider_only service (INA first come, first served) on a star of 6, served."""
    svc = make_service(_topo(), MEMORY, policy="provider_only", reap_period_s=0.05)
    with Server(svc, socket_path=str(tmp_path / "provider.sock")) as srv:
        with ProviderClient(srv.url) as pc:
            yield svc, srv, pc


def _state(pc: ProviderClient) -> str:
    """Everything a request could change, as one comparable string."""
    jobs = pc.jobs()
    for j in jobs.values():  # time passes; the lease itself must not change
        j.pop("expires_in_s")
    return json.dumps([jobs, pc.memory(), pc.log()], sort_keys=True)


def _req(job: str, hosts: list[str], **hints) -> JobRequest:
    return JobRequest(job=job, hosts=hosts, hints=Hints(**hints), lease_s=600)


def test_api_contract(served):
    """Admit, plan, list, renew, dry-run, log and release answer the schema's models and
    refusals say what is wrong."""
    _svc, _srv, pc = served
    assert pc.health()["policy"] == "provider_only"
    inv = pc.inventory()
    assert isinstance(inv, FabricSnapshot) and inv.hosts == [f"tbh{i}" for i in range(1, 7)]
    assert {s.name: s.memory_bytes for s in inv.switches} == {"tbs1": MEMORY}

    plan = pc.admit(_req("a", ["tbh1", "tbh2"], collective_bytes=1 << 20))
    assert isinstance(plan, Plan) and plan.job == "a" and plan.algo == "ina"
    assert plan.tree == ["tbs1"] and plan.slots > 0
    assert pc.plan("a") == plan
    mem = pc.memory()["tbs1"]
    assert mem["allocated"]["a"] > 0 and mem["free"] == MEMORY - mem["allocated"]["a"]
    job = pc.job("a")
    assert job["hosts"] == ["tbh1", "tbh2"] and Plan.model_validate(job["plan"]) == plan
    assert 0 < pc.renew("a") <= 600

    b = pc.admit(_req("b", ["tbh3", "tbh4"]))  # no hints at all still runs
    assert set(pc.jobs()) == {"a", "b"} and b.job == "b"
    dry = pc.dry_run("tenant_only")
    assert {k: p.algo for k, p in dry.items()} == {"a": "ring", "b": "ring"}
    assert pc.plan("a") == plan  # a dry run changes nothing

    with pytest.raises(ProviderRefused) as e:
        pc.admit(_req("a", ["tbh5", "tbh6"]))
    assert e.value.status == 409 and "already admitted" in e.value.detail
    with pytest.raises(ProviderRefused) as e:
        pc.admit(_req("c", ["tbh1", "tbh5"]))
    assert e.value.status == 409 and "tbh1" in e.value.detail
    with pytest.raises(ProviderRefused) as e:
        pc.admit(_req("c", ["tbh5", "tbh99"]))
    assert e.value.status == 422 and "tbh99" in e.value.detail
    with pytest.raises(ProviderRefused) as e:
        pc.plan("nope")
    assert e.value.status == 404 and "nope" in e.value.detail
    with pytest.raises(ProviderRefused) as e:
        pc.dry_run("magic")
    assert e.value.status == 400 and "cooperative" in e.value.detail

    pc.release("a")
    assert set(pc.jobs()) == {"b"} and "a" not in pc.memory()["tbs1"]["allocated"]
    reasons = [(c["job"], c["reason"].split(":")[0]) for c in pc.log()]
    assert ("a", "admitted") in reasons and ("a", "released") in reasons
    assert [c["job"] for c in pc.log(since=len(reasons) - 1)] == [pc.log()[-1]["job"]]
    with pytest.raises(ProviderRefused) as e:
        pc.release("a")
    assert e.value.status == 404


#: Per field of a JobRequest, values its schema refuses.
BAD_VALUES = [("job", [None, 3.5, -1, True, [], {}, "a" * 100, "x y", ""]),
              ("hosts", [None, 3.5, "tbh1", [], {}, [1, 2], ["tbh5"], [None, "tbh6"]]),
              ("hints", [None, 3.5, "x", [], True, [1]]),
              ("lease_s", [None, -1, 0, "x", [], {}, 5000])]


def _malformed(rng: random.Random, jobs: list[str]) -> tuple[str, str, dict]:
    """One bad request: (method, path, httpx keyword arguments)."""
    good = {"job": "z", "hosts": ["tbh5", "tbh6"], "hints": {"collective_bytes": 1024}}
    kind = rng.randrange(10)
    if kind == 0:  # not JSON at all
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        return "POST", "/v1/jobs", {"content": raw, "headers": {"content-type":
                                                               "application/json"}}
    if kind == 1:  # truncated JSON
        text = json.dumps(good)
        return "POST", "/v1/jobs", {"content": text[:rng.randrange(1, len(text))],
                                    "headers": {"content-type": "application/json"}}
    if kind == 2:  # a wrong type in one field
        body = json.loads(json.dumps(good))
        field, values = rng.choice(BAD_VALUES)
        body[field] = rng.choice(values)
        return "POST", "/v1/jobs", {"json": body}
    if kind == 3:  # bad hints
        bad = rng.choice([{"collective_bytes": -5}, {"tolerance": "approx"},
                          {"error_budget": 2.0}, {"priority": 99}, {"version": 2},
                          {"surprise": 1}, {"iterations": 0}, {"compute_s": -1.0}])
        return "POST", "/v1/jobs", {"json": {**good, "hints": bad}}
    if kind == 4:  # semantically wrong: hosts taken, unknown, repeated; name taken
        body = rng.choice([{**good, "hosts": ["tbh1", "tbh5"]},
                           {**good, "hosts": ["tbh5", "tbh77"]},
                           {**good, "hosts": ["tbh5", "tbh5"]},
                           {**good, "job": rng.choice(jobs)},
                           {**good, "job": "bad name!"},
                           {**good, "extra": 1}])
        return "POST", "/v1/jobs", {"json": body}
    name = "".join(rng.choice("abcdefgh_-.0123") for _ in range(rng.randrange(1, 12)))
    name = name if name not in jobs else name + "x"
    if kind == 5:
        return "GET", f"/v1/jobs/{name}/plan", {}
    if kind == 6:
        return "POST", f"/v1/jobs/{name}/renew", {}
    if kind == 7:
        return "DELETE", f"/v1/jobs/{name}", {}
    if kind == 8:
        return rng.choice([("GET", "/v1/plan", {"params": {"policy": name}}),
                           ("GET", "/v1/plan", {}),
                           ("GET", "/v1/log", {"params": {"since": rng.choice(["-1", "x"])}})])
    return rng.choice([("PUT", "/v1/jobs", {"json": good}), ("GET", "/v1/nothing", {}),
                       ("POST", "/v1/jobs", {}),
                       ("POST", "/v1/jobs", {"content": b"[]",
                                             "headers": {"content-type": "application/json"}}),
                       ("GET", "/v1/jobs/" + "x" * 80, {})])


def test_thousand_malformed_requests_4xx_and_nothing_changes(served):
    """1 000 seeded malformed requests (bad JSON, wrong types, bad hints, taken or unknown
    hosts and names, unknown jobs and routes): each answered 4xx with a JSON body naming the
    problem; the jobs, memory and plan log are exactly as before."""
    _svc, srv, pc = served
    pc.admit(_req("a", ["tbh1", "tbh2"], collective_bytes=1 << 20))
    pc.admit(_req("b", ["tbh3", "tbh4"]))
    before = _state(pc)
    rng = random.Random(13)
    statuses: dict[int, int] = {}
    transport = httpx.HTTPTransport(uds=srv.socket_path)
    with httpx.Client(base_url="http://provider", transport=transport, timeout=10) as http:
        for _ in range(1000):
            method, path, kw = _malformed(rng, ["a", "b"])
            r = http.request(method, path, **kw)
            assert 400 <= r.status_code < 500, (method, path, kw, r.status_code, r.text)
            body = r.json()
            assert body.get("detail"), (method, path, kw, body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert _state(pc) == before
    assert {404, 405, 409, 422} <= set(statuses)


def test_lease_expiry_returns_memory(served):
    """A tenant that stops renewing loses its job within its lease: memory back, others
    re-planned; a renewing tenant keeps its job."""
    svc, _srv, pc = served
    pc.admit(JobRequest(job="gone", hosts=["tbh1", "tbh2"], lease_s=1.0,
                        hints=Hints(collective_bytes=1 << 20)))
    pc.admit(JobRequest(job="kept", hosts=["tbh3", "tbh4"], lease_s=1.0,
                        hints=Hints(collective_bytes=1 << 20)))
    assert set(pc.memory()["tbs1"]["allocated"]) == {"gone", "kept"}
    deadline = time.monotonic() + 30
    while "gone" in pc.jobs():
        assert time.monotonic() < deadline, "the lease reaper did not expire the job"
        pc.renew("kept")
        time.sleep(0.1)
    assert "kept" in pc.jobs()
    assert set(pc.memory()["tbs1"]["allocated"]) == {"kept"}
    change = [c for c in pc.log() if c["job"] == "gone"][-1]
    assert change["reason"] == "lease expired" and change["new"] is None
    # expired when due: not before the lease ran out after the last admission
    assert change["time_s"] >= pc.log()[0]["time_s"] + 1.0
    assert svc.last_error is None


def test_client_errors_name_the_address(tmp_path):
    """No service: the client says where it looked; a bad address is refused up front."""
    with ProviderClient(f"unix:{tmp_path}/none.sock") as pc, \
            pytest.raises(ProviderUnreachable, match="none.sock"):
        pc.health()
    with pytest.raises(ValueError, match="unix:"):
        ProviderClient("tcp://localhost:1")
    with pytest.raises(ValueError, match="cooperative"):
        make_service(_topo(), MEMORY, policy="magic")


TENANT = """
import json, sys
from testbed.datapath.control import ControlError, DatapathClient
from testbed.provider.client import ProviderClient
from testbed.provider.schema import Hints, JobRequest
out = {}
try:
    DatapathClient("tbs1").configure("aggregate", remove_jobs=[1000])
    out["switch"] = "reached"
except ControlError as e:
    out["switch"] = str(e)
with ProviderClient(sys.argv[1]) as pc:
    plan = pc.admit(JobRequest(job="t1", hosts=["tbh1", "tbh2"], lease_s=float(sys.argv[2]),
                               hints=Hints(collective_bytes=1 << 20)))
    out["plan"] = plan.model_dump()
    out["job"] = pc.job("t1")
print(json.dumps(out))
"""


@pytest.mark.mininet
def test_tenant_in_host_reaches_provider_not_switch(tmp_path):
    """From inside an emulated host, tenant code is admitted through the service's socket and
    is refused by the switch's control channel with an error that says why; the service (in
    the root namespace) registered the job on the switch, and after the tenant vanishes the
    switch's memory is back within the lease."""
    from testbed.topologies.net import TestbedNet

    lease = 5.0
    with TestbedNet(_topo(2)) as net:
        h1, s1 = net.hosts[0], net.mininet.get("tbs1")
        svc = make_service(net, MEMORY, policy="provider_only", net=net,
                           telemetry_period_s=0.2, reap_period_s=0.1)
        with Server(svc, socket_path=str(tmp_path / "provider.sock")) as srv:
            r = subprocess.run(["mnexec", "-a", str(h1.pid), sys.executable, "-c", TENANT,
                                srv.url, str(lease)], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert "not reachable from this network namespace" in out["switch"], out
            assert "provider" in out["switch"]
            assert out["plan"]["algo"] == "ina" and out["plan"]["tree"] == ["tbs1"]
            reg = out["job"]["registration"]
            assert reg is not None, out["job"].get("registration_error")
            jobs = s1.client().counters()["stages"]["aggregate"]["jobs"]
            assert jobs[str(reg["job_id"])]["memory_bytes"] > 0
            # telemetry reads the engine: the switch's allocation shows up in a snapshot
            deadline = time.monotonic() + 30
            while True:
                snap = svc.telemetry.collect()
                alloc = {s.name: s.allocated_bytes for s in snap.switches}["tbs1"]
                if alloc.get(str(reg["job_id"])):
                    break
                assert time.monotonic() < deadline, snap
            # link telemetry: traffic h1 -> h2 between two collections shows on both hops
            tel = Telemetry(net.topo.describe(), {"tbs1": MEMORY})
            tel.collect()
            h1.cmd("ping -q -c 40 -i 0.01 -s 1400", net.hosts[1].IP())
            links = {(lk.src, lk.dst): lk for lk in tel.collect().links}
            tel.close()
            assert links[("tbh1", "tbs1")].utilisation > 0
            assert links[("tbs1", "tbh2")].utilisation > 0
            assert set(links) == {("tbh1", "tbs1"), ("tbs1", "tbh1"), ("tbh2", "tbs1"),
                                  ("tbs1", "tbh2")}
            # the tenant is gone (it never renews): the job leaves the switch within its lease
            t0 = time.monotonic()
            while str(reg["job_id"]) in s1.client().counters()["stages"]["aggregate"]["jobs"]:
                assert time.monotonic() - t0 < lease + 10, "the job outlived its lease"
                time.sleep(0.1)
            mem = s1.client().counters()["stages"]["aggregate"]["memory"]
            assert mem["allocated_bytes"] == 0
            with ProviderClient(srv.url) as pc:
                assert pc.jobs() == {} and pc.memory()["tbs1"]["allocated"] == {}



def test_cli_serve_and_ask(tmp_path):
    """``testbed provider serve FILE --no-network`` serves the file's topology until SIGTERM
    (exit 0, socket gone); ``status``, ``jobs`` and ``plan`` answer from it, in JSON and as
    tables, and name the address when nothing serves."""
    import os
    import signal

    from typer.testing import CliRunner

    from testbed.cli import app

    exp = tmp_path / "fabric.toml"
    exp.write_text('name = "fabric"\n[topology]\nkind = "star"\nn_hosts = 4\nbw_mbps = 100\n'
                   'switch = "programmable"\naggregator = "tbs1"\n'
                   '[[jobs]]\nname = "x"\nalgo = "ring"\nnbytes = "1MiB"\n')
    sock = tmp_path / "p.sock"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "provider", "serve", str(exp),
                             "--no-network", "--socket", str(sock), "--policy", "provider_only",
                             "--memory-bytes", str(MEMORY)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        addr = ["--address", f"unix:{sock}"]
        cli = CliRunner()
        deadline = time.monotonic() + 60
        while cli.invoke(app, ["provider", "status", *addr]).exit_code != 0:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.2)
        with ProviderClient(f"unix:{sock}") as pc:
            pc.admit(_req("j1", ["tbh1", "tbh2"], collective_bytes=1 << 20))
        r = cli.invoke(app, ["provider", "jobs", "--json", *addr])
        assert r.exit_code == 0 and json.loads(r.stdout)["j1"]["plan"]["algo"] == "ina"
        r = cli.invoke(app, ["provider", "plan", "j1", *addr])
        assert r.exit_code == 0 and "first come" in r.stdout
        r = cli.invoke(app, ["provider", "plan", "--policy", "tenant_only", "--json", *addr])
        assert json.loads(r.stdout)["plans"]["j1"]["algo"] == "ring"
        r = cli.invoke(app, ["provider", "status", *addr])
        assert r.exit_code == 0 and "provider_only" in r.stdout and "tbs1" in r.stdout
        r = cli.invoke(app, ["provider", "plan", "nope", *addr])
        assert r.exit_code == 1 and "404" in r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not os.path.exists(sock)
    r = CliRunner().invoke(app, ["provider", "jobs", "--address", f"unix:{sock}"])
    assert r.exit_code == 1 and "p.sock" in r.stderr


def test_telemetry_reads_each_direction_at_the_right_port():
    """On a leaf-spine whose switches are all programmable, every direction of every link is
    measured at its source's egress port; with only the leaves programmable, the
    leaf -> spine direction at the leaf's egress and spine -> leaf at the leaf's ingress."""
    from testbed.provider.service import _port_map
    from testbed.topologies import make_topology

    kw = {"leaves": 2, "spines": 2, "hosts_per_leaf": 2, "bw_mbps": 100}
    desc = make_topology("leaf_spine", switch="programmable", **kw).describe()
    ports = _port_map(desc)
    assert len(ports) == 2 * len(desc["links"])
    for spec in desc["links"]:
        for src, dst, port in ((spec["a"], spec["b"], spec["port_a"]),
                               (spec["b"], spec["a"], spec["port_b"])):
            if src in desc["programmable"]:
                assert ports[(src, dst)][:2] == (src, f"{src}-eth{port}")
    leaves = [s for s, role in desc["switches"].items() if role == "leaf"]
    desc2 = make_topology("leaf_spine", switch=leaves, **kw).describe()
    assert sorted(desc2["programmable"]) == sorted(leaves)
    ports2 = _port_map(desc2)
    for spec in desc2["links"]:
        a, b = spec["a"], spec["b"]
        if {a, b} & set(leaves) and not {a, b} <= set(leaves):
            leaf = a if a in leaves else b
            port = spec["port_a"] if leaf == a else spec["port_b"]
            assert ports2[(a, b)][:2] == ports2[(b, a)][:2] == (leaf, f"{leaf}-eth{port}")


FOLLOWER = """
import json, sys, time
from testbed.provider.client import PlanFollower, ProviderClient
from testbed.provider.schema import Hints, JobRequest
out = {"plans": []}
with ProviderClient(sys.argv[1]) as pc:
    plan = pc.admit(JobRequest(job="t1", hosts=["tbh1", "tbh2"],
                               hints=Hints(collective_bytes=1 << 20)))
    with PlanFollower(sys.argv[1], "t1", plan) as follow:
        print("admitted", flush=True)
        for it in range(200):
            plan = follow.plan_for(it)
            out["plans"].append(plan.algo)
            time.sleep(0.05)  # the iteration
            follow.done(it)
            if plan.algo == "ina" and out["plans"].count("ina") >= 3:
                break
        out["applied"] = follow.applied
        out["registration"] = pc.job("t1")["registration"]
    pc.release("t1")
print(json.dumps(out))
"""


@pytest.mark.mininet
def test_tenant_in_host_follows_a_pushed_replan_mid_job(tmp_path):
    """A tenant's loop inside an emulated host gets a re-plan pushed (long poll) when another
    job leaves the switch's memory, and applies it at the iteration the service named: the
    one after next of the last it reported; the job is then registered on the switch."""
    from testbed.topologies.net import TestbedNet

    with TestbedNet(_topo(4)) as net:
        h1 = net.hosts[0]
        memory = plan_memory(Plan(job="x", algo="ina", tree=["tbs1"], slots=32), 2)["tbs1"]
        svc = make_service(net, memory, policy="provider_only", net=net)
        with Server(svc, socket_path=str(tmp_path / "provider.sock")) as srv, \
                ProviderClient(srv.url) as pc:
            assert pc.admit(_req("t0", ["tbh3", "tbh4"])).algo == "ina"  # holds the memory
            proc = subprocess.Popen(["mnexec", "-a", str(h1.pid), sys.executable, "-c",
                                     FOLLOWER, srv.url], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            try:
                assert proc.stdout.readline().strip() == "admitted", proc.stderr.read()
                assert pc.plan("t1").algo == "ring"
                time.sleep(0.5)  # a few iterations on the ring
                pc.release("t0")  # t1 gets the switch: pushed to the tenant
                out, err = proc.communicate(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    plans = res["plans"]
    switch_at = plans.index("ina")
    assert switch_at >= 5 and set(plans[:switch_at]) == {"ring"}, plans
    assert set(plans[switch_at:]) == {"ina"}
    assert res["applied"] == [[switch_at, 2]]
    assert res["registration"]["tree"] == ["tbs1"]
