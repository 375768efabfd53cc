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

from testbed.datapath.aggclient import header_bytes, udp_frame, worker_input
from testbed.datapath.aggregate import DEFAULT_AGG_IP, DEFAULT_AGG_MAC, AggregateReference
from testbed.datapath.batch import PORT_DROP, DropReason
from testbed.datapath.forward import forward_reference, ip_to_int, mac_to_int
from testbed.kernels.wire import HEADER_OFFSET, MsgType

N_FRAMES = 10_000
AGG_MAC = mac_to_int(DEFAULT_AGG_MAC).to_bytes(6, "big")
AGG_IP = ip_to_int(DEFAULT_AGG_IP).to_bytes(4, "big")
JOB, N_WORKERS, SLOTS = 7, 2, 4


def _valid(rng, src_mac, src_ip):
    elems = int(rng.integers(1, 300))
    data = header_bytes(int(MsgType.DATA), JOB, int(rng.integers(0, N_WORKERS)),
                        int(rng.integers(0, SLOTS)), int(rng.integers(0, 2)), N_WORKERS, elems,
                        0) + rng.bytes(4 * elems)
    return bytearray(udp_frame(src_mac, AGG_MAC, src_ip, AGG_IP, 5555, 41000, data))


def _mutate(rng, f: bytearray, scapy_fuzz) -> bytes:
    """One malformation: truncation, wrong lengths, unknown type/job/slot/worker, bad magic,
    version or codec, IP options, not UDP, not IPv4, random bytes, scapy-fuzzed header."""
    kind = int(rng.integers(0, 14))
    H = HEADER_OFFSET
    if kind == 0:
        return bytes(f[: int(rng.integers(14, len(f)))])
    if kind == 1:
        f[16:18] = int(rng.integers(0, 65536)).to_bytes(2, "big")  # IP total length
    elif kind == 2:
        f[38:40] = int(rng.integers(0, 65536)).to_bytes(2, "big")  # UDP length
    elif kind == 3:
        f[H + 18 : H + 20] = int(rng.integers(0, 65536)).to_bytes(2, "little")  # elem_count
    elif kind == 4:
        f[H + 3] = int(rng.integers(3, 256))  # msg_type (RESULT/ACK/CONTROL/unknown)
    elif kind == 5:
        f[H + 4 : H + 6] = int(rng.integers(8, 65536)).to_bytes(2, "little")  # unknown job
    elif kind == 6:
        f[H + 8 : H + 10] = int(rng.integers(SLOTS, 65536)).to_bytes(2, "little")  # slot
    elif kind == 7:
        f[H + 6 : H + 8] = int(rng.integers(N_WORKERS, 65536)).to_bytes(2, "little")
    elif kind == 8:
        f[H : H + 2] = int(rng.integers(0, 0x4254)).to_bytes(2, "little")  # magic
    elif kind == 9:
        if rng.random() < 0.5:
            f[H + 2] = int(rng.choice([0, *range(2, 256)]))  # version
        else:
            f[H + 12] = int(rng.integers(1, 256))  # codec (only INT32 is summable)
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
    ref = AggregateReference(DEFAULT_AGG_MAC, DEFAULT_AGG_IP, {JOB: (0, SLOTS, N_WORKERS)})
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
    from testbed.datapath.bench import save_frames
    from testbed.testing import programmable_star

    progs = [("aggregate", {"jobs": {JOB: {"n_workers": N_WORKERS, "slots": SLOTS}}}),
             ("forward", {})]
    with programmable_star(2, programs=progs) as (_net, (h1, h2), sw):
        mac = lambda h: bytes.fromhex(h.MAC().replace(":", ""))  # noqa: E731
        frames, expect = make_fuzz(mac(h1), ip_to_int(h1.IP()).to_bytes(4, "big"), mac(h2))
        save_frames(str(tmp_path / "fuzz.npz"), frames)
        before = sw.client().counters()["ports"]["tbs1-eth1"]["drops"]
        g = h1.popen([sys.executable, "-m", "testbed.datapath.bench", "gen", "--iface",
                      h1.defaultIntf().name, "--src-mac", h1.MAC(), "--dst-mac", h2.MAC(),
                      "--src-ip", h1.IP(), "--dst-ip", h2.IP(), "--load",
                      str(tmp_path / "fuzz.npz"), "--count", str(N_FRAMES), "--pps", "25000"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = g.communicate(timeout=120)
        assert g.returncode == 0, err
        assert '"sent": 10000' in out.decode()
        # the engine is alive and answers; wait until its drop counters stop moving
        c = sw.client()
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
        procs = [h.popen([sys.executable, "-m", "testbed.datapath.aggclient", "--job",
                          str(JOB), "--worker", str(w), "--n", "2", "--slots", str(SLOTS),
                          "--length", "2000", "--seed", "5", "--out",
                          str(tmp_path / f"w{w}.npy")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE) for w, h in enumerate((h1, h2))]
        for p in procs:
            _, e = p.communicate(timeout=60)
            assert p.returncode == 0, e
        expect_sum = worker_input(5, JOB, 0, 2000, 2).astype(np.int64) + worker_input(
            5, JOB, 1, 2000, 2)
        for w in range(2):
            assert np.array_equal(np.load(tmp_path / f"w{w}.npy"), expect_sum.astype(np.int32))
        c.close()
