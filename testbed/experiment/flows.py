"""Incast of flows: n senders each send one message to one receiver at the same instant.

The measure of UET trimming (``testbed bench trimming``): every sender opens its flow, waits for
a common start time and sends ``nbytes``; the receiver records when each flow's last byte
arrived. A flow's completion time (FCT) is that arrival minus the start (one clock: the
emulated hosts share the machine's). Transports:

* ``tcp``: the kernel's TCP (reno); the sender counts its namespace's retransmission
  timeouts (``TcpExt TCPTimeouts``, per network namespace);
* ``uet``: :class:`testbed.collectives.uet.UetComm` (sprayed UDP, NACKs for trimmed packets),
  with its own counters.

What the switch's port to the receiver does (drop-tail, UET trimming) is the network's
business: see :mod:`testbed.bench.trimming`. On a dilated network (factor f) every timeout
is stretched by f too (TCP's through each host's routes, ``rto_min``) and the completion
times are reported in emulated seconds (divided by f). Processes: ``python -m testbed.experiment.flows
receiver|sender ... testbed-node=<host>`` (the marker lets ``testbed cleanup`` find them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from testbed.cleanup import temp_dir
from testbed.collectives.transport import DEFAULT_TCP_CC, set_tcp_cc
from testbed.collectives.uet import TRANSPORTS, UetComm

TCP_PORT = 5555
#: seconds the processes get to start and connect
SETUP_S = 60.0
#: Linux TCP's shortest retransmission timeout, which the UET transport takes too
RTO_MIN_S = 0.2
JOB_ID = 9


def _tcp_timeouts() -> int:
    """This network namespace's TCP retransmission timeouts so far."""
    with open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
    for head, vals in zip(lines[::2], lines[1::2], strict=False):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split()[1:], vals.split()[1:], strict=True))["TCPTimeouts"])
    return 0


def _uet(a, rank: int) -> UetComm:
    return UetComm(rank, [f"r{i}" for i in range(a.n + 1)], a.timeout, job_id=JOB_ID,
                   rto_min_s=a.rto_min)


def _receiver(a) -> int:
    n = a.n
    done: dict[int, float] = {}
    stats: dict[str, Any] = {}
    if a.transport == "uet":
        comm = _uet(a, 0)
        comm.listen(a.ip)
        ips = a.senders.split(",")
        comm.connect(list(range(1, n + 1)), {r: (ips[r - 1], 0) for r in range(1, n + 1)})

        def take(r):
            comm.recv(r, np.empty(a.nbytes, np.uint8))
            done[r] = time.time()
        threads = [threading.Thread(target=take, args=(r,), daemon=True)
                   for r in range(1, n + 1)]
    else:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((a.ip, TCP_PORT))
        ls.listen(n)
        ls.settimeout(a.timeout)
        conns = []
        for _ in range(n):
            c, _addr = ls.accept()
            conns.append(c)

        def take(c):
            c.settimeout(a.timeout)
            (r,) = c.recv(1)
            left = a.nbytes
            buf = bytearray(1 << 16)
            while left:
                k = c.recv_into(buf, min(left, len(buf)))
                if not k:
                    raise ConnectionError(f"flow {r} closed with {left} B missing")
                left -= k
            done[r] = time.time()
            c.sendall(b"k")
        threads = [threading.Thread(target=take, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.timeout + SETUP_S)
    start_at = _go_time(a.sync)
    if a.transport == "uet":
        stats = comm.stats()
        time.sleep(0.2)  # ACK the last retransmissions before the socket goes
        comm.close()
    with open(a.out, "w") as f:
        json.dump({"fct": {r: t - start_at for r, t in done.items()}, "stats": stats,
                   "complete": len(done) == n}, f)
    return 0 if len(done) == n else 4


def _go_time(sync: str) -> float:
    with open(os.path.join(sync, "go")) as f:
        return float(f.read())


def _ready_then_wait(a) -> None:
    """Say this sender is set up, then sleep until the common start the runner writes."""
    with open(os.path.join(a.sync, f"ready{a.rank}"), "w"):
        pass
    deadline = time.time() + SETUP_S
    while not os.path.exists(os.path.join(a.sync, "go")):
        if time.time() > deadline:
            raise TimeoutError(f"no start within {SETUP_S} s")
        time.sleep(0.005)
    time.sleep(max(0.0, _go_time(a.sync) - time.time()))


def _sender(a) -> int:
    data = np.random.default_rng(a.rank).integers(0, 256, a.nbytes, dtype=np.uint8)
    out: dict[str, Any] = {}
    if a.transport == "uet":
        comm = _uet(a, a.rank)
        comm.listen(a.ip)
        comm.connect([0], {0: (a.dst, 0)})
        _ready_then_wait(a)
        comm.send(0, data).result(a.timeout)
        out["stats"] = comm.stats()
        comm.close()
    else:
        before = _tcp_timeouts()
        s = socket.create_connection((a.dst, TCP_PORT), timeout=a.timeout)
        set_tcp_cc(s, DEFAULT_TCP_CC)
        s.sendall(bytes([a.rank]))
        _ready_then_wait(a)
        s.sendall(memoryview(data))
        s.recv(1)
        out["stats"] = {"timeouts": _tcp_timeouts() - before}
        s.close()
    with open(a.out, "w") as f:
        json.dump(out, f)
    # exit only once the receiver is done: 16 interpreters ending at once would load the CPU
    # the measurement of the other flows runs on
    deadline = time.time() + a.timeout
    while not os.path.exists(os.path.join(a.sync, "end")) and time.time() < deadline:
        time.sleep(0.02)
    return 0


def _dilate_rto(hosts, f: float) -> list:
    """Stretch TCP's shortest retransmission timeout by the time dilation ``f`` on every
    host's routes (``ip route ... rto_min``): the kernel's 200 ms is wall-clock time, and left
    alone a dilated network would see its timeouts f times too short. Returns (host, route)
    pairs to put back."""
    old = []
    ms = int(round(RTO_MIN_S * 1000 * f))
    for h in hosts:
        for line in h.cmd("ip route show").splitlines():
            line = line.strip()
            if line and "rto_min" not in line:
                h.cmd(f"ip route change {line} rto_min {ms}ms")
                old.append((h, line))
    return old


def run_flows(net, transport: str, nbytes: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """One incast on ``net``: host 0 receives, every other host sends ``nbytes`` at once over
    ``transport``. Returns the flow completion times (receiver side, emulated seconds)
    ``fct_s`` and their ``fct_p50_s``/``fct_p99_s``/``fct_max_s``/``fct_mean_s``, ``timeouts``
    (every sender's retransmission timeouts), ``cpu_bound`` with ``cpu_why`` and the busiest
    threads (as the collectives measure it) and, for ``uet``, the summed transport counters
    ``uet``."""
    # here, not at the top: the sender and receiver processes run this module too, and the
    # incast module's imports (numba) would cost each of them a quarter second
    from testbed.experiment.incast import stop_processes, wait_sampling  # noqa: PLC0415

    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} must be one of {TRANSPORTS}")
    hosts = list(net.hosts)
    if len(hosts) < 2:
        raise ValueError("an incast needs at least 2 hosts (one receiver, one sender)")
    recv, senders = hosts[0], hosts[1:]
    n = len(senders)
    dil = float(getattr(net, "time_dilation", 1.0))
    routes = _dilate_rto(hosts, dil) if transport == "tcp" and dil != 1.0 else []
    tmp = temp_dir("flows")  # testbed cleanup removes it if this process is killed
    common = ["--transport", transport, "--nbytes", str(nbytes), "--n", str(n),
              "--sync", tmp, "--timeout", str(timeout_s * dil),
              "--rto-min", repr(RTO_MIN_S * dil)]
    py = [sys.executable, "-m", "testbed.experiment.flows"]
    procs = []
    try:
        procs.append(recv.popen(py + ["receiver", *common, "--ip", recv.IP(), "--out",
                                      f"{tmp}/r.json", "--senders",
                                      ",".join(h.IP() for h in senders),
                                      f"testbed-node={recv.name}"]))
        time.sleep(0.3)  # the receiver listens before a TCP sender connects
        for r, h in enumerate(senders, 1):
            procs.append(h.popen(py + ["sender", *common, "--rank", str(r), "--ip", h.IP(),
                                       "--dst", recv.IP(), "--out", f"{tmp}/s{r}.json",
                                       f"testbed-node={h.name}"]))
        # every sender started, connected and waits: then one start for all, so the start
        # measures the network, not how fast 16 interpreters come up on a few cores
        ready = time.time() + SETUP_S
        while len([x for x in os.listdir(tmp) if x.startswith("ready")]) < n:
            if time.time() > ready or any(p.poll() not in (None, 0) for p in procs):
                raise OSError("the senders did not all start")
            time.sleep(0.02)
        start_at = time.time() + 0.2
        with open(f"{tmp}/go.tmp", "w") as f:
            f.write(repr(start_at))
        os.rename(f"{tmp}/go.tmp", f"{tmp}/go")
        deadline = time.time() + timeout_s * dil + 10
        cpu = wait_sampling(procs, net.engine_pids(), start_at, deadline - time.time())
        with open(f"{tmp}/end", "w"):  # the senders may exit now, outside the measurement
            pass
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
        with open(f"{tmp}/r.json") as f:
            res = json.load(f)
        sent = []
        for r in range(1, n + 1):
            with open(f"{tmp}/s{r}.json") as f:
                sent.append(json.load(f))
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        logs = b""
        for p in procs:
            if p.poll() is not None and p.returncode and p.stdout is not None:
                logs = p.stdout.read()[-1500:]
                break
        raise RuntimeError(f"incast of {transport} flows failed ({type(e).__name__}: {e}) "
                           f"{logs.decode(errors='replace')}") from None
    finally:
        stop_processes(procs)
        for h, line in routes:  # the routes as they were
            h.cmd(f"ip route change {line}")
        shutil.rmtree(tmp, ignore_errors=True)
    if not res["complete"]:
        raise RuntimeError(f"incast of {transport} flows incomplete after {timeout_s} s")
    fct = np.array([res["fct"][str(r)] for r in range(1, n + 1)]) / dil  # emulated s
    row: dict[str, Any] = {
        "fct_s": [round(float(x), 5) for x in fct], "transport": transport, "senders": n, "bytes": nbytes,
        "fct_p50_s": float(np.percentile(fct, 50)), "fct_p99_s": float(np.percentile(fct, 99)),
        "fct_max_s": float(fct.max()), "fct_mean_s": float(fct.mean()),
        "timeouts": sum(s["stats"].get("timeouts", 0) for s in sent),
        "cpu_bound": cpu["bound"], "cpu_why": cpu["why"], "cpu_max": cpu["cpu_max"], "cpu_engine": cpu["cpu_engine"]}
    if transport == "uet":
        tot: dict[str, int] = dict(res["stats"])
        for s in sent:
            for k, v in s["stats"].items():
                tot[k] = tot.get(k, 0) + v
        row["uet"] = tot
    return row


def main(argv: list[str] | None = None) -> int:
    """Process entry: ``receiver`` or ``sender`` (started by :func:`run_flows`)."""
    p = argparse.ArgumentParser(prog="python -m testbed.experiment.flows")
    p.add_argument("role", choices=("receiver", "sender"))
    p.add_argument("--transport", choices=TRANSPORTS, required=True)
    p.add_argument("--nbytes", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--sync", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--ip", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--senders")
    p.add_argument("--rank", type=int)
    p.add_argument("--dst")
    p.add_argument("--rto-min", type=float, default=RTO_MIN_S)
    a, _markers = p.parse_known_args(argv)  # testbed-node=<host> markers are ignored
    return _receiver(a) if a.role == "receiver" else _sender(a)


if __name__ == "__main__":
    raise SystemExit(main())
