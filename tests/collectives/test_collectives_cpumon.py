"""The CPU-saturation signal against real load: busy processes pinned to every core make a
run CPU-bound; a multi-threaded process that uses most of a core in total does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from testbed.collectives import cpumon

SPIN = textwrap.dedent("""
    import os, sys, time
    os.sched_setaffinity(0, {int(sys.argv[1])})
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        pass
""")

# duty-cycled work on ``threads`` threads (hashing releases the GIL, so they run in parallel):
# each is busy ``duty`` of every 10 ms
DUTY = textwrap.dedent("""
    import hashlib, os, sys, threading, time
    threads, duty, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    if len(sys.argv) > 4:
        os.sched_setaffinity(0, {int(sys.argv[4])})
    buf = bytes(64 << 10)
    end = time.monotonic() + seconds
    def work():
        while time.monotonic() < end:
            t = time.monotonic()
            while time.monotonic() - t < 0.010 * duty:
                hashlib.sha256(buf).digest()
            time.sleep(0.010 * (1 - duty))
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts: t.start()
    for t in ts: t.join()
""")


def _start(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)])


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _measure(pids: list[int], seconds: float) -> cpumon.CpuReport:
    mon = cpumon.CpuMonitor({"ranks": pids}, min_interval=0.05)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
        mon.sample()
    return mon.stop()


def test_busy_processes_pinned_to_every_core_make_the_run_cpu_bound():
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    try:
        for c in cores:  # two spinners per core: every core saturated, every thread queues
            procs += [_start(SPIN, c, 4.0), _start(SPIN, c, 4.0)]
        victim = _start(DUTY, 2, 0.5, 3.5, cores[0])  # the "collective": wants half a core x2
        procs.append(victim)
        time.sleep(0.5)  # let the interpreters start
        rep = _measure([victim.pid], 1.5)
    finally:
        _stop(procs)
    assert rep.cpu_util >= cpumon.UTIL_SATURATED, rep
    assert rep.cpu_wait > cpumon.WAIT_LIMIT, rep
    assert rep.cpu_bound and any("saturated" in w for w in rep.why)
    assert any("waited" in w for w in rep.why)
    assert set(rep.core_util) == set(cores)


@pytest.mark.quiet_cpu
def test_many_light_threads_are_not_cpu_bound():
    """Three threads at ~45 % of a core each: together more than the 0.9 of a core that the
    old per-process sum flagged, yet no core is saturated and no thread waits."""
    before = _measure([], 0.5)
    if before.cpu_util > 0.25:  # others' load would make these threads queue for real
        pytest.skip(f"the machine is busy with other work ({before.cpu_util:.0%} of its cores)")
    p = _start(DUTY, 3, 0.45, 3.5)
    try:
        time.sleep(0.5)
        rep = _measure([p.pid], 2.5)
    finally:
        _stop([p])
    if rep.cpu_util >= cpumon.UTIL_SATURATED:
        pytest.skip(f"other work loaded the machine meanwhile ({rep.cpu_util:.0%})")
    total = rep.group_cpu_s["ranks"] / rep.wall_s
    # the premise: summing the threads of the process (the old signal) calls this saturated.
    # The kernel charges threads by 1 ms-10 ms ticks, so short bursts are counted unevenly
    # (0.85-1.12 of a core measured here for 1.2 asked); below 0.9 there is nothing to show.
    if total <= 0.9:
        pytest.skip(f"the threads were charged {total:.2f} of a core, not the 1.35 asked (tick "
                    f"accounting or other load): the case this test is about did not arise")
    assert rep.cpu_demand < cpumon.DEMAND_SATURATED, rep
    assert rep.cpu_wait <= cpumon.WAIT_LIMIT, rep
    assert not rep.cpu_bound, rep.why


def test_a_thread_that_exits_still_counts():
    p = _start(DUTY, 1, 0.9, 0.6)
    mon = cpumon.CpuMonitor({"ranks": [p.pid]}, min_interval=0.0)
    try:
        while p.poll() is None:
            time.sleep(0.05)
            mon.sample()
    finally:
        _stop([p])
    rep = mon.stop()
    assert rep.group_cpu_s["ranks"] > 0.2  # counted from the last sample before it ended


def test_decision_reasons():
    assert cpumon.cpu_bound_reasons(0.5, 0.02, 0.4) == []
    assert "saturated" in cpumon.cpu_bound_reasons(0.95, 0.0, 0.0)[0]
    assert "waited" in cpumon.cpu_bound_reasons(0.5, 0.2, 0.1, wait_thread="send1[7]")[0]
    assert "engine[3] was busy" in cpumon.cpu_bound_reasons(0.5, 0.0, 0.92,
                                                            demand_thread="engine[3]")[0]


def test_an_empty_group_reports_zeros():
    rep = cpumon.CpuMonitor({"ranks": [os.getpid()], "engines": []}).stop()
    assert rep.group_max["engines"] == 0.0 and rep.group_cpu_s["engines"] == 0.0


def test_kernel_events_count_what_the_machine_did():
    """Sleeps are timer wake-ups and context switches; the machine-wide counters grow by
    at least what this process caused."""
    before = cpumon.kernel_events()
    for _ in range(50):
        time.sleep(0.001)
    after = cpumon.kernel_events()
    assert after["ctx_switches"] - before["ctx_switches"] >= 50
    assert after["net_softirqs"] >= before["net_softirqs"] >= 0
    if before["timer_irqs"] is not None:  # x86's LOC or arm64's arch_timer line
        assert after["timer_irqs"] - before["timer_irqs"] >= 50
