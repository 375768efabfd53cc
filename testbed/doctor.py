"""``testbed doctor``: what the testbed needs against what this machine offers.

Kernel features are probed for real, not looked up: inside a throwaway anonymous network
namespace the doctor creates a veth pair, a bridge, an ifb, HTB / TBF / netem qdiscs and an
OVS kernel datapath. The namespace dies with the probe, so nothing can be left behind and a
concurrent ``testbed cleanup`` or leftover check never sees it.

Each check is a dict ``{"name", "status", "detail", "required"}``; status is one of
``ok`` (works), ``degraded`` (works with a caveat), ``missing`` (absent) or ``skipped``
(not probed: needs root). ``testbed doctor`` exits non-zero only when a required check is
not ok.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time

OVS_CTL = "/usr/share/openvswitch/scripts/ovs-ctl"
STATUSES = ("ok", "degraded", "missing", "skipped")

# (name, required, what it means when absent). The order is the order of the report.
CHECKS: tuple[tuple[str, bool, str], ...] = (
    ("root", True, "the testbed builds namespaces and links: run it as root (sudo) or in the lab VM"),
    ("netns", True, "no network namespaces: Mininet hosts cannot exist"),
    ("veth", True, "no veth pairs: no links between nodes"),
    ("bridge", True, "no Linux bridge: the plain (non-programmable) switches cannot be built"),
    ("htb", True, "no HTB: TCLink bw= cannot shape links"),
    ("tbf", False, "no TBF: only HTB shaping is available"),
    ("netem", False, "link delay and loss are emulated in the data path (impair stage) instead "
                     "of TCLink delay=/loss="),
    ("ifb", False, "no ifb devices: ingress shaping is unavailable"),
    ("ovs-kmod", False, "no Open vSwitch kernel datapath: OVS runs only as the userspace "
                        "datapath (datapath_type=netdev), the benchmark's anchor"),
    ("ovs-userspace", False, "no Open vSwitch binaries: the data-path benchmark skips its OVS "
                             "anchor"),
    ("packet-mmap", False, "no PACKET_MMAP rings: the data-path engine and the load generator "
                           "fall back to recvmmsg/sendmmsg (more CPU per packet)"),
    ("af-xdp", False, "no AF_XDP sockets (informational: the engine uses PACKET_MMAP rings)"),
    ("pktgen", False, "no kernel pktgen (/proc/net/pktgen): the data-path benchmark's load comes "
                      "from its user-space generator on a PACKET_MMAP TX ring"),
    ("mnexec", True, "Mininet (mnexec + the mininet package) is what builds the networks"),
    ("numba", True, "the data path and the kernels are Numba-compiled"),
    ("scapy", False, "packet tests and crafting are unavailable"),
    ("iperf3", False, "bandwidth checks (smoke demo, cross traffic) cannot run"),
    ("ethtool", False, "checksum offload cannot be switched off on veths"),
    ("brctl", False, "Mininet's LinuxBridge switch needs brctl (bridge-utils)"),
    ("ifconfig", False, "Mininet configures interfaces with ifconfig (net-tools)"),
    ("tcp-cc", False, "the collectives' TCP congestion control (CollectiveSpec.tcp_cc default) "
                      "is not in this kernel: their runs fail until it is loaded or the spec "
                      "names one that is (None: the host's default)"),
    ("memory", False, "little memory: keep experiments small"),
    ("cores", False, "few cores: CPU-heavy runs are flagged cpu_bound"),
)
REQUIRED = {name for name, req, _ in CHECKS if req}
_MEANING = {name: meaning for name, _, meaning in CHECKS}
ROOT_ONLY = ("netns", "veth", "bridge", "htb", "tbf", "netem", "ifb", "ovs-kmod", "mnexec",
             "packet-mmap", "af-xdp")

NOT_ROOT_HELP = (
    "The testbed needs root: it builds network namespaces, links and qdiscs. Run "
    "'sudo make doctor' (or 'sudo .venv/bin/testbed doctor'), or use the lab VM: "
    "'vagrant up && vagrant ssh', then 'cd /vagrant && sudo make doctor'."
)


def _sh(*cmd: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run a command; (worked, first line of its error or output)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return False, f"{cmd[0]} not found"
    except subprocess.TimeoutExpired:
        return False, f"{cmd[0]} timed out"
    text = (res.stderr.strip() or res.stdout.strip()).splitlines()
    return res.returncode == 0, (text[0] if text else "")


def _check(name: str, status: str, detail: str) -> dict:
    return {"name": name, "status": status, "detail": detail, "required": name in REQUIRED}


def _missing(name: str, why: str) -> dict:
    return _check(name, "missing", f"{_MEANING[name]} ({why})" if why else _MEANING[name])


# Kernel probes, run as one shell script inside a fresh anonymous network namespace: nothing
# is visible outside it and nothing can outlive it, even if the doctor is killed. (The
# interface names inside are private to it, so they need no tb prefix; cleanup never sees them.)
_PROBES: tuple[tuple[str, str], ...] = (
    ("veth", "ip link add probe0 type veth peer name probe1 && ip link set probe0 up"),
    ("bridge", "ip link add probebr0 type bridge"),
    ("ifb", "ip link add probeifb0 type ifb"),
    ("htb", "tc qdisc add dev probe0 root handle 1: htb default 1 && "
            "tc class add dev probe0 parent 1: classid 1:1 htb rate 100mbit"),
    ("tbf", "tc qdisc add dev probe0 root tbf rate 100mbit burst 32kbit latency 50ms"),
    ("netem", "tc qdisc add dev probe0 root netem delay 1ms loss 1%"),
    ("ovs-kmod", "ovs-dpctl add-dp probedp0 && ovs-dpctl del-dp probedp0"),
)
_GOOD = {
    "veth": "veth pairs work",
    "bridge": "Linux bridge works",
    "ifb": "ifb devices work",
    "htb": "HTB shaping works (TCLink bw=)",
    "tbf": "TBF shaping works",
    "netem": "netem works: TCLink delay=/loss= are available",
    "ovs-kmod": "OVS kernel datapath works",
}


def _probe_script() -> str:
    lines = []
    for name, cmd in _PROBES:
        # Each probe prints '@@<name> <exit status> <first line of its output>'; a qdisc is
        # removed again so the next one can take the root.
        lines.append(f'out=$( {{ {cmd} ; }} 2>&1 ); rc=$?; tc qdisc del dev probe0 root '
                     f'>/dev/null 2>&1; printf "@@{name} %d %s\\n" "$rc" "$(echo "$out" | '
                     f'head -n1)"')
    return "\n".join(lines)


def _probe_kernel() -> list[dict]:
    """netns (anonymous), then veth, bridge, ifb, HTB, TBF, netem, OVS datapath inside it."""
    if shutil.which("unshare"):
        enter = ["unshare", "--net", "--"]
    elif shutil.which("mnexec"):
        enter = ["mnexec", "-n"]
    else:
        return [_missing("netns", "neither unshare (util-linux) nor mnexec found")]
    ok, text = _sh(*enter, "sh", "-c", "readlink /proc/self/ns/net")
    if not ok or text == os.readlink("/proc/self/ns/net"):
        return [_missing("netns", text or "no new namespace")]
    out = [_check("netns", "ok", "network namespaces work")]
    try:
        res = subprocess.run([*enter, "sh", "-c", _probe_script()], capture_output=True,
                             text=True, timeout=30, check=False)
        lines = res.stdout.splitlines()
    except subprocess.TimeoutExpired:
        lines = []
    found = {}
    for line in lines:
        if line.startswith("@@"):
            name, rc, *msg = line[2:].split(" ", 2)
            found[name] = (rc == "0", msg[0].strip() if msg else "")
    have_veth = found.get("veth", (False, ""))[0]
    for name, _ in _PROBES:
        ok, msg = found.get(name, (False, "probe did not run"))
        if ok:
            out.append(_check(name, "ok", _GOOD[name]))
        elif name in ("htb", "tbf", "netem") and not have_veth:
            out.append(_missing(name, "no veth to attach a qdisc to"))
        elif name == "ovs-kmod":
            if shutil.which("ovs-dpctl") is None:  # probe by the loaded module instead
                loaded = os.path.isdir("/sys/module/openvswitch")
                out.append(_check(name, "ok", _GOOD[name]) if loaded else _missing(
                    name, "openvswitch module not loaded (no ovs-dpctl to probe with)"))
            else:
                out.append(_missing(name, "kernel module openvswitch absent"
                                    if "does not exist" in msg else msg))
        else:
            out.append(_missing(name, msg))
    return out


def _check_mnexec() -> dict:
    try:
        import mininet.net  # noqa: F401  (the PyPI package the topologies build with)
        from mininet.net import VERSION
    except ImportError as exc:
        return _missing("mnexec", f"python package mininet: {exc}")
    if shutil.which("mnexec") is None:
        return _missing("mnexec", "mnexec not on PATH (Debian package mininet)")
    ok, text = _sh("mnexec", "-n", "readlink", "/proc/self/ns/net")
    if not ok or text == os.readlink("/proc/self/ns/net"):
        return _missing("mnexec", f"mnexec -n did not give a new namespace ({text})")
    return _check("mnexec", "ok", f"Mininet {VERSION}; mnexec -n gives a fresh namespace")


def _check_numba() -> dict:
    try:
        import numba
        import numpy as np
    except ImportError as exc:
        return _missing("numba", str(exc))
    t0 = time.perf_counter()
    try:
        @numba.njit(cache=False)
        def _sum(a):
            s = 0
            for x in a:
                s += x
            return s

        got = _sum(np.arange(10, dtype=np.int64))
    except Exception as exc:  # any compile failure means the data path cannot run
        return _check("numba", "missing", f"numba {numba.__version__} cannot compile: {exc}")
    if got != 45:
        return _check("numba", "missing", f"numba {numba.__version__} miscompiled a sum")
    dt = time.perf_counter() - t0
    return _check("numba", "ok", f"numba {numba.__version__} compiles (tiny kernel in {dt:.2f} s)")


def _check_module(name: str, module: str) -> dict:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return _missing(name, str(exc))
    return _check(name, "ok", f"{module} {getattr(mod, '__version__', '')}".strip())


def _check_tool(binary: str, *version_args: str) -> dict:
    path = shutil.which(binary)
    if path is None:
        return _missing(binary, f"{binary} not on PATH")
    ok, text = _sh(binary, *version_args) if version_args else (True, "")
    return _check(binary, "ok", path + (f" ({text})" if ok and text else ""))


def _check_ovs_userspace() -> dict:
    bins = [b for b in ("ovs-vsctl", "ovs-vswitchd", "ovsdb-server") if shutil.which(b) is None]
    if bins:
        return _missing("ovs-userspace", f"{', '.join(bins)} not found")
    if os.geteuid() == 0 and _sh("ovs-vsctl", "--timeout=2", "show", timeout=5)[0]:
        return _check("ovs-userspace", "ok", "OVS binaries present, ovs-vswitchd running")
    return _check("ovs-userspace", "degraded",
                  f"OVS binaries present, daemons not running (start: {OVS_CTL} start "
                  "--system-id=random); use datapath_type=netdev without the kernel module")


def _check_packet_io() -> list[dict]:
    """PACKET_MMAP rings (what the engine uses) and AF_XDP sockets (whether they exist)."""
    from testbed.datapath.io import probe_af_xdp, probe_rings  # numba: only when probing

    out = []
    for name, probe in (("packet-mmap", probe_rings), ("af-xdp", probe_af_xdp)):
        ok, detail = probe()
        out.append(_check(name, "ok", detail) if ok else _missing(name, detail))
    return out


def _check_pktgen() -> dict:
    if os.path.exists("/proc/net/pktgen/pgctrl"):
        return _check("pktgen", "ok", "kernel pktgen present (/proc/net/pktgen/pgctrl)")
    return _missing("pktgen", "module pktgen not loaded or not built")


def _check_memory() -> dict:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    avail = info.get("MemAvailable", info.get("MemFree", 0)) / 2**30
    total = info.get("MemTotal", 0) / 2**30
    # A Python process with numba and cached kernels costs about 140 MB (docs/DESIGN).
    detail = f"{avail:.1f} GiB available of {total:.1f} GiB (≈{int(avail * 1024 / 140)} " \
             "numba worker processes)"
    return _check("memory", "ok" if avail >= 4 else "degraded",
                  detail if avail >= 4 else f"{detail}: {_MEANING['memory']}")


def _check_tcp_cc() -> dict:
    # here, not at the top: the doctor must run (and say what is missing) where the
    # collectives' own imports (mininet, numba) fail
    from testbed.collectives.transport import DEFAULT_TCP_CC, available_tcp_cc, host_tcp_cc

    have = available_tcp_cc()
    host = host_tcp_cc() or "unknown"
    detail = (f"collectives run {DEFAULT_TCP_CC} on their connections; this machine's default "
              f"is {host} (available: {' '.join(have) or 'unknown'})")
    if DEFAULT_TCP_CC in have:
        return _check("tcp-cc", "ok", detail)
    return _check("tcp-cc", "degraded", f"{detail}: {_MEANING['tcp-cc']}")


def _check_cores() -> dict:
    n = len(os.sched_getaffinity(0))
    if n >= 4:
        return _check("cores", "ok", f"{n} cores")
    return _check("cores", "degraded",
                  f"{n} core(s): emulated hosts and data-path engines share them; "
                  f"{_MEANING['cores']}")


def run_checks() -> list[dict]:
    """Probe the machine; one dict per check in ``CHECKS`` order (see the module docstring)."""
    root = os.geteuid() == 0
    results: dict[str, dict] = {
        "root": _check("root", "ok", "running as root") if root else _missing("root", "not root"),
    }
    if root:
        results.update({c["name"]: c for c in _probe_kernel()})
        results["mnexec"] = _check_mnexec()
        results.update({c["name"]: c for c in _check_packet_io()})
    for name in ROOT_ONLY:
        results.setdefault(name, _missing(name, "not probed: no network namespace") if root
                           else _check(name, "skipped", "needs root to probe"))
    results["ovs-userspace"] = _check_ovs_userspace()
    results["pktgen"] = _check_pktgen()
    results["numba"] = _check_numba()
    results["scapy"] = _check_module("scapy", "scapy")
    for tool, version_args in (("iperf3", ["--version"]), ("ethtool", ["--version"]),
                               ("brctl", []), ("ifconfig", [])):
        results[tool] = _check_tool(tool, *version_args)
    results["tcp-cc"] = _check_tcp_cc()
    results["memory"] = _check_memory()
    results["cores"] = _check_cores()
    return [results[name] for name, _, _ in CHECKS]


def failed_required(checks: list[dict]) -> list[str]:
    """Names of required checks that are not ok (empty: the testbed can run here)."""
    return [c["name"] for c in checks if c["required"] and c["status"] != "ok"]


def check_servers(servers) -> list[dict]:
    """Preflight of a cluster network's remote servers (docs/cluster.md), one check each:
    reachable by ssh without a password, the same venv path (this interpreter) there, the
    server's own ``testbed doctor`` (required checks), its clock against ours, and the
    underlay rate and latency from this machine (what its tunnels will get).

    ``servers``: host names, ``user@host`` strings or ``Server`` records (this machine is
    implied)."""
    # imported here: a plain 'testbed doctor' never needs Mininet's cluster classes
    from testbed.topologies import cluster

    out = []
    for srv in cluster.parse_servers(["localhost", *servers])[1:]:
        name = f"server {srv.name}"
        try:
            conn = cluster.Connection(srv)
        except Exception as e:  # noqa: BLE001 - reported as the check's result
            out.append(_check(name, "missing", str(e)))
            continue
        try:
            res = conn.run(f"{sys.executable} -m testbed.cli doctor --json", check=False,
                           timeout=300)
            try:
                remote = json.loads(res)["checks"]
            except ValueError:
                out.append(_check(name, "missing", f"no testbed at {sys.executable} there: "
                                  "install the same checkout and venv at the same path"))
                continue
            bad = failed_required(remote)
            skew, window = 0.0, float("inf")
            for _ in range(3):  # the narrowest of three round trips bounds the offset best
                t0 = time.time()
                their = float(conn.run("date +%s.%N"))
                t1 = time.time()
                if t1 - t0 < window:
                    skew, window = their - (t0 + t1) / 2, t1 - t0
            ip = srv.tunnel_ip or cluster.resolve(srv.address)
            under = cluster.measure_underlay(conn, cluster.local_ip_towards(ip), ip)
            detail = (f"doctor: {'required not ok: ' + ', '.join(bad) if bad else 'ok'}; "
                      f"clock {skew * 1e3:+.1f} ms (±{window * 5e2:.0f}); underlay {under['rate_mbps']} Mb/s, "
                      f"{under['latency_ms']} ms one way")
            status = "missing" if bad else ("degraded" if abs(skew) - window / 2 > 0.1 else "ok")
            out.append({**_check(name, status, detail), "underlay": under,
                        "clock_skew_s": skew})
        finally:
            conn.close()
    return out


def main(json_out: bool = False, servers=()) -> int:
    """CLI entry: print the checks (a table, or JSON with --json); 1 if a required one failed.
    ``servers``: also check these cluster servers over ssh (:func:`check_servers`)."""
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    if os.geteuid() != 0:
        err.print(f"[yellow]testbed doctor: not running as root; network probes skipped.[/yellow]"
                  f"\n{NOT_ROOT_HELP}")
    checks = run_checks()
    failed = failed_required(checks)
    if servers:
        remote = check_servers(servers)
        checks += remote
        failed += [c["name"] for c in remote if c["status"] == "missing"]
    if json_out:
        print(json.dumps({"checks": checks}, indent=2))
    else:
        colour = {"ok": "green", "degraded": "yellow", "missing": "red", "skipped": "dim"}
        table = Table(title=f"testbed doctor ({sys.platform}, {os.uname().release})")
        table.add_column("check")
        table.add_column("status")
        table.add_column("required")
        table.add_column("what it means")
        for c in checks:
            table.add_row(c["name"], f"[{colour[c['status']]}]{c['status']}[/]",
                          "yes" if c["required"] else "", c["detail"])
        Console().print(table)
    if failed:
        err.print(f"[red]required and not ok: {', '.join(failed)}[/red]")
    elif not json_out:
        Console().print("[green]everything the testbed requires is here[/green]")
    return 1 if failed else 0
