"""The foundation: doctor, cleanup, the not-root path, a Mininet smoke star, lab, set-up, Vagrant.

Everything that builds a network holds the emulation lock for the network's whole life
(docs/architecture.md); a child process that builds a star runs inside the parent's hold.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testbed import PREFIX, cleanup, doctor
from testbed.lifeline import start_ticks
from testbed.netlock import EmulationBusy, emulation_lock

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "testbed.cli"]
# An unprivileged user (euid nobody) that can still read the checkout: CI may clone into a
# 0700 folder (mktemp -d), where plain nobody could not even import the package. Reading is all
# CAP_DAC_READ_SEARCH grants; the testbed's root checks look at the euid, which stays nobody.
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
          "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def _run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=REPO, **kw)


def build_star(n_hosts: int, bw_mbps: float = 100.0):
    """A started Mininet star tbh1..n on Linux bridge tbs1, TCLink bw (caller holds the lock)."""
    from mininet.link import TCLink
    from mininet.log import setLogLevel
    from mininet.net import Mininet
    from mininet.nodelib import LinuxBridge

    setLogLevel("critical")  # the kernel's 'HTB quantum is big' note is logged as an error
    net = Mininet(switch=LinuxBridge, link=TCLink, controller=None, build=False,
                  autoSetMacs=True, waitConnected=False)
    try:
        switch = net.addSwitch(f"{PREFIX}s1")
        for i in range(1, n_hosts + 1):
            net.addLink(net.addHost(f"{PREFIX}h{i}"), switch, bw=bw_mbps)
        net.build()
        net.start()
    except BaseException:
        net.stop()
        raise
    return net


# --------------------------------------------------------------------------------- doctor


def _netem_works() -> bool:
    """Probe sch_netem ourselves, independently of the doctor (in a private namespace)."""
    script = ("ip link add q0 type veth peer name q1 && "
              "tc qdisc add dev q0 root netem delay 5ms")
    return _run(["unshare", "--net", "sh", "-c", script]).returncode == 0


def _ovs_kmod_present() -> bool:
    return (os.path.isdir("/sys/module/openvswitch")
            or _run(["modprobe", "-q", "openvswitch"]).returncode == 0)


@pytest.mark.root_required
def test_doctor_json_has_one_entry_per_check_and_reports_what_probes_find():
    proc = subprocess.Popen(CLI + ["doctor", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=120)
    checks = json.loads(out)["checks"]
    names = [c["name"] for c in checks]
    assert names == [name for name, _, _ in doctor.CHECKS]
    assert len(set(names)) == len(names)
    for c in checks:
        assert {"name", "status", "detail"} <= set(c), c
        assert c["status"] in doctor.STATUSES and c["detail"], c
    by = {c["name"]: c for c in checks}
    assert by["root"]["status"] == "ok"
    # What the doctor says must be what the kernel does (missing on the CI machines).
    assert (by["netem"]["status"] == "ok") == _netem_works()
    assert (by["ovs-kmod"]["status"] == "ok") == _ovs_kmod_present()
    assert not by["netem"]["required"] and not by["ovs-kmod"]["required"]
    assert {n for n in names if by[n]["required"]} == doctor.REQUIRED
    failed = [c["name"] for c in checks if c["required"] and c["status"] != "ok"]
    assert proc.returncode == (1 if failed else 0), (failed, err)
    assert "Traceback" not in err


# -------------------------------------------------------------------------------- cleanup

CHILD = f"""
import subprocess, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_foundation import build_star
net = build_star(4)
h1, h2, h3 = net.get('tbh1', 'tbh2', 'tbh3')
h1.cmd('iperf3 -s -D')  # a daemon in a host namespace, no marker of ours
h2.cmd('sleep 600 &')   # an ordinary child of a host shell
h3.cmd(sys.executable + " -c 'import time; time.sleep(600)' testbed-node=tbh3 &")
ns = 'tb-tkill-%d' % __import__('os').getpid()
subprocess.run(['ip', 'netns', 'add', ns], check=True)
subprocess.Popen(['ip', 'netns', 'exec', ns, 'sleep', '600'], start_new_session=True)
print('ready', flush=True)
time.sleep(600)
"""


def _cmdlines() -> dict[int, str]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return out


def _netns_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _tb_links() -> list[str]:
    return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(PREFIX))


@pytest.mark.parametrize("argv, ours", [
    (("bash", "--norc", "--noediting", "-is", "mininet:tbh1"), True),
    (("python", "-m", "testbed.collectives.worker", "--job", "j", "testbed-node=tbh1"), True),
    (("python", "-m", "testbed.datapath.engine", "cfg.json"), True),
    (("engine", "testbed-node=tbs1"), True),
    (("ovsdb-server", "/run/testbed/ovs/conf.db", "--remote=punix:/run/testbed/ovs/db.sock"),
     True),
    (("bash", "--norc", "-is", "mininet:h1"), False),  # Mininet, but not a testbed node
    (("bash", "-c", "grep -r testbed-node= . && ls /run/testbed/x"), False),  # a shell script
    (("python", "-m", "testbed.cli", "doctor"), False),
    (("pytest", "--basetemp=/tmp/pytest-of-root"), False),
])
def test_cleanup_recognises_our_command_lines_only(argv, ours):
    assert (cleanup._argv_reason(argv) is not None) == ours


@pytest.mark.mininet
def test_cleanup_after_sigkilled_star_removes_all_of_it_and_nothing_else(capsys):
    decoy_link = f"xtb{os.getpid() % 100000}"
    decoys = []
    with emulation_lock():
        try:
            # An earlier test's processes still on their way out would be listed below as
            # well: this test judges cleanup on its own star only, so it starts clean
            if cleanup.leftovers()["processes"]:
                cleanup.cleanup(force=True, files=False)
            # Things that look a bit like ours but are not: they must survive.
            subprocess.run(["ip", "link", "add", decoy_link, "type", "veth", "peer", "name",
                            decoy_link + "p"], check=True)
            decoys.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                            "mininet:h1"]))
            decoys.append(subprocess.Popen(["unshare", "--net", "sleep", "600"]))

            child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO)
            line = child.stdout.readline()
            assert line.strip() == "ready", child.stderr.read() if child.poll() else line
            shells = {pid: cmd for pid, cmd in _cmdlines().items() if "mininet:tb" in cmd}
            assert len(shells) == 5, shells  # 4 hosts + the bridge's shell
            host_ns = {_netns_of(pid) for pid, cmd in shells.items() if "mininet:tbh" in cmd}
            assert len(host_ns) == 4 and _tb_links()
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            orphans = [pid for pid, cmd in _cmdlines().items()
                       if "iperf3 -s" in cmd and _netns_of(pid) in host_ns]
            assert orphans  # processes of the dead hosts live on until cleanup

            # Before anything is killed: cleanup's view lists only the dead star's processes,
            # never one in this namespace without a marker (the test runner, the decoys).
            tkill_ns = {os.stat(f"/run/netns/{PREFIX}-tkill-{child.pid}").st_ino}
            listed = {int(d.split()[0]) for d in cleanup.leftovers()["processes"]}
            cmds = _cmdlines()
            assert os.getpid() not in listed and not listed & {p.pid for p in decoys}
            # (a process of the dying star that exited since it was listed, gone or a zombie:
            # no start time, has neither)
            strangers = {pid: (cmds.get(pid), _netns_of(pid)) for pid in listed
                         if start_ticks(pid) is not None
                         and _netns_of(pid) not in host_ns | tkill_ns
                         and "mininet:tb" not in cmds.get(pid, "")
                         and "testbed-node=" not in cmds.get(pid, "")}
            assert not strangers, (strangers, host_ns, tkill_ns)

            removed = cleanup.cleanup()
            assert removed["errors"] == []
            # Host shells die with their pty once the parent is gone; these outlive it.
            assert "tbs1" in removed["links"]
            assert removed["netns"] == [f"{PREFIX}-tkill-{child.pid}"]
            assert any("iperf3 -s" in d for d in removed["processes"]), removed
            assert any(d.split()[1:3] == ["sleep", "600"] and "named netns" in d
                       for d in removed["processes"]), removed

            # Checked independently of cleanup's own view.
            assert _tb_links() == []
            assert not [n for n in os.listdir("/run/netns") if n.startswith(f"{PREFIX}-tkill")]
            survivors = {pid: cmd for pid, cmd in _cmdlines().items()
                         if "mininet:tb" in cmd or "testbed-node=" in cmd
                         or (_netns_of(pid) in host_ns)}
            assert survivors == {}
            assert cleanup.leftovers() == {k: [] for k in cleanup.KINDS}
            again = cleanup.cleanup()  # safe to run twice: nothing left to remove
            assert again == {**{k: [] for k in cleanup.KINDS}, "errors": []}
            assert cleanup.main() == 0  # the CLI's path (the lock is ours: re-entrant)
            assert "nothing to remove" in capsys.readouterr().out

            assert all(p.poll() is None for p in decoys)
            assert os.path.exists(f"/sys/class/net/{decoy_link}")
        finally:
            for p in decoys:
                p.kill()
                p.wait()
            subprocess.run(["ip", "link", "delete", decoy_link], capture_output=True)
            if "child" in locals() and child.poll() is None:
                child.kill()
                child.wait()
            cleanup.cleanup()


@pytest.mark.root_required
def test_cleanup_waits_for_a_live_lock_holder_then_names_it():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom testbed.netlock import emulation_lock\n"
         "with emulation_lock():\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cleanup.busy_holder() is not None
        t0 = time.monotonic()
        with pytest.raises(EmulationBusy, match=f"pid {holder.pid}"):
            cleanup.cleanup(wait=1.0)
        assert time.monotonic() - t0 >= 1.0
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- not root


@pytest.mark.root_required
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_doctor_demo_cleanup_as_nobody_say_root_is_needed_without_traceback():
    env = {**os.environ, "HOME": "/tmp"}
    res = _run(NOBODY + CLI + ["doctor", "--json"], env=env)
    assert "Traceback" not in res.stderr + res.stdout
    assert res.returncode == 1
    by = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert by["root"]["status"] == "missing"
    assert all(by[name]["status"] == "skipped" for name in doctor.ROOT_ONLY)
    assert by["numba"]["status"] == "ok"  # what can run without root still runs
    assert "root" in res.stderr and "sudo" in res.stderr and "vagrant" in res.stderr

    table = _run(NOBODY + CLI + ["doctor"], env=env)
    assert table.returncode == 1 and "Traceback" not in table.stderr + table.stdout
    assert "skipped" in table.stdout

    for command in (["demo"], ["cleanup"]):
        res = _run(NOBODY + CLI + command, env=env)
        assert res.returncode == 1, (command, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr + res.stdout
        assert "root" in res.stderr and "sudo" in res.stderr, (command, res.stderr)


# ---------------------------------------------------------------------- Mininet smoke


def _iperf3_mbps(client, server, seconds: float = 2.0) -> float:
    # -O 1: leave TCP slow start out of the figure, we measure the shaper's steady rate
    srv = server.popen(["iperf3", "-s", "-1", "-p", "5201"])
    try:
        for _ in range(25):
            report = json.loads(client.cmd(f"iperf3 -c {server.IP()} -t {seconds:g} -O 1 -J") or "{}")
            if "end" in report and "error" not in report:
                return report["end"]["sum_received"]["bits_per_second"] / 1e6
            time.sleep(0.2)  # the server was not listening yet
        raise AssertionError(f"iperf3 never connected: {report}")
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.mininet
@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
def test_smoke_star_pings_all_and_shapes_100mbps_within_10_percent():
    with emulation_lock():
        net = build_star(3, bw_mbps=100)
        try:
            assert net.pingAll(timeout="2") == 0
            h1, h2 = net.get("tbh1", "tbh2")
            mbps = _iperf3_mbps(h1, h2)
        finally:
            net.stop()
        assert 90 <= mbps <= 110, f"{mbps:.1f} Mb/s over a 100 Mb/s HTB link"
        assert cleanup.leftovers() == {k: [] for k in cleanup.KINDS}


# ------------------------------------------------------------------------------- lab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lab_serves_notebooks_behind_the_printed_token():
    port = _free_port()
    lab = subprocess.Popen(CLI + ["lab", "--port", str(port), "--ip", "127.0.0.1"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        url = next(line.split("open: ", 1)[1].strip() for line in lab.stdout
                   if line.startswith("open: "))
        assert url.startswith(f"http://127.0.0.1:{port}/lab?token=")
        token = url.rsplit("=", 1)[1]
        status = f"http://127.0.0.1:{port}/api/contents?token="
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(status + token, timeout=5) as resp:
                    listing = json.load(resp)
                break
            except (urllib.error.URLError, ConnectionError):
                assert lab.poll() is None and time.monotonic() < deadline, "lab never answered"
                time.sleep(0.5)
        assert listing["type"] == "directory"  # the root is notebooks/
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(status + "wrong", timeout=5)
        assert denied.value.code == 403
    finally:
        lab.terminate()
        try:
            lab.wait(timeout=20)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait()


# ------------------------------------------------------------------ set-up, Vagrant


@pytest.mark.root_required
def test_setup_on_a_ready_machine_installs_nothing():
    res = _run(["bash", ".ci/setup.sh"], timeout=600, env={**os.environ, "VENV": sys.prefix})
    assert res.returncode == 0, res.stderr
    lines = (res.stdout + res.stderr).lower().splitlines()
    assert not [ln for ln in lines if "installing" in ln or "creating" in ln], lines


@pytest.mark.skipif(shutil.which("vagrant") is None, reason="vagrant is not installed here")
def test_vagrantfile_validates():
    res = _run(["vagrant", "validate", "--ignore-provider"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
