"""A provider killed and restarted beside a running network (``testbed up`` + ``testbed
provider serve --attach --journal``): the network and the switch registrations outlive it; the
restarted provider adopts what the switches still hold (same job id and first round: workers
are not disturbed), registers again what a switch lost, removes what no journaled job owns,
and leaks no switch memory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from testbed.datapath.control import DatapathClient
from testbed.provider.client import ProviderClient
from testbed.provider.schema import Hints, JobRequest

TB = [sys.executable, "-m", "testbed.cli"]
FABRIC = ('name = "fabric"\n[topology]\nkind = "star"\nn_hosts = 6\nbw_mbps = 100\n'
          'switch = "programmable"\naggregator = "tbs1"\n'
          '[[jobs]]\nname = "x"\nalgo = "ring"\nnbytes = "1MiB"\n')


def _provider(journal, sock) -> subprocess.Popen:
    proc = subprocess.Popen([*TB, "provider", "serve", "--attach", "--journal", str(journal),
                             "--socket", str(sock), "--policy", "provider_only"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while True:
        try:
            with ProviderClient(f"unix:{sock}", timeout=2) as pc:
                pc.health()
                return proc
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                raise AssertionError(f"provider exited {proc.returncode}: "
                                     f"{proc.communicate()[1]}") from None
            assert time.monotonic() < deadline, "the provider did not come up"
            time.sleep(0.2)


def _kill(proc: subprocess.Popen, sig=signal.SIGKILL) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.communicate(timeout=60)[1]


def _on_switch() -> dict:
    with DatapathClient("tbs1") as c:
        return c.counters()["stages"]["aggregate"]


def _req(job, hosts, lease_s=600.0):
    return JobRequest(job=job, hosts=hosts, hints=Hints(collective_bytes=1 << 20),
                      lease_s=lease_s)


@pytest.mark.mininet
def test_provider_killed_and_restarted_beside_a_running_network(tmp_path):
    exp = tmp_path / "fabric.toml"
    exp.write_text(FABRIC)
    journal, sock = tmp_path / "provider.db", tmp_path / "p.sock"
    r = subprocess.run([*TB, "up", str(exp), "--detach"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_provider(journal, sock))
        with ProviderClient(f"unix:{sock}") as pc:
            for job, hosts, lease in (("a", ["tbh1", "tbh2"], 600), ("c", ["tbh5", "tbh6"], 600),
                                      ("short", ["tbh3", "tbh4"], 3)):
                assert pc.admit(_req(job, hosts, lease)).algo == "ina"
            regs = {j: v["registration"] for j, v in pc.jobs().items()}
        ids = {j: r["job_id"] for j, r in regs.items()}
        assert set(_on_switch()["jobs"]) == {str(i) for i in ids.values()}

        _kill(procs[0])  # SIGKILL: no clean-up of any kind
        # the network and its registrations outlive the provider; a switch loses c's
        with DatapathClient("tbs1") as c:
            c.configure("aggregate", remove_jobs=[ids["c"]])
        time.sleep(3.5)  # short's lease runs out while no provider runs
        procs.append(_provider(journal, sock))
        with ProviderClient(f"unix:{sock}") as pc:
            jobs = pc.jobs()
            assert set(jobs) == {"a", "c"}, jobs
            # a: adopted as it was; c: registered again (a new first round)
            assert jobs["a"]["registration"] == regs["a"]
            assert jobs["c"]["registration"]["seq0"] != regs["c"]["seq0"]
            held = set(_on_switch()["jobs"])
            assert held == {str(jobs["a"]["registration"]["job_id"]),
                            str(jobs["c"]["registration"]["job_id"])}, held
            assert [c["reason"] for c in pc.log() if c["job"] == "short"][-1] == \
                "lease expired"
            pc.release("c")
        assert set(_on_switch()["jobs"]) == {str(ids["a"])}

        # the switch's engine restarted (`testbed switch tbs1 restart`, run by `up`, which owns
        # it): its jobs are gone; the provider sees it in its telemetry and registers a again
        r = subprocess.run([*TB, "switch", "tbs1", "restart", "--json"], capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ok"] is True
        with ProviderClient(f"unix:{sock}") as pc:
            deadline = time.monotonic() + 30
            while pc.job("a")["registered_again"] < 1:
                assert time.monotonic() < deadline, pc.job("a")
                time.sleep(0.2)
            again = pc.job("a")["registration"]
        assert again["job_id"] == ids["a"] and again["seq0"] != regs["a"]["seq0"]
        assert set(_on_switch()["jobs"]) == {str(ids["a"])}

        # the journal lost (another file): a's registration is nobody's, and is removed
        _kill(procs[1])
        procs.append(_provider(tmp_path / "fresh.db", sock))
        agg = _on_switch()
        assert agg["jobs"] == {} and agg["memory"]["allocated_bytes"] == 0, agg
        with ProviderClient(f"unix:{sock}") as pc:
            assert pc.jobs() == {}
        err = _kill(procs[2], signal.SIGTERM)
        assert procs[2].returncode == 0, err
    finally:
        for p in procs:
            _kill(p)
        subprocess.run([*TB, "down"], capture_output=True, timeout=300)


def test_attach_without_a_network_up_says_what_to_do(tmp_path):
    from testbed.up import read_state

    state = read_state()
    if state is not None and state["alive"]:
        pytest.skip("a network is up on this machine ('testbed down' first)")
    r = subprocess.run([*TB, "provider", "serve", "--attach", "--socket",
                        str(tmp_path / "p.sock")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "testbed up FILE --detach" in r.stderr, r.stderr
    r = subprocess.run([*TB, "provider", "serve", "--socket", str(tmp_path / "p.sock")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--attach" in r.stderr, r.stderr
