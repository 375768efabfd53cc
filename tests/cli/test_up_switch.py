"""A network that outlives one command (``testbed up`` / ``down``) and the node client
(``testbed switch NODE ...``): the engine's ``config`` and ``trace`` commands, the frame decoder
against scapy, and the whole loop on a real emulated network."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from testbed.datapath.batch import PORT_DROP, PORT_FLOOD, PORT_HELD, Batch, DropReason
from testbed.datapath.trace import Tracer, describe_frame
from testbed.kernels import wire

TB = [sys.executable, "-m", "testbed.cli"]


def _testbed_frame(**fields) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from testbed.datapath.scapy_layer import TestbedHeader

    return bytes(Ether(src="00:00:00:00:00:01", dst="02:54:42:00:00:fe")
                 / IP(src="10.0.0.1", dst="10.0.0.254")
                 / UDP(sport=40001, dport=wire.TESTBED_UDP_PORT)
                 / TestbedHeader(**fields) / (b"\x01\x00\x00\x00" * fields["elem_count"]))


def test_frame_decoder_agrees_with_scapy():
    from scapy.layers.l2 import Ether

    from testbed.datapath.scapy_layer import TestbedHeader

    raw = _testbed_frame(msg_type=int(wire.MsgType.RETRANSMIT), job_id=7, worker_id=3, slot=9,
                         slot_set=1, flags=int(wire.Flags.TRIMMED | wire.Flags.LAST),
                         codec=int(wire.Codec.THC), n_workers=4, exponent=-3, elem_count=4,
                         head_bytes=2, chunk_offset=1 << 20, scale=0.5)
    got = describe_frame(np.frombuffer(raw, np.uint8))
    h = Ether(raw)[TestbedHeader]
    assert got["proto"] == "testbed"
    assert (got["ip_src"], got["ip_dst"], got["dport"]) == ("10.0.0.1", "10.0.0.254", 41000)
    assert got["msg_type"] == wire.MsgType(int(h.msg_type)).name == "RETRANSMIT"
    assert got["codec"] == wire.Codec(int(h.codec)).name == "THC"
    assert got["flags"] == "TRIMMED|LAST"
    for name in (f.name for f in wire.HEADER_FIELDS):
        if name not in ("magic", "version", "msg_type", "codec", "flags"):
            assert got[name] == pytest.approx(getattr(h, name)), name
    # not ours: plain UDP, ARP, a runt
    udp = bytearray(raw)
    udp[36:38] = (5000).to_bytes(2, "big")
    assert describe_frame(np.frombuffer(bytes(udp), np.uint8))["proto"] == "udp"
    arp = bytes(12) + b"\x08\x06" + bytes(28)
    assert describe_frame(np.frombuffer(arp, np.uint8))["proto"] == "arp"
    assert "error" in describe_frame(np.zeros(6, np.uint8))


def test_tracer_records_decisions_until_its_count():
    ports = ["tbs1-eth1", "tbs1-eth2"]
    frame = np.frombuffer(_testbed_frame(elem_count=1), np.uint8)
    b = Batch(8)
    cases = [(0, 1, 0), (1, PORT_DROP, int(DropReason.UNKNOWN_JOB)), (0, PORT_FLOOD, 0),
             (1, PORT_HELD, 0), (-1, 0, 0)]
    for i, (inp, out, reason) in enumerate(cases):
        b.buf[i, :len(frame)] = frame
        b.length[i] = len(frame)
        b.in_port[i], b.out_port[i], b.reason[i] = inp, out, reason
    b.n = len(cases)
    t = Tracer(ports)
    assert t.arm(4) == {"armed": 4}
    t.record(b, time.monotonic_ns())
    assert t.remaining == 0
    got = t.read()
    assert [(r["in"], r["out"]) for r in got["records"]] == [
        ("tbs1-eth1", "tbs1-eth2"), ("tbs1-eth2", "drop:UNKNOWN_JOB"), ("tbs1-eth1", "flood"),
        ("tbs1-eth2", "held")]
    assert all(r["len"] == len(frame) and r["proto"] == "testbed" for r in got["records"])
    assert t.read() == {"remaining": 0, "records": []}  # handed over once
    with pytest.raises(ValueError, match="count must be an integer"):
        t.arm(-1)


def test_engine_answers_config_and_trace_commands():
    from testbed.datapath.engine import Engine

    cfg = {"node": "tbs9", "ports": ["tbs9-eth1", "tbs9-eth2"],
           "programs": [["forward", {"learn": True}]]}
    eng = Engine(cfg)  # ports are opened only by open(): no network needed here
    got = eng.dispatch({"cmd": "config"})
    assert got["programs"] == cfg["programs"] and got["stages"] == ["forward"]
    assert eng.dispatch({"cmd": "trace", "count": 5}) == {"armed": 5}
    assert eng.dispatch({"cmd": "trace"}) == {"remaining": 5, "records": []}
    with pytest.raises(ValueError, match="config, configure, coalesce, flood, reset_job, trace"):
        eng.dispatch({"cmd": "nope"})


# -- on a real network -----------------------------------------------------------------------------

UP_FILE = """name = "up-test"
[topology]
kind = "star"
n_hosts = 2
bw_mbps = 100
switch = "programmable"
[[trimming]]
node = "tbs1"
rate_mbps = 50
[[jobs]]
algo = "ina"
nbytes = "16KiB"
"""


def _tb(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TB, *args], capture_output=True, text=True, timeout=timeout)


def _switch_json(*args: str) -> dict:
    r = _tb("switch", *args, "--json", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def network_up(tmp_path):
    """``testbed up --detach`` on a 2-host programmable star; always torn down."""
    from testbed.up import read_state

    exp = tmp_path / "up.toml"
    exp.write_text(UP_FILE)
    r = _tb("up", str(exp), "--detach", timeout=900)
    state = read_state()
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert state and state["alive"] and state["ready"], state
        yield state
    finally:
        if state and state["alive"]:
            down = _tb("down", timeout=300)
            assert down.returncode == 0, down.stdout + down.stderr


def _in_host(pid: int, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mnexec", "-a", str(pid), *cmd], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.mininet
def test_up_switch_down(network_up, tmp_path):
    from testbed.lifeline import start_ticks
    from testbed.up import read_state

    state = network_up
    assert state["programmable"] == ["tbs1"] and state["hosts"] == ["tbh1", "tbh2"]
    assert state["programs"]["tbs1"][-1] == "trim"

    # a second `up` refuses while one runs
    again = _tb("up", state["file"], "--detach")
    assert again.returncode == 1 and "already up" in again.stderr

    cfg = _switch_json("tbs1", "config")
    assert cfg["ports"] == ["tbs1-eth1", "tbs1-eth2"]
    assert cfg["stages"] == ["aggregate", "forward", "trim"]
    jobs = _switch_json("tbs1", "jobs")
    assert jobs["jobs"] == {} and jobs["free_slots"] > 0

    # trace while tbh1 pings tbh2 and sends one DATA packet for a job nobody registered
    tracer = subprocess.Popen([*TB, "switch", "tbs1", "trace", "--count", "200", "--timeout",
                               "8", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    time.sleep(1.5)  # armed before the traffic starts
    h1 = state["pids"]["tbh1"]
    ping = _in_host(h1, "ping", "-c", "3", "-i", "0.2", "10.0.0.2")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    send = ("import socket; from testbed.kernels import wire; h = wire.new_headers(1); "
            "h['job_id'] = 4242; h['elem_count'] = 2; "
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.sendto(h.tobytes() + bytes(8), ('10.0.0.254', wire.TESTBED_UDP_PORT))")
    sent = _in_host(h1, sys.executable, "-c", send)
    assert sent.returncode == 0, sent.stderr
    out, err = tracer.communicate(timeout=60)
    assert tracer.returncode == 0, err
    recs = json.loads(out)["records"]
    icmp = [r for r in recs if r.get("proto") == "icmp"]
    assert {(r["in"], r["out"]) for r in icmp} == {("tbs1-eth1", "tbs1-eth2"),
                                                   ("tbs1-eth2", "tbs1-eth1")}
    ours = [r for r in recs if r.get("proto") == "testbed"]
    assert ours and ours[0]["job_id"] == 4242 and ours[0]["msg_type"] == "DATA"
    assert ours[0]["out"] == "drop:UNKNOWN_JOB" and ours[0]["in"] == "tbs1-eth1"

    counters = _switch_json("tbs1", "counters")
    assert counters["ports"]["tbs1-eth1"]["rx_packets"] >= 4
    assert counters["drops"].get("UNKNOWN_JOB", 0) >= 1
    table = _tb("switch", "tbs1", "counters")
    assert table.returncode == 0 and "tbs1: ports" in table.stdout and "trim" in table.stdout
    bad = _tb("switch", "tbs1", "reset-job", "77")
    assert bad.returncode == 1 and "no job 77" in bad.stderr
    nobody = _tb("switch", "tbs8", "counters")
    assert nobody.returncode == 1 and "running nodes: tbs1" in nobody.stderr
    # links: the up process answers; on a star every link is a host's only one
    cut = _tb("link", "down", "tbs1", "tbh2")
    assert cut.returncode == 1 and "would cut ['tbh2'] off" in cut.stderr, cut.stderr
    assert "no link between tbh1 and tbh2" in _tb("link", "down", "tbh1", "tbh2").stderr
    assert "is not down" in _tb("link", "up", "tbh1", "tbs1").stderr

    # down: the up process ends, its state goes, and (holding the lock) nothing of ours is left
    pid, ticks = state["pid"], state["start_ticks"]
    down = _tb("down", timeout=300)
    assert down.returncode == 0 and "torn down" in down.stdout, down.stdout + down.stderr
    assert start_ticks(pid) != ticks and read_state() is None
    state["alive"] = False  # the fixture has nothing left to do
    from testbed.cleanup import leftovers
    from testbed.netlock import emulation_lock

    with emulation_lock(timeout=300):
        left = leftovers()
    assert not any(left.values()), left
    assert _tb("down").stdout.strip() == "no network is up"
    assert not Path(f"/proc/{pid}").exists() or start_ticks(pid) != ticks
