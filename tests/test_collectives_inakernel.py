"""The batched INA worker kernel against its plain-Python twin, on synthetic RESULT bursts
(valid results in random order, duplicates, foreign and truncated datagrams, seeded drops)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from testbed.collectives import inakernel as ik
from testbed.kernels.wire import HEADER_LEN, MAGIC, VERSION, Codec, MsgType

HDR = struct.Struct("<HBBHHHBBBBhHHIf")


def _state(W, count, K, boot):
    pkts = np.zeros((W, ik.ROW), dtype=np.uint8)
    return {
        "pkts": pkts, "lens": np.zeros(W, np.int64), "qsum": np.zeros(count, np.int32),
        "out": np.zeros(count, np.float32), "agreed": np.full(max(K, 1), -149, np.int16),
        "cur": np.full(W, -1, np.int64), "uses": np.zeros(W, np.int64),
        "sent_at": np.zeros(W), "retx": np.zeros(W, np.bool_), "deadline": np.full(W, np.inf),
        "rto": np.full(W, ik.T0), "st": np.array([0.0, 0.0, ik.T0, 0.0]),
        "send_list": np.zeros(W, np.int64),
    }


def _views(s):
    return s["pkts"], s["pkts"].view(np.int32), s["pkts"].view(np.float32)


def _result(rng, s, slot, job, nic, boot, count, good=True):
    j = int(s["cur"][slot])
    off = ik.BOOT_OFFSET if j < boot else (j - boot) * 256
    ne = 1 if j < boot else min(256, count - off)
    codec = int(Codec.FLOAT32) if nic else int(Codec.INT32)
    sset = int(s["uses"][slot] & 1) if good else 1 - int(s["uses"][slot] & 1)
    e = int(rng.integers(6, 20))  # agreed exponents bound the data (|x| < 2**6 here)
    hdr = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), job, 0, slot, sset, 0, codec, 3, e, ne,
                   0, off, 0.0)
    if nic:
        pay = rng.standard_normal(ne).astype(np.float32).tobytes()
    else:
        pay = rng.integers(-(1 << 30), 1 << 30, ne).astype(np.int32).tobytes()
    return hdr + pay


@pytest.mark.parametrize("nic, count, W", [(False, 256 * 5 + 17, 4), (True, 256 * 3 + 1, 3),
                                           (False, 100, 8)])
def test_kernel_matches_twin(nic, count, W):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(count) * 3).astype(np.float32)
    x[256:512] = 0.0  # an all-zero chunk: exponent EXP_MIN
    K = -(-count // 256)
    boot = 0 if nic else W
    total = K + boot
    job, n = 7, 3
    a, b = _state(W, count, K, boot), _state(W, count, K, boot)
    for s in range(min(W, total)):
        la = ik.build_packet(*_views(a), s, s, x, K, boot, n, job, 1, 0, a["agreed"], nic)
        lb = ik.build_packet_ref(*_views(b), s, s, x, K, boot, n, job, 1, 0, b["agreed"], nic)
        assert la == lb
        for st in (a, b):
            st["lens"][s], st["cur"][s] = la, s
    assert np.array_equal(a["pkts"], b["pkts"])
    rbuf = np.zeros((16, 2048), np.uint8)
    done = 0
    now = 0.0
    while done < total:
        now += 0.001
        live = [s for s in range(W) if a["cur"][s] >= 0]
        msgs = [_result(rng, a, s, job, nic, boot, count) for s in rng.permutation(live)]
        # junk: another job, the wrong set (a stale duplicate), a truncated datagram
        msgs.append(_result(rng, a, live[0], job + 1, nic, boot, count))
        msgs.append(_result(rng, a, live[0], job, nic, boot, count, good=False))
        msgs.append(msgs[0][:HEADER_LEN - 2])
        msgs = msgs[:16]
        rlen = np.zeros(16, np.int64)
        for i, m in enumerate(msgs):
            rbuf[i, :len(m)] = np.frombuffer(m, np.uint8)
            rlen[i] = len(m)
        drop = rng.random(16) < 0.2
        ra = ik.on_results(rbuf, rbuf.view(np.int32), rbuf.view(np.float32), rlen, len(msgs),
                           drop, *_views(a), a["lens"], x, a["qsum"], a["out"], a["agreed"],
                           a["cur"], a["uses"], a["sent_at"], a["retx"], a["deadline"],
                           a["rto"], a["st"], now, K, boot, W, n, job, 1, nic, a["send_list"])
        rb = ik.on_results_ref(rbuf, rbuf.view(np.int32), rbuf.view(np.float32), rlen,
                               len(msgs), drop, *_views(b), b["lens"], x, b["qsum"], b["out"],
                               b["agreed"], b["cur"], b["uses"], b["sent_at"], b["retx"],
                               b["deadline"], b["rto"], b["st"], now, K, boot, W, n, job, 1,
                               nic, b["send_list"])
        assert tuple(int(v) for v in ra) == tuple(int(v) for v in rb)
        assert ra[4] == -1 and ra[2] >= 2  # no protocol error; the junk was ignored
        for key in a:
            assert np.array_equal(a[key], b[key]), key
        done += ra[0]
    assert (a["cur"] == -1).all()


def test_kernel_flags_a_wrong_chunk_offset():
    W, count, K = 2, 600, 3
    s = _state(W, count, K, 0)
    x = np.ones(count, np.float32)
    for slot in range(W):
        s["lens"][slot] = ik.build_packet(*_views(s), slot, slot, x, K, 0, 2, 1, 0, 0,
                                          s["agreed"], True)
        s["cur"][slot] = slot
    # right offset (chunk 1 = 256) but 300 elements: would overrun the 600-element result
    m = HDR.pack(MAGIC, VERSION, int(MsgType.RESULT), 1, 0, 1, 0, 0, int(Codec.FLOAT32), 2, 0,
                 300, 0, 256, 0.0) + bytes(1200)
    rbuf = np.zeros((1, 2048), np.uint8)
    rbuf[0, :len(m)] = np.frombuffer(m, np.uint8)
    r = ik.on_results(rbuf, rbuf.view(np.int32), rbuf.view(np.float32),
                      np.array([len(m)], np.int64), 1, np.zeros(1, np.bool_), *_views(s),
                      s["lens"], x, s["qsum"], s["out"], s["agreed"], s["cur"], s["uses"],
                      s["sent_at"], s["retx"], s["deadline"], s["rto"], s["st"], 0.0, K, 0, W,
                      2, 1, 0, True, s["send_list"])
    assert r[4] == 1
