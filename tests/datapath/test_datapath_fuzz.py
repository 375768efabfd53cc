"""10 000 malformed packets at the aggregate and forward programs of a running switch.

Each frame is classified beforehand by the plain-Python twins (``AggregateReference``,
``forward_reference``); the test asserts the engine survives, counts every frame as a drop, and
that its per-reason drop counters equal the twins' prediction exactly.
"""

from __future__ import annotations

import collections
import copy
import subprocess
import sys
import time

import numpy as np
import pytest

from testbed.datapath.aggclient import header_bytes, udp_frame
from testbed.datapath.aggregate import DEFAULT_AGG_IP, DEFAULT_AGG_MAC
from testbed.datapath.batch import PORT_DROP, DropReason
from testbed.datapath.forward import forward_reference, ip_to_int, mac_to_int
from testbed.datapath.reference.aggregate import AggregateReference
from testbed.kernels.wire import FIELD_OFFSETS, HEADER_OFFSET, MsgType

N_FRAMES = 10_000
AGG_MAC = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
AGG_IP = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")
JOB, N_WORKERS, SLOTS = 7, 2, 4
SPORT = 5555


def _o(field: str) -> int:
    return HEADER_OFFSET + FIELD_OFFSETS[field]


def members(src_mac: bytes, src_ip: bytes, ingress) -> list[dict]:
    """Worker 0 is the fuzzing host itself (so well-formed frames reach the protocol); worker
    1 lives elsewhere (frames with its id from the fuzzing host are strangers)."""
    other = [{"worker": 1, "mac": "02:00:00:00:00:99", "ip": "10.0.0.99", "port": SPORT,
              "ingress": ingress[1]}]
    return [{"worker": 0, "mac": ":".join(f"{b:02x}" for b in src_mac),
             "ip": ".".join(map(str, src_ip)), "port": SPORT, "ingress": ingress[0]}] + other


def _valid(rng, src_mac, src_ip):
    elems = int(rng.integers(1, 300))
    data = header_bytes(int(MsgType.DATA), JOB, int(rng.integers(0, N_WORKERS)),
                        int(rng.integers(0, SLOTS)), int(rng.integers(0, 2)), N_WORKERS, elems,
                        0) + rng.bytes(4 * elems)
    return bytearray(udp_frame(src_mac, AGG_MAC, src_ip, AGG_IP, SPORT, 41000, data))


def _mutate(rng, f: bytearray, scapy_fuzz) -> bytes:
    """One malformation: truncation, wrong lengths, unknown type/job/slot/worker, bad magic,
    version or codec, IP options, not UDP, not IPv4, random bytes, scapy-fuzzed header."""
    kind = int(rng.integers(0, 14))
    H = HEADER_OFFSET

    def put(field, value, size):
        f[_o(field):_o(field) + size] = int(value).to_bytes(size, "little")

    if kind == 0:
        return bytes(f[: int(rng.integers(14, len(f)))])
    if kind == 1:
        f[16:18] = int(rng.integers(0, 65536)).to_bytes(2, "big")  # IP total length
    elif kind == 2:
        f[38:40] = int(rng.integers(0, 65536)).to_bytes(2, "big")  # UDP length
    elif kind == 3:
        put("elem_count", rng.integers(0, 65536), 2)
    elif kind == 4:
        put("msg_type", rng.integers(3, 256), 1)  # RESULT/ACK/CONTROL/unknown
    elif kind == 5:
        put("job_id", rng.integers(8, 65536), 2)  # unknown job
    elif kind == 6:
        put("slot", rng.integers(SLOTS, 65536), 2)
    elif kind == 7:
        put("worker_id", rng.integers(N_WORKERS, 65536), 2)
    elif kind == 8:
        put("magic", rng.integers(0, 0x4254), 2)
    elif kind == 9:
        if rng.random() < 0.5:
            put("version", rng.choice([0, 1, *range(3, 256)]), 1)
        else:
            put("codec", rng.integers(1, 256), 1)  # only INT32 (and THC) are summable
    elif kind == 10:
        f[14] = 0x40 | int(rng.integers(6, 16))  # IP options
    elif kind == 11:
        f[23] = int(rng.choice([1, 6, 47, 132]))  # not UDP
    elif kind == 12:
        body = rng.bytes(int(rng.integers(8, 1500)))
        et = body[:2]
        if et in (b"\x08\x00", b"\x08\x06"):
            et = b"\x86\xdd"
        return AGG_MAC + body[2:8] + et + body[8:]
    else:
        hdr = bytes(scapy_fuzz())
        return bytes(f[:H]) + hdr + bytes(f[H + len(hdr) :])
    return bytes(f)


def _broken_ipv4(rng, dst_mac, src_mac):
    f = bytearray(udp_frame(src_mac, dst_mac, b"\x0a\0\0\x01", b"\x0a\0\0\x02", 1, 9,
                            rng.bytes(int(rng.integers(0, 200)))))
    k = int(rng.integers(0, 4))
    if k == 0:
        f[14] = (int(rng.integers(0, 16)) << 4) | 5 if rng.random() < 0.5 else 0x65
        if f[14] >> 4 == 4:
            f[14] = 0x75
    elif k == 1:
        f[14] = 0x40 | int(rng.integers(0, 5))  # IHL < 5
    elif k == 2:
        f[16:18] = (len(f) - 13 + int(rng.integers(0, 1000))).to_bytes(2, "big")
    else:
        f = f[: int(rng.integers(14, 34))]
    return bytes(f)


def make_fuzz(src_mac: bytes, src_ip: bytes, dst_mac: bytes, seed: int = 4242):
    """N_FRAMES malformed frames and the expected drop-reason histogram."""
    from scapy.packet import fuzz

    from testbed.datapath.scapy_layer import TestbedHeader

    rng = np.random.default_rng(seed)
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, {JOB: {
        "slots": SLOTS, "seq0": 0, "members": members(src_mac, src_ip, (0, 1))}})
    frames, expect = [], collections.Counter()
    while len(frames) < N_FRAMES:
        if rng.random() < 0.2:
            f = _broken_ipv4(rng, dst_mac, src_mac)
            (d, r), = forward_reference([f], [0], {}, {}, {}, True, True, True)
        else:
            f = _mutate(rng, _valid(rng, src_mac, src_ip), lambda: fuzz(TestbedHeader()))
            saved = copy.deepcopy(ref)
            d, r, _ = ref.process(f, 0)
            if d != PORT_DROP:
                ref = saved  # the engine never sees this frame: undo its effect on the state
        if d != PORT_DROP:
            continue  # the mutation happened to produce a valid packet; not a fuzz case
        frames.append(f)
        expect[DropReason(r).name] += 1
    return frames, expect


def test_fuzz_corpus_is_varied():
    """The corpus exercises many different drop reasons (so the Mininet test means something)."""
    frames, expect = make_fuzz(b"\x02\0\0\0\0\1", b"\x0a\0\0\x01", b"\x02\0\0\0\0\2")
    assert len(frames) == N_FRAMES
    assert len(expect) >= 12, expect
    assert min(len(f) for f in frames) >= 14


@pytest.mark.mininet
def test_engine_survives_and_counts_every_malformed_packet(tmp_path):
    """Send the corpus through a real switch; drops by reason == prediction; still works."""
    from testbed.collectives.spec import CollectiveSpec
    from testbed.collectives.testing import run_direct
    from testbed.datapath.bench import save_frames
    from testbed.topologies import Star, TestbedNet

    with TestbedNet(Star(2, bw_mbps=None, switch="programmable")) as net:
        h1, h2 = net.hosts
        mac = lambda h: bytes.fromhex(h.MAC().replace(":", ""))  # noqa: E731
        src_ip = ip_to_int(h1.IP()).to_bytes(4, "big")
        c = net.switch_client("tbs1")
        c.configure("aggregate", jobs={JOB: {"slots": SLOTS, "seq0": 0, "members": members(
            mac(h1), src_ip, ("tbs1-eth1", "tbs1-eth2"))}})
        frames, expect = make_fuzz(mac(h1), src_ip, mac(h2))
        save_frames(str(tmp_path / "fuzz.npz"), frames)
        before = c.counters()["ports"]["tbs1-eth1"]["drops"]
        g = h1.popen([sys.executable, "-m", "testbed.datapath.bench", "gen", "--iface",
                      h1.defaultIntf().name, "--src-mac", h1.MAC(), "--dst-mac", h2.MAC(),
                      "--src-ip", h1.IP(), "--dst-ip", h2.IP(), "--load",
                      str(tmp_path / "fuzz.npz"), "--count", str(N_FRAMES), "--pps", "25000"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = g.communicate(timeout=120)
        assert g.returncode == 0, err
        assert '"sent": 10000' in out.decode()
        # the engine is alive and answers; wait until its drop counters stop moving
        last = -1
        for _ in range(100):
            cnt = c.counters()
            drops = cnt["ports"]["tbs1-eth1"]["drops"]
            delta = {k: v - before.get(k, 0) for k, v in drops.items() if v - before.get(k, 0)}
            total = sum(delta.values())
            if total == N_FRAMES or total == last:
                break
            last = total
            time.sleep(0.3)
        assert total == N_FRAMES, (delta, dict(expect), cnt)
        assert delta == dict(expect)
        # ... and it still aggregates and forwards correctly afterwards
        assert "0% packet loss" in h1.cmd("ping -c 1", h2.IP())
        spec = CollectiveSpec(algo="ina", nbytes=8000, window=SLOTS, timeout_s=30, job_id=9)
        xs, outs, _ = run_direct(net, spec, 2)
        want = xs[0].astype(np.float64) + xs[1]
        assert all(np.allclose(o, want, rtol=1e-5, atol=1e-5) for o in outs)
