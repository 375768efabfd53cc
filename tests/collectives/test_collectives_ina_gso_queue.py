"""The INA client fits its sends to the host's shaping queue: a UDP GSO run is one packet to the
qdisc, so a run larger than a ``bfifo``'s byte limit was dropped whole every time it was sent,
and a window whose retransmissions expired together never finished; a delay-based window that
started with more packets than the queue holds lost them before they left the host."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys

import pytest

from testbed.collectives import CollectiveSpec, ina, run_collective
from testbed.collectives.testing import check_rows

pytestmark = pytest.mark.root_required

NS = "tbtest-gso"
_PROBE = """
import json, socket
from testbed.collectives import CollectiveSpec, ina
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
queue = ina.egress_queue_bytes()
windows = {}
for cc in (None, "delay"):
    ranks = [{"host": "h", "ip": "127.0.0.1", "port": 0,
              "aggregator": {"ip": "127.0.0.1", "port": 47100}}]
    c = ina.InaClient({"n": 1, "ranks": ranks}, CollectiveSpec(algo="ina", ina_cc=cc), 0)
    windows[str(cc)] = [c.start_window()]
    c.cwnd = 2.0  # the window a last collective ended with
    windows[str(cc)].append(c.start_window())
    c.close()
print(json.dumps({"limits": {name: ina.byte_fifo_limits().get(i) for i, name in
                             socket.if_nameindex()},
                  "run": ina.gso_run_bytes(s.fileno(), ina.FRAME_BYTES, queue),
                  "windows": windows}))
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _probe() -> dict:
    import json

    out = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", _PROBE],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def ns():
    """A namespace with a veth pair ``tbgsoa``/``tbgsob``, transmit checksum offload off on
    both (as on the testbed's hosts, where UDP GSO is then segmented before the device)."""
    with contextlib.suppress(subprocess.CalledProcessError):
        _sh("ip", "netns", "del", NS)
    _sh("ip", "netns", "add", NS)
    try:
        _sh("ip", "-n", NS, "link", "add", "tbgsoa", "type", "veth", "peer", "name", "tbgsob")
        for dev in ("tbgsoa", "tbgsob"):
            _sh("ip", "-n", NS, "link", "set", dev, "up")
            _sh("ip", "netns", "exec", NS, "ethtool", "-K", dev, "tx", "off")
        yield
    finally:
        _sh("ip", "netns", "del", NS)


def test_runs_and_start_windows_fit_the_smallest_byte_fifo(ns):
    """GSO runs are at most a quarter of the smallest bfifo, none below two frames; a
    delay-based window (``ina_cc="delay"``) starts no larger than that queue holds, the
    protocol's fixed window (no ``ina_cc``) stays all W slots (0)."""
    tc = ("ip", "netns", "exec", NS, "tc")
    _sh("ip", "-n", NS, "link", "set", "lo", "up")
    full = {"None": [0.0, 2.0], "delay": [0.0, 2.0]}
    assert _probe() == {"limits": {"lo": None, "tbgsoa": None, "tbgsob": None},
                        "run": ina.GSO_BURST_BYTES, "windows": full}
    # Mininet's shaping: HTB, a bfifo under its class (what queue_ms sets)
    _sh(*tc, "qdisc", "add", "dev", "tbgsoa", "root", "handle", "5:", "htb", "default", "1")
    _sh(*tc, "class", "add", "dev", "tbgsoa", "parent", "5:", "classid", "5:1", "htb",
        "rate", "100mbit", "burst", "15k")
    _sh(*tc, "qdisc", "add", "dev", "tbgsoa", "parent", "5:1", "handle", "20:", "bfifo",
        "limit", "40000")
    frame = ina.FRAME_BYTES
    assert _probe() == {"limits": {"lo": None, "tbgsoa": 40000, "tbgsob": None},
                        "run": int(40000 * ina.GSO_QUEUE_SHARE),
                        "windows": {"None": [0.0, 2.0], "delay": [40000 // frame, 2.0]}}
    # the smallest queue of any interface bounds it; below two frames' share, no GSO at all
    _sh(*tc, "qdisc", "add", "dev", "tbgsob", "root", "bfifo", "limit", "1000")
    assert _probe() == {"limits": {"lo": None, "tbgsoa": 40000, "tbgsob": 1000}, "run": 0,
                        "windows": {"None": [0.0, 2.0], "delay": [1.0, 1.0]}}


def test_no_byte_fifo_outside_a_shaped_namespace():
    """The machine's own namespace: a dump that finds no bfifo says so (an empty dict)."""
    limits = ina.byte_fifo_limits()
    names = dict(socket.if_nameindex())
    assert all(i in names for i in limits)


@pytest.mark.mininet
def test_ina_finishes_through_a_queue_smaller_than_a_gso_run():
    """20 Mb/s with ``queue_ms=2``: a 5000 B queue on every host. With runs of up to 15000 B
    every retransmission of a 64-packet window was dropped at the host and the job timed out
    with 64 of 357 packets done; now exact, for ``ina``, the SmartNIC's ``nic`` and ``ina``
    with its delay-based window (whose first collective started with all 64 slots and took
    2.0-2.4 s where the next took 0.17-0.18 s)."""
    from testbed.topologies import Star, TestbedNet

    topo = Star(4, bw_mbps=20, queue_ms=2, switch="programmable", smartnic=True,
                programs={"smartnic": ["nic_codec"]})
    with TestbedNet(topo) as net:
        for algo, cc in (("ina", None), ("nic", None), ("ina", "delay")):
            spec = CollectiveSpec(algo=algo, ina_cc=cc, nbytes=300_000, timeout_s=30,
                                  repetitions=2)
            check_rows(run_collective(net, spec), spec, 4, bw_mbps=20)
