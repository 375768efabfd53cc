"""How set-up time, teardown time and memory grow with the number of emulated hosts.

``measure([2, 4, 8, 16, 32], 'bridge')`` builds a star of each size (Linux bridge or the
programmable switch), checks that every host reaches every other (all pairs up to 16 hosts,
ring + 3 sampled pairs per host above), and reports one row per size::

    python -c "from testbed.topologies.scale import main; main()" 2 4 8 16 32

Memory is the resident set of every process this one started (Mininet node shells, data-path
engines, ...), read from /proc while the network runs, plus this process's own growth.
"""

from __future__ import annotations

import os
import sys
import time

from .net import TestbedNet
from .star import Star


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root: int | None = None) -> list[int]:
    """PIDs of all live descendants of ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def mem_available_kb() -> int:
    """This machine's ``MemAvailable`` in KiB (0 when the kernel does not say)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def measure(ns, switch: str = "bridge", bw_mbps: float = 100.0) -> list[dict]:
    """One row per host count in ``ns``: set-up / teardown seconds and memory of a star.

    Row keys: ``n, switch, lock_wait_s, build_s, start_s, configure_s, ping_s, setup_s``
    (build+start+configure+ping, lock wait excluded), ``teardown_s``, ``processes``,
    ``children_rss_mb`` (all processes we started), ``self_rss_growth_mb``,
    ``mem_available_drop_mb`` (machine-wide, noisy on a shared machine), ``ping_pairs``,
    ``ping_failed``.
    """
    if switch not in ("bridge", "programmable"):
        raise ValueError(f"switch must be 'bridge' or 'programmable', got {switch!r}")
    rows = []
    for n in ns:
        self0 = _rss_kb(os.getpid())
        avail0 = mem_available_kb()
        net = TestbedNet(Star(n, bw_mbps=bw_mbps, switch=switch))
        with net:
            t = time.monotonic()
            ping = net.pingall()
            ping_s = time.monotonic() - t
            procs = descendants()
            rss = sum(_rss_kb(p) for p in procs)
            self1 = _rss_kb(os.getpid())
            avail1 = mem_available_kb()
        tm = net.timings
        rows.append({
            "n": n, "switch": switch,
            "lock_wait_s": round(tm["lock_wait_s"], 3),
            "build_s": round(tm["build_s"], 3),
            "start_s": round(tm["start_s"], 3),
            "configure_s": round(tm["configure_s"], 3),
            "ping_s": round(ping_s, 3),
            "setup_s": round(tm["build_s"] + tm["start_s"] + tm["configure_s"] + ping_s, 3),
            "teardown_s": round(tm["teardown_s"], 3),
            "processes": len(procs),
            "children_rss_mb": round(rss / 1024, 1),
            "self_rss_growth_mb": round((self1 - self0) / 1024, 1),
            "mem_available_drop_mb": round((avail0 - avail1) / 1024, 1),
            "ping_pairs": ping["pairs"],
            "ping_failed": len(ping["failed"]),
        })
    return rows


def main(argv=None) -> int:
    """Print the scale table for both switch kinds (host counts from argv, default 2..32)."""
    args = sys.argv[1:] if argv is None else argv
    ns = [int(a) for a in args] or [2, 4, 8, 16, 32]
    cols = ["n", "switch", "setup_s", "build_s", "start_s", "configure_s", "ping_s",
            "teardown_s", "processes", "children_rss_mb", "self_rss_growth_mb",
            "mem_available_drop_mb", "ping_failed"]
    print(" | ".join(cols))
    for switch in ("bridge", "programmable"):
        for row in measure(ns, switch):
            print(" | ".join(str(row[c]) for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
