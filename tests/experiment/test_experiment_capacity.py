"""``testbed bench capacity``: the sweep's verdicts, its CPU-per-packet figures, its CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.bench.capacity import MACHINE_MIN_WALL_S, ROW_KEYS, max_not_bound, run


def test_max_workers_is_the_largest_n_before_the_first_saturated_run():
    """Largest n not CPU-bound with every smaller n also not bound; 0 when the first is."""
    def rows(*bound):
        return [{"n": n, "cpu_bound": b} for n, b in zip((8, 2, 4, 16), bound, strict=True)]

    assert max_not_bound(rows(False, False, False, False)) == 16
    assert max_not_bound(rows(True, False, False, False)) == 4
    assert max_not_bound(rows(False, False, True, False)) == 2  # 4 bound: 8 does not count
    assert max_not_bound(rows(False, True, False, False)) == 0
    assert max_not_bound(rows(False, False, None, False)) == 2  # a failed run counts as bound


def test_bad_arguments_fail_before_building_anything():
    for bad in (0.5, "auto", 1000.0):
        with pytest.raises(ValueError, match="time_dilation"):
            run(workers=(2,), time_dilation=bad)
    with pytest.raises(ValueError, match="algos"):
        run(workers=(2,), algos=("hd",))
    with pytest.raises(ValueError, match="workers"):
        run(workers=(1,))
    with pytest.raises(ValueError, match="io"):
        run(workers=(2,), io="xdp")
    with pytest.raises(ValueError, match="shaping"):
        run(workers=(2,), shaping="tbf")
    with pytest.raises(ValueError, match="sched"):
        run(workers=(2,), sched="rr")
    with pytest.raises(ValueError, match="worker_send"):
        run(workers=(2,), worker_send="xdp")
    with pytest.raises(ValueError, match="fabric"):
        run(workers=(2,), fabric="torus")
    with pytest.raises(ValueError, match=r"fat-tree holds \[16, 128\] hosts"):
        run(workers=(8,), fabric="fat_tree")
    for nbytes in (0, -(1 << 20), 2.5):  # --mib 0 or below ran every row to a failure
        with pytest.raises(ValueError, match=r"nbytes .*--mib > 0"):
            run(workers=(2,), nbytes=nbytes)
    with pytest.raises(ValueError, match="bw_mbps"):
        run(workers=(2,), bw_mbps=0.0)
    with pytest.raises(ValueError, match=r"dilate must list host counts >= 2 .*got \[0\]"):
        run(workers=(2,), dilate_workers=(0,))


@pytest.mark.mininet
def test_capacity_rows_measure_real_runs():
    """A two-worker sweep: one correct row per algorithm with the issue's keys, CPU per
    packet from packets the engine and the hosts really moved, and the verdict behind
    ``max_workers_not_cpu_bound``."""
    size = 256 << 10
    rows = run(workers=(2,), nbytes=size, timeout_s=60, dilate_workers=(2,))
    assert [(r["algo"], r["n"]) for r in rows] == [("ina", 2), ("ring", 2)]
    for r in rows:
        assert set(ROW_KEYS) <= set(r), r
        assert r["correct"] is True and r["bw_mbps"] == pytest.approx(100, rel=0.05)
        assert r["cpu_s_per_kpkt_engine"] > 0 and r["cpu_s_per_kpkt_worker"] > 0
        # the whole machine per emulated packet: from the cores' ticks over the run, so not
        # for these short runs (a real-length one: test_capacity_machine_cpu_per_packet)
        assert r["cpu_s_per_kpkt_machine"] is None, r
        # every packet crossed the switch on shaped links: the kernel ran its network
        # softirqs and switched contexts while the run lasted (x86 and arm64 name their timer)
        assert r["net_softirqs_per_pkt"] > 0 and r["ctx_switches_per_pkt"] > 0, r
        assert r["timer_irqs_per_pkt"] is None or r["timer_irqs_per_pkt"] > 0, r
        assert r["max_workers_not_cpu_bound"] == (0 if r["cpu_bound"] else 2)
        assert r["io"] == "ring" and r["shaping"] == "engine" and r["time_dilation"] == 1.0
        assert r["worker_send"] == "gso"
        assert 0 < r["speed_probe_s"] < 60 and 0 < r["speed_probe_end_s"] < 60, r
        # the calibration found a factor, or says why none kept the run below saturation
        assert (r["min_time_dilation"] or 0) >= 1.0 or r["dilation_note"], r
    ina, ring = rows
    # INA: each worker's 256 KiB arrives at the switch in 1 KiB chunks (plus the exponent
    # round), and the results go back: at least 2 x 256 packets each way
    assert ina["engine_kpkts"] >= 2 * size / 1024 / 1e3
    assert ina["worker_kpkts"] >= 2 * 2 * size / 1024 / 1e3
    # ring: each worker sends 2 (n-1)/n of the array in TCP segments of at most one MTU
    assert ring["engine_kpkts"] >= 2 * size / 1500 / 1e3


@pytest.mark.mininet
def test_capacity_machine_cpu_per_packet():
    """A run long enough for the kernel's CPU ticks: the machine's busy time per packet is
    at least what the engine process used (its counters span a little more than the timed
    run: a generous margin). With the kernel shaping the switch's ports, the comparison
    ``--shaping qdisc`` offers, and INA workers sending a datagram per entry
    (``--worker-send mmsg``)."""
    before = os.environ.get("TESTBED_INA_GSO")
    rows = run(workers=(2,), algos=("ina",), nbytes=8 << 20, timeout_s=60, dilate_workers=(),
               shaping="qdisc", sched="other", worker_send="mmsg")
    (r,) = rows
    assert r["correct"] is True and r["time_s"] >= MACHINE_MIN_WALL_S, r
    assert r["shaping"] == "qdisc" and r["sched"] == "other" and r["worker_send"] == "mmsg"
    assert os.environ.get("TESTBED_INA_GSO") == before  # the sweep's setting did not leak
    assert r["cpu_s_per_kpkt_machine"] > 0.5 * r["cpu_s_per_kpkt_engine"] > 0, r


@pytest.mark.mininet
def test_capacity_on_a_fat_tree_counts_every_engine_and_the_packets_delivered():
    """A fat-tree k=4 of 16 workers: every collective exact, the engine figures sum its 20
    engines (a packet crosses one to five of them, so they received more packets than the
    hosts), and the machine's CPU is also given per packet delivered to a host."""
    rows = run(workers=(16,), fabric="fat_tree", nbytes=4 << 20, timeout_s=120,
               dilate_workers=())
    assert [(r["algo"], r["n"]) for r in rows] == [("ina", 16), ("ring", 16)]
    for r in rows:
        assert r["correct"] is True and r["fabric"] == "fat_tree", r
        assert r["engine_kpkts"] > r["delivered_kpkts"] > 0, r
        if r["time_s"] >= MACHINE_MIN_WALL_S:
            assert r["cpu_s_per_kpkt_delivered"] > r["cpu_s_per_kpkt_machine"] > 0, r
    ina, ring = rows
    # the ring's TCP: every worker receives 2 (n-1)/n of 4 MiB in segments of at most 1448 B
    assert ring["delivered_kpkts"] >= 16 * 2 * 15 / 16 * (4 << 20) / 1448 / 1e3


def test_cli_wiring():
    """`testbed bench capacity --help` reaches our command (no Mininet or Numba import)."""
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "bench", "capacity", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--workers" in out.stdout and "--io" in out.stdout
    assert "--shaping" in out.stdout and "--sched" in out.stdout and "--fabric" in out.stdout
    assert "--worker-send" in out.stdout
