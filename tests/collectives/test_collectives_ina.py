"""In-network aggregation on an emulated programmable star (Mininet, the data path's aggregate
program, real packets): sums for several n and sizes, exactness under 5 % seeded loss, and a
worker killed mid-collective."""

from __future__ import annotations

import time

import pytest

from testbed.collectives import CollectiveError, CollectiveSpec, CollectiveTimeout, run_collective
from testbed.collectives.testing import check_rows, kill_process_later
from testbed.collectives.testing import leftovers as _ours_left

pytestmark = pytest.mark.mininet


@pytest.fixture(scope="module")
def agg_net():
    """4 hosts on a programmable switch running the aggregate program, 100 Mb/s links."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(4, bw_mbps=100, switch="programmable",
                programs={"switch": ["aggregate", "forward"]})
    with TestbedNet(topo) as net:
        yield net


def test_ina_sums_on_programmable_star(agg_net):
    for workers, nbytes in ((4, 4 * 40_001), (3, 4 * 1_000)):
        spec = CollectiveSpec(algo="ina", nbytes=nbytes, workers=workers, window=32,
                              timeout_s=20, repetitions=2, seed=11)
        rows = run_collective(agg_net, spec)
        check_rows(rows, spec, workers, bw_mbps=100)
        assert rows[0]["max_abs_err"] > 0  # fixed point is not exact, only within its bound
    assert not _ours_left()


def test_ina_exact_under_loss(agg_net):
    """5 % seeded loss of contributions and results (client-side drop): retransmissions and
    the shadow copy still give the right sum."""
    spec = CollectiveSpec(algo="ina", nbytes=4 * 30_000, window=16, loss=0.05, timeout_s=20,
                          seed=5)
    before = agg_net.counters()["datapath"]
    rows = run_collective(agg_net, spec)
    check_rows(rows, spec, 4, bw_mbps=100)
    after = agg_net.counters()["datapath"]
    sw = agg_net.aggregator["switch"]
    agg_b = before[sw]["stages"]["aggregate"]
    agg_a = after[sw]["stages"]["aggregate"]
    # lost results were recovered from the shadow copy
    assert agg_a["retransmissions_answered"] > agg_b["retransmissions_answered"]


def test_ina_dead_worker_ends_the_job_naming_it(agg_net):
    """A worker killed mid-allreduce: the job ends with the death named (its peers stopped a
    moment later: they would only time out waiting for the dead worker's contributions)."""
    spec = CollectiveSpec(algo="ina", nbytes=16 << 20, window=32, timeout_s=20)
    t, killed = kill_process_later("tbw-tbh2", delay_s=1.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match=r"rank 1 \(tbh2\) died \(signal SIGKILL\); "
                                                  r"ranks \[0, 2, 3\] stopped") as info:
            run_collective(agg_net, spec)
    finally:
        t.join()
    assert killed
    assert not isinstance(info.value, CollectiveTimeout)
    assert time.monotonic() - t0 < 15  # not the 20 s timeout
    assert not _ours_left()


@pytest.mark.parametrize("algo, compressor", [("ina", None), ("ina", "thc")])
def test_client_reuses_its_summed_lanes_buffer(algo, compressor):
    """The int32 buffer the RESULTs are summed into is touched when the client starts and
    reused by every later collective (a fresh one would be zeroed page by page inside the
    timed loop); a larger collective grows it."""
    import numpy as np

    from testbed.collectives.ina import InaClient

    spec = CollectiveSpec(algo=algo, nbytes=4 * 100_000, compressor=compressor)
    job = {"n": 2, "ranks": [{"host": f"h{r}", "ip": "127.0.0.1", "port": 47_000 + r,
                              "aggregator": {"ip": "127.0.0.2"}} for r in range(2)]}
    c = InaClient(job, spec, 0)
    try:
        first = c._payload(np.ones(spec.count, np.float32), np.empty(spec.count, np.float32), 0)
        assert first.qsum.size >= spec.count
        again = c._payload(np.ones(spec.count, np.float32), np.empty(spec.count, np.float32), 1)
        assert np.shares_memory(first.qsum, again.qsum)
        big = 3 * spec.count
        grown = c._payload(np.ones(big, np.float32), np.empty(big, np.float32), 2)
        assert grown.qsum.size >= big and not np.shares_memory(grown.qsum, first.qsum)
    finally:
        c.close()


@pytest.mark.parametrize("ina_cc, bw_bps, floor", [(None, 5e6, "path"), (None, None, "T0"),
                                                    ("delay", 5e6, "T0")])
def test_a_client_times_out_no_sooner_than_its_window_takes_to_leave(ina_cc, bw_bps, floor):
    """A plain window's timeout floor leaves room for the whole window at the job's
    bottleneck share (``job["bw_bps"]``); a delay-based window keeps its queue short and
    keeps SwitchML's 10 ms, as does a job whose bandwidth is not known."""
    from testbed.collectives import inakernel as ik
    from testbed.collectives.ina import InaClient, timeout_floor

    spec = CollectiveSpec(algo="ina", nbytes=4 * 1000, window=64, ina_cc=ina_cc)
    job = {"n": 2, "bw_bps": bw_bps, "ranks": [
        {"host": f"h{r}", "ip": "127.0.0.1", "port": 47_010 + r,
         "aggregator": {"ip": "127.0.0.2"}} for r in range(2)]}
    c = InaClient(job, spec, 0)
    try:
        want = timeout_floor(64, bw_bps) if floor == "path" else ik.T0
        assert c.t0 == pytest.approx(want)
        assert (c.t0 > 0.2) == (floor == "path")  # 64 full frames at 5 Mb/s: 0.11 s, twice
    finally:
        c.close()


_GSO_SENDER = """
import json, sys
import numpy as np
from testbed.collectives import CollectiveSpec
from testbed.collectives.ina import InaClient
ip1, ip2, lens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ranks = [{"host": "tbh1", "ip": ip1, "port": 47001, "aggregator": {"ip": ip2, "port": 47100}},
         {"host": "tbh2", "ip": ip2, "port": 47002, "aggregator": {"ip": ip2, "port": 47100}}]
c = InaClient({"n": 2, "ranks": ranks}, CollectiveSpec(algo="ina", window=64), 0)
order = np.random.default_rng(3).permutation(len(lens))
for i, s in enumerate(order):
    c.slots.pkts[s, :lens[i]] = (i + np.arange(lens[i])) % 251
    c.slots.lens[s] = lens[i]
c.send_list[:len(lens)] = order
c._send(len(lens))
print(json.dumps({"gso": c.gso, "gso_sends": c.stats["gso_sends"]}))
"""

_GSO_RECEIVER = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 47100)); s.settimeout(3)
print("ready", flush=True)
got = []
try:
    while len(got) < int(sys.argv[2]):
        got.append(list(s.recv(65535)))
except OSError:
    pass
print(json.dumps(got))
"""


@pytest.mark.parametrize("gso", ["1", "0"])
def test_batched_sends_arrive_as_the_datagrams_listed(agg_net, gso, monkeypatch):
    """The INA client's UDP GSO runs leave the host as the single datagrams it listed, in
    order and byte for byte, through the switch's engine (runs of equal sizes, a shorter one
    ending a run, a longer one starting the next); with ``TESTBED_INA_GSO=0`` it sends them
    one by one."""
    import json
    import sys

    monkeypatch.setenv("TESTBED_INA_GSO", gso)
    h1, h2 = agg_net.hosts[0], agg_net.hosts[1]
    lens = [1000] * 20 + [600] + [1000] * 5 + [300, 1000, 1050, 1050, 40]
    rx = h2.popen([sys.executable, "-c", _GSO_RECEIVER, h2.IP(), str(len(lens))])
    try:
        assert rx.stdout.readline().decode().strip() == "ready"
        tx = h1.popen([sys.executable, "-c", _GSO_SENDER, h1.IP(), h2.IP(), json.dumps(lens)])
        out, err = tx.communicate(timeout=60)
        assert tx.returncode == 0, err.decode()
        sent = json.loads(out.decode().strip().splitlines()[-1])
        got = json.loads(rx.communicate(timeout=30)[0].decode().strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    want = [[(i + b) % 251 for b in range(ln)] for i, ln in enumerate(lens)]
    assert got == want
    assert sent["gso"] == (gso == "1")
    assert (0 < sent["gso_sends"] < len(lens)) if gso == "1" else sent["gso_sends"] == 0
