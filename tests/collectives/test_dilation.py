"""Time dilation: what a dilated network runs (pipelines, links, INA timers), the factor
search of "auto", the experiment field, and real dilated networks (shaping, delays, reported
times, calibration)."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from testbed.collectives import CollectiveSpec
from testbed.collectives import inakernel as ik
from testbed.collectives.dilation import Calibration, search
from testbed.collectives.reference import inakernel as ref
from testbed.datapath.engine import DEFAULT_COALESCE_US, rx_ring_frames
from testbed.experiment.spec import ExperimentError, parse_experiment
from testbed.testing import shaped_rate_mbps
from testbed.topologies import Star, TopologyError
from testbed.topologies.pipeline import (
    DatapathOptions,
    Impairment,
    Trimming,
    check_time_dilation,
    compose,
    dilate,
)

# ----------------------------------------------------------------------------- pure parts


def test_dilate_stretches_impair_times_and_slows_trim_queues():
    topo = Star(3, switch="programmable", bw_mbps=50, programs={"tbs1": ["forward"]})
    opts = DatapathOptions(
        impairments=(Impairment("tbs1", loss=0.02, delay_ms=1.5, jitter_ms=0.5),
                     Impairment("tbs1", direction="egress", delay_ms=2.0, ports=(0,))),
        trimming=(Trimming("tbs1", rate_mbps=20, ports=("tbs1-eth2",)),))
    plan = compose(topo, opts)
    before = copy.deepcopy(plan)
    dil = dilate(plan, 4.0)
    assert plan == before  # the plan itself (the undilated network) is left alone
    stages = dict(dil["tbs1"])
    assert [p for p, _ in dil["tbs1"]] == [p for p, _ in plan["tbs1"]]
    ing = stages["impair_ingress"]
    assert (ing["delay_ms"], ing["jitter_ms"], ing["loss"]) == (6.0, 2.0, 0.02)
    assert stages["impair"]["delay_ms"] == {"tbs1-eth1": 8.0}
    assert stages["trim"]["rate_mbps"] == {"tbs1-eth1": 12.5, "tbs1-eth2": 5.0,
                                           "tbs1-eth3": 12.5}
    assert stages["trim"]["threshold_bytes"] == dict(plan["tbs1"])["trim"]["threshold_bytes"]
    assert stages["forward"] == dict(plan["tbs1"])["forward"]
    assert dilate(plan, 1.0) == plan
    # the topology's own link delay (no netem here: the data path's impair stages)
    linked = compose(Star(2, switch="programmable", delay_ms=1.0))
    for _p, s in dilate(linked, 3.0)["tbs1"]:
        if "delay_ms" in s:
            assert set(s["delay_ms"].values()) == {3.0}


@pytest.mark.parametrize("bad", [0.5, 0, -2, 65, float("nan"), True, "2", "fast", None])
def test_time_dilation_factor_is_checked(bad):
    with pytest.raises(TopologyError, match="time_dilation"):
        check_time_dilation(bad)


def test_time_dilation_factor_accepts_numbers_and_auto():
    assert check_time_dilation(1) == 1.0 and check_time_dilation(6.5) == 6.5
    assert check_time_dilation("auto") == "auto"
    with pytest.raises(TopologyError, match="factor"):
        check_time_dilation("auto", auto=False)


def _ina_state(dilation: float, W: int = 4):
    x = np.random.default_rng(3).standard_normal(256 * 12).astype(np.float32)
    K = x.size // ik.ELEMS
    p = ik.Payload(ik.MODE_NIC, x, np.full(x.size, np.nan, np.float32),
                   np.zeros(x.size, np.int32), np.full(K, -149, np.int16), K, 0, ik.ELEMS,
                   x.size, 3, 7, 1, 0.0, 1.0, 1, np.uint64(0), np.uint64(0),
                   np.zeros(ik.THC_ELEMS, np.float32))
    state = (ik.new_slots(W, 5), ik.new_loop(0.0, dilation), p)
    return state, copy.deepcopy(state)


def test_dilated_ina_timer_floor_and_cap_kernel_and_twin():
    """On a network dilated by f the worker's first timeout is f x 10 ms and its doubling
    stops at f x 320 ms, in the kernel and its twin alike."""
    f = 4.0
    (slots, loop, p), (rs, rl, rp) = _ina_state(f)
    assert loop[0]["t0"] == ik.T0 * f and loop[0]["tmax"] == ik.T_MAX * f
    sl, rsl = np.zeros(4, np.int64), np.zeros(4, np.int64)
    assert ik.start(slots, loop, p, 0.0, sl) == ref.start(rs, rl, rp, 0.0, rsl) == 4
    assert np.all(slots.rto == ik.T0 * f) and np.all(slots.deadline == ik.T0 * f)
    now = 0.0
    for _ in range(12):  # nothing is ever answered: every timer doubles up to the cap
        now = float(slots.deadline.min())
        assert ik.expire(slots, loop, now, sl) == ref.expire(rs, rl, now, rsl)
        assert np.array_equal(sl, rsl)
    assert slots.rto.max() == ik.T_MAX * f
    for name in slots._fields:
        assert np.array_equal(getattr(slots, name), getattr(rs, name)), name
    assert loop.tobytes() == rl.tobytes()
    # an RTT sample far below the floor leaves the floor (dilated) in force
    slots.retx[:] = False
    ik.rtt_sample(loop[0], 1e-4)
    assert loop[0]["rto"] == ik.T0 * f
    # and an undilated loop keeps SwitchML's 10 ms / 320 ms
    plain = ik.new_loop(0.0)
    assert (plain[0]["t0"], plain[0]["tmax"], plain[0]["rto"]) == (ik.T0, ik.T_MAX, ik.T0)


def test_experiment_time_dilation_field():
    jobs = [{"algo": "ring"}]
    assert parse_experiment({"jobs": jobs}).time_dilation == 1.0
    auto = parse_experiment({"jobs": jobs, "time_dilation": "auto"})
    four = parse_experiment({"jobs": jobs, "time_dilation": 4})
    assert auto.time_dilation == "auto" and four.time_dilation == 4.0
    assert auto.network_key() != four.network_key()  # a different factor: another network
    swept = parse_experiment({"jobs": jobs, "sweep": {"time_dilation": [1, 8]}})
    assert [p.time_dilation for _, p in swept.points()] == [1.0, 8.0]
    with pytest.raises(ExperimentError) as ei:
        parse_experiment({"jobs": jobs, "time_dilation": 0.25})
    assert ei.value.problems[0].startswith("time_dilation: got 0.25; give a factor from 1")
    with pytest.raises(ExperimentError, match="time_dilation"):
        parse_experiment({"jobs": jobs, "sweep": {"time_dilation": [2, "slow"]}})


def _table_runner(needs: dict[str, float], background: float = 0.0):
    """``run_at`` for :func:`search` from each workload's true need: it passes at a factor >=
    its need, with pressure need / factor."""
    calls = []

    def run_at(factor, workloads):
        calls.append((factor, sorted(workloads)))
        failed = [w for w in workloads if factor < needs[w]]
        worst = max(needs[w] / factor for w in workloads)
        return failed, worst, background if failed else 0.0

    return run_at, calls


def test_search_climbs_by_pressure_then_refines_with_the_failing_workloads():
    run_at, calls = _table_runner({"ring": 5.0, "ina": 3.0})
    cal = Calibration(factor=1.0)
    search(cal, 1.0, ["ina", "ring"], 16.0, run_at)
    assert cal.factor == 6.0 and not cal.saturated
    # 1: both fail (pressure 5 -> x4); 4: ring fails (x2); 8: pass; 6: ring alone passes
    assert calls == [(1.0, ["ina", "ring"]), (4.0, ["ina", "ring"]), (8.0, ["ring"]),
                     (6.0, ["ring"])]
    run_at, calls = _table_runner({"ring": 2.2})
    search(cal := Calibration(factor=1.0), 1.0, ["ring"], 16.0, run_at)
    # 1 -> x2.2 = 2.2, nice 2: fails; x2 -> 4: passes; halfway 3: passes (3/2 <= 1.5: done)
    assert cal.factor == 3.0 and [c[0] for c in calls] == [1.0, 2.0, 4.0, 3.0]
    run_at, calls = _table_runner({"ring": 1.0})
    search(cal := Calibration(factor=1.0), 1.0, ["ring"], 16.0, run_at)
    assert cal.factor == 1.0 and calls == [(1.0, ["ring"])]


def test_search_stops_where_dilation_cannot_help():
    run_at, calls = _table_runner({"ring": 100.0})
    cal = Calibration(factor=1.0)
    search(cal, 1.0, ["ring"], 16.0, run_at)
    assert cal.saturated and cal.factor == 16.0 and "largest factor 16" in cal.note
    assert [c[0] for c in calls] == [1.0, 4.0, 16.0]
    run_at, calls = _table_runner({"ring": 100.0}, background=0.95)
    cal = Calibration(factor=1.0)
    search(cal, 1.0, ["ring"], 16.0, run_at)
    assert cal.saturated and "other processes" in cal.note and len(calls) == 1


def test_demo_names_cpu_bound_runs_and_suggests_dilation():
    import pandas as pd
    from rich.console import Console

    from testbed.experiment.demo import _cpu_verdict

    df = pd.DataFrame({"label": ["ring", "ina", "ina+thc"], "cpu_bound": [True, False, True],
                       "cpu_why": ["thread tbs1-eng[9] was busy or waiting for a CPU 93% of "
                                   "the run", "", "cores saturated (95% busy)"],
                       "time_dilation": [1.0, 1.0, 1.0]})
    con = Console(record=True, width=200)
    assert _cpu_verdict(con, df) == {"cpu_bound": 2, "time_dilation": 1.0}
    text = con.export_text()
    assert "2 of 3 runs were cpu_bound (ring, ina+thc)" in text
    assert "tbs1-eng[9]" in text and "testbed demo --time-dilation auto" in text
    con = Console(record=True, width=200)
    calm = df.assign(cpu_bound=False, time_dilation=4.0)
    assert _cpu_verdict(con, calm) == {"cpu_bound": 0, "time_dilation": 4.0}
    text = con.export_text()
    assert "cpu_bound" not in text and "time dilation 4" in text


# ----------------------------------------------------------------------------- real networks


_RTO_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5297)); s.listen(); s.settimeout(10); c, _ = s.accept(); time.sleep(2)
"""
_RTO_CLIENT = """
import re, socket, subprocess, sys, time
for _ in range(50):
    try:
        s = socket.create_connection((sys.argv[1], 5297), timeout=5); break
    except OSError:
        time.sleep(0.1)
s.sendall(b"x" * 1000); time.sleep(0.3)
out = subprocess.run(["ss", "-tinH", "dst", sys.argv[1]], capture_output=True, text=True).stdout
print("RTO", re.search(r"\\brto:([0-9.]+)", out).group(1))
"""


def _tcp_rto_ms(client, server, server_ip, tmp_path) -> float:
    """The retransmission timeout (ms) of a fresh TCP connection from ``client`` to ``server``
    after one exchange on an idle network: the minimum RTO plus a few ms."""
    import sys

    (tmp_path / "rto_server.py").write_text(_RTO_SERVER)
    (tmp_path / "rto_client.py").write_text(_RTO_CLIENT)
    srv = server.popen([sys.executable, str(tmp_path / "rto_server.py"), server_ip])
    try:
        out = client.cmd(f"{sys.executable} {tmp_path / 'rto_client.py'} {server_ip}")
    finally:
        srv.kill()
        srv.wait()
    return float(out.split("RTO", 1)[1].split()[0])


@pytest.mark.mininet
def test_dilated_network_stretches_every_hosts_minimum_tcp_rto(tmp_path):
    """The kernel's 200 ms floor times f on every host, through the per-namespace sysctl, or
    through the routes' rto_min on kernels without it (forced here on one host): a fresh
    connection's RTO is the floor plus a few ms."""
    from testbed.topologies import TestbedNet
    from testbed.topologies.net import TCP_RTO_MIN_US, tcp_rto_min_cmd

    with TestbedNet(Star(2, bw_mbps=100), time_dilation=2) as net:
        a, b = net.hosts
        knob = "cat /proc/sys/net/ipv4/tcp_rto_min_us 2>/dev/null"
        if a.cmd(knob).strip():
            assert [int(h.cmd(knob)) for h in net.hosts] == [2 * TCP_RTO_MIN_US] * 2
        assert 400 <= _tcp_rto_ms(a, b, net.host_ips[1], tmp_path) < 450
        net.set_time_dilation(4)
        assert 800 <= _tcp_rto_ms(a, b, net.host_ips[1], tmp_path) < 850
        if a.cmd(knob).strip():  # the routes' way: the namespace floor back at 200 ms
            a.cmd(f"echo {TCP_RTO_MIN_US} > /proc/sys/net/ipv4/tcp_rto_min_us")
            assert 200 <= _tcp_rto_ms(a, b, net.host_ips[1], tmp_path) < 250
            out = a.cmd(tcp_rto_min_cmd(a.defaultIntf().name, 3, per_netns=False))
            assert "rror" not in out, out
            assert "rto_min" in a.cmd(f"ip -4 route show dev {a.defaultIntf().name}")
            assert 600 <= _tcp_rto_ms(a, b, net.host_ips[1], tmp_path) < 650
            a.cmd(tcp_rto_min_cmd(a.defaultIntf().name, 1, per_netns=False))
        net.set_time_dilation(1)
        assert 200 <= _tcp_rto_ms(a, b, net.host_ips[1], tmp_path) < 250


@pytest.mark.mininet
def test_dilated_network_slows_links_stretches_delays_and_reports_undilated_time():
    from testbed.collectives import run_collective
    from testbed.topologies import TestbedNet

    topo = Star(2, bw_mbps=40, switch="programmable", delay_ms=1.0)
    with TestbedNet(topo, time_dilation=2) as net:
        assert net.bottleneck_bps() == 40e6  # the undilated network the model speaks of
        assert net.describe()["time_dilation"] == 2.0
        sw = net.switch_client(next(iter(topo.programmable)))
        assert sw.config()["coalesce_us"] == 2 * DEFAULT_COALESCE_US  # a time like the others
        # its RX rings sized for the dilated rate: 40 Mb/s at f=2 needs 512 slots, not 2048
        assert sw.config()["rx_ring_frames"] == rx_ring_frames(40, 2, 2 * DEFAULT_COALESCE_US)
        assert sw.config()["rx_ring_frames"] == 512
        got2 = shaped_rate_mbps(net.hosts[0], net.hosts[1], net.host_ips[1], 16.0, port=5298)
        hop2 = net.hop_latency_s()
        net.set_time_dilation(4)
        assert sw.config()["coalesce_us"] == 4 * DEFAULT_COALESCE_US
        got4 = shaped_rate_mbps(net.hosts[0], net.hosts[1], net.host_ips[1], 8.0, port=5298)
        hop4 = net.hop_latency_s()
        spec = CollectiveSpec(algo="ring", nbytes=1 << 20, repetitions=1)
        t0 = time.monotonic()
        (row,) = run_collective(net, spec)
        wall = time.monotonic() - t0
    # links shaped to 40/f Mb/s (HTB: within 10 %, the shaper never exceeds its rate)
    assert 16.0 <= got2 <= 22.0, got2
    assert 8.0 <= got4 <= 11.0, got4
    # the data path's 1 ms link delay (no netem here) stretched to f ms: a delay line never
    # releases early, so the measured per-link latency is at least that
    assert 0.95 * 2e-3 <= hop2 < hop4 and hop4 >= 0.95 * 4e-3, (hop2, hop4)
    assert row["correct"] and row["time_dilation"] == 4.0
    assert row["time_s"] * 4 <= wall  # reported time = measured / f
    assert row["fidelity"] == pytest.approx(row["time_s"] / row["model_s"])


@pytest.mark.mininet
def test_auto_network_is_calibrated_by_its_first_collective():
    from testbed.collectives import run_collective
    from testbed.topologies import TestbedNet

    with TestbedNet(Star(2, bw_mbps=100), time_dilation="auto") as net:
        assert net.time_dilation == 1.0 and net.calibration is None
        spec = CollectiveSpec(algo="ring", nbytes=2 << 20)
        (row,) = run_collective(net, spec)
        cal = net.calibration
        assert cal is not None and net.time_dilation == cal.factor == row["time_dilation"]
        assert row["correct"]
        by_factor: dict[float, list[bool]] = {}
        for t in cal.trials:
            assert t["algo"] == "ring" and t["bytes"] % 4096 == 0
            by_factor.setdefault(t["factor"], []).append(t["passed"])
        # the chosen factor passed (most repetitions; unless nothing could), every smaller one
        # tried failed
        if not cal.saturated:
            assert sum(by_factor[cal.factor]) * 2 > len(by_factor[cal.factor])
        assert all(sum(v) * 2 < len(v) for f, v in by_factor.items() if f < cal.factor)
        # a second collective does not calibrate again
        run_collective(net, CollectiveSpec(algo="hd", nbytes=1 << 20))
        assert net.calibration is cal


@pytest.mark.mininet
def test_dilated_incast_trims_like_the_undilated_one_and_reports_undilated_time(tmp_path):
    """Trimming queues drain at rate / f on a dilated network, so an incast that overloads a
    30 Mb/s port still trims; the row speaks of the undilated port (30 Mb/s) and time."""
    from testbed.experiment.checks import assert_all_ok
    from testbed.experiment.runner import run

    exp = {"name": "dil-incast", "seed": 3, "time_dilation": 2,
           "topology": {"kind": "incast", "n_senders": 2, "bw_mbps": 100,
                        "switch": "programmable"},
           "trimming": [{"node": "tbs1", "mode": "trim", "rate_mbps": 30,
                         "threshold_bytes": 5000}],
           "jobs": [{"op": "incast", "nbytes": "64KiB", "options": {"bits": 4}}]}
    res = run(exp, out_dir=tmp_path / "r", progress=False, doctor=False)
    assert_all_ok(res)
    row = res.df.iloc[0]
    assert row["time_dilation"] == 2 and row["bw_mbps"] == 30
    assert row["trimmed_frac"] > 0 and row["dp_trim_trimmed"] > 0
    assert row["busbw"] == pytest.approx(2 * row["algbw"])
    assert row["algbw"] == pytest.approx(65536 * 8 / row["time_s"] / 1e9)
    assert row["fidelity"] == pytest.approx(row["time_s"] / row["model_s"])
    assert res.metadata["time_dilation"] == 2
    assert res.metadata["networks"][0]["time_dilation"] == 2.0
