"""Engine groups (testbed.datapath.group): one process serving several nodes, the links
between them in memory; on rings, in a namespace of real veths, and on real networks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from testbed.datapath.group import EngineGroup, mark_ready, parse_link
from testbed.datapath.io import (
    RING_FRAME,
    TP_STATUS_AVAILABLE,
    MemoryPort,
    ring_rx,
    ring_tx,
)
from testbed.datapath.reference import io as ref


@pytest.mark.parametrize("seed", range(8))
def test_a_tx_ring_in_memory_reads_as_its_peers_rx_ring(seed):
    """Frames put in one MemoryPort's TX ring come out of its peer's RX ring whole and in
    order, over several laps of the ring; a full ring takes nothing more until the peer
    read; the slots read are free to send again. The plain-Python twins agree."""
    rng = np.random.default_rng(seed)
    nframes = int(rng.integers(2, 12))
    ab, ba = (np.zeros(nframes * RING_FRAME, np.uint8) for _ in range(2))
    a, b = MemoryPort("a", rx=ba, tx=ab), MemoryPort("b", rx=ab, tx=ba)
    twin = bytearray(nframes * RING_FRAME)
    twin_heads = [0, 0]
    row = 2048
    buf = np.zeros((nframes + 4, row), np.uint8)
    out = np.zeros((nframes + 4, row), np.uint8)
    lengths = np.zeros(nframes + 4, np.int32)
    out_len = np.zeros(nframes + 4, np.int32)
    for _lap in range(4):
        count = int(rng.integers(1, nframes + 3))
        frames = [rng.bytes(int(rng.integers(14, 1500))) for _ in range(count)]
        for i, f in enumerate(frames):
            buf[i, : len(f)] = np.frombuffer(f, np.uint8)
            lengths[i] = len(f)
        done, a.heads[1], refused = ring_tx(a.tx_ring, a.tx_ring32, 0, RING_FRAME,
                                            a.tx_frames, a.heads[1], buf,
                                            np.arange(count, dtype=np.int64), lengths, count)
        assert refused == 0 and done == min(count, nframes)  # a full ring stops the burst
        got, b.heads[0] = ring_rx(b.ring, b.ring32, RING_FRAME, b.rx_frames, b.heads[0], out,
                                  0, nframes + 4, out_len)
        assert got == done
        assert [bytes(out[i, : out_len[i]]) for i in range(got)] == frames[:done]
        assert all(ab.view("<u4")[(h * RING_FRAME) >> 2] == TP_STATUS_AVAILABLE
                   for h in range(nframes))
        placed, twin_heads[1], _ = ref.ring_tx(twin, 0, RING_FRAME, nframes, twin_heads[1],
                                               frames)
        back, twin_heads[0] = ref.ring_rx(twin, RING_FRAME, nframes, twin_heads[0],
                                          nframes + 4, row)
        assert placed == done and back == frames[:done]
        assert bytes(twin) == ab.tobytes()  # the kernels and their twins write the same ring
    assert not ba.any()  # nothing went the other way


@pytest.mark.parametrize("seed", range(6))
def test_mark_ready_matches_its_numpy_twin(seed):
    """Nodes with frames to send, a deadline due, or a frame at the next slot of a memory
    ring are marked (and counted), whatever the ring heads."""
    rng = np.random.default_rng(seed)
    nodes, n_mem, frames = 7, 12, 8
    mem32 = (rng.integers(0, 3, n_mem * frames * (RING_FRAME // 4))).astype(np.uint32)
    words = np.arange(n_mem, dtype=np.int64) * frames * (RING_FRAME // 4)
    heads = rng.integers(0, frames, (n_mem + 3, 2)).astype(np.int64)
    rows = rng.permutation(n_mem + 3)[:n_mem].astype(np.int64)
    owner = rng.integers(0, nodes, n_mem).astype(np.int64)
    pending = rng.random(nodes) < 0.2
    deadline = rng.integers(0, 200, nodes).astype(np.int64)
    ready = np.zeros(nodes, np.bool_)
    count = mark_ready(ready, pending, deadline, 100, mem32, words, heads, rows, owner)
    want = pending | (deadline <= 100)
    want[owner[(mem32[words + heads[rows, 0] * (RING_FRAME // 4)] & 1) != 0]] = True
    assert ready.tolist() == want.tolist() and count == want.sum()


def _config(node: str, ports: list[str], **kw) -> dict:
    return {"node": node, "ports": ports, "programs": ["wire"], "sched": "other", **kw}


def test_an_engine_group_refuses_what_it_cannot_serve():
    a, b = _config("tbga", ["tbga0", "tbga1"]), _config("tbgb", ["tbgb0", "tbgb1"])
    cases = [
        ([a, b], [("tbga1", "tbgx0")], "no node of the group has port 'tbgx0'"),
        ([a, b], [("tbga1", "tbgb0"), ("tbga1", "tbgb1")], "port 'tbga1' is in two links"),
        ([a, b], [("tbga0", "tbga1")], "joins tbga to itself"),
        ([a, dict(b, io="mmsg")], [], "io='ring'"),
        ([a, dict(b, node="tbga", ports=["tbgc0", "tbgc1"])], [], "a node appears twice"),
        ([a, dict(b, ports=["tbga1", "tbgb1"])], [], "port .tbga1. belongs to tbga and tbgb"),
        ([], [], "at least one node"),
    ]
    for configs, links, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineGroup(configs, links)
    for bad in ("tbga1", "=tbgb0", "tbga1="):
        with pytest.raises(ValueError, match="PORT_A=PORT_B"):
            parse_link(bad)
    assert parse_link("tbga1=tbgb0") == ("tbga1", "tbgb0")


_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[1], 0))
for i in range(int(sys.argv[2])):
    s.send(b"\\xff" * 6 + b"\\x02" * 6 + b"\\x88\\xb5" + i.to_bytes(4, "big") + bytes(986))
"""
_RECEIVER = """
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x88b5))
s.bind((sys.argv[1], 0))
s.settimeout(4)
print("ready", flush=True)
seq, first, last = [], None, None
try:
    while len(seq) < int(sys.argv[2]):
        f = s.recv(2048)
        now = time.monotonic()
        first = first or now
        last = now
        seq.append(int.from_bytes(f[14:18], "big") if len(f) == 1004 else -1)
except socket.timeout:
    pass
print(seq, (last or 0) - (first or 0))
"""


@pytest.mark.root_required
def test_an_engine_group_carries_frames_between_its_nodes_in_memory(tmp_path):
    """Two nodes in one engine process, a veth to each from outside and a link between them
    in memory, shaped to 20 Mb/s by the sender's ``shape`` stage: every frame crosses both
    nodes whole and in order, no faster than the link's rate; each node answers on its own
    control socket with its own counters (the memory link's ends, ``engine_group``, CPU
    shares), and SIGTERM ends the process cleanly with both nodes' final counters."""
    from testbed.datapath.control import DatapathClient

    ns = f"tbgrp{os.getpid() % 10000}"
    nsx = ["ip", "netns", "exec", ns]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc = None
    n = 300
    try:
        # no IPv6 on the veths: a late router solicitation would cross the engine between
        # the two nodes' counter reads
        subprocess.run(nsx + ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                              "net.ipv6.conf.default.disable_ipv6=1"], check=True)
        for x, y in (("tbgx0", "tbga0"), ("tbgb1", "tbgx1")):
            subprocess.run(nsx + ["ip", "link", "add", x, "type", "veth", "peer", "name", y],
                           check=True)
            for dev in (x, y):
                subprocess.run(nsx + ["ip", "link", "set", dev, "up"], check=True)
        shape = {"name": "shape", "settings": {"rate_mbps": {"tbga1": 20.0}}}
        configs = {"tbga": _config("tbga", ["tbga0", "tbga1"],
                                   programs=["wire", shape]),
                   "tbgb": _config("tbgb", ["tbgb0", "tbgb1"])}
        argv = []
        for node, config in configs.items():
            config["control_socket"] = str(tmp_path / f"{node}.sock")
            (tmp_path / f"{node}.json").write_text(json.dumps(config))
            argv += ["--config", str(tmp_path / f"{node}.json"),
                     "--counters-out", str(tmp_path / f"{node}.out.json")]
        with open(tmp_path / "engine.log", "w") as log:
            proc = subprocess.Popen(nsx + [sys.executable, "-m", "testbed.datapath.engine",
                                           *argv, "--link", "tbga1=tbgb0"],
                                    stdout=log, stderr=subprocess.STDOUT)
        clients = {node: DatapathClient(str(tmp_path / f"{node}.sock")) for node in configs}
        deadline = time.monotonic() + 60
        while not (tmp_path / "tbgb.sock").exists():
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            assert time.monotonic() < deadline, "the group did not open its control sockets"
            time.sleep(0.05)
        assert clients["tbga"].request("ping") == "pong"
        rx = subprocess.Popen(nsx + [sys.executable, "-c", _RECEIVER, "tbgx1", str(n)],
                              stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        subprocess.run(nsx + [sys.executable, "-c", _SENDER, "tbgx0", str(n)], check=True)
        seq_text, span = rx.communicate(timeout=30)[0].rsplit(" ", 1)
        assert eval(seq_text) == list(range(n))  # noqa: S307 - our own receiver's list
        # 1018-byte frames at 20 Mb/s: 407 us each; the shaper's 15 kB burst goes at once
        assert float(span) >= 0.9 * (n * 1018 - 15_000) * 8 / 20e6
        a, b = clients["tbga"].counters(), clients["tbgb"].counters()
        assert a["ports"]["tbga1"]["io"] == b["ports"]["tbgb0"]["io"] == "memory"
        assert a["ports"]["tbga0"]["io"] == "ring"
        assert a["ports"]["tbga1"]["tx_packets"] == b["ports"]["tbgb0"]["rx_packets"] >= n
        assert b["ports"]["tbgb1"]["tx_packets"] >= n
        assert a["engine_group"] == b["engine_group"] == ["tbga", "tbgb"]
        assert a["pid"] == b["pid"]  # one process
        assert a["cpu_seconds"] > 0 and b["cpu_seconds"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        for node in configs:
            final = json.loads((tmp_path / f"{node}.out.json").read_text())
            assert final["engine_group"] == ["tbga", "tbgb"]
        assert json.loads((tmp_path / "tbgb.out.json").read_text())["ports"]["tbgb1"][
            "tx_packets"] >= n
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", ns], check=False)
